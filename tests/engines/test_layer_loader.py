"""WholeLayerLoader: weights arrive bucket by bucket, a rollout engine takes whole layers only."""

from __future__ import annotations

import pytest
import torch

from dockrl.engines.layer_loader import WholeLayerLoader

QKV = frozenset({"l0.q", "l0.k", "l0.v"})


class FakeEngine:
    """Fake rollout engine: records each load call and refuses a partial fused layer, as vLLM does."""

    def __init__(self):
        self.calls: list[list[str]] = []

    def layer_members(self, name):
        return QKV if name in QKV else frozenset({name})

    def load_weights(self, named):
        named = list(named)
        names = {n for n, _ in named}
        assert not (names & QKV) or QKV <= names, f"partial layer {sorted(names)}"
        self.calls.append([n for n, _ in named])
        return sum(t.numel() * 4 for _, t in named)


def test_a_layer_cut_by_a_bucket_boundary_is_loaded_once_complete():
    engine = FakeEngine()
    loader = WholeLayerLoader(engine.load_weights, engine.layer_members)
    one = torch.ones(2)
    assert loader([("embed", one), ("l0.q", one)]) == 8  # the embedding goes at once, q waits
    assert loader([("l0.k", one)]) == 0  # still incomplete: nothing loaded
    assert loader([("l0.v", one), ("norm", one)]) == 4 * 8
    assert engine.calls == [["embed"], ["l0.q", "l0.k", "l0.v", "norm"]]
    assert loader.finish() == 5 * 8 and loader.calls == 2


def test_an_incomplete_layer_at_the_end_is_an_error():
    engine = FakeEngine()
    loader = WholeLayerLoader(engine.load_weights, engine.layer_members)
    loader([("l0.q", torch.ones(1))])
    with pytest.raises(ValueError, match=r"incomplete rollout-engine layers; waiting tensors: \['l0.q'\]"):
        loader.finish()


def test_without_layer_members_every_tensor_is_its_own_layer():
    engine = FakeEngine()
    loader = WholeLayerLoader(lambda named: engine.calls.append([n for n, _ in named]) or 1)
    loader([("a", torch.ones(1)), ("b", torch.ones(1))])
    assert engine.calls == [["a", "b"]] and loader.finish() == 1
