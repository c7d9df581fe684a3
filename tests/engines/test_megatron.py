"""megatron-core engine against the HF reference: conversion, logits, log-probs, save, one GRPO step.

The distributed checks spawn one gloo group per layout (TP=2; PP=2) that runs every check once
and writes its results; the tests below compare them with the HF model in this process.
"""

from __future__ import annotations

import os
import random
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from dockrl.config import AlgorithmConfig
from dockrl.engines.hf.train import HFTrainEngine
from dockrl.engines.megatron.convert import GPTArch, hf_param_names, hf_to_megatron, megatron_to_hf
from dockrl.engines.train_engine import TrainEngine
from dockrl.parallel.cpu_device import CudaFactoriesOnCpu
from dockrl.stages.actor import accumulate_mini_batch

LR = 1e-3
TEMPERATURE = 0.7
ALGO = AlgorithmConfig(kl_loss_coef=0.1)


# ---------------------------------------------------------------- conversion, in this process


def _arch(**kw) -> GPTArch:
    base = dict(num_layers=2, hidden_size=1, num_heads=4, num_kv_heads=2, head_dim=1, ffn_hidden_size=4, vocab_size=5,
                rms_norm_eps=1e-6, rope_theta=1e4, qkv_bias=True, tied_embeddings=False, max_position_embeddings=8)
    return GPTArch(**(base | kw))


def _hand_state(arch: GPTArch) -> dict[str, torch.Tensor]:
    """Every HF tensor filled with distinct, recognisable values."""
    shapes = {"q_proj": arch.num_heads, "k_proj": arch.num_kv_heads, "v_proj": arch.num_kv_heads}
    out, base = {}, 0
    for name in hf_param_names(arch):
        proj = name.split(".")[-2]
        if proj in shapes:
            shape = (shapes[proj] * arch.head_dim,) + ((arch.hidden_size,) if name.endswith("weight") else ())
        elif proj in ("gate_proj", "up_proj"):
            shape = (arch.ffn_hidden_size, arch.hidden_size)
        elif proj == "down_proj":
            shape = (arch.hidden_size, arch.ffn_hidden_size)
        elif proj == "o_proj":
            shape = (arch.hidden_size, arch.num_heads * arch.head_dim)
        elif proj in ("embed_tokens", "lm_head"):
            shape = (arch.vocab_size, arch.hidden_size)
        else:
            shape = (arch.hidden_size,)
        out[name] = torch.arange(base, base + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        base += 1000
    return out


def test_fused_qkv_interleaves_each_query_group_and_tp_splits_whole_groups():
    arch = _arch()
    hf = _hand_state(arch)
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv")
    full = hf_to_megatron(hf, arch, tp=1, tp_rank=0, pp=1, pp_rank=0)["decoder.layers.0.self_attention.linear_qkv.bias"]
    # group g: its 2 query heads, then its key head, then its value head
    assert full.tolist() == [q[0], q[1], k[0], v[0], q[2], q[3], k[1], v[1]]
    rank1 = hf_to_megatron(hf, arch, tp=2, tp_rank=1, pp=1, pp_rank=0)["decoder.layers.0.self_attention.linear_qkv.bias"]
    assert rank1.tolist() == [q[2], q[3], k[1], v[1]]


def test_fc1_holds_gate_then_up_of_each_tp_rank_and_vocab_is_padded():
    arch = _arch()
    hf = _hand_state(arch)
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"][:, 0], hf["model.layers.1.mlp.up_proj.weight"][:, 0]
    shard = hf_to_megatron(hf, arch, tp=2, tp_rank=1, pp=2, pp_rank=1)
    assert shard["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist() == [gate[2], gate[3], up[2], up[3]]
    head = shard["output_layer.weight"][:, 0]  # vocab 5 padded to 6: rank 1 holds rows 3, 4 and a zero row
    assert head.tolist() == hf["lm_head.weight"][3:, 0].tolist() + [0.0]
    assert "embedding.word_embeddings.weight" not in shard and "decoder.layers.1.mlp.linear_fc1.weight" not in shard


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("tied", [True, False])
def test_hf_to_megatron_to_hf_is_exact(tp, pp, tied):
    arch = _arch(tied_embeddings=tied, hidden_size=3, head_dim=2)
    hf = _hand_state(arch)
    stages = [[hf_to_megatron(hf, arch, tp=tp, tp_rank=t, pp=pp, pp_rank=p) for t in range(tp)] for p in range(pp)]
    back = megatron_to_hf(stages, arch)
    assert list(back) == hf_param_names(arch)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_unsupported_models_and_layouts_are_named():
    config = AutoConfig.for_model("qwen2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
    GPTArch.from_hf(config).check_layout(2, 1)
    with pytest.raises(ValueError, match="num_key_value_heads: got 2; it must be divisible by TP=4"):
        GPTArch.from_hf(config).check_layout(4, 1)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        GPTArch.from_hf(config).check_layout(1, 5)
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": 5e5}
    with pytest.raises(ValueError, match="rope_type: got 'llama3'"):
        GPTArch.from_hf(config)
    with pytest.raises(ValueError, match="model_type: got 'gpt2'"):
        GPTArch.from_hf(AutoConfig.for_model("gpt2"))


def test_hf_engine_satisfies_the_train_engine_protocol(tiny_model_dir):
    assert isinstance(HFTrainEngine(tiny_model_dir, trainable=False), TrainEngine)


def test_cuda_factories_run_on_cpu_only_inside_the_mode():
    with CudaFactoriesOnCpu():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(2, 2, device=torch.device("cuda", 0)).device.type == "cpu"
        assert torch.empty(1, device=0).device.type == "cpu"
        assert torch.ones(3).cuda().device.type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError)):
            torch.zeros(2, device="cuda")


# ---------------------------------------------------------------- distributed runs


PROMPTS = [[5, 6, 7, 8, 9], [9, 10], [11, 12, 13, 14], [30, 31, 32], [40, 41, 42, 43, 44, 45]]


def _responses(eos: int) -> list[list[int]]:
    return [[20, 21, 22, eos], [23, 24, 25, 26, 27, 28], [eos], [29, 30, eos], [50, 51, 52]]


def _batch(reference: HFTrainEngine) -> dict[str, list]:
    """An off-policy GRPO mini-batch with KL: old log-probs shifted so ratios and clipping are exercised."""
    rng = random.Random(0)
    responses = _responses(reference.tokenizer.eos_token_id)
    lp = reference.log_probs(PROMPTS, responses, temperature=TEMPERATURE, micro_batch=len(PROMPTS))
    return {
        "prompt_ids": PROMPTS, "response_ids": responses,
        "advantages": [rng.uniform(-1, 1) for _ in PROMPTS],
        "old_log_prob": [[x - 0.25 for x in row] for row in lp],
        "ref_log_prob": [[x + rng.uniform(-0.3, 0.3) for x in row] for row in lp],
    }


def _logit_ids(batch: dict, pad_id: int) -> torch.Tensor:
    """Two rows of ``prompt + response``, the shorter right-padded: ``(2, L)``."""
    rows = [batch["prompt_ids"][i] + batch["response_ids"][i] for i in (0, 3)]
    L = max(map(len, rows))
    return torch.tensor([r + [pad_id] * (L - len(r)) for r in rows])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}  # (TP, PP) on 2 ranks; DP = 2 / (TP·PP)


