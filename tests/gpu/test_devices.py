"""Device placement, process groups, engines and the host swap on each device kind.

Every test runs on the CPU in the suite and, marked ``gpu``, on CUDA where a GPU is present
(``pytest -m gpu``, run by ``make gpu-check``); without one the CUDA cases skip and say why.
"""

from __future__ import annotations

import datetime
import gc
import random

import pytest
import torch
import torch.distributed as dist

from dockrl.config import AlgorithmConfig, load_config, resolve_auto
from dockrl.engines.hf.train import HFTrainEngine
from dockrl.parallel import device as devices
from dockrl.parallel.layout import ModelShape, ParallelLayout
from dockrl.parallel.ranks import join_groups, leave_groups
from dockrl.resharding.allgather_swap import AllGatherSwap
from dockrl.resharding.host_swap import ParamTrainState
from dockrl.resharding.spec import model_spec
from dockrl.stages.actor import accumulate_mini_batch

NO_GPU = "needs a CUDA GPU: run `make gpu-check` (benchmarks/gpu_check.sh) on a machine with one"
KINDS = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)])]


@pytest.mark.parametrize("kind", KINDS)
def test_auto_and_explicit_placement(kind):
    assert devices.detect_kind() == kind
    cfg = resolve_auto(load_config())
    assert cfg.parallel.device == kind
    if kind == "cuda":  # an H100/H200 computes bf16: the auto dtypes follow the device
        assert cfg.rollout.dtype == "bfloat16" and cfg.trainer.autocast_bf16 is True
    dev = devices.process_device(kind, 0)
    assert dev.type == kind and torch.ones(2, device=dev).device == dev
    if kind != "cpu":
        assert torch.accelerator.current_device_index() == 0


@pytest.mark.parametrize("kind", KINDS)
def test_process_groups_of_one_use_the_kinds_backend(kind):
    dev = join_groups(ParallelLayout(device=kind), timeout_s=60).device
    try:
        assert dist.get_backend() == devices.backend_for(kind)
        x = torch.arange(4.0, device=dev)
        dist.all_reduce(x)
        assert torch.equal(x.cpu(), torch.arange(4.0))
    finally:
        leave_groups()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    channel = devices.channel_group(kind, store, prefix="check", rank=0, world_size=1, timeout_s=60)
    wire = dev if devices.channel_backend(kind) == "nccl" else torch.device("cpu")
    y = torch.arange(3.0, device=wire)
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    channel.broadcast([y], opts).wait()
    assert torch.equal(y.cpu(), torch.arange(3.0))


def _rows(vocab: int, pad: int, n: int = 8, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 12))] for _ in range(n)]
    responses = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))] + [pad] for _ in range(n)]
    return prompts, responses


@pytest.mark.parametrize("kind", KINDS)
def test_hf_log_probs_on_the_device_equal_the_cpus(tiny_model_dir, kind):
    dev = devices.process_device(kind, 0)
    host = HFTrainEngine(tiny_model_dir, trainable=False)
    engine = HFTrainEngine(tiny_model_dir, trainable=False, device=dev)
    assert {p.device.type for p in engine.model.parameters()} == {kind}
    prompts, responses = _rows(len(engine.tokenizer), engine.pad_id)
    want = host.log_probs(prompts, responses, temperature=0.7, micro_batch=3)
    got = engine.log_probs(prompts, responses, temperature=0.7, micro_batch=3)
    assert [len(r) for r in got] == [len(r) for r in responses]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)  # fp32 on both
    engine.autocast_bf16 = True
    bf16 = engine.log_probs(prompts, responses, temperature=0.7, micro_batch=3)
    worst = max(abs(x - y) for a, b in zip(bf16, want) for x, y in zip(a, b))
    assert worst < 0.05, f"bf16 autocast log-probs differ from fp32 by {worst}"


@pytest.mark.parametrize("kind", KINDS)
def test_an_update_on_the_device_changes_every_weight_there(tiny_model_dir, kind):
    dev = devices.process_device(kind, 0)
    engine = HFTrainEngine(tiny_model_dir, trainable=True, lr=1e-3, autocast_bf16=kind != "cpu", device=dev)
    prompts, responses = _rows(len(engine.tokenizer), engine.pad_id)
    rng = random.Random(1)
    batch = {"prompt_ids": prompts, "response_ids": responses, "advantages": [rng.uniform(-1, 1) for _ in prompts]}
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    metrics = engine.optimizer_step(lambda: accumulate_mini_batch(engine, batch, algo=AlgorithmConfig(), temperature=0.7, micro_batch=4))
    assert abs(metrics["actor/ratio_mean"] - 1.0) < 1e-5 and metrics["actor/grad_norm"] > 0
    for name, p in engine.model.named_parameters():
        assert p.device.type == kind and p.dtype == torch.float32  # fp32 master weights on the device
        assert not torch.equal(p.detach(), before[name]), f"{name} did not change"


