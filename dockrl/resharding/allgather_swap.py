"""Allgather–swap weight sync of the hybrid actor (docs/design.md §3; MindSpeed RL, arXiv 2507.19017 §4).

The actor trains in the Megatron layout (TP, PP, DP) and generates in the vLLM layout (TP') on
the same devices. ``AllGatherSwap.sync`` on every rank, collectively:

1. swaps optimizer state, gradients and the training weights to host memory;
2. for each bucket (``buckets.plan_buckets``), in the same order on all ranks: the ranks of the
   bucket's PP stage copy their training shards from host into their chunk of the gathered
   buffer on the device; the chunk is broadcast over the PP group (so every stage gets the
   layers it does not train) and all-gathered over the TP group; each rank copies its own TP'
   shards into a new inference bucket and the gathered buffer is freed;
3. the rollout engine's weights are views into the inference buckets (``InferenceWeights``),
   or are loaded from them bucket by bucket (``on_bucket``; then each bucket is freed).

Swapping the training weights out before the first bucket (and copying each bucket's shards
back, one more host-to-device pass over them) keeps the peak at the inference weights plus one
bucket also when the training weights are wider than the inference ones (fp32 training, bf16
rollout: packing from device-resident weights would start at twice the inference weights).

``finish_generation`` frees the buckets and brings weights, gradients and optimizer state
back. Peak device memory of a sync is about the inference weights plus one gathered bucket
(see ``benchmarks/reshard.py``), instead of the training state plus the inference weights.

Phases of the hybrid actor: training → syncing → generating → training; a call in the wrong
phase raises ``PhaseError``. Every collective is bounded by the process group's timeout.
"""

from __future__ import annotations

import enum
import logging
import time
from typing import Callable

import torch
import torch.distributed as dist

from dockrl.parallel import device as devices
from dockrl.parallel.layout import ModelShape
from dockrl.parallel.ranks import ProcessRanks
from dockrl.resharding.buckets import Bucket, bucket_checksum, checksum_temp_bytes, copy_to_inference, plan_buckets
from dockrl.resharding.host_swap import MemoryTracker, TrainState, nbytes
from dockrl.resharding.sync_results import BucketRecord, InferenceWeights, SyncReport, named_views

logger = logging.getLogger(__name__)

# torch >= 2.13 renames all_gather_into_tensor; older torch (torch_npu images) has only the old name.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Phase(enum.Enum):
    TRAINING = "training"
    SYNCING = "syncing"
    GENERATING = "generating"


class PhaseError(RuntimeError):
    """A hybrid-actor call came in the wrong phase (order: training → syncing → generating → training)."""


