"""Supervised fine-tuning on the actor's engine: ``dockrl sft`` (docs/sft.md).

    dockrl sft [--config FILE] [section.field=value ...]   # e.g. data.train_path=chats.jsonl sft.epochs=2

No stage, no dock: one loop in this process over the training engine RL runs train
(``build_train_engine``: ``trainer.engine``, ``trainer.lora``, AdamW at ``trainer.lr``), fed
``Example`` rows (``dockrl.sft.data``) as a multi-turn rollout feeds the actor (prompt, response,
``loss_mask``) and its ``forward_backward`` over ``trainer.micro_batch`` sequences or
``trainer.micro_batch_tokens`` tokens. Each step is ``sft.batch_size`` examples drawn as RL draws its
prompts (``prompt_batches``: epoch after epoch of seeded permutations, ``trainer.seed``), its loss the
mean NLL over the mini-batch's assistant tokens (``nll_loss``).

The run folder is an RL run's: ``config.yaml``, ``metrics.jsonl`` and ``tensorboard/`` (one line per
step), ``metrics.png``, ``summary.json`` (greedy test accuracy before and after, as ``dockrl train``
measures it: ``dockrl.stages.evaluate``), ``checkpoints/iter_<step>`` every ``trainer.save_every``
steps (pruned to ``trainer.keep_checkpoints``) and ``checkpoints/final``: HF weights (a LoRA run's
merged, with ``adapter/``), ``optimizer.pt`` and ``driver_state.json`` written last. ``run.resume=latest``
continues a stopped run at the step after its newest checkpoint; ``dockrl train
model.path=RUN/checkpoints/final`` starts RL from the result.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import torch

from dockrl.algorithms import nll_loss, right_pad
from dockrl.checkpoint.optimizer_state import load_optimizer, save_optimizer
from dockrl.checkpoint.pruning import prune_checkpoints
from dockrl.checkpoint.resume import (
    FORMAT,
    VERSION,
    CheckpointInProgress,
    actor_layout,
    checkpoint_dir,
    checkpoint_due,
    final_dir,
    prepare_checkpoint,
    weights_path,
    write_state,
)
from dockrl.checkpoint.resume_point import ResumePoint, data_order_differs, prompts_fingerprint, resume_state
from dockrl.config import Config, ConfigError, TrainerConfig, resolve_auto, save_config
from dockrl.engines.train_engine import TrainEngine
from dockrl.launch.run_records import recorded_run
from dockrl.process.lifeline import sigterm_as_exit
from dockrl.run.data import Prompt, load_prompts
from dockrl.run.lock import RunLock
from dockrl.run.metrics import MetricsWriter, plot_metrics
from dockrl.run.progress import Progress
from dockrl.run.setup import (
    as_config_error,
    check_data_paths,
    prompt_batches,
    recorded_paths,
    resolve_data,
    resolve_model,
    seed_everything,
    set_aside_stopped_run,
)
from dockrl.sft.data import Example, load_examples

logger = logging.getLogger(__name__)

OnStep = Callable[[int, dict[str, float]], None]
PLOT_KEYS = ("sft/loss", "actor/grad_norm", "sft/tokens", "perf/tokens_per_s")


@dataclass(frozen=True, kw_only=True)
class SFTPlan:
    """What an SFT run settled before its engine is built (``plan_sft``)."""

    cfg: Config
    """The run's config; with a resume, ``run.resume`` names the checkpoint folder itself."""
    model_path: Path
    examples: list[Example]
    test_prompts: list[Prompt]
    """The evaluation prompts (none when ``trainer.eval_before`` and ``trainer.eval_after`` are off)."""
    fingerprint: str
    """``prompts_fingerprint`` of the examples: a checkpoint is only resumed with the same."""
    steps: int
    """Optimizer steps of the run: ``ceil(sft.epochs × examples / sft.batch_size)``."""
    resume: ResumePoint | None

    @property
    def trainer(self) -> TrainerConfig:
        """``trainer`` as the loop reads it: an iteration is one optimizer step over ``sft.batch_size``
        examples (``prompt_batches``' batch, ``checkpoint_due``'s count)."""
        return dataclasses.replace(self.cfg.trainer, iterations=self.steps, global_batch=self.cfg.sft.batch_size)


