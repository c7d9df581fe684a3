"""Dynamic sampling (DAPO, arXiv 2503.14476 §3.2) through the dock: rounds of prompts that the
advantage stage releases one after the other until ``trainer.global_batch`` groups carry signal.

An iteration with ``algorithm.filter_groups.enable`` has R = ``max_num_gen_batches`` rounds of
B = ``trainer.global_batch`` prompt groups: round r owns groups ``[r·B, (r+1)·B)``. The driver
writes the prompts of every round but the ``released`` gate of round 0 only, and the rollout
claims ``["prompt_ids", "released"]``, so it samples round 0 and then waits. The advantage stage
(``DynamicSampler``) claims each round whole once it is scored, keeps its mixed groups (not all
equal in ``filter_groups.metric``: ``dockrl.algorithms.dapo.mixed_groups``), and then either
releases the next round (writes its gate) or, once B groups are kept or no round is left, ends
the sampling: it drops (``Dock.drop``) every row but the B kept groups — filtered groups, kept
groups beyond B, rounds never released — so the rollout, reward and advantage claims end and the
reference and actor only ever see the B kept groups; then it puts their advantages, computed in
one call over the trained batch (batch-wide estimators see exactly what is trained).

When the rounds run out with fewer than B kept groups, ``filter_groups.on_exhausted`` says what
happens: ``error`` drops every row (so no stage waits on) and raises ``DynamicSamplingExhausted``
naming the fields; ``fill`` tops the kept groups up with filtered ones, in sampling order. Either
way an iteration samples at most R rounds: it can never loop forever.

Claims must never wait for rows of a round not yet released: the rollout claims a number of groups
dividing B and the reward a number of rows dividing B·n (``divisor_at_most``), so each round is
taken in whole claims; the stages that feed each other across rounds (rollout, reward, advantage)
run side by side (``SideBySide``), in-process as threads.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Mapping, Protocol, Sequence

import pyarrow as pa
import torch

from dockrl.algorithms.dapo import mixed_groups
from dockrl.config import Config, FilterGroupsConfig
from dockrl.dock import Dock

GATE = "released"
"""The column that lets the rollout sample a row (``dockrl.dock.schema``)."""


class StageWorker(Protocol):
    def run_iteration(self, dock: Dock) -> dict[str, float]: ...


class DynamicSamplingExhausted(RuntimeError):
    """Dynamic sampling used up its rounds with fewer kept groups than the batch (``on_exhausted=error``)."""


def groups_per_round(cfg: Config) -> int:
    """Groups per round with dynamic sampling (``trainer.global_batch``); 0 without it."""
    return cfg.trainer.global_batch if cfg.algorithm.filter_groups.enable else 0


def divisor_at_most(total: int, limit: int) -> int:
    """The largest divisor of ``total`` that is at most ``limit`` (1 when ``limit < 1``).

    A claim of that size never waits for a row beyond a round of ``total``.
    """
    return max((d for d in range(1, min(total, max(limit, 1)) + 1) if total % d == 0), default=1)


def round_rows(round_index: int, groups: int, group_size: int) -> range:
    """The rows of round ``round_index`` (``groups`` prompt groups of ``group_size`` rows each)."""
    return range(round_index * groups * group_size, (round_index + 1) * groups * group_size)


class DynamicSampler:
    """The advantage stage's part in dynamic sampling: filter each round, release the next, drop what
    is not trained, and put the advantages of the trained batch.

    The iteration holds ``cfg.max_num_gen_batches`` rounds of B groups (B = ``trainer.global_batch``,
    from the iteration's size).

    Args:
        cfg: ``algorithm.filter_groups``.
        columns: what the advantages are computed from (besides the metric's column).
        advantages: the estimator: the claimed cells of the B trained groups (groups contiguous, a
            ``pa.RecordBatch`` of ``columns``) → the columns to put for those rows, in that order.
    """

    def __init__(self, cfg: FilterGroupsConfig, columns: Sequence[str], advantages: Callable[[pa.RecordBatch], Mapping[str, list]]) -> None:
        self.cfg, self.advantages = cfg, advantages
        self.metric = "correct" if cfg.metric == "acc" else "rm_score"
        self.columns = list(dict.fromkeys([*columns, self.metric, "rm_score"]))

    def run_iteration(self, dock: Dock) -> dict[str, float]:
        """Sample rounds until B groups are kept or R rounds are used; put the trained batch's advantages.

        Returns ``rollout/*`` metrics: ``gen_batches`` (rounds sampled), ``kept_groups`` (mixed
        groups found, those beyond B included), ``filled_groups`` (``fill``), ``frac_zero_std_groups``
        (of the rewards, over every sampled group), and ``timing_s/advantage``.

        Raises:
            DynamicSamplingExhausted: ``on_exhausted=error`` and fewer than B mixed groups in R rounds.
        """
        start = time.perf_counter()
        n, rounds = dock.group_size, self.cfg.max_num_gen_batches
        B = dock.num_rows // (rounds * n)
        if B * rounds * n != dock.num_rows:  # internal: the driver opens R rounds of B groups (open_with_prompts)
            raise AssertionError(f"dynamic sampling: {dock.num_rows} rows are not {rounds} rounds of whole groups of {n}")
        claims, parts = [], []
        kept: list[tuple[int, int]] = []  # (claim, group within the claim) of the mixed groups, in sampling order
        filtered: list[tuple[int, int]] = []
        zero_std = sampled = 0
        for r in range(rounds):
            claim = dock.claim("advantage", self.columns, B * n, whole_groups=True)
            if sorted(claim.rows) != list(round_rows(r, B, n)):  # internal: rounds are released one at a time
                raise AssertionError(f"dynamic sampling: claimed rows {claim.rows[:8]}… are not those of round {r}")
            claims.append(claim)
            parts.append(claim.batch)
            metric = torch.tensor(claim.batch.column(self.metric).to_pylist(), dtype=torch.float64)
            scores = torch.tensor(claim.batch.column("rm_score").to_pylist(), dtype=torch.float64)
            zero_std += int((~mixed_groups(scores, n)).sum())
            for g, mixed in enumerate(mixed_groups(metric, n).tolist()):
                (kept if mixed else filtered).append((r, g))
            sampled += B
            if len(kept) >= B or r == rounds - 1:
                break
            dock.put(round_rows(r + 1, B, n), {GATE: [True] * (B * n)})  # the rollout samples the next round
        trained = kept[:B]
        filled = 0
        if len(trained) < B:
            if self.cfg.on_exhausted == "error":
                dock.drop(range(dock.num_rows))  # no stage waits on rows that will not come
                for claim in claims:
                    dock.ack(claim)
                raise DynamicSamplingExhausted(
                    f"algorithm.filter_groups: {len(kept)} of trainer.global_batch={B} groups had responses that were not all "
                    f"equal in metric={self.cfg.metric!r} after max_num_gen_batches={rounds} rounds ({sampled} groups sampled); "
                    "the prompts are too easy or too hard for the model: raise algorithm.filter_groups.max_num_gen_batches, "
                    "set algorithm.filter_groups.on_exhausted=fill to train on what there is, or change the data"
                )
            filled = B - len(trained)
            trained += filtered[:filled]
        trained.sort()
        rows = [claims[r].rows[g * n + k] for r, g in trained for k in range(n)]
        keep = set(rows)
        dock.drop([row for row in range(dock.num_rows) if row not in keep])  # the reference and actor see only these
        table = pa.Table.from_batches(parts)
        offsets = [sum(len(c.rows) for c in claims[:r]) for r in range(len(claims))]
        index = pa.array([offsets[r] + g * n + k for r, g in trained for k in range(n)], type=pa.int64())
        batch = table.take(index).combine_chunks().to_batches()[0]  # B ≥ 1 groups: one batch
        dock.put(rows, dict(self.advantages(batch)))
        for claim in claims:
            dock.ack(claim)
        return {"rollout/gen_batches": len(claims), "rollout/kept_groups": len(kept), "rollout/filled_groups": filled,
                "rollout/frac_zero_std_groups": zero_std / sampled, "timing_s/advantage": time.perf_counter() - start}


class SideBySide:
    """Stage workers that feed each other across rounds (rollout, reward, advantage) as one stage
    worker whose iteration runs theirs side by side, each on a thread of its own for the whole run;
    their metrics merged in order.

    A worker keeps its thread from one iteration to the next because a process it starts (a
    custom scorer's, ``dockrl.rewards.guard``) is bound to the starting thread: it is killed when
    that thread ends (Linux ties ``PR_SET_PDEATHSIG`` to the parent thread). The first error of
    any worker is raised at once; the other threads are daemons, blocked at most until their claims
    time out (``dock.timeout_s``) or the dock closes (the runner's clean-up). Each worker may take
    ``timeout_s`` after the previous one ended (as the driver waits for the stages' reports).
    """

    def __init__(self, workers: Sequence[StageWorker], *, timeout_s: float) -> None:
        self.workers, self.timeout_s = list(workers), timeout_s
        self.done: queue.Queue[tuple[int, dict[str, float] | BaseException]] = queue.Queue()
        self.jobs: list[queue.Queue[Dock | None]] = [queue.Queue() for _ in self.workers]  # None: stop
        self.threads = [threading.Thread(target=self._serve, args=(i, worker), name=f"stage-{type(worker).__name__}", daemon=True)
                        for i, worker in enumerate(self.workers)]
        for thread in self.threads:
            thread.start()

    def _serve(self, i: int, worker: StageWorker) -> None:
        while (dock := self.jobs[i].get()) is not None:
            try:
                self.done.put((i, worker.run_iteration(dock)))
            except BaseException as e:  # noqa: BLE001 - handed to the calling thread
                self.done.put((i, e))

    def close(self) -> None:
        """End the threads once their current iteration (if any) is over; they are daemons, so nothing waits for them."""
        for jobs in self.jobs:
            jobs.put(None)

    def run_iteration(self, dock: Dock) -> dict[str, float]:
        """Every worker's iteration, side by side; their merged metrics.

        Raises:
            the first error of a worker (a worker that failed leaves the others blocked: the run ends).
            TimeoutError: no worker ended within ``timeout_s`` of the previous one; names those still running.
        """
        for jobs in self.jobs:
            jobs.put(dock)
        results: dict[int, dict[str, float]] = {}
        while len(results) < len(self.workers):
            try:
                i, out = self.done.get(timeout=self.timeout_s)
            except queue.Empty:
                running = [type(w).__name__ for j, w in enumerate(self.workers) if j not in results]
                raise TimeoutError(f"dynamic sampling: {running} still running {self.timeout_s:g} s after the previous "
                                   "stage ended (dock.timeout_s)") from None
            if isinstance(out, BaseException):
                raise out
            results[i] = out
        merged: dict[str, float] = {}
        for i in range(len(self.workers)):
            merged |= results[i]
        return merged