def _state(kind: str, dev: torch.device):
    params = {f"w{i}": torch.nn.Parameter(torch.randn(256, 64, device=dev)) for i in range(4)}
    optimizer = torch.optim.AdamW(params.values(), lr=1e-3)
    for p in params.values():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return params, optimizer


@pytest.mark.parametrize("kind", KINDS)
def test_the_host_swap_round_trip_is_bit_exact(kind):
    dev = devices.process_device(kind, 0)
    params, optimizer = _state(kind, dev)
    state = ParamTrainState(params, optimizer, device=dev, copy_on_cpu=True)
    weights = {n: p.detach().clone() for n, p in params.items()}
    grads = {n: p.grad.clone() for n, p in params.items()}
    moments = [{k: v.clone() for k, v in s.items()} for s in optimizer.state.values()]
    held = devices.allocator_bytes(dev)
    moved = state.offload_optimizer_and_grads() | state.offload_weights(None)
    assert moved["weights"] == moved["grads"] == 4 * 256 * 64 * 4
    assert sum(state.device_bytes().values()) == 0
    if kind != "cpu":  # the memory went back to the allocator, and the host copies are pinned
        assert devices.allocator_bytes(dev) <= held - sum(moved.values())
        assert all(p.data.is_pinned() for p in params.values())
    state.reload()
    for name, p in params.items():
        assert p.device == dev and torch.equal(p.detach(), weights[name]) and torch.equal(p.grad, grads[name])
    for s, want in zip(optimizer.state.values(), moments):
        assert all(torch.equal(s[k], want[k]) for k in want if isinstance(want[k], torch.Tensor))


@pytest.mark.parametrize("kind", KINDS)
def test_an_allgather_swap_of_one_rank_frees_its_buckets(kind):
    shape = ModelShape(model_type="qwen2", num_heads=4, num_kv_heads=2, num_layers=4, vocab_size=512, hidden_size=64,
                       intermediate_size=128, head_dim=16, tie_word_embeddings=True, qkv_bias=True, o_bias=False, mlp_bias=False)
    layout = ParallelLayout(device=kind)
    ranks = join_groups(layout, timeout_s=60)
    dev = ranks.device
    try:
        params = {s.name: torch.nn.Parameter(torch.randn(s.shape, device=dev)) for s in model_spec(layout, shape)}
        optimizer = torch.optim.AdamW(params.values(), lr=1e-3)
        for p in params.values():
            p.grad = torch.randn_like(p)
        optimizer.step()
        weights = {n: p.detach().cpu() for n, p in params.items()}
        state = ParamTrainState(params, optimizer, device=dev, copy_on_cpu=True)
        resident = sum(state.device_bytes().values())
        gc.collect()  # earlier tests' models, held by reference cycles, would count in the allocator's peak
        others = (devices.allocator_bytes(dev) or resident) - resident  # live device tensors not of this state
        swap = AllGatherSwap(ranks=ranks, model=shape, state=state, bucket_bytes=64 << 10, train_dtype=torch.float32,
                             infer_dtype=torch.bfloat16)
        loaded = {}
        report = swap.sync(on_bucket=lambda named: loaded.update((n, t.cpu().float()) for n, t in named), keep_buckets=False)
        assert len(report.buckets) > 1 and set(loaded) >= set(weights)
        for name, w in weights.items():
            torch.testing.assert_close(loaded[name], w.to(torch.bfloat16).float(), atol=0, rtol=0)
        assert report.peak_tracked_bytes < resident / 2  # one bucket at a time, the training state on its way out
        if kind != "cpu":  # the allocator agrees
            assert report.peak_allocator_bytes is not None and report.peak_allocator_bytes - others < resident / 2
        swap.finish_generation()
        assert all(torch.equal(p.detach().cpu(), weights[n]) for n, p in params.items())
    finally:
        leave_groups()


@pytest.mark.parametrize("kind", KINDS[1:])  # on the CPU: tests/launch/test_pod_shape.py
def test_a_pod_of_rank_processes_puts_each_on_its_local_device(kind, tmp_path):
    """``dockrl node`` (a pod shaped like a node; torchrun inside) starts the rank processes and
    each lands on the device of its local rank: what a platform engineer runs first on a node."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    count = torch.cuda.device_count()
    root = str(Path(__file__).resolve().parents[2])  # the source tree, where dockrl is not installed (make gpu-check)
    env = {**os.environ, "DOCKRL_REPLICA": "0", "DOCKRL_REPLICAS": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run([sys.executable, "-m", "dockrl", "node", "--nproc-per-node", str(count), "--rdzv-timeout-s", "60", "--",
                          "ranks", f"parallel.dp={count}", f"parallel.device={kind}"],
                         env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    reports = sorted((json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [r["local_rank"] for r in reports] == list(range(count))
    assert [r["device"] for r in reports] == [f"cuda:{i}" for i in range(count)]
