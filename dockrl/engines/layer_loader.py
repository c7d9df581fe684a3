"""Hand weights to a rollout engine in whole layers, as they arrive bucket by bucket.

vLLM fuses some HF tensors into one layer (``q_proj, k_proj, v_proj`` → ``qkv_proj``) and
rebuilds a layer from garbage when only part of it is loaded (``VLLMRolloutEngine.load_weights``
refuses such a call). A bucketed weight sync cuts the model wherever a bucket is full, so a
layer can straddle two buckets. ``WholeLayerLoader`` keeps the tensors of a layer that is not
complete yet and loads each layer in the call that completes it; the rest of a bucket goes in
at once. At most the tensors of the layers cut by one bucket boundary wait: views into the
previous bucket (which stays alive until they are loaded).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch


class WholeLayerLoader:
    """Callable ``(named tensors) -> bytes loaded`` that loads only complete layers.

    Args:
        load: the engine's ``load_weights`` (returns the bytes it wrote).
        layer_members: HF names of the layer that loads a name
            (``VLLMRolloutEngine.layer_members``); ``None``: every tensor is a layer of its own
            (``HFRolloutEngine``).
    """

    def __init__(
        self,
        load: Callable[[Iterable[tuple[str, torch.Tensor]]], int],
        layer_members: Callable[[str], frozenset[str]] | None = None,
    ) -> None:
        self.load, self.layer_members = load, layer_members
        self.pending: dict[str, torch.Tensor] = {}
        self.loaded_bytes = 0
        self.calls = 0

    def __call__(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Take the tensors of one bucket; load every layer they complete. Returns the bytes loaded now."""
        self.pending.update(named)
        ready: list[str] = []
        waiting = set(self.pending)
        for name in self.pending:
            members = self.layer_members(name) if self.layer_members else frozenset((name,))
            if members <= waiting:
                ready.append(name)
        if not ready:
            return 0
        n = self.load([(name, self.pending.pop(name)) for name in ready])
        self.loaded_bytes += n
        self.calls += 1
        return n

    def finish(self) -> int:
        """Check that nothing is left waiting; returns the bytes loaded in all.

        Raises:
            ValueError: tensors whose layer never became complete (named).
        """
        if self.pending:
            missing = sorted(self.pending)
            self.pending.clear()
            raise ValueError(f"weight sync ended with incomplete rollout-engine layers; waiting tensors: {missing[:6]}")
        return self.loaded_bytes