def _rank_main(rank: int, world: int, port: int, model_dir: str, batch: dict, out: str) -> None:
    """Every layout in turn in the same two processes (megatron's import is the slow part)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        from megatron.core import parallel_state

        from dockrl.engines.megatron.engine import MegatronTrainEngine
        from dockrl.parallel.cpu_device import REDIRECTIONS
        from dockrl.parallel.layout import ParallelLayout
        from dockrl.parallel.ranks import join_groups

        for key, (tp, pp) in LAYOUTS.items():
            layout = ParallelLayout(tp=tp, pp=pp, dp=world // (tp * pp), device="cpu")
            ranks = join_groups(layout, rank=rank, timeout_s=120, megatron=True)  # over the test's default group
            engine = MegatronTrainEngine(model_dir, trainable=True, ranks=ranks, lr=LR)
            result = {
                "is_train_engine": isinstance(engine, TrainEngine),
                "logits": engine.logits(_logit_ids(batch, engine.pad_id)),
                "log_probs": engine.log_probs(batch["prompt_ids"], batch["response_ids"], temperature=TEMPERATURE, micro_batch=2),
                "before": [(n, t.clone()) for n, t in engine.named_weights()],  # unsharded ones are live views
            }
            engine.save(Path(out) / key / "export")
            result["metrics"] = engine.optimizer_step(
                lambda: accumulate_mini_batch(engine, dict(batch), algo=ALGO, temperature=TEMPERATURE, micro_batch=2)  # noqa: B023 - called in this iteration
            )
            result["after"] = engine.named_weights()
            # nothing of the CPU device layer may stay patched outside its scopes
            modules = {r.module: __import__(r.module, fromlist=["_"]) for r in REDIRECTIONS}
            result["left_patched"] = [r.name for r in REDIRECTIONS if getattr(modules[r.module], r.name) is r.replacement]
            result["mode_left_on"] = torch._C._is_torch_function_mode_enabled()
            torch.save(result, Path(out) / key / f"rank{rank}.pt")
            parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with random biases and norm weights (initialized to 0 and 1), so their mapping counts."""
    out = tmp_path_factory.mktemp("tiny-perturbed")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf_step(model_dir):
    """The HF reference: the batch, and named weights and metrics after one step on it."""
    engine = HFTrainEngine(model_dir, trainable=True, lr=LR)
    batch = _batch(engine)
    metrics = engine.optimizer_step(lambda: accumulate_mini_batch(engine, dict(batch), algo=ALGO, temperature=TEMPERATURE, micro_batch=2))
    return batch, dict(engine.named_weights()), metrics


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory, model_dir, hf_step) -> Path:
    out = tmp_path_factory.mktemp("megatron")
    for key in LAYOUTS:
        (out / key).mkdir()
    mp.spawn(_rank_main, args=(2, _free_port(), str(model_dir), hf_step[0], str(out)), nprocs=2, join=True)
    return out


