"""``dockrl rollouts replay``: recompute one iteration's actor update from its kept rows and stored checkpoint.

    dockrl rollouts replay runs/demo --iteration 3

The weights that trained at iteration N are the checkpoint written after iteration N-1,
``checkpoints/iter_<N:06d>`` (``dockrl.checkpoint.resume.checkpoint_dir``; ``trainer.save_every=1`` keeps every one,
with its optimizer state), or the run's starting model for its first iteration. Replay loads them into
the actor's engine (``build_train_engine``, ``load_optimizer``), puts the iteration's kept rows (the
prompts, responses, advantages, and the reference and rollout log-probs where the run had them) into a
dock of the run's shard layout, and runs the actor's own iteration (``dockrl.stages.actor.ActorWorker``)
on it: the same claim order, mini-batches, micro-batches and optimizer steps. The result is compared
with what ``metrics.jsonl`` logged for the iteration (``actor/loss``, ``actor/pg_loss``, ``actor/kl``,
``actor/grad_norm``) and with the kept ``old_log_prob``: on CPU in fp32 they are the same bits.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pyarrow as pa

from dockrl.checkpoint.optimizer_state import load_optimizer
from dockrl.checkpoint.resume import checkpoint_dir, read_state
from dockrl.config import Config
from dockrl.dock.client.dock_client import open_dock
from dockrl.dock.schema import GRPO_SCHEMA
from dockrl.dock.shard.kept_rollouts import LEADING
from dockrl.engines.factory import build_train_engine, process_ranks
from dockrl.process.seeding import seed_iteration
from dockrl.rollouts.keep import KeptRollouts, read_kept
from dockrl.run.setup import resolve_model
from dockrl.stages.actor import ActorWorker

CLAIM_TIMEOUT_S = 60.0
"""Longest the replayed actor waits for its rows (all are put before it claims), seconds."""
COMPARED = ("actor/loss", "actor/pg_loss", "actor/kl", "actor/grad_norm", "actor/clip_ratio")
"""The logged actor metrics a replay recomputes and compares (those the run logged)."""


def check_replayable(cfg: Config, kept: KeptRollouts) -> None:
    """Refuse a run whose actor iteration replay cannot reproduce.

    Raises:
        ValueError: naming the field: ``run.keep_rollouts`` not ``all`` (a sample of the rows is not the batch
            trained), ``trainer.engine`` not ``hf``, ``trainer.hybrid``, ``trainer.lora``, dynamic sampling
            (``algorithm.filter_groups.enable``: the rows trained are a selection), or a pipeline artifact
            folder (no checkpoints: replay needs the run folder).
    """
    t = cfg.trainer
    refused = [
        (cfg.run.keep_rollouts != "all", "run.keep_rollouts", cfg.run.keep_rollouts,
         "needs 'all': a sample of the rows is not the batch the actor trained on"),
        (t.engine != "hf", "trainer.engine", t.engine, "replay runs the HF actor engine"),
        (t.hybrid, "trainer.hybrid", t.hybrid, "the hybrid actor is not replayed"),
        (t.lora.enabled, "trainer.lora.rank", t.lora.rank, "a LoRA actor is not replayed"),
        (cfg.algorithm.filter_groups.enable, "algorithm.filter_groups.enable", True, "with dynamic sampling the rows trained are a selection"),
    ]
    for bad, name, value, why in refused:
        if bad:
            raise ValueError(f"dockrl rollouts replay: {name}={value!r} in the run's config: {why}")
    if kept.run_dir is None:
        raise ValueError(f"dockrl rollouts replay: {kept.root} is a rollouts artifact; replay needs the run folder (its checkpoints)")


def starting_weights(cfg: Config, run_dir: Path, iteration: int) -> tuple[Path, Path | None]:
    """The weights that trained at ``iteration`` and the checkpoint whose optimizer state goes with them (None: a
    fresh optimizer, the run's first iteration from its model).

    Raises:
        FileNotFoundError: no complete ``checkpoints/iter_<N:06d>`` (it names the setting that keeps one).
    """
    folder = checkpoint_dir(run_dir, iteration)
    if read_state(folder) is not None:
        return folder, folder
    if iteration == 0 and not cfg.run.resume:
        return resolve_model(cfg), None
    raise FileNotFoundError(f"dockrl rollouts replay: {folder} is not a complete checkpoint: iteration {iteration} trained the weights "
                            "written after the iteration before it; a run keeps every one with trainer.save_every=1 (and "
                            "trainer.keep_checkpoints=0)")


def logged_metrics(run_dir: Path, iteration: int) -> dict[str, Any]:
    """The last ``metrics.jsonl`` line of ``iteration`` (a resumed run may have logged it twice).

    Raises:
        KeyError: the run logged no such iteration.
    """
    found = None
    for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row.get("iteration") == iteration:
            found = row
    if found is None:
        raise KeyError(f"dockrl rollouts replay: {run_dir / 'metrics.jsonl'} has no line of iteration {iteration}")
    return found


def dock_columns(table: pa.Table) -> dict[str, list]:
    """The cells a replay puts back into the dock: every kept dock column with a value in every row but the actor's
    own (it computes them); the dock's per-token ``weight_version`` (kept as the row's, the version that finished the
    response) as that version on every token, which it is without partial rollout (it enters only the
    staleness metrics, not the loss)."""
    names = [c.name for c in GRPO_SCHEMA.columns if not c.rewritable and c.name not in LEADING and c.producer != "actor"]
    out = {n: table.column(n).to_pylist() for n in names if n in table.column_names and table.column(n).null_count == 0}
    if any(c.name == "weight_version" for c in GRPO_SCHEMA.columns):
        out["weight_version"] = [[v] * len(r) for v, r in zip(table.column("weight_version").to_pylist(), out["response_ids"])]
    return out


def replay(kept: KeptRollouts, iteration: int) -> dict[str, Any]:
    """Recompute the actor's update of ``iteration`` (see the module docstring).

    Returns:
        ``actor/*`` metrics of the replayed iteration and ``replay/old_log_prob_equal`` (1.0 when the recomputed
        ``old_log_prob`` equal the kept ones bit for bit).

    Raises:
        ValueError: a run replay cannot reproduce (``check_replayable``), the iteration has no kept rows
            (``read_kept``), or its kept rows are not the whole batch (``trainer.global_batch`` × ``rollout.n``).
        FileNotFoundError: the iteration's weights are not kept (``starting_weights``).
    """
    cfg = kept.config
    check_replayable(cfg, kept)
    assert kept.run_dir is not None, "checked above"
    table = read_kept(kept, iteration)
    rows, n = cfg.trainer.global_batch * cfg.rollout.n, cfg.rollout.n
    if table.num_rows != rows:
        raise ValueError(f"dockrl rollouts replay: iteration {iteration} kept {table.num_rows} rows; the actor trained on "
                         f"trainer.global_batch × rollout.n = {rows}")
    weights, optimizer = starting_weights(cfg, kept.run_dir, iteration)
    engine = build_train_engine(cfg, weights, process_ranks(cfg, trains=True))
    if optimizer is not None:
        load_optimizer(engine, optimizer)
    # every cell is put before the actor claims: a claim that waits lacks a column, and says which, soon
    dock = open_dock(dataclasses.replace(cfg.dock, warehouse="memory", timeout_s=min(cfg.dock.timeout_s, CLAIM_TIMEOUT_S)),
                     GRPO_SCHEMA, run="replay")
    try:
        dock.open_iteration(iteration, rows, n)
        index = table.column("row").to_pylist()
        dock.put(index, dock_columns(table), iteration=iteration)
        seed_iteration(cfg.trainer.seed, iteration)
        worker = ActorWorker(engine, trainer=cfg.trainer, algo=cfg.algorithm, rollout=cfg.rollout,
                             warmup_iterations=cfg.critic.warmup_iterations)
        metrics: dict[str, Any] = worker.run_iteration(dock)
        old = dock.get(["old_log_prob"], index, iteration=iteration).column("old_log_prob").to_pylist()
        metrics["replay/old_log_prob_equal"] = float(old == table.column("old_log_prob").to_pylist())
    finally:
        dock.close()
    return metrics


def replay_command(kept: KeptRollouts, iteration: int) -> tuple[str, bool]:
    """``dockrl rollouts replay``: the comparison as text (logged, replayed, difference per metric) and whether every
    compared value, and the old log-probs, are the same bits."""
    ran = replay(kept, iteration)
    assert kept.run_dir is not None, "replay checked it"
    logged = logged_metrics(kept.run_dir, iteration)
    lines = [f"{'metric':<16} {'logged':>24} {'replayed':>24} {'difference':>11}"]
    same = ran["replay/old_log_prob_equal"] == 1.0
    for key in COMPARED:
        if key in logged and key in ran:
            a, b = float(logged[key]), float(ran[key])
            same &= a == b
            lines.append(f"{key:<16} {a!r:>24} {b!r:>24} {b - a:>11.3g}")
    lines.append(f"old_log_prob: {'the same bits' if ran['replay/old_log_prob_equal'] == 1.0 else 'DIFFERENT'} as kept")
    lines.append(f"iteration {iteration}: " + ("reproduced exactly" if same else "NOT reproduced exactly"))
    return "\n".join(lines), same