def examples_fingerprint(examples: Sequence[Example]) -> str:
    """``prompts_fingerprint`` of each example's ids and loss mask (``-1`` between them): the sampler's input."""
    return prompts_fingerprint([e.prompt_ids + [-1] + e.response_ids + [-1] + e.loss_mask for e in examples])


def find_sft_resume(cfg: Config, fingerprint: str | None, steps: int | None) -> ResumePoint | None:
    """The checkpoint ``run.resume`` names (``resume_state``), checked against this SFT run; None for a
    fresh run. ``fingerprint`` and ``steps`` None: not checked yet (before the data is loaded).

    Raises:
        ConfigError: as ``resume_state``; an RL run's checkpoint; ``trainer.seed``, ``sft.batch_size``
            or the examples differ from the checkpoint's (the data order depends on them); another
            actor layout; no step left to run.
    """
    found = resume_state(cfg)
    if found is None:
        return None
    path, doc = found
    if doc.get("kind") != "sft":
        raise ConfigError(f"run.resume: {path} is a checkpoint of an RL run (dockrl train): continue it with dockrl train, or "
                          f"fine-tune its weights with model.path={path} and no run.resume")
    ours = {"seed": ("trainer.seed", cfg.trainer.seed), "batch_size": ("sft.batch_size", cfg.sft.batch_size),
            "prompts": ("the training examples", fingerprint), "actor_layout": ("the actor's layout", actor_layout(cfg))}
    for key, (field, mine) in ours.items():
        if mine is not None and doc.get(key) != mine:
            raise data_order_differs(path, field, doc.get(key), mine)
    nxt = int(doc["next_iteration"])
    if steps is not None and nxt >= steps:
        raise ConfigError(f"sft.epochs: got {cfg.sft.epochs} ({steps} steps); the checkpoint {path} resumes at step {nxt}: "
                          "raise sft.epochs to continue the run")
    return ResumePoint(checkpoint=path.resolve(), next_iteration=nxt, dock_uri="", open_iteration=None,
                       summary=dict(doc.get("summary") or {}), prompts=doc.get("prompts"))


def plan_sft(cfg: Config) -> SFTPlan:
    """Resolve ``auto`` fields, seed, check ``run.resume`` and the data files (seconds), resolve the
    model and data (``data.train_path`` empty: the demo's generated problems), load the examples and the
    test prompts, check them against the checkpoint's, then write ``RUN/config.yaml``.

    Raises:
        ConfigError: ``model.path``, the data files, the chat template or ``run.resume`` do not fit (named).
    """
    cfg = resolve_auto(cfg)
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    seed_everything(cfg.trainer.seed)
    find_sft_resume(cfg, None, None)  # what run.resume and the folder allow, before model and data take their time
    check_data_paths(cfg)
    if cfg.env.name:
        logger.warning("env.name=%r is not read by dockrl sft: its prompts show no tools and its evaluation is single-turn",
                       cfg.env.name)
    model_path = resolve_model(cfg)
    train_file, test_file = resolve_data(cfg)
    from dockrl.engines.hf.load import load_tokenizer  # lazy: transformers' models, after the model and data are known to be there

    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
    examples, report = as_config_error("data.train_path", load_examples, train_file, tokenizer, cfg.sft, cfg.data, model=cfg.model.path)
    logger.info("data data.train_path: %d examples (%d rows dropped)", report.kept, len(report.bad))
    test: list[Prompt] = []
    if cfg.trainer.eval_before or cfg.trainer.eval_after:
        test, _ = as_config_error("data.test_path", load_prompts, test_file, tokenizer, system_prompt=cfg.data.system_prompt,
                                  max_prompt_length=cfg.data.max_prompt_length, chat_template=cfg.data.chat_template,
                                  model=cfg.model.path)
        test = test[: cfg.data.eval_size] if cfg.data.eval_size else test
    steps = math.ceil(cfg.sft.epochs * len(examples) / cfg.sft.batch_size)
    fingerprint = examples_fingerprint(examples)
    point = find_sft_resume(cfg, fingerprint, steps)
    if point is None:
        set_aside_stopped_run(Path(cfg.run.output_dir))
    save_config(recorded_paths(cfg), Path(cfg.run.output_dir) / "config.yaml")
    if point:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=str(point.checkpoint)))
    return SFTPlan(cfg=cfg, model_path=model_path, examples=examples, test_prompts=test, fingerprint=fingerprint, steps=steps,
                   resume=point)


