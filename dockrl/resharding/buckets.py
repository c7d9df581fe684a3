"""Bucket plan of a weight sync, the per-bucket copy from training to inference layout, and checksums.

A bucket is a run of consecutive spec parameters of one PP stage. Its **gathered buffer** holds
``TP`` chunks, chunk ``j`` being TP rank ``j``'s training shards of those parameters packed
back to back (``chunk_numel`` elements each); an all-gather over the TP group fills it. The
**inference bucket** holds this rank's TP' shards of the same parameters back to back; the
rollout engine's weights are views into it.

``bucket_bytes`` bounds the gathered buffer (``TP × chunk_numel × element size``); a parameter
larger than that gets a bucket of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dockrl.resharding.layout import ParallelLayout
from dockrl.resharding.spec import ParamSpec, model_spec, shard_range

# Inference buckets are padded to a multiple of 4 elements so their bytes view as 32-bit words.
_WORD_PAD = 4
# Words per chunk of the checksum: bounds its int64 temporaries to 24 MiB (3 tensors × 8 MiB).
_CHECKSUM_CHUNK = 1 << 20
# Weights of the position-weighted checksum: i mod 65521 (the largest prime < 2^16), plus one.
_CHECKSUM_MOD = 65521


@dataclass(frozen=True)
class BucketEntry:
    """One parameter's place in a bucket."""

    spec: ParamSpec
    train_offset: int
    """Element offset of this parameter's training shard inside one TP chunk."""
    train_shape: tuple[int, ...]
    infer_offset: int
    """Element offset of this parameter's inference shard inside the inference bucket."""
    infer_shape: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class Bucket:
    """A run of parameters of one PP stage gathered together."""

    index: int
    stage: int
    """PP stage whose ranks hold the training shards."""
    entries: tuple[BucketEntry, ...]
    chunk_numel: int
    """Elements of one TP rank's packed training shards."""
    infer_numel: int
    """Elements of the inference bucket (padded to a multiple of 4)."""


def plan_buckets(layout: ParallelLayout, bucket_bytes: int, element_size: int) -> list[Bucket]:
    """Split the spec into buckets of at most ``bucket_bytes`` gathered bytes each.

    Args:
        layout: the parallel layout.
        bucket_bytes: bound of one gathered buffer (``TP × chunk × element_size``), in bytes.
        element_size: bytes per element of the training weights (4 for fp32, 2 for bf16).

    Returns:
        Buckets in spec order; every spec parameter is in exactly one bucket; no bucket spans
        two PP stages.

    Raises:
        ValueError: ``bucket_bytes`` or ``element_size`` not positive.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes: got {bucket_bytes}; expected a positive number of bytes")
    if element_size < 1:
        raise ValueError(f"element_size: got {element_size}; expected >= 1")
    buckets: list[Bucket] = []
    current: list[ParamSpec] = []

    def close() -> None:
        entries, t_off, i_off = [], 0, 0
        for s in current:
            t_shape = s.shard_shape(layout.tp, layout.train_vocab_size)
            i_shape = s.shard_shape(layout.infer_tp, layout.infer_vocab_size)
            entries.append(BucketEntry(s, t_off, t_shape, i_off, i_shape))
            t_off += math.prod(t_shape)
            i_off += math.prod(i_shape)
        i_off = -(-i_off // _WORD_PAD) * _WORD_PAD
        buckets.append(Bucket(len(buckets), current[0].stage, tuple(entries), t_off, i_off))
        current.clear()

    gathered = 0
    for s in model_spec(layout):
        size = layout.tp * math.prod(s.shard_shape(layout.tp, layout.train_vocab_size)) * element_size
        if current and (s.stage != current[0].stage or gathered + size > bucket_bytes):
            close()
            gathered = 0
        current.append(s)
        gathered += size
    close()
    return buckets


def copy_to_inference(
    gathered: torch.Tensor, bucket: Bucket, infer: torch.Tensor, layout: ParallelLayout, infer_tp_rank: int
) -> None:
    """Copy this rank's TP' shards of every bucket parameter from the gathered buffer.

    Works for any TP and TP' (shard ranges are intersected), casting to ``infer``'s dtype. No
    full parameter is materialized: each piece goes straight from a training chunk to its place
    in the inference bucket.

    Args:
        gathered: ``(TP × bucket.chunk_numel,)`` training shards of all TP ranks.
        infer: ``(bucket.infer_numel,)`` destination; padding rows must already be zero.
    """
    chunk = bucket.chunk_numel
    for e in bucket.entries:
        s = e.spec
        dest = infer.narrow(0, e.infer_offset, math.prod(e.infer_shape)).view(e.infer_shape)

        def source(j: int) -> torch.Tensor:
            return gathered.narrow(0, j * chunk + e.train_offset, math.prod(e.train_shape)).view(e.train_shape)  # noqa: B023

        if s.split_dim is None:
            dest.copy_(source(0))
            continue
        d = s.split_dim
        start, stop = shard_range(s.shape[d], s.padded(layout.infer_vocab_size), layout.infer_tp, infer_tp_rank)
        size = e.train_shape[d]
        for j in range(layout.tp):
            lo, hi = max(start, j * size), min(stop, (j + 1) * size)
            if lo < hi:
                dest.narrow(d, lo - start, hi - lo).copy_(source(j).narrow(d, lo - j * size, hi - lo))


def bucket_checksum(flat: torch.Tensor) -> int:
    """Position-weighted sum of a bucket's 32-bit words, modulo 2^64.

    ``Σ_i w_i · (i mod 65521 + 1)`` over the signed 32-bit words ``w_i`` of the tensor's bytes,
    in int64 arithmetic that wraps modulo 2^64 (addition mod 2^64 is associative, so the value
    does not depend on the reduction order or the device). Equal bytes give equal sums; a
    changed or moved word changes it with high probability. Runs on the tensor's device in
    chunks of 2^20 words (24 MiB of temporaries).

    Args:
        flat: a contiguous 1-D tensor whose size in bytes is a multiple of 4.

    Returns:
        The checksum as a Python int in ``[0, 2^64)``.
    """
    assert flat.dim() == 1 and flat.is_contiguous() and flat.numel() * flat.element_size() % 4 == 0
    words = flat.view(torch.uint8).view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), _CHECKSUM_CHUNK):
        part = words[start : start + _CHECKSUM_CHUNK].to(torch.int64)
        weight = torch.arange(start, start + part.numel(), dtype=torch.int64, device=flat.device)
        weight.remainder_(_CHECKSUM_MOD).add_(1)
        total += (part * weight).sum()
    return int(total.item()) % (1 << 64)