class AllGatherSwap:
    """The hybrid actor's weight sync on one rank (see the module docstring).

    Args:
        ranks: this process's ranks: the layout, its rank, TP and PP groups and device
            (``dockrl.parallel.ranks.join_groups``).
        model: the sizes of the model it shards (``layout.check_model`` passed).
        state: the training state of this rank (``host_swap.TrainState``).
        bucket_bytes: bound of one gathered buffer, in bytes.
        train_dtype: dtype of the training shards (fp32 or bf16).
        infer_dtype: dtype of the inference weights; defaults to ``train_dtype``.
        swap: ``False`` keeps the training state on the device (naive co-residence; benchmarks).
    """

    def __init__(
        self,
        *,
        ranks: ProcessRanks,
        model: ModelShape,
        state: TrainState,
        bucket_bytes: int,
        train_dtype: torch.dtype,
        infer_dtype: torch.dtype | None = None,
        swap: bool = True,
    ) -> None:
        layout = ranks.layout
        self.ranks, self.layout, self.model, self.rank, self.state, self.device = ranks, layout, model, ranks.rank, state, ranks.device
        self.train_dtype, self.infer_dtype = train_dtype, infer_dtype or train_dtype
        self.swap = swap
        self.coords = layout.train_coords(self.rank)
        self.infer_tp_rank = ranks.infer_tp_rank
        self.plan = plan_buckets(layout, model, bucket_bytes, torch.empty((), dtype=train_dtype).element_size())
        self.tracker = MemoryTracker()
        self.phase = Phase.TRAINING
        self._weights: InferenceWeights | None = None
        self.last_report: SyncReport | None = None

    def _expect(self, phase: Phase, what: str) -> None:
        if self.phase is not phase:
            hint = " (a sync is in progress, or failed)" if self.phase is Phase.SYNCING else ""
            raise PhaseError(
                f"{what}: the hybrid actor is in phase {self.phase.value!r}{hint}; allowed only in {phase.value!r} "
                "(order: training → syncing → generating → training)"
            )

    def require_training(self, what: str = "train step") -> None:
        """Raise ``PhaseError`` unless the actor is training (call before forward/backward/step)."""
        self._expect(Phase.TRAINING, what)

    def require_generating(self, what: str = "generate") -> None:
        """Raise ``PhaseError`` unless the actor is generating (call before the rollout engine runs)."""
        self._expect(Phase.GENERATING, what)

    @property
    def weights(self) -> InferenceWeights:
        """The inference weights; only while generating."""
        self._expect(Phase.GENERATING, "weights")
        assert self._weights is not None
        return self._weights

    def sync(
        self,
        on_bucket: Callable[[list[tuple[str, torch.Tensor]]], object] | None = None,
        keep_buckets: bool = True,
    ) -> SyncReport:
        """Training → syncing → generating: build the inference weights (collective on all ranks).

        Args:
            on_bucket: called with each finished bucket's ``(hf_name, shard)`` views, in order
                (for a rollout engine that copies weights in).
            keep_buckets: keep the buckets as ``weights`` (a rollout engine pointing at them);
                ``False`` frees each after ``on_bucket``.

        Raises:
            PhaseError: not in the training phase.
        """
        self._expect(Phase.TRAINING, "sync")
        self.phase = Phase.SYNCING
        t0 = time.perf_counter()
        tracker = self.tracker = MemoryTracker()
        report = SyncReport()
        for kind, n in self.state.device_bytes().items():
            tracker.alloc(kind, n)
        swapped: dict[str, int] = {}

        def swapped_out(moved: dict[str, int]) -> None:
            for kind, n in moved.items():
                tracker.free(kind, n)
                swapped[kind] = swapped.get(kind, 0) + n

        if self.swap:
            swapped_out(self.state.offload_optimizer_and_grads())
            swapped_out(self.state.offload_weights(None))  # each bucket copies its shards back from host
        # The peak of the sync counts from here: what the training step left is freed, or kept (swap=False).
        tracker.reset_peak()
        devices.reset_allocator_peak(self.device)
        kept: list[tuple[Bucket, torch.Tensor]] = []
        for bucket in self.plan:
            record, infer = self._sync_bucket(bucket)
            report.buckets.append(record)
            if on_bucket is not None:
                on_bucket(list(named_views(self.layout, self.model, self.infer_tp_rank, [(bucket, infer)], False)))
            if keep_buckets:
                kept.append((bucket, infer))
            else:  # loaded: freed before the next bucket is gathered
                tracker.free("buckets", nbytes(infer))
            del infer
        devices.synchronize(self.device)
        report.seconds = time.perf_counter() - t0
        report.swapped_out_bytes = swapped
        report.peak_tracked_bytes = tracker.peak
        report.peak_allocator_bytes = devices.allocator_peak_bytes(self.device)
        self._weights = InferenceWeights(self.layout, self.model, self.infer_tp_rank, kept)
        self.last_report = report
        self.phase = Phase.GENERATING
        logger.debug("rank %d: weight sync %.3f s, %d buckets, %d B moved", self.rank, report.seconds, len(report.buckets), report.bytes_moved)
        return report

    def _sync_bucket(self, bucket: Bucket) -> tuple[BucketRecord, torch.Tensor]:
        t0 = time.perf_counter()
        tp, pp, tracker = self.layout.tp, self.layout.pp, self.tracker
        chunk = bucket.chunk_numel
        gathered = torch.empty(tp * chunk, dtype=self.train_dtype, device=self.device)
        gathered_bytes = nbytes(gathered)
        tracker.alloc("gather", gathered_bytes)
        mine = gathered.narrow(0, self.coords.tp_rank * chunk, chunk)
        holder = self.coords.pp_rank == bucket.stage
        if holder:
            for e in bucket.entries:
                shard = self.state.shard(e.name, on_host=self.swap)
                if tuple(shard.shape) != e.train_shape:
                    raise ValueError(f"training shard {e.name!r}: shape {tuple(shard.shape)}; expected {e.train_shape}")
                # from pinned host memory that stays untouched until the sync's final synchronize
                mine.narrow(0, e.train_offset, shard.numel()).view(e.train_shape).copy_(shard, non_blocking=True)
        moved = 0
        if pp > 1:
            dist.broadcast(mine, group=self.ranks.pp_group, group_src=bucket.stage)
            moved += 0 if holder else nbytes(mine)
        if tp > 1:
            _all_gather(gathered, mine, group=self.ranks.tp_group)  # in place: input is this rank's chunk
            moved += nbytes(gathered) - nbytes(mine)
        infer = torch.zeros(bucket.infer_numel, dtype=self.infer_dtype, device=self.device)
        tracker.alloc("buckets", nbytes(infer))
        copy_to_inference(gathered, bucket, infer, self.layout, self.model, self.infer_tp_rank)
        del mine, gathered
        tracker.free("gather", gathered_bytes)
        tracker.alloc("checksum", checksum_temp_bytes(nbytes(infer)))
        checksum = bucket_checksum(infer)
        tracker.free("checksum", checksum_temp_bytes(nbytes(infer)))
        devices.synchronize(self.device)
        record = BucketRecord(
            index=bucket.index, stage=bucket.stage, params=len(bucket.entries), gathered_bytes=gathered_bytes,
            infer_bytes=nbytes(infer), bytes_moved=moved, seconds=time.perf_counter() - t0, checksum=checksum,
        )
        return record, infer

    def finish_generation(self) -> dict[str, int]:
        """Generating → training: free the inference buckets, swap the training state back in.

        The rollout engine must drop its references to ``weights`` first (views keep buckets alive).

        Returns:
            Bytes swapped back in, by kind.

        Raises:
            PhaseError: not in the generating phase.
        """
        self._expect(Phase.GENERATING, "finish_generation")
        assert self._weights is not None
        self.tracker.free("buckets", self._weights.nbytes)
        self._weights = None
        moved = self.state.reload() if self.swap else {}
        for kind, n in moved.items():
            self.tracker.alloc(kind, n)
        self.phase = Phase.TRAINING
        return moved
