"""Weight sync: the actor's fp32 weights arrive in the rollout process, cast, bucket by bucket."""

from __future__ import annotations

import datetime
import multiprocessing

import pytest
import torch
import torch.distributed as dist

from dockrl.engines.weight_sync import WeightChannel, fingerprint, parse_address, plan_buckets


def test_plan_buckets_packs_consecutive_tensors():
    assert plan_buckets([10, 10, 10], 2, 40) == [[0, 1], [2]]
    assert plan_buckets([10, 100, 5, 5], 2, 40) == [[0], [1], [2, 3]]  # a tensor over the limit goes alone
    assert plan_buckets([], 2, 40) == []
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        plan_buckets([1], 2, 0)


def test_fingerprint_covers_names_shapes_and_dtype():
    a = fingerprint([("w", (2, 3)), ("b", (3,))], torch.bfloat16)
    assert a == fingerprint([("w", (2, 3)), ("b", (3,))], torch.bfloat16)
    assert a != fingerprint([("w", (3, 2)), ("b", (3,))], torch.bfloat16)
    assert a != fingerprint([("b", (3,)), ("w", (2, 3))], torch.bfloat16)
    assert a != fingerprint([("w", (2, 3)), ("b", (3,))], torch.float32)


@pytest.mark.parametrize("address", ["127.0.0.1", "host:port", ":80", "h:0", "h:70000"])
def test_bad_addresses_are_named(address):
    with pytest.raises(ValueError, match="host:port"):
        parse_address(address)


def _model(seed: int, dtype: torch.dtype, vocab: int = 50) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(vocab, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, vocab)).to(dtype)


def _copy_into(model: torch.nn.Module):
    params = dict(model.named_parameters())

    def load(named) -> int:
        copied = 0
        with torch.no_grad():
            for name, tensor in named:
                params[name].copy_(tensor)
                copied += tensor.numel() * tensor.element_size()
        return copied

    return load


def _rank(rank: int, address: str, out: str) -> None:
    """One rank: a sync of matching models, then one where the receiver has a different vocabulary."""
    result: dict = {}
    try:
        channel = WeightChannel(address, rank=rank, timeout_s=20.0, bucket_bytes=1000)
        if rank == 0:
            model = _model(1, torch.float32)
            result["metrics"] = channel.send(model.named_parameters(), torch.bfloat16)
            result["state"] = {k: v.clone() for k, v in model.state_dict().items()}
            channel.send(model.named_parameters(), torch.bfloat16)  # the receiver gives up on this one
        else:
            model = _model(2, torch.bfloat16)
            result["metrics"] = channel.receive(list(model.named_parameters()), _copy_into(model))
            result["state"] = {k: v.clone() for k, v in model.state_dict().items()}
            other = _model(3, torch.bfloat16, vocab=60)
            channel.receive(list(other.named_parameters()), _copy_into(other))
        channel.close()
    except Exception as e:  # noqa: BLE001 - handed to the test
        result["error"] = f"{type(e).__name__}: {e}"
    torch.save(result, out)


@pytest.mark.slow  # two processes importing torch: a few seconds, tens on a loaded machine
def test_rollout_weights_equal_the_actor_weights_cast_and_a_different_model_fails(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    ctx = multiprocessing.get_context("spawn")
    outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
    procs = [ctx.Process(target=_rank, args=(r, f"127.0.0.1:{store.port}", str(outs[r]))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
        assert p.exitcode is not None, "a weight-sync rank hung"
    del store
    sender, receiver = (torch.load(o) for o in outs)

    for name, value in sender["state"].items():
        assert receiver["state"][name].dtype == torch.bfloat16
        assert torch.equal(receiver["state"][name], value.to(torch.bfloat16)), name
    numels = [v.numel() for v in sender["state"].values()]
    assert sender["metrics"]["weight_sync/bytes"] == receiver["metrics"]["weight_sync/bytes"] == sum(numels) * 2
    # embedding 50x16 bf16 = 1600 B > 1000 B: a bucket of its own, as is the 16x50 head
    assert sender["metrics"]["weight_sync/buckets"] == receiver["metrics"]["weight_sync/buckets"] == len(plan_buckets(numels, 2, 1000)) == 4
    assert receiver["metrics"]["weight_sync/seconds"] > 0
    assert receiver["error"].startswith("ValueError: weight sync: the actor's parameters")
