"""What a weight sync of the hybrid actor leaves on each rank: its report and the inference weights.

``SyncReport`` (one ``BucketRecord`` per bucket) says what ``AllGatherSwap.sync`` did on this rank
(bytes moved, time, peak memory) and turns it into metrics; ``InferenceWeights`` holds the
inference-layout (TP') buckets it built and hands out named views into them, the weights the
rollout engine loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

import torch

from dockrl.parallel.layout import ModelShape, ParallelLayout
from dockrl.resharding.buckets import Bucket
from dockrl.resharding.host_swap import nbytes
from dockrl.resharding.spec import shard_range


@dataclass(frozen=True)
class BucketRecord:
    index: int
    stage: int
    params: int
    gathered_bytes: int
    """Size of the gathered buffer (TP × chunk)."""
    infer_bytes: int
    """Size of this rank's inference bucket."""
    bytes_moved: int
    """Bytes this rank received over collectives for the bucket."""
    seconds: float
    checksum: int
    """``buckets.bucket_checksum`` of this rank's inference bucket."""


@dataclass
class SyncReport:
    """What one sync did on this rank."""

    buckets: list[BucketRecord] = field(default_factory=list)
    seconds: float = 0.0
    swapped_out_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes swapped to host by kind (weights, grads, optimizer)."""
    peak_tracked_bytes: int = 0
    """Peak of the explicit accounting (``MemoryTracker``) from the moment optimizer state and
    gradients are swapped out to the end of the sync."""
    peak_allocator_bytes: int | None = None
    """Peak of the device allocator over the same span (cuda/npu; ``None`` on cpu)."""

    @property
    def bytes_moved(self) -> int:
        return sum(b.bytes_moved for b in self.buckets)

    def metrics(self) -> dict[str, float]:
        """Flat metrics: ``timing_s/weight_sync``, ``reshard/*``."""
        return {
            "timing_s/weight_sync": self.seconds,
            "reshard/bytes_moved": float(self.bytes_moved),
            "reshard/buckets": float(len(self.buckets)),
            "reshard/swapped_out_bytes": float(sum(self.swapped_out_bytes.values())),
            "reshard/peak_tracked_bytes": float(self.peak_tracked_bytes),
        }


class InferenceWeights:
    """This rank's inference-layout (TP') weights: named views into the inference buckets."""

    def __init__(self, layout: ParallelLayout, model: ModelShape, infer_tp_rank: int, buckets: list[tuple[Bucket, torch.Tensor]]) -> None:
        self.layout, self.model = layout, model
        self.infer_tp_rank = infer_tp_rank
        self.buckets = buckets

    @property
    def nbytes(self) -> int:
        return sum(nbytes(t) for _, t in self.buckets)

    def named_tensors(self, trim_padding: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, shard)`` views in spec order; with tied embeddings ``lm_head.weight`` too.

        Args:
            trim_padding: cut vocab-parallel shards to their real rows (for TP' = 1 the full
                HF shapes), instead of the padded shard shape.
        """
        yield from named_views(self.layout, self.model, self.infer_tp_rank, self.buckets, trim_padding)


def named_views(
    layout: ParallelLayout, model: ModelShape, infer_tp_rank: int, buckets: list[tuple[Bucket, torch.Tensor]], trim: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, shard)`` views into inference ``buckets`` (``InferenceWeights.named_tensors``)."""
    for bucket, flat in buckets:
        for e in bucket.entries:
            view = flat.narrow(0, e.infer_offset, math.prod(e.infer_shape)).view(e.infer_shape)
            if trim and e.spec.vocab:
                start, stop = shard_range(e.spec.shape[0], layout.infer_vocab_size(model), layout.infer_tp, infer_tp_rank)
                view = view.narrow(0, 0, stop - start)
            yield e.name, view
            if e.name == "model.embed_tokens.weight" and model.tie_word_embeddings:
                yield "lm_head.weight", view