def accumulate_sft(engine: TrainEngine, batch: Sequence[Example], *, micro_batch: int, micro_batch_tokens: int = 0) -> dict[str, float]:
    """Forward/backward one mini-batch of examples over the engine's micro-batches, accumulating the
    gradient of the mean NLL of its assistant tokens (``nll_loss``, normalized by the mini-batch's
    count of them over all data-parallel replicas: the same gradient however the micro-batches split it).

    Returns:
        ``sft/loss`` (nats per assistant token), ``sft/tokens`` (assistant tokens) and ``sft/sequences``.
    """
    tokens = float(sum(sum(e.loss_mask) for e in batch))
    total_tokens, total_sequences = engine.sum_over_replicas([tokens, float(len(batch))])
    masks = right_pad([e.loss_mask for e in batch], max(len(e.response_ids) for e in batch))
    on_device: dict[torch.device, torch.Tensor] = {}

    def loss_fn(rows: list[int], log_prob: torch.Tensor, mask: torch.Tensor, entropy: torch.Tensor) -> tuple[torch.Tensor, float]:
        if log_prob.device not in on_device:  # one copy per mini-batch
            on_device[log_prob.device] = masks.to(log_prob.device)
        assistant = mask * on_device[log_prob.device][torch.tensor(rows, device=log_prob.device), : log_prob.shape[1]]
        loss = nll_loss(log_prob, assistant, total_tokens)
        return loss, float(loss.detach())

    parts = engine.forward_backward([e.prompt_ids for e in batch], [e.response_ids for e in batch], temperature=1.0,
                                    micro_batch=micro_batch, loss_fn=loss_fn, micro_batch_tokens=micro_batch_tokens)
    (loss,) = engine.sum_over_replicas([sum(parts)])
    return {"sft/loss": loss, "sft/tokens": total_tokens, "sft/sequences": total_sequences}


def write_sft_state(folder: Path, plan: SFTPlan, next_step: int, summary: dict[str, float]) -> None:
    """``driver_state.json`` of an SFT checkpoint (``write_state``): the step it resumes at and what the data order depends on."""
    cfg = plan.cfg
    write_state(folder, {"format": FORMAT, "version": VERSION, "kind": "sft", "next_iteration": next_step, "open_iteration": None,
                         "dock_snapshot": "", "open_iterations": [], "summary": summary, "seed": cfg.trainer.seed,
                         "batch_size": cfg.sft.batch_size, "prompts": plan.fingerprint, "actor_layout": actor_layout(cfg)})


def sft(cfg: Config, *, on_step: OnStep | None = None) -> dict[str, float]:
    """Run SFT as configured (the module docstring); returns the run summary.

    ``on_step(step, metrics)`` is called once each step's metrics are written. A checkpoint whose
    write an error, Ctrl-C or SIGTERM cut short is removed (``CheckpointInProgress``). The run folder
    is locked for the run (``RunLock``), and ``dockrl runs`` lists the run while it runs (``recorded_run``).

    Raises:
        RunLockedError: another live run holds ``run.output_dir``.
        ConfigError: as ``plan_sft``.
    """
    with RunLock(cfg.run.output_dir, wait_s=cfg.run.lock_wait_s) as lock, sigterm_as_exit() as stop:
        plan = plan_sft(cfg)
        lock.accept()
        in_progress = CheckpointInProgress()
        try:
            with recorded_run(f"dockrl-sft-{secrets.token_hex(6)}", cfg.run.output_dir):
                summary = fit(plan, in_progress=in_progress, on_step=on_step, check_stop=stop.raise_if_stopped)
        finally:
            in_progress.remove()
    run_dir = Path(cfg.run.output_dir)
    plot_metrics(run_dir / "metrics.jsonl", run_dir / "metrics.png", keys=PLOT_KEYS)
    return summary


