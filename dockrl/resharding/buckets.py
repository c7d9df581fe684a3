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

from dockrl.parallel.layout import ModelShape, ParallelLayout
from dockrl.resharding.spec import ParamSpec, model_spec, shard_range

# Inference buckets are padded to a multiple of 8 elements so their bytes view as 64-bit words.
_WORD_PAD = 8
# The checksum lays the words out as rows of this many columns.
_CHECKSUM_COLS = 4096
# Odd multiplier that mixes the row sums into the column sums.
_ROW_MIX = 1_000_003


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
    """Elements of the inference bucket (padded to a multiple of 8)."""


def plan_buckets(layout: ParallelLayout, model: ModelShape, bucket_bytes: int, element_size: int) -> list[Bucket]:
    """Split the spec into buckets of at most ``bucket_bytes`` gathered bytes each.

    Args:
        layout: the parallel layout.
        model: the sizes of the model it shards.
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
            t_shape = s.shard_shape(layout.tp, layout.train_vocab_size(model))
            i_shape = s.shard_shape(layout.infer_tp, layout.infer_vocab_size(model))
            entries.append(BucketEntry(s, t_off, t_shape, i_off, i_shape))
            t_off += math.prod(t_shape)
            i_off += math.prod(i_shape)
        i_off = -(-i_off // _WORD_PAD) * _WORD_PAD
        buckets.append(Bucket(len(buckets), current[0].stage, tuple(entries), t_off, i_off))
        current.clear()

    gathered = 0
    for s in model_spec(layout, model):
        size = layout.tp * math.prod(s.shard_shape(layout.tp, layout.train_vocab_size(model))) * element_size
        if current and (s.stage != current[0].stage or gathered + size > bucket_bytes):
            close()
            gathered = 0
        current.append(s)
        gathered += size
    close()
    return buckets


def copy_to_inference(
    gathered: torch.Tensor, bucket: Bucket, infer: torch.Tensor, layout: ParallelLayout, model: ModelShape, infer_tp_rank: int
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
        start, stop = shard_range(s.shape[d], s.padded(layout.infer_vocab_size(model)), layout.infer_tp, infer_tp_rank)
        size = e.train_shape[d]
        for j in range(layout.tp):
            lo, hi = max(start, j * size), min(stop, (j + 1) * size)
            if lo < hi:
                dest.narrow(d, lo - start, hi - lo).copy_(source(j).narrow(d, lo - j * size, hi - lo))


def checksum_temp_bytes(nbytes: int) -> int:
    """Device bytes of the temporaries of ``bucket_checksum`` on a tensor of ``nbytes`` bytes
    (column and row sums and their weighted products, int64)."""
    words = nbytes // 8
    cols = max(1, min(words, _CHECKSUM_COLS))
    return 16 * (cols + words // cols + 2)


def bucket_checksum(flat: torch.Tensor) -> int:
    """Checksum of a bucket's bytes: position-weighted column and row sums of its 64-bit words, mod 2^64.

    The words ``w`` (the tensor's bytes as int64) are laid out as rows of ``K = min(4096, words)``
    columns (the last row may be short); with column sums ``C_j`` and row sums ``R_r``, the
    checksum is ``Σ_j (j+1)·C_j + 1000003 · Σ_r (r+1)·R_r`` in int64 arithmetic, which wraps
    modulo 2^64. Addition mod 2^64 is associative, so the value does not depend on the
    reduction order or the device. A changed word changes it (but for a vanishing set of
    deltas); two swapped words change a row or a column weight.
    Two native int64 reductions over the data, no full-size temporary (``checksum_temp_bytes``).

    Args:
        flat: a contiguous 1-D tensor whose size in bytes is a multiple of 8.

    Returns:
        The checksum as a Python int in ``[0, 2^64)``.
    """
    assert flat.dim() == 1 and flat.is_contiguous() and flat.numel() * flat.element_size() % 8 == 0
    words = flat.view(torch.uint8).view(torch.int64)
    k = max(1, min(words.numel(), _CHECKSUM_COLS))
    rows, tail = divmod(words.numel(), k)
    grid = words[: rows * k].view(rows, k)
    col, row = grid.sum(0), grid.sum(1)
    if tail:
        col[:tail] += words[rows * k :]
        row = torch.cat([row, words[rows * k :].sum().view(1)])
    col_w = torch.arange(1, k + 1, dtype=torch.int64, device=flat.device)
    row_w = torch.arange(1, row.numel() + 1, dtype=torch.int64, device=flat.device)
    total = (col * col_w).sum() + (row * row_w).sum() * _ROW_MIX
    return int(total.item()) % (1 << 64)
