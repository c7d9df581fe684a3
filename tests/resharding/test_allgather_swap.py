"""Hybrid-actor phases, host swap and sync bookkeeping in one process (TP = PP = TP' = 1, no collectives).

The multi-process layouts are in test_sync_multiprocess.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from dockrl.parallel.layout import ModelShape, ParallelLayout
from dockrl.parallel.ranks import ProcessRanks
from dockrl.resharding.allgather_swap import AllGatherSwap, Phase, PhaseError
from dockrl.resharding.host_swap import ParamTrainState
from dockrl.resharding.spec import shard_state_dict

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    full = {n: t.detach().clone() for n, t in Qwen2ForCausalLM(config).state_dict().items()}
    return ModelShape.from_hf_config(config), full


def make_actor(model, *, swap=True, copy_on_cpu=True, step=True):
    shape, full = model
    layout = ParallelLayout(device="cpu")
    params = {n: torch.nn.Parameter(t) for n, t in shard_state_dict(full, layout, shape, 0).items()}
    optimizer = torch.optim.Adam(params.values(), lr=1e-3)
    if step:
        for p in params.values():
            p.grad = torch.ones_like(p)
        optimizer.step()
    state = ParamTrainState(params, optimizer, device=CPU, copy_on_cpu=copy_on_cpu)
    actor = AllGatherSwap(ranks=ProcessRanks.alone(layout), model=shape, state=state, bucket_bytes=4096, train_dtype=torch.float32, swap=swap)
    return actor, params, optimizer


def test_phases_in_order(model):
    actor, _, _ = make_actor(model)
    assert actor.phase is Phase.TRAINING
    actor.require_training()
    actor.sync()
    assert actor.phase is Phase.GENERATING
    assert dict(actor.weights.named_tensors())["lm_head.weight"] is not None
    actor.finish_generation()
    assert actor.phase is Phase.TRAINING
    actor.sync()  # and round again
    actor.finish_generation()


@pytest.mark.parametrize(
    ("calls", "fragment"),
    [
        (["finish_generation"], "finish_generation: the hybrid actor is in phase 'training'; allowed only in 'generating'"),
        (["weights"], "weights: the hybrid actor is in phase 'training'"),
        (["sync", "sync"], "sync: the hybrid actor is in phase 'generating'; allowed only in 'training'"),
        (["sync", "require_training"], "train step: the hybrid actor is in phase 'generating'"),
        (["sync", "finish_generation", "finish_generation"], "finish_generation: the hybrid actor is in phase 'training'"),
    ],
)
def test_out_of_order_calls_are_rejected(model, calls, fragment):
    actor, _, _ = make_actor(model)
    *ok, bad = calls

    def call(name):
        return getattr(actor, name) if name == "weights" else getattr(actor, name)()

    for name in ok:
        call(name)
    phase = actor.phase
    with pytest.raises(PhaseError) as info:
        call(bad)
    assert fragment in str(info.value)
    assert "training → syncing → generating → training" in str(info.value)
    assert actor.phase is phase  # a rejected call changes nothing


def test_a_failed_sync_blocks_further_calls(model):
    actor, params, _ = make_actor(model)
    params["model.norm.weight"].data = torch.zeros(3)  # a training shard of the wrong shape
    with pytest.raises(ValueError, match=r"training shard 'model.norm.weight': shape \(3,\); expected \(16,\)"):
        actor.sync()
    with pytest.raises(PhaseError, match="in phase 'syncing' \\(a sync is in progress, or failed\\)"):
        actor.sync()


def test_host_swap_moves_the_training_state_out_and_back_unchanged(model):
    actor, params, optimizer = make_actor(model, copy_on_cpu=True)
    before = {n: (p.detach().clone(), p.grad.clone(), {k: v.clone() for k, v in optimizer.state[p].items()}) for n, p in params.items()}
    storage = {n: p.data.data_ptr() for n, p in params.items()}
    report = actor.sync()
    assert all(p.grad is None for p in params.values())  # gradients swapped out
    assert all(p.data.data_ptr() != storage[n] for n, p in params.items())  # weights now in host copies
    weight_bytes = sum(p.numel() * 4 for p in params.values())
    assert report.swapped_out_bytes == {"grads": weight_bytes, "optimizer": 2 * weight_bytes + 4 * len(params), "weights": weight_bytes}
    moved = actor.finish_generation()
    assert moved["weights"] == weight_bytes and moved["grads"] == weight_bytes
    for n, p in params.items():
        w, g, st = before[n]
        assert torch.equal(p.detach(), w) and torch.equal(p.grad, g)
        assert all(torch.equal(optimizer.state[p][k], v) for k, v in st.items())
    optimizer.step()  # the optimizer runs on the restored state


def test_sync_report_and_memory_accounting(model):
    actor, params, _ = make_actor(model)
    report = actor.sync()
    infer = sum(b.infer_bytes for b in report.buckets)
    assert actor.weights.nbytes == infer
    assert len(report.buckets) >= 3 and all(b.seconds >= 0 and b.bytes_moved == 0 for b in report.buckets)  # nothing crosses a wire
    assert len({b.checksum for b in report.buckets}) == len(report.buckets)
    gathered, infer_bucket = max(b.gathered_bytes for b in report.buckets), max(b.infer_bytes for b in report.buckets)
    assert infer < report.peak_tracked_bytes <= infer + gathered + 24 * infer_bucket // 4
    assert actor.tracker.by_kind["weights"] == 0 and actor.tracker.by_kind["buckets"] == infer
    assert report.peak_allocator_bytes is None  # CPU: no allocator to ask
    assert set(report.metrics()) == {"timing_s/weight_sync", "reshard/bytes_moved", "reshard/buckets",
                                     "reshard/swapped_out_bytes", "reshard/peak_tracked_bytes"}
    actor.finish_generation()
    weights = sum(p.numel() * 4 for p in params.values())
    assert weights == infer  # TP = TP' = 1: the same shards, in the same dtype
    assert actor.tracker.by_kind["buckets"] == 0 and actor.tracker.by_kind["weights"] == weights


def test_naive_co_residence_keeps_the_training_state(model):
    naive, _, _ = make_actor(model, swap=False)
    swapped, _, _ = make_actor(model, swap=True)
    a, b = naive.sync(), swapped.sync()
    assert a.swapped_out_bytes == {}
    weights = naive.tracker.by_kind["weights"]
    assert naive.tracker.by_kind["grads"] == weights and naive.tracker.by_kind["optimizer"] > 2 * weights - 1
    assert a.peak_tracked_bytes >= 4 * weights + sum(r.infer_bytes for r in a.buckets)
    assert b.peak_tracked_bytes < a.peak_tracked_bytes / 2
    assert [r.checksum for r in a.buckets] == [r.checksum for r in b.buckets]  # same weights either way


def test_bucket_streaming_to_a_copying_rollout_engine(model):
    actor, _, _ = make_actor(model, step=False)  # the weights stay those of the full state dict
    received = []
    report = actor.sync(on_bucket=lambda named: received.extend(named), keep_buckets=False)
    _, full = model
    assert sorted(n for n, _ in received) == sorted(full)  # the tied head comes as an alias of the embedding
    assert all(torch.equal(t, full[n]) for n, t in received)
    assert actor.tracker.by_kind["buckets"] == 0 and actor.weights.nbytes == 0
    weights = sum(t.numel() * 4 for n, t in full.items() if n != "lm_head.weight")
    largest = max(max(b.gathered_bytes, 6 * b.infer_bytes) for b in report.buckets)
    assert report.peak_tracked_bytes <= weights + largest  # never more than one bucket beside the weights
    actor.finish_generation()


def test_param_train_state_rejects_params_off_the_device(model):
    with pytest.raises(ValueError, match="params\\['w'\\]: on meta; expected the training device cpu"):
        ParamTrainState({"w": torch.nn.Parameter(torch.empty(2, device="meta"))}, device=CPU)