def fit(plan: SFTPlan, *, in_progress: CheckpointInProgress, on_step: OnStep | None = None,
        check_stop: Callable[[], None] = lambda: None) -> dict[str, float]:
    """The steps of a planned run, with its evaluations and checkpoints; returns the run summary.

    ``in_progress`` names the checkpoint being written (the caller removes it when the run is cut
    short); ``check_stop`` raises a SIGTERM or Ctrl-C a finalizer swallowed (between steps).
    """
    from dockrl.engines.factory import build_rollout_engine, build_train_engine, process_ranks, shares_actor_module, weights_to_send
    from dockrl.rewards.guard import build_scorer
    from dockrl.stages.evaluate import evaluate  # lazy, as the engines: math_verify (sympy) for the scorer

    t0 = time.perf_counter()
    cfg, point, t = plan.cfg, plan.resume, plan.trainer
    run_dir = Path(cfg.run.output_dir)
    summary: dict[str, float] = {"data/train_examples": len(plan.examples), "eval/test_prompts": len(plan.test_prompts),
                                 "sft/steps": plan.steps}
    summary |= point.summary if point else {}
    first = point.next_iteration if point else 0
    ranks = process_ranks(cfg, trains=True)
    weights = weights_path(cfg, plan.model_path)
    engine = build_train_engine(cfg, weights, ranks)  # a LoRA run's adapter from the checkpoint, over model.path's weights
    if point:
        load_optimizer(engine, point.checkpoint)
        logger.info("resuming at step %d from %s", first, point.checkpoint)
    rollout = build_rollout_engine(cfg, weights, ranks, actor=engine) if plan.test_prompts else None
    scorer = build_scorer(cfg.algorithm)
    try:
        if rollout is not None and t.eval_before and not point:
            summary |= evaluate(rollout, plan.test_prompts, scorer, cfg, "before")
        batches = list(prompt_batches(plan.examples, t))
        with MetricsWriter(run_dir, on_log=on_step, resume_from=first if point else None) as writer, \
                Progress(plan.steps - first, "SFT", enable=cfg.run.progress, keys=("sft/loss",)) as progress:
            for step in range(first, plan.steps):
                check_stop()
                start = time.perf_counter()
                metrics = engine.optimizer_step(partial(accumulate_sft, engine, batches[step], micro_batch=t.micro_batch,
                                                        micro_batch_tokens=t.micro_batch_tokens))
                seconds = time.perf_counter() - start
                metrics |= {"sft/epoch": (step + 1) * cfg.sft.batch_size / len(plan.examples), "timing_s/step": seconds,
                            "perf/tokens_per_s": sum(len(e.prompt_ids) + len(e.response_ids) for e in batches[step]) / seconds}
                writer.log(step, metrics)
                progress.update(metrics)
                if checkpoint_due(t, step):
                    save_checkpoint(engine, plan, checkpoint_dir(run_dir, step + 1), step + 1, summary, in_progress)
            save_checkpoint(engine, plan, final_dir(run_dir), plan.steps, summary, in_progress)
            if rollout is not None and t.eval_after:
                if not shares_actor_module(cfg, engine):
                    rollout.load_weights(weights_to_send(cfg, engine)[0])  # the trained weights (LoRA: the adapter)
                summary |= evaluate(rollout, plan.test_prompts, scorer, cfg, "after")
            summary["run/seconds"] = time.perf_counter() - t0
            writer.log_summary(summary)
    finally:
        scorer.close()
    return summary


def save_checkpoint(engine: TrainEngine, plan: SFTPlan, folder: Path, next_step: int, summary: dict[str, float],
                    in_progress: CheckpointInProgress) -> None:
    """Weights and optimizer into ``folder``, then its state (complete from then on; ``in_progress``
    names it until then); then older checkpoints pruned to ``trainer.keep_checkpoints``."""
    in_progress.folder = folder
    save_optimizer(engine, engine.save(prepare_checkpoint(folder)))
    write_sft_state(folder, plan, next_step, summary)
    in_progress.folder = None
    logger.info("checkpoint %s written; step %d resumes from it", folder, next_step)
    prune_checkpoints(plan.cfg.run.output_dir, plan.cfg.trainer.keep_checkpoints, folder)
