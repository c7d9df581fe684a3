"""Actor stage: claim scored groups, put ``old_log_prob``, run the policy update.

One iteration: claim every row (whole groups) with its advantages (and reference log-probs
when ``algorithm.kl_loss_coef > 0``); compute the log-probs before the update; then ``ppo_epochs`` passes over the
global batch in mini-batches, each one optimizer step accumulated over micro-batches. As a
process of its own (``run_actor``) it sends its weights to the rollout after every update and
writes the checkpoints (weights and optimizer; the driver adds the dock snapshot).
"""

from __future__ import annotations

import logging
import time
from functools import partial
from pathlib import Path
from typing import Sequence

import torch

from dockrl.algorithms import actor_loss, mismatch_metrics, response_mask, right_pad, token_staleness
from dockrl.checkpoint.optimizer_state import load_optimizer, save_optimizer
from dockrl.checkpoint.resume import checkpoint_dir, checkpoint_due, final_dir, prepare_checkpoint, weights_path
from dockrl.config import AlgorithmConfig, Config, RolloutConfig, TrainerConfig, multi_turn
from dockrl.dock import Dock, StageDock
from dockrl.engines.factory import build_train_engine, weights_to_send
from dockrl.engines.train_engine import TrainEngine
from dockrl.engines.weight_sync import WeightChannel
from dockrl.parallel.ranks import ProcessRanks
from dockrl.run.setup import resolve_model
from dockrl.stages.loop import Report, final_report, serve_iterations, snapshot_after

logger = logging.getLogger(__name__)
ACTOR_RANK = 0
"""The actor's rank on the weight channel (the rollout's is 1)."""


class DeviceColumns:
    """The per-row float columns of a mini-batch (advantages, old, reference and rollout
    log-probs) as padded tensors on the engine's device, built on the host and moved in one copy
    per column the first time a micro-batch asks for them (on the device of its log-probs).
    ``advantages`` are per token (the dock's column) or one float per sequence."""

    def __init__(self, batch: dict[str, list], names: Sequence[str]) -> None:
        self.batch, self.names = batch, names
        self.tensors: dict[str, torch.Tensor] | None = None

    def get(self, device: torch.device) -> dict[str, torch.Tensor]:
        if self.tensors is None:
            T = max(max((len(r) for r in self.batch["response_ids"]), default=1), 1)
            adv = self.batch["advantages"]
            per_token = bool(adv) and isinstance(adv[0], (list, tuple))
            host = {"advantages": right_pad(adv, T) if per_token else torch.tensor(adv, dtype=torch.float32)}
            host |= {n: right_pad(self.batch[n], T) for n in self.names}
            self.tensors = {n: t.to(device) for n, t in host.items()}
        return self.tensors