@pytest.fixture(params=list(LAYOUTS))
def layout(request, megatron_runs) -> tuple[list[dict], Path]:
    """The results of both ranks under one layout, and its folder."""
    out = megatron_runs / request.param
    return [torch.load(out / f"rank{r}.pt") for r in range(2)], out


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.slow
def test_logits_and_log_probs_match_hf(layout, hf_model, hf_step, model_dir):
    results, _ = layout
    batch = hf_step[0]
    with torch.no_grad():  # causal attention only: padding at the right end changes no earlier logit
        expected = hf_model(input_ids=_logit_ids(batch, hf_model.config.pad_token_id)).logits
    reference = HFTrainEngine(model_dir, trainable=False)
    lp = reference.log_probs(batch["prompt_ids"], batch["response_ids"], temperature=TEMPERATURE, micro_batch=5)
    for r in results:
        assert r["is_train_engine"]
        torch.testing.assert_close(r["logits"], expected, atol=1e-4, rtol=0)
        for got, want in zip(r["log_probs"], lp):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_named_weights_and_saved_checkpoint_round_trip(layout, hf_model):
    results, out = layout
    expected = dict(hf_model.named_parameters())
    for r in results:
        assert [n for n, _ in r["before"]] == list(expected)
        for name, tensor in r["before"]:
            assert torch.equal(tensor, expected[name]), name
    reloaded = AutoModelForCausalLM.from_pretrained(out / "export", dtype=torch.float32).eval()
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, hf_model(input_ids=ids).logits, atol=0, rtol=0)
    assert (out / "export" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_one_grpo_step_changes_weights_as_hf_does(layout, hf_step):
    results, _ = layout
    _, hf_after, hf_metrics = hf_step
    for r in results:
        assert r["left_patched"] == [] and not r["mode_left_on"]
        for key in ("actor/loss", "actor/pg_loss", "actor/kl", "actor/entropy", "actor/clip_ratio", "actor/grad_norm"):
            assert r["metrics"][key] == pytest.approx(hf_metrics[key], rel=1e-5, abs=1e-7), key
        before = dict(r["before"])
        moved = total_diff = 0.0
        for name, tensor in r["after"]:
            # AdamW's first step moves each weight by lr·g/(|g| + 1e-8), ≈ ±lr: compare steps in
            # units of lr. Where |g| ≲ 1e-8 it amplifies fp32 rounding of g to ~1e-2 of a step.
            step, hf_step_ = (tensor - before[name]) / LR, (hf_after[name] - before[name]) / LR
            torch.testing.assert_close(step, hf_step_, atol=0.05, rtol=0, msg=name)
            total_diff += float((step - hf_step_).abs().sum())
            moved += int((hf_step_.abs() > 0.5).sum())
        n = sum(t.numel() for t in hf_after.values())
        assert total_diff / n < 1e-4  # almost every element agrees to fp32 precision
        assert moved > 0.5 * n
