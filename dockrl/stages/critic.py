"""Critic stage (PPO): claim responses, put their values; claim the returns, update the critic.

One iteration has two steps, each a dock consumer of its own:

1. ``critic``: claim ``prompt_ids`` + ``response_ids`` (any rows, as they are generated), put the
   per-token ``values`` V(s_t) under the critic before its update;
2. ``critic_update``: once the advantage stage put the GAE ``returns`` (it needs the values), claim
   every row (whole groups) with its ``values`` and ``returns`` and train: ``critic.ppo_epochs``
   passes over the global batch in mini-batches, each one optimizer step accumulated over
   micro-batches — the actor's update, with the clipped value loss in place of the policy loss.

In-process the two steps are two stage workers, around the advantage stage (``inprocess_parts``:
``values_step``, ``update_step``); as a process of its own (``run_critic``) one loop runs both
and writes the critic's checkpoints (``CHECKPOINT/critic``: weights and optimizer).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from dockrl.algorithms import right_pad, value_loss
from dockrl.checkpoint.optimizer_state import load_optimizer, save_optimizer
from dockrl.checkpoint.resume import checkpoint_dir, checkpoint_due, critic_dir, final_dir, prepare_checkpoint
from dockrl.config import Config, CriticConfig, critic_batches, multi_turn
from dockrl.dock import Dock, StageDock
from dockrl.engines.critic import HFCriticEngine
from dockrl.engines.hf.load import load_tokenizer
from dockrl.parallel.ranks import ProcessRanks
from dockrl.run.setup import resolve_model
from dockrl.stages.inprocess import InProcessContext, InProcessParts
from dockrl.stages.loop import Report, final_report, serve_iterations

logger = logging.getLogger(__name__)

_SUMS = ("vf_loss", "vf_clipfrac", "vpred_sum")


def accumulate_value_mini_batch(engine: HFCriticEngine, batch: dict[str, list], *, cliprange_value: float,
                                micro_batch: int, micro_batch_tokens: int = 0) -> dict[str, float]:
    """Forward/backward every micro-batch of one mini-batch with the clipped value loss, accumulating gradients.

    Args:
        batch: ``prompt_ids``, ``response_ids``, ``values`` (before the update: the clip's centre)
            and ``returns``, one list entry per sequence; ``loss_mask`` for multi-turn rows: only the
            tokens the model sampled count (observations are not states the policy acted in).

    The loss is the token mean over the whole mini-batch (each micro-batch's token sum divided by
    the mini-batch's response tokens), so the gradient depends neither on ``micro_batch`` nor on
    which rows the engine puts together (consecutive; sorted by length, at most ``micro_batch_tokens`` tokens each, when > 0).

    Returns:
        ``critic/vf_loss`` (the mini-batch loss), ``critic/vf_clipfrac`` (share of tokens where the
        clipped term was the larger) and ``critic/vpred_mean`` (mean new value), token means.
    """
    loss_mask = batch.get("loss_mask")
    total_tokens = float(sum(sum(m) for m in loss_mask) if loss_mask is not None else sum(len(r) for r in batch["response_ids"]))
    T = max((len(r) for r in batch["response_ids"]), default=1)
    old, returns = right_pad(batch["values"], max(T, 1)), right_pad(batch["returns"], max(T, 1))
    sampled = right_pad(loss_mask, max(T, 1)) if loss_mask is not None else None

    def loss_fn(rows: list[int], vpreds: torch.Tensor, mask: torch.Tensor):  # rows: this micro-batch's (``micro_batches``)
        t = vpreds.shape[1]
        idx = torch.tensor(rows)
        if sampled is not None:  # multi-turn: observation tokens leave the loss, as padding does
            mask = mask * sampled[idx, :t].to(mask)
        per_token, clipped = value_loss(vpreds, old[idx, :t].to(vpreds.device), returns[idx, :t].to(vpreds.device), mask,
                                        clip_range=cliprange_value)
        loss = (per_token * mask).sum() / max(total_tokens, 1.0)  # token-mean over the mini-batch
        with torch.no_grad():
            sums = torch.stack([loss.detach(), (clipped * mask).sum(), (vpreds.detach() * mask).sum()]).tolist()
        return loss, sums

    parts = engine.forward_backward(batch["prompt_ids"], batch["response_ids"], micro_batch=micro_batch, loss_fn=loss_fn,
                                    micro_batch_tokens=micro_batch_tokens)
    loss, clipfrac, vpred = (sum(p[k] for p in parts) for k in range(len(_SUMS)))
    return {"critic/vf_loss": loss, "critic/vf_clipfrac": clipfrac / max(total_tokens, 1.0),
            "critic/vpred_mean": vpred / max(total_tokens, 1.0)}


def value_metrics(values: list[list[float]], returns: list[list[float]], loss_mask: list[list[int]] | None = None) -> dict[str, float]:
    """``critic/values_mean``, ``critic/returns_mean`` and ``critic/vf_explained_var``
    ``= 1 - Var(R - V) / (Var(R) + 1e-5)`` over all response tokens (or where ``loss_mask`` is 1),
    before the update (verl's metrics and ε: returns that are all equal do not divide by zero)."""
    masks = loss_mask if loss_mask is not None else [[1] * len(row) for row in values]
    v = torch.tensor([x for row, m in zip(values, masks) for x, k in zip(row, m) if k], dtype=torch.float64)
    r = torch.tensor([x for row, m in zip(returns, masks) for x, k in zip(row, m) if k], dtype=torch.float64)
    explained = 1.0 - (r - v).var(unbiased=False) / (r.var(unbiased=False) + 1e-5)
    return {"critic/values_mean": float(v.mean()), "critic/returns_mean": float(r.mean()), "critic/vf_explained_var": float(explained)}


class CriticWorker:
    """The critic's two steps of an iteration over one ``HFCriticEngine``.

    Args:
        mini_batch: prompts per optimizer step; micro_batch: sequences per forward/backward
            (``config.critic_batches``); micro_batch_tokens: or at most this many tokens
            (``trainer.micro_batch_tokens``; 0: off); multi_turn: the rows are multi-turn trajectories
            (``dockrl.config.multi_turn``), whose ``loss_mask`` the update claims too.
    """

    def __init__(self, engine: HFCriticEngine, cfg: CriticConfig, *, mini_batch: int, micro_batch: int,
                 micro_batch_tokens: int = 0, multi_turn: bool = False) -> None:
        self.engine, self.cfg, self.mini_batch, self.micro_batch = engine, cfg, mini_batch, micro_batch
        self.micro_batch_tokens, self.multi_turn = micro_batch_tokens, multi_turn

    @classmethod
    def from_config(cls, engine: HFCriticEngine, cfg: Config) -> CriticWorker:
        mini, micro = critic_batches(cfg)
        return cls(engine, cfg.critic, mini_batch=mini, micro_batch=micro, micro_batch_tokens=cfg.trainer.micro_batch_tokens,
                   multi_turn=multi_turn(cfg.env))

    def compute_values(self, dock: StageDock) -> dict[str, float]:
        """Put ``values`` for every row of the open iteration; returns ``timing_s/critic_values``."""
        start = time.perf_counter()
        while claim := dock.claim("critic", ["prompt_ids", "response_ids"], self.micro_batch * 4):
            values = self.engine.values(claim.batch.column("prompt_ids").to_pylist(), claim.batch.column("response_ids").to_pylist(),
                                        micro_batch=self.micro_batch, micro_batch_tokens=self.micro_batch_tokens)
            dock.put(claim.rows, {"values": values}, ack=claim)
        return {"timing_s/critic_values": time.perf_counter() - start}

    def update(self, dock: StageDock) -> dict[str, float]:
        """Train on the returns of every row of the open iteration; returns ``critic/*`` and timing metrics."""
        start = time.perf_counter()
        columns = ["prompt_ids", "response_ids", "values", "returns"] + (["loss_mask"] if self.multi_turn else [])
        claim = dock.claim("critic_update", columns, dock.num_rows, whole_groups=True)
        batch = {c: claim.batch.column(c).to_pylist() for c in columns}
        rows_per_step = self.mini_batch * dock.group_size
        steps = []
        for _ in range(self.cfg.ppo_epochs):
            for s in range(0, len(claim.rows), rows_per_step):
                mini = {k: v[s : s + rows_per_step] for k, v in batch.items()}
                steps.append(self.engine.optimizer_step(partial(accumulate_value_mini_batch, self.engine, mini,
                                                                cliprange_value=self.cfg.cliprange_value, micro_batch=self.micro_batch,
                                                                micro_batch_tokens=self.micro_batch_tokens)))
        dock.ack(claim)
        metrics = {k: sum(m[k] for m in steps) / len(steps) for k in steps[0]}
        metrics |= value_metrics(batch["values"], batch["returns"], batch.get("loss_mask"))
        return metrics | {"timing_s/critic": time.perf_counter() - start}

    def values_step(self) -> Stage:
        """The first step as an in-process stage worker (``dockrl.stages.dynamic_sampling.StageWorker``)."""
        return Stage(self.compute_values)

    def update_step(self) -> Stage:
        """The second step as an in-process stage worker."""
        return Stage(self.update)


@dataclass(frozen=True)
class Stage:
    """One step of a stage as an in-process stage worker: ``run_iteration(dock)`` runs it."""

    step: Callable[[StageDock], dict[str, float]]

    def run_iteration(self, dock: StageDock) -> dict[str, float]:
        return self.step(dock)


def build_critic_engine(cfg: Config, policy_path: Path, device: torch.device | str, *, resume: Path | None = None) -> HFCriticEngine:
    """The critic of ``cfg`` on ``device``: from ``CHECKPOINT/critic`` (weights and optimizer) when
    resuming from ``resume``, else from ``critic.model_path`` or the policy at ``policy_path``.

    Raises:
        ValueError: the checkpoint has no critic, or the critic's vocabulary does not fit the policy's.
    """
    tokenizer = load_tokenizer(policy_path, cfg.model.trust_remote_code)
    start = critic_dir(resume) if resume else Path(cfg.critic.model_path or policy_path)
    if resume and not start.is_dir():
        raise ValueError(f"run.resume: checkpoint {resume} has no critic/ (written by a run without critic.enable?)")
    k = cfg.critic
    with torch.random.fork_rng(devices=[]):  # a new value head is drawn from trainer.seed, the same in a process of its own
        torch.manual_seed(cfg.trainer.seed)
        engine = HFCriticEngine(start, pad_id=tokenizer.pad_token_id, vocab_size=len(tokenizer), lr=k.lr, weight_decay=k.weight_decay,
                                grad_clip=k.grad_clip, autocast_bf16=cfg.trainer.autocast_bf16 is True,
                                trust_remote_code=cfg.model.trust_remote_code, device=device)
    if resume:
        load_optimizer(engine, start)
    return engine


def save_critic(engine: HFCriticEngine, checkpoint: Path) -> Path:
    """Write the critic's weights and optimizer to ``CHECKPOINT/critic``."""
    return save_optimizer(engine, engine.save(critic_dir(prepare_checkpoint(checkpoint))))


def run_critic(cfg: Config, dock: Dock, ranks: ProcessRanks, weight_sync: str = "", first_wait_s: float | None = None) -> None:
    """The ``critic`` stage process: values, then the update, every iteration (``CRITIC``); writes a
    due checkpoint's ``critic/`` (``CRITIC_CHECKPOINT``), then ``checkpoints/final/critic``."""
    t, run_dir = cfg.trainer, Path(cfg.run.output_dir)
    worker = CriticWorker.from_config(build_critic_engine(cfg, resolve_model(cfg), ranks.device,
                                                          resume=Path(cfg.run.resume) if cfg.run.resume else None), cfg)

    def after_update(it: int) -> None:
        if checkpoint_due(t, it):  # the driver snapshots the dock once the actor and the critic reported theirs
            save_critic(worker.engine, checkpoint_dir(run_dir, it + 1))
            dock.report(it, Report.CRITIC_CHECKPOINT, {})

    serve_iterations(dock, Report.CRITIC, lambda it: worker.compute_values(dock) | worker.update(dock), timeout_s=cfg.dock.timeout_s,
                     after_report=after_update, seed=t.seed, first_timeout_s=first_wait_s)
    save_critic(worker.engine, final_dir(run_dir))
    dock.report(t.iterations, final_report("critic"), {})


def inprocess_parts(ctx: InProcessContext) -> InProcessParts:
    """The stage in-process: its values with the rollout's stages, its update after the advantages; it saves ``critic/``."""
    worker = CriticWorker.from_config(build_critic_engine(ctx.cfg, ctx.plan.model_path, ctx.ranks.device, resume=ctx.resume), ctx.cfg)
    return InProcessParts(sample=[worker.values_step()], learn=[worker.update_step()], save=partial(save_critic, worker.engine))