def accumulate_mini_batch(
    engine: TrainEngine,
    batch: dict[str, list],
    *,
    algo: AlgorithmConfig,
    temperature: float,
    micro_batch: int,
    horizon: int = 0,
    micro_batch_tokens: int = 0,
) -> dict[str, float]:
    """Forward/backward every micro-batch of one mini-batch, accumulating gradients.

    Args:
        batch: ``prompt_ids``, ``response_ids``, ``truncated`` when ``algo.overlong_filter`` (those
            rows are masked out of the loss and its normalizer), ``advantages`` (per token ``(R,)``, or one
            float per sequence), ``old_log_prob``, ``ref_log_prob`` when ``algo.kl_loss_coef >
            0`` and ``rollout_log_prob`` when ``algo.corrects_rollout`` — one list entry per
            sequence: this data-parallel replica's part of the mini-batch. When ``old_log_prob``
            is absent the update is on-policy: the detached log-probs of this very forward pass
            are the old ones (ratio exactly 1, as in verl), and they are added to
            ``batch["old_log_prob"]``, which saves a forward pass over the batch. ``loss_mask``
            (multi-turn rows, ``(R,)`` each): 1 on the tokens the model sampled; the others leave the
            loss, its token counts and its metrics as padding does.
        horizon: the constant normalizer of ``loss_agg_mode='seq-mean-token-sum-norm'``
            (``rollout.max_response_length``).
        micro_batch_tokens: the engine forms micro-batches of at most this many tokens instead of
            ``micro_batch`` rows (``trainer.micro_batch_tokens``; 0: off).

    The loss of each micro-batch is normalized by the totals of the whole mini-batch over all
    data-parallel replicas (response tokens for ``token-mean``, sequences for the ``seq-mean-*``
    modes; ``engine.sum_over_replicas``), and the engine sums the replicas' gradients.
    Every term is a sum over whole sequences, so the gradient depends neither on ``micro_batch``,
    nor on which rows the engine puts together (sorted by length under ``micro_batch_tokens``), nor on how
    the mini-batch is split over replicas: with DP = k it is the DP = 1 gradient of the same global mini-batch, also
    when the replicas' responses differ in length (a per-replica token mean would weigh a token
    of a replica with short responses more).

    Returns:
        ``actor/*`` metrics of the whole mini-batch (the same on every replica): ``loss`` and
        ``pg_loss`` aggregated as ``algo.loss_agg_mode`` says (``pg_loss`` is ``loss`` without
        the KL term and the entropy bonus); ``kl``, ``entropy``, ``clip_ratio``, ``ratio_mean`` as token means (the
        token ratio, also under GSPO); ``ratio_max`` over this replica's tokens; with dual-clip
        ``dual_clip_frac``, with TIS ``tis_weight_mean`` and ``tis_clip_frac`` (tokens at the cap), with
        ``algo.rollout_correction`` ``rollout_weight_mean`` and ``rollout_masked_frac`` (tokens masked out).
    """
    keep = None
    if algo.overlong_filter:  # DAPO §3.4: truncated responses leave the loss and its normalizer
        keep = torch.tensor([not t for t in batch["truncated"]], dtype=torch.float32)
    loss_mask = batch.get("loss_mask")  # multi-turn: the tokens the model sampled; observations do not count
    counted = [sum(m) for m in loss_mask] if loss_mask is not None else [len(r) for r in batch["response_ids"]]
    kept = [n for i, n in enumerate(counted) if keep is None or keep[i]]
    n_seq, tokens = len(kept), float(sum(kept))
    total_tokens, total_seqs = engine.sum_over_replicas([tokens, float(n_seq)])
    on_policy = "old_log_prob" not in batch
    names = ((["old_log_prob"] if not on_policy else []) + (["ref_log_prob"] if algo.kl_loss_coef > 0 else [])
             + (["rollout_log_prob"] if algo.corrects_rollout else []) + (["loss_mask"] if loss_mask is not None else []))
    columns = DeviceColumns(batch, names)

    def loss_fn(rows: list[int], log_prob: torch.Tensor, mask: torch.Tensor, entropy: torch.Tensor):
        T = log_prob.shape[1]
        idx = torch.tensor(rows)  # this micro-batch's rows of the mini-batch, in the engine's order
        if keep is not None:
            mask = mask * keep[idx].to(mask)[:, None]
        on_device = columns.get(log_prob.device)
        at = idx.to(log_prob.device)
        if loss_mask is not None:  # multi-turn: observation and template tokens leave the loss, as padding does
            mask = mask * on_device["loss_mask"][at, :T]
        old = log_prob.detach() if on_policy else on_device["old_log_prob"][at, :T]
        adv = on_device["advantages"][at]
        if adv.ndim == 2:
            adv = adv[:, :T]
        out = actor_loss(
            log_prob, old, adv, mask, entropy, algo=algo, total_tokens=total_tokens, total_sequences=total_seqs, horizon=float(horizon),
            ref_log_prob=on_device["ref_log_prob"][at, :T] if algo.kl_loss_coef > 0 else None,
            rollout_log_prob=on_device["rollout_log_prob"][at, :T] if algo.corrects_rollout else None,
        )
        # one device → host copy per micro-batch for all the statistics
        *sums, ratio_max = torch.stack([v.float() for v in [*out.sums.values(), out.ratio_max]]).tolist()
        old_rows = None
        if on_policy:
            host_old = old.cpu()
            old_rows = [host_old[k, : len(batch["response_ids"][i])].tolist() for k, i in enumerate(rows)]
        return out.loss, (dict(zip(out.sums, sums)), ratio_max, rows, old_rows)

    parts = engine.forward_backward(
        batch["prompt_ids"], batch["response_ids"], temperature=temperature, micro_batch=micro_batch, loss_fn=loss_fn,
        entropy_grad=algo.entropy_coeff > 0, micro_batch_tokens=micro_batch_tokens,
    )
    if on_policy:  # back in the mini-batch's row order
        old_by_row = {i: lp for _, _, rows, olds in parts for i, lp in zip(rows, olds)}
        batch["old_log_prob"] = [old_by_row[i] for i in range(len(batch["response_ids"]))]
    # loss and pg_loss are already shares of the global aggregate; the rest are token sums
    metric_names = list(parts[0][0])  # the same on every replica: they depend on ``algo`` only
    sums = engine.sum_over_replicas([sum(p[0][k] for p in parts) for k in metric_names])
    metrics = {f"actor/{k}": v if k in ("loss", "pg_loss") else v / max(total_tokens, 1.0) for k, v in zip(metric_names, sums)}
    metrics["actor/ratio_max"] = max(p[1] for p in parts)
    return metrics


