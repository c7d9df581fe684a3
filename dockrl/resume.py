"""Checkpoints a run can resume from, and resuming one (``dockrl train ... run.resume=latest``; docs/resume.md).

``RUN/checkpoints/iter_<k:06d>/`` is written after iteration ``k-1`` (every
``trainer.save_every`` iterations), ``RUN/checkpoints/final/`` after the last one; each holds
the actor's HF weights, ``optimizer.pt`` (``save_optimizer``), with ``critic.enable`` the
critic's weights and optimizer in ``critic/`` (``critic_dir``), the dock snapshot taken with
iteration ``k`` open and its prompts put but not yet announced (``dock/``, or the run's S3 store:
``dock_snapshot_uri``; none in ``final``), and ``driver_state.json``, written last and
atomically: a folder without it is incomplete and never resumed from (``prepare_checkpoint``
removes it before a folder is written again). ``run.resume=latest`` takes the complete
checkpoint that resumes furthest (``find_resume``).

A resumed run goes on where the interrupted one was: the sampler is a pure function of
``(trainer.seed, iteration)`` (``dockrl.run_setup.prompt_batches``), every process reseeds per
iteration (``seed_iteration``), ``metrics.jsonl`` keeps the iterations before ``k``
(``MetricsWriter(resume_from=k)``), and the rows of iteration ``k`` come from the snapshot.
Known limit: vLLM seeds its sampler at start, not per iteration.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from dockrl.config import Config, ConfigError, TrainerConfig

logger = logging.getLogger(__name__)

FORMAT = "dockrl.checkpoint"
VERSION = 1
STATE_FILE = "driver_state.json"
"""Written last into a checkpoint folder: its presence marks the checkpoint complete."""
OPTIMIZER_FILE = "optimizer.pt"
DOCK_DIR = "dock"
CRITIC_DIR = "critic"
FINAL_DIR = "final"
"""``RUN/checkpoints/final``: the checkpoint after the last iteration."""
_ITER_DIR = re.compile(r"iter_(\d{6,})")


def checkpoint_dir(run_dir: str | Path, next_iteration: int) -> Path:
    """``RUN/checkpoints/iter_<next_iteration:06d>``: the checkpoint written after iteration ``next_iteration - 1``."""
    return Path(run_dir) / "checkpoints" / f"iter_{next_iteration:06d}"


def final_dir(run_dir: str | Path) -> Path:
    """``RUN/checkpoints/final``: the checkpoint written after the last iteration."""
    return Path(run_dir) / "checkpoints" / FINAL_DIR


def prepare_checkpoint(checkpoint: str | Path) -> Path:
    """Create ``checkpoint`` or mark an existing one incomplete (its ``driver_state.json``
    removed) before weights and optimizer are written into it: a run continued from ``final``
    overwrites that folder, and a crash halfway must not leave it looking complete."""
    path = Path(checkpoint)
    path.mkdir(parents=True, exist_ok=True)
    (path / STATE_FILE).unlink(missing_ok=True)
    return path


def critic_dir(checkpoint: str | Path) -> Path:
    """``CHECKPOINT/critic``: the critic's HF weights and ``optimizer.pt`` (with ``critic.enable``)."""
    return Path(checkpoint) / CRITIC_DIR


def checkpoint_due(t: TrainerConfig, iteration: int) -> bool:
    """Whether a checkpoint is written after ``iteration`` (not after the last: that one is ``final``)."""
    return bool(t.save_every) and (iteration + 1) % t.save_every == 0 and iteration + 1 < t.iterations


