"""The hybrid actor: megatron-core training and vLLM generation on the same devices (docs/design.md §3).

``HybridActor`` owns one rank's ``MegatronTrainEngine``, its ``VLLMRolloutEngine`` and the
``AllGatherSwap`` between them, and walks the cycle of phases

    generating ──start_training()──► training ──sync()──► (syncing) ──► generating

* ``sync``: optimizer state and gradients go to host; bucket by bucket the training shards are
  gathered over the TP/PP groups into inference-layout (TP') buckets, which are loaded into
  vLLM (``load_weights``, whole vLLM layers at a time: ``WholeLayerLoader``) and freed; the
  training weights go to host. Returns ``weight_sync/*`` and ``reshard/*`` metrics.
* ``start_training``: vLLM sleeps (its weights to host, its KV cache freed, where the
  platform has sleep mode), and the training state comes back to the device.

With sleep mode the sync wakes vLLM's weights first, loads the buckets into them while the
training state leaves the device, returns the freed memory to the allocator
(``devices.empty_cache``) and only then wakes the KV cache, which takes that memory.

``rollout_engine`` and ``train_engine`` are the two engines behind phase guards: generating
while training, or a forward/backward or optimizer step while generating, raises
``PhaseError`` instead of silently using stale or swapped-out weights. The stage loop is
``dockrl/stages/hybrid.py``.

Every step is driven by the process's ranks (``ProcessRanks``: the layout and megatron's TP/PP
groups, made once by ``join_groups``), so a TP/PP > 1 group runs the same code on every rank (one process per rank, ``run_hybrid`` in
``dockrl/stages/hybrid.py``); each rank's vLLM holds a full copy (TP' = 1). On CPU host and
device are the same memory, so the swap moves only the accounting (``reshard/*``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from dockrl.engines.layer_loader import WholeLayerLoader
from dockrl.engines.megatron.state import MegatronTrainState
from dockrl.parallel import device as devices
from dockrl.parallel.layout import ModelShape
from dockrl.parallel.ranks import ProcessRanks, leave_groups
from dockrl.resharding.allgather_swap import AllGatherSwap, Phase, PhaseError
from dockrl.resharding.sync_results import SyncReport

logger = logging.getLogger(__name__)

CHECKSUM_BITS = 53
"""Metrics are floats: the sync checksum is reported modulo 2^53, which a float holds exactly."""


def sync_metrics(report: SyncReport, loaded_bytes: int) -> dict[str, float]:
    """Flat metrics of one sync: ``report.metrics()`` (``timing_s/weight_sync``, ``reshard/*``) plus
    ``weight_sync/bytes`` (bytes written into the rollout engine, its dtype; a tied head counted
    again, as vLLM keeps its own copy), ``weight_sync/seconds``, ``weight_sync/buckets`` and
    ``weight_sync/checksum``: the sum of the buckets' ``bucket_checksum`` modulo 2^64, then 2^53."""
    checksum = sum(b.checksum for b in report.buckets) % (1 << 64)
    return report.metrics() | {
        "weight_sync/bytes": float(loaded_bytes),
        "weight_sync/seconds": report.seconds,
        "weight_sync/buckets": float(len(report.buckets)),
        "weight_sync/checksum": float(checksum % (1 << CHECKSUM_BITS)),
    }


class HybridActor:
    """One rank of the hybrid actor (see the module docstring).

    Builds its ``AllGatherSwap`` from the training engine's ranks (layout, TP/PP groups, device),
    then runs a first sync, so that vLLM serves exactly the training weights and the actor starts
    in the generating phase.

    Args:
        train: the trainable megatron engine of this rank (built with this process's ``ProcessRanks``).
        rollout: this rank's vLLM engine (any engine with ``load_weights``; ``layer_members`` if
            it loads fused layers).
        bucket_bytes: bound of one gathered bucket, bytes.
        infer_dtype: dtype of the rollout weights.

    Raises:
        LayoutError: the layout breaks a rule or does not fit the model (``ParallelLayout``).
    """

    def __init__(self, train, rollout, *, bucket_bytes: int = 256 << 20, infer_dtype: torch.dtype = torch.float32) -> None:
        ranks: ProcessRanks = train.ranks
        self.ranks, self.layout, self.device, self.rank = ranks, ranks.layout, ranks.device, ranks.rank
        self.train, self.rollout = train, rollout
        self._asleep = False
        self.model = model = ModelShape.from_model_dir(train.model_path)
        self.layout.check_model(model)
        self.state = MegatronTrainState(train, self.layout, model, device=self.device)
        self.swap = AllGatherSwap(
            ranks=ranks, model=model, state=self.state, bucket_bytes=bucket_bytes, train_dtype=torch.float32, infer_dtype=infer_dtype,
        )
        self.rollout_engine = GuardedRollout(rollout, self.swap)
        self.train_engine = GuardedTrain(train, self.swap)
        self.last_sync = self.sync()

    @property
    def phase(self) -> Phase:
        return self.swap.phase

    def sync(self) -> dict[str, float]:
        """Training → generating: allgather–swap the updated weights into the rollout engine.

        Returns:
            ``sync_metrics``: bytes, seconds, buckets, checksum, swapped and peak bytes.

        Raises:
            PhaseError: not in the training phase.
        """
        self.swap.require_training("sync")
        if self._asleep:  # the weights' memory back first: the buckets are loaded into it
            self.rollout.wake_up(["weights"])
        loader = WholeLayerLoader(self.rollout.load_weights, getattr(self.rollout, "layer_members", None))
        report = self.swap.sync(on_bucket=loader, keep_buckets=False)
        self.last_sync = sync_metrics(report, loader.finish())
        devices.empty_cache(self.device)  # the training state's memory, for vLLM's KV cache
        if self._asleep:
            self.rollout.wake_up(["kv_cache"])
            self._asleep = False
        logger.info("hybrid sync: %.1f MB into the rollout engine in %d buckets, %.2f s", loader.loaded_bytes / 1e6,
                    len(report.buckets), report.seconds)
        return self.last_sync

    def start_training(self) -> dict[str, int]:
        """Generating → training: bring weights, gradients and optimizer state back to the device.

        Raises:
            PhaseError: not in the generating phase.
        """
        self.swap.require_generating("finish_generation")
        sleep = getattr(self.rollout, "sleep", None)
        if sleep is not None and getattr(self.rollout, "sleep_supported", False):
            sleep(level=1)  # weights to host, KV cache freed: room for the training state
            self._asleep = True
        return self.swap.finish_generation()

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The training engine's optimizer (checkpointed by ``dockrl.checkpoint.optimizer_state.save_optimizer``)."""
        return self.train.optimizer

    def save(self, path: str | Path) -> Path:
        """Write an HF checkpoint of the training weights (``MegatronTrainEngine.save``).

        While generating the training weights sit in host memory; one rank reads them from
        there. With TP/PP > 1 the export gathers over the groups, which needs them on the device.

        Raises:
            PhaseError: during a sync, or while generating with more than one rank.
        """
        if self.phase is Phase.SYNCING or (self.phase is not Phase.TRAINING and self.layout.world_size > 1):
            raise PhaseError(f"save: the hybrid actor is in phase {self.phase.value!r}; with {self.layout.world_size} ranks save while training")
        return self.train.save(path)

    def close(self) -> None:
        """Shut vLLM down and leave this process's groups (``leave_groups``)."""
        close = getattr(self.rollout, "close", None)
        if close is not None:
            close()
        leave_groups()


class GuardedRollout:
    """A ``RolloutEngine`` that generates only while the hybrid actor is generating; its weights
    come only through the sync."""

    def __init__(self, engine, swap: AllGatherSwap) -> None:
        self.engine, self.swap = engine, swap
        self.tokenizer, self.pad_id = engine.tokenizer, engine.pad_id

    @property
    def eos_id(self) -> int:
        return self.engine.eos_id

    def generate(self, prompts: Sequence[Sequence[int]], **kwargs: Any):
        self.swap.require_generating("generate")
        return self.engine.generate(prompts, **kwargs)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        raise PhaseError("load_weights: the hybrid actor's rollout engine takes its weights only from HybridActor.sync")


class GuardedTrain:
    """A ``TrainEngine`` that scores and steps only while the hybrid actor is training."""

    def __init__(self, engine, swap: AllGatherSwap) -> None:
        self.engine, self.swap = engine, swap
        self.tokenizer, self.pad_id = engine.tokenizer, engine.pad_id

    def log_probs(self, prompts, responses, **kwargs: Any) -> list[list[float]]:
        self.swap.require_training("log_probs")
        return self.engine.log_probs(prompts, responses, **kwargs)

    def forward_backward(self, prompts, responses, **kwargs: Any) -> list[Any]:
        self.swap.require_training("forward_backward")
        return self.engine.forward_backward(prompts, responses, **kwargs)

    def sum_over_replicas(self, values: Sequence[float]) -> list[float]:
        self.swap.require_training("sum_over_replicas")
        return self.engine.sum_over_replicas(values)

    def optimizer_step(self, accumulate: Callable[[], dict[str, float]]) -> dict[str, float]:
        self.swap.require_training("optimizer_step")
        return self.engine.optimizer_step(accumulate)

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        self.swap.require_training("named_weights")
        return self.engine.named_weights()

    def save(self, path: str | Path) -> Path:
        self.swap.require_training("save")
        return self.engine.save(path)