def rollout_log_prob_diff(rollout: Sequence[Sequence[float]], actor: Sequence[Sequence[float]],
                          loss_mask: Sequence[Sequence[int]] | None = None) -> dict[str, float]:
    """``actor/rollout_log_prob_diff_{mean,max}``: |rollout engine's − actor's log-prob| of the same
    tokens before the update (nats, over all response tokens, or where ``loss_mask`` is 1: the
    sampled tokens of multi-turn rows; verl's ``rollout_probs_diff``).
    Near 0 when the rollout engine serves the actor's weights (fp32: ~1e-5, bf16: ~1e-2); a stale
    or broken weight sync shows here first."""
    masks = loss_mask if loss_mask is not None else [[1] * len(r) for r in rollout]
    diffs = [abs(a - b) for r, o, m in zip(rollout, actor, masks) for a, b, k in zip(r, o, m) if k]
    return {"actor/rollout_log_prob_diff_mean": sum(diffs) / max(len(diffs), 1), "actor/rollout_log_prob_diff_max": max(diffs, default=0.0)}


def rollout_mismatch(
    rollout: Sequence[Sequence[float]], actor: Sequence[Sequence[float]], weight_version: Sequence[Sequence[int]], *,
    iteration: int, cap: float, loss_mask: Sequence[Sequence[int]] | None = None,
) -> dict[str, float]:
    """The rest of the off-policy metrics, beside ``rollout_log_prob_diff``, over the same tokens:
    ``actor/rollout_kl_k3``, ``actor/rollout_ratio_max`` and ``actor/rollout_frac_beyond_cap``
    (``mismatch_metrics``: ``ρ = π_old/π_rollout`` above ``cap``, ``algorithm.tis_cap`` or else
    ``algorithm.rollout_ratio_high``), and ``actor/rollout_staleness_{mean,max}``: how many updates
    the weights that sampled each token lag behind update ``iteration``, which trains on them
    (``token_staleness`` of the ``weight_version`` column)."""
    T = max(max((len(r) for r in rollout), default=1), 1)
    mask = response_mask([len(r) for r in rollout], T, loss_mask)
    metrics = mismatch_metrics(right_pad(actor, T), right_pad(rollout, T), mask, cap=cap)
    metrics |= token_staleness(iteration, weight_version, loss_mask)
    return {f"actor/rollout_{k}": v for k, v in metrics.items()}