def iteration_seed(seed: int, iteration: int) -> int:
    """The seed of ``iteration``: a 63-bit integer from SHA-256 of ``(seed, iteration)``."""
    digest = hashlib.sha256(f"dockrl:{seed}:{iteration}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_iteration(seed: int, iteration: int) -> None:
    """Reseed Python's and torch's global generators for ``iteration`` (every stage, every process)."""
    s = iteration_seed(seed, iteration)
    random.seed(s)
    torch.manual_seed(s)


def prompts_fingerprint(prompt_ids: Sequence[Sequence[int]]) -> str:
    """SHA-256 (hex, 16 chars) of the training prompts' token ids in order: the sampler's input."""
    h = hashlib.sha256()
    for ids in prompt_ids:
        h.update(json.dumps(list(ids)).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def dock_snapshot_uri(cfg: Config, checkpoint: Path, run: str) -> str:
    """Where the dock snapshot of ``checkpoint`` goes.

    ``CHECKPOINT/dock`` (absolute path), or with ``dock.warehouse=s3`` in distributed mode
    (in-process mode keeps the dock in memory and uses no warehouse) the run's store:
    ``s3://<bucket>/<prefix>/<run>/checkpoints/<folder>/dock?endpoint_override=…`` (pyarrow
    reads the credentials from ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``; with other
    ``dock.access_key_env``/``dock.secret_key_env`` names the snapshot stays in the run folder).
    """
    from dockrl.config import s3_endpoint

    k = cfg.dock
    local = str((checkpoint / DOCK_DIR).resolve())
    if k.warehouse != "s3" or k.mode != "distributed":
        return local
    if (k.access_key_env, k.secret_key_env) != ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        logger.warning("dock snapshot kept in %s: pyarrow reads S3 credentials from AWS_ACCESS_KEY_ID and "
                       "AWS_SECRET_ACCESS_KEY, not from %s and %s", local, k.access_key_env, k.secret_key_env)
        return local
    endpoint, secure = s3_endpoint(k.endpoint or os.environ.get("AWS_ENDPOINT_URL", ""), k.secure, "dock.endpoint")
    key = "/".join(p for p in (k.prefix.strip("/"), run, "checkpoints", checkpoint.name, DOCK_DIR) if p)
    query = f"endpoint_override={endpoint}&scheme={'https' if secure else 'http'}" + (f"&region={k.region}" if k.region else "")
    return f"s3://{k.bucket}/{key}?{query}"


def optimizer_file(rank: int = 0) -> str:
    """Name of the optimizer state of actor rank ``rank`` in a checkpoint: ``optimizer.pt`` for
    rank 0 (the only one of a single-process actor), ``optimizer.rank<r>.pt`` for the other
    ranks of a multi-rank hybrid actor, each holding its own TP/PP shard's AdamW state."""
    return OPTIMIZER_FILE if rank == 0 else f"optimizer.rank{rank}.pt"


def save_optimizer(engine: Any, checkpoint: Path, rank: int = 0) -> Path:
    """Write ``engine.optimizer.state_dict()`` to ``CHECKPOINT/optimizer_file(rank)``.

    Raises:
        ValueError: the engine has no optimizer (a frozen engine).
    """
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None:
        raise ValueError(f"save_optimizer: {type(engine).__name__} has no optimizer to checkpoint (trainable=False?)")
    path = Path(checkpoint) / optimizer_file(rank)
    tmp = path.with_suffix(".pt.tmp")
    torch.save(optimizer.state_dict(), tmp)
    tmp.replace(path)
    return path


def load_optimizer(engine: Any, checkpoint: Path, rank: int = 0) -> None:
    """Load ``CHECKPOINT/optimizer_file(rank)`` into ``engine.optimizer`` (built over the checkpoint's weights).

    Raises:
        ValueError: the engine has no optimizer, or the file is missing.
    """
    optimizer = getattr(engine, "optimizer", None)
    path = Path(checkpoint) / optimizer_file(rank)
    if optimizer is None:
        raise ValueError(f"load_optimizer: {type(engine).__name__} has no optimizer to restore into")
    if not path.is_file():
        raise ValueError(f"run.resume: checkpoint {checkpoint} has no {path.name} (written by an older version, "
                         "or by an actor with another parallel layout?)")
    optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


@dataclass(frozen=True, kw_only=True)
class ResumePoint:
    """A complete checkpoint to resume from (``find_resume``)."""

    checkpoint: Path
    """The checkpoint folder (HF weights, ``optimizer.pt``, ``driver_state.json``)."""
    next_iteration: int
    """The first iteration the resumed run runs."""
    dock_uri: str
    """The dock snapshot; iteration ``open_iteration`` is open in it (or none); '' for ``final``, which has none."""
    open_iteration: int | None
    summary: dict[str, float]
    """Run summary at checkpoint time (evaluation before training)."""


def actor_layout(cfg: Config) -> str:
    """What the actor's optimizer files depend on: its engine and, for megatron, its TP/PP/DP shards."""
    p = cfg.parallel
    return "hf" if cfg.trainer.engine == "hf" else f"megatron tp={p.tp} pp={p.pp} dp={p.dp}"


def write_driver_state(
    checkpoint: Path, cfg: Config, *, next_iteration: int, dock_uri: str, open_iteration: int | None,
    summary: dict[str, float], prompts: str,
) -> None:
    """Write ``CHECKPOINT/driver_state.json`` atomically; call it last, after weights, optimizer and dock."""
    doc = {
        "format": FORMAT, "version": VERSION, "next_iteration": next_iteration, "dock_snapshot": dock_uri,
        "open_iteration": open_iteration, "summary": summary, "seed": cfg.trainer.seed,
        "global_batch": cfg.trainer.global_batch, "group_size": cfg.rollout.n, "prompts": prompts,
        "actor_layout": actor_layout(cfg),
    }
    path = Path(checkpoint) / STATE_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def write_final_state(checkpoint: Path, cfg: Config, *, summary: dict[str, float], prompts: str) -> None:
    """The driver state of ``checkpoints/final`` (after the actor wrote weights and optimizer):
    the next iteration is ``trainer.iterations``, no iteration is open, no dock snapshot."""
    write_driver_state(checkpoint, cfg, next_iteration=cfg.trainer.iterations, dock_uri="", open_iteration=None,
                       summary=summary, prompts=prompts)


def _read_state(checkpoint: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((checkpoint / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == FORMAT else None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint of ``run_dir`` that resumes furthest (``iter_*`` or ``final``); None when there is none."""
    folder = Path(run_dir) / "checkpoints"
    found = [p for p in folder.glob("iter_*") if _ITER_DIR.fullmatch(p.name) and p.is_dir()]
    found += [p for p in (folder / FINAL_DIR,) if p.is_dir()]
    best: tuple[int, Path] | None = None
    for path in found:
        doc = _read_state(path)
        if doc is None:
            logger.warning("checkpoint %s is incomplete (no %s): skipped", path, STATE_FILE)
        elif best is None or int(doc.get("next_iteration", -1)) > best[0]:
            best = (int(doc.get("next_iteration", -1)), path)
    return best[1] if best else None


def find_resume(cfg: Config, prompts: str) -> ResumePoint | None:
    """The checkpoint ``run.resume`` names, checked against this run; None for a fresh run.

    ``run.resume`` is ``''`` (fresh), ``'latest'`` (the newest complete checkpoint under
    ``run.output_dir/checkpoints``) or a checkpoint folder. ``prompts`` is this run's
    ``prompts_fingerprint``.

    Raises:
        ConfigError: a fresh run in a ``run.output_dir`` that holds another run's metrics or
            checkpoints (they would mix, and ``latest`` would find the other run's); no such
            folder, no complete checkpoint, another format or version, or a setting the
            sampler depends on differs (``trainer.seed``, ``trainer.global_batch``,
            ``rollout.n``, the training prompts), or nothing is left to run.
    """
    value = cfg.run.resume
    if not value:
        run_dir = Path(cfg.run.output_dir)
        held = [name for name in ("metrics.jsonl", "checkpoints") if (run_dir / name).exists()]
        if held:
            how = ("continue it with run.resume=latest, or choose another run.output_dir (or delete that folder)"
                   if latest_checkpoint(run_dir) is not None else
                   "it has no complete checkpoint to continue with run.resume=latest (one is written every trainer.save_every "
                   "iterations and at the end): choose another run.output_dir (or delete that folder)")
            raise ConfigError(f"run.output_dir: {run_dir} already holds a run ({', '.join(held)}); a fresh run there would mix with it: {how}")
        return None
    if value == "latest":
        path = latest_checkpoint(cfg.run.output_dir)
        if path is None:
            raise ConfigError(
                f"run.resume: got 'latest'; no complete checkpoint under {Path(cfg.run.output_dir) / 'checkpoints'} "
                f"(folders iter_NNNNNN with {STATE_FILE}); start fresh without run.resume, in another run.output_dir "
                "(or delete that folder)"
            )
    else:
        path = Path(value)
        if not path.is_dir():
            raise ConfigError(f"run.resume: got {value!r}; expected 'latest' or an existing checkpoint folder")
    doc = _read_state(path)
    if doc is None:
        raise ConfigError(f"run.resume: {path} is not a complete checkpoint: no readable {STATE_FILE} of format {FORMAT!r}")
    if doc.get("version") != VERSION:
        raise ConfigError(f"run.resume: {path} has checkpoint version {doc.get('version')!r}; this dockrl reads {VERSION}")
    ours = {"seed": cfg.trainer.seed, "global_batch": cfg.trainer.global_batch, "group_size": cfg.rollout.n, "prompts": prompts}
    fields = {"seed": "trainer.seed", "global_batch": "trainer.global_batch", "group_size": "rollout.n", "prompts": "the training prompts"}
    for key, mine in ours.items():
        if doc.get(key) != mine:
            raise ConfigError(
                f"run.resume: {path} was written with {fields[key]}={doc.get(key)!r}, this run has {mine!r}; "
                "the data order depends on it: resume with the checkpoint's settings"
            )
    layout = actor_layout(cfg)
    if doc.get("actor_layout", layout) != layout:  # checkpoints of older versions name none
        raise ConfigError(
            f"run.resume: {path} holds the optimizer state of a {doc['actor_layout']!r} actor, this run's is {layout!r}: "
            "resume with the checkpoint's trainer.engine and parallel.tp/pp/dp"
        )
    if cfg.critic.enable and not critic_dir(path).is_dir():
        raise ConfigError(f"run.resume: {path} has no critic/ (written by a run without critic.enable): resume with the "
                          "checkpoint's critic.enable, or start a fresh run")
    nxt = doc["next_iteration"]
    if not nxt < cfg.trainer.iterations:
        if path.name == FINAL_DIR:
            raise ConfigError(
                f"run.resume: the run in {path.parents[1]} finished all its {nxt} iterations ({path}); nothing is left to run "
                f"with trainer.iterations={cfg.trainer.iterations}: pass trainer.iterations=N with N > {nxt} to continue it "
                "from its final weights, optimizer and data position"
            )
        raise ConfigError(
            f"trainer.iterations: got {cfg.trainer.iterations}; the checkpoint {path} resumes at iteration {nxt}: "
            "expected more iterations than that"
        )
    return ResumePoint(checkpoint=path.resolve(), next_iteration=nxt, dock_uri=doc["dock_snapshot"],
                       open_iteration=doc["open_iteration"], summary=dict(doc.get("summary") or {}))


def weights_path(cfg: Config, model_path: Path) -> Path:
    """Where the actor and rollout load their starting weights: the resumed checkpoint, else ``model_path``."""
    return Path(cfg.run.resume) if cfg.run.resume else model_path