class ActorWorker:
    """The policy update of one iteration.

    Args:
        warmup_iterations: the first iterations only ack their rows (``critic.warmup_iterations``).
        multi_turn: the rows are multi-turn trajectories (``dockrl.config.multi_turn``): their
            ``loss_mask`` is claimed too and keeps the observations out of the loss (``accumulate_mini_batch``).
        replicas: data-parallel replicas of the actor (megatron's DP): each claims an equal
            part of the global batch (``num_rows / replicas`` rows; with dynamic sampling the kept
            groups, ``num_rows / rounds / replicas``) and steps on an equal part
            of every mini-batch; each part's loss is normalized by the mini-batch's global token
            or sequence count and the engine sums the replicas' gradients
            (``accumulate_mini_batch``). ``trainer.global_batch`` and ``trainer.mini_batch``
            must be multiples of it (the config checks).
    """

    def __init__(
        self, engine: TrainEngine, *, trainer: TrainerConfig, algo: AlgorithmConfig, rollout: RolloutConfig, replicas: int = 1,
        warmup_iterations: int = 0, multi_turn: bool = False,
    ) -> None:
        self.engine, self.trainer, self.algo, self.rollout, self.replicas = engine, trainer, algo, rollout, replicas
        self.warmup_iterations, self.multi_turn = warmup_iterations, multi_turn

    def run_iteration(self, dock: StageDock) -> dict[str, float]:
        """Update the actor on the global batch (this replica's part); returns ``actor/*`` and timing metrics."""
        start = time.perf_counter()
        columns = (["prompt_ids", "response_ids", "advantages"] + (["ref_log_prob"] if self.algo.kl_loss_coef > 0 else [])
                   + (["truncated"] if self.algo.overlong_filter else []) + (["loss_mask"] if self.multi_turn else []))
        rows = dock.num_rows // self.algo.filter_groups.rounds  # dynamic sampling: one round's worth of kept groups is trained
        claim = dock.claim("actor", columns + ["rollout_log_prob", "weight_version"], rows // self.replicas, whole_groups=True)
        claim_s = time.perf_counter() - start  # waiting for the scored rows: the actor is idle meanwhile
        if not claim:  # every row was dropped (the reward stage failed the iteration: its error is the run's)
            return {"actor/sequences": 0, "timing_s/actor": time.perf_counter() - start}
        batch = {c: claim.batch.column(c).to_pylist() for c in columns}
        rollout_log_prob = claim.batch.column("rollout_log_prob").to_pylist()
        weight_version = claim.batch.column("weight_version").to_pylist()
        if claim.iteration < self.warmup_iterations:  # critic.warmup_iterations: only the critic trains (verl's critic_warmup)
            dock.ack(claim)
            return {"actor/warmup": 1.0, "timing_s/actor": time.perf_counter() - start}
        if self.algo.corrects_rollout:
            batch["rollout_log_prob"] = rollout_log_prob
        on_policy = self.trainer.ppo_epochs == 1 and self.trainer.mini_batch == self.trainer.global_batch
        if not on_policy:  # later mini-batches need the log-probs from before the first step
            batch["old_log_prob"] = self.engine.log_probs(
                batch["prompt_ids"], batch["response_ids"], temperature=self.rollout.temperature, micro_batch=self.trainer.micro_batch,
                micro_batch_tokens=self.trainer.micro_batch_tokens,
            )
            dock.put(claim.rows, {"old_log_prob": batch["old_log_prob"]})
        old_s = time.perf_counter() - start

        rows_per_step = self.trainer.mini_batch // self.replicas * dock.group_size
        steps: list[dict[str, float]] = []
        for _ in range(self.trainer.ppo_epochs):
            for s in range(0, len(claim.rows), rows_per_step):
                mini = {k: v[s : s + rows_per_step] for k, v in batch.items()}
                steps.append(
                    self.engine.optimizer_step(
                        partial(accumulate_mini_batch, self.engine, mini, algo=self.algo, temperature=self.rollout.temperature,
                                micro_batch=self.trainer.micro_batch, horizon=self.rollout.max_response_length,
                                micro_batch_tokens=self.trainer.micro_batch_tokens)
                    )
                )
        if on_policy:
            batch["old_log_prob"] = mini["old_log_prob"]
            dock.put(claim.rows, {"old_log_prob": batch["old_log_prob"]})
        dock.ack(claim)  # the update is done: the lease on these rows ends for good
        metrics = {k: sum(m[k] for m in steps) / len(steps) for k in steps[0]}
        metrics["actor/ratio_max"] = max(m["actor/ratio_max"] for m in steps)
        metrics["actor/first_step_ratio_mean"] = steps[0]["actor/ratio_mean"]
        metrics["actor/sequences"] = len(claim.rows)  # trained by this replica (dynamic sampling: exactly its part of the batch)
        if self.algo.overlong_filter:
            metrics["actor/overlong_filtered"] = sum(batch["truncated"]) / len(claim.rows)
        metrics |= rollout_log_prob_diff(rollout_log_prob, batch["old_log_prob"], batch.get("loss_mask"))
        metrics |= rollout_mismatch(rollout_log_prob, batch["old_log_prob"], weight_version, iteration=claim.iteration,
                                    cap=self.algo.tis_cap or self.algo.rollout_ratio_high, loss_mask=batch.get("loss_mask"))
        tokens = sum(len(r) for r in batch["response_ids"])
        seconds = time.perf_counter() - start
        metrics.update({"timing_s/old_log_prob": old_s, "timing_s/actor": seconds, "timing_s/actor_claim": claim_s,
                        "perf/actor_tokens_per_s": tokens * self.trainer.ppo_epochs / seconds})
        return metrics


def run_actor(cfg: Config, dock: Dock, ranks: ProcessRanks, weight_sync: str, first_wait_s: float | None = None) -> None:
    """The ``actor`` stage process: update every iteration (``ACTOR``), send the weights on the
    channel at ``weight_sync``, write a due checkpoint (``CHECKPOINT``), then ``checkpoints/final``.

    With ``dock.max_inflight`` = m > 1 the rollout takes the weights of update ``k`` only after
    generating iteration ``k+m-1`` (``dockrl.stages.rollout_process.sync_target``): the send waits for that
    ``ROLLOUT`` report first, so the broadcast itself never waits on a generation."""
    t = cfg.trainer
    engine = build_train_engine(cfg, weights_path(cfg, resolve_model(cfg)), ranks)
    if cfg.run.resume:
        load_optimizer(engine, Path(cfg.run.resume))
    channel = WeightChannel(weight_sync, rank=ACTOR_RANK, timeout_s=cfg.dock.timeout_s, device=ranks.device)
    worker = ActorWorker(engine, trainer=t, algo=cfg.algorithm, rollout=cfg.rollout, warmup_iterations=cfg.critic.warmup_iterations,
                         multi_turn=multi_turn(cfg.env))
    run_dir = Path(cfg.run.output_dir)

    def after_update(it: int) -> None:
        if cfg.dock.max_inflight > 1:  # the rollout receives these weights once it generated the iterations in flight
            dock.wait_reports(min(it + cfg.dock.max_inflight - 1, t.iterations - 1), [Report.ROLLOUT], cfg.dock.timeout_s)
        sent = channel.send(*weights_to_send(cfg, engine))  # LoRA: the adapter alone (trainer.lora.sync)
        logger.info("actor: sent %.1f MB of weights in %d buckets in %.2f s", sent["weight_sync/bytes"] / 1e6,
                    sent["weight_sync/buckets"], sent["weight_sync/seconds"])
        if checkpoint_due(t, it):  # the driver snapshots the dock once this is reported
            save_optimizer(engine, engine.save(prepare_checkpoint(checkpoint_dir(run_dir, it + 1))))
            dock.report(it, Report.CHECKPOINT, {})

    try:
        serve_iterations(dock, Report.ACTOR, lambda it: worker.run_iteration(dock), timeout_s=cfg.dock.timeout_s,
                         after_report=after_update, seed=t.seed, first_timeout_s=first_wait_s, hold=snapshot_after(cfg))
        save_optimizer(engine, engine.save(prepare_checkpoint(final_dir(run_dir))))  # the driver completes it
        dock.report(t.iterations, final_report("actor"), {})
    finally:
        channel.close()
