"""The resume point of a run (``run.resume``; docs/resume.md): ``find_resume`` picks the checkpoint
``run.resume`` names and checks it against this run: the settings the data order depends on
(``trainer.seed``, ``trainer.global_batch``, ``rollout.n``, the training prompts'
``prompts_fingerprint``), the actor's layout, the iterations in flight, the critic, and that
iterations are left to run. The checkpoint folders and their driver state are ``dockrl.checkpoint.resume``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from dockrl.checkpoint.resume import FINAL_DIR, FORMAT, STATE_FILE, VERSION, actor_layout, critic_dir, latest_checkpoint, read_state
from dockrl.config import Config, ConfigError, RolloutConfig

RUN_MARKERS = ("metrics.jsonl", "checkpoints")
"""What a run that started training leaves in its folder (``find_resume``, ``dockrl.run.setup.set_aside_stopped_run``)."""


def prompts_fingerprint(prompt_ids: Sequence[Sequence[int]]) -> str:
    """SHA-256 (hex, 16 chars) of the training prompts' token ids in order: the sampler's input."""
    h = hashlib.sha256()
    for ids in prompt_ids:
        h.update(json.dumps(list(ids)).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


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
    open_iterations: tuple[int, ...] = ()
    """Every iteration open in the snapshot, oldest first (``open_iteration`` is the first)."""
    reports: dict[int, dict[str, dict[str, float]]] | None = None
    """Reports of open iterations handed in before the snapshot (the rollout's of those it generated)."""
    prompts: str | None = None
    """The ``prompts_fingerprint`` the checkpoint was written with (``check_resume_prompts``)."""


def find_resume(cfg: Config, prompts: str | None) -> ResumePoint | None:
    """The checkpoint ``run.resume`` names, checked against this run; None for a fresh run.

    ``run.resume`` is ``''`` (fresh), ``'latest'`` (the newest complete checkpoint under
    ``run.output_dir/checkpoints``) or a checkpoint folder. ``prompts`` is this run's
    ``prompts_fingerprint``; None checks all but the prompts (a run does so before it prepares
    its model and loads its data, then ``check_resume_prompts`` checks them).

    A fresh run may go into a folder whose run stopped before its first complete checkpoint: nothing
    there resumes, and the run sets what it left aside (``dockrl.run.setup.set_aside_stopped_run``).

    Raises:
        ConfigError: a fresh run in a ``run.output_dir`` that holds another run with a complete
            checkpoint (they would mix, and ``latest`` would find the other run's); no such folder, no
            complete checkpoint, another format or version (``resume_state``); an SFT run's checkpoint
            (``dockrl sft``); a setting the sampler depends on differs (``trainer.seed``, ``trainer.global_batch``,
            ``rollout.n``, the training prompts), or nothing is left to run.
    """
    found = resume_state(cfg)
    if found is None:
        return None
    path, doc = found
    if doc.get("kind") == "sft":
        raise ConfigError(f"run.resume: {path} is a checkpoint of an SFT run (dockrl sft): continue that run with dockrl sft, "
                          f"or start RL from its weights with model.path={path} and no run.resume")
    ours = {"seed": cfg.trainer.seed, "global_batch": cfg.trainer.global_batch, "group_size": cfg.rollout.n, "prompts": prompts}
    fields = {"seed": "trainer.seed", "global_batch": "trainer.global_batch", "group_size": "rollout.n", "prompts": "the training prompts"}
    for key, mine in ours.items():
        if doc.get(key) != mine and mine is not None:
            raise data_order_differs(path, fields[key], doc.get(key), mine)
    layout = actor_layout(cfg)
    if doc.get("actor_layout", layout) != layout:  # checkpoints of older versions name none
        raise ConfigError(
            f"run.resume: {path} holds the optimizer state of a {doc['actor_layout']!r} actor, this run's is {layout!r}: "
            "resume with the checkpoint's trainer.engine and parallel.tp/pp/dp"
        )
    inflight = doc.get("max_inflight", 1)
    if doc.get("open_iterations", [doc["open_iteration"]] if doc.get("open_iteration") is not None else []) \
            and inflight != cfg.dock.max_inflight:
        raise ConfigError(
            f"dock.max_inflight: got {cfg.dock.max_inflight}; the checkpoint {path} was written with dock.max_inflight={inflight} "
            "and holds the iterations then in flight: resume with its dock.max_inflight (a final checkpoint takes any)"
        )
    for key in ("partial_tokens", "partial_max_age"):
        theirs, ours_ = doc.get(key, getattr(RolloutConfig(), key)), getattr(cfg.rollout, key)  # older checkpoints: the defaults
        if doc.get("open_iterations") and theirs != ours_:
            raise ConfigError(
                f"rollout.{key}: got {ours_}; the checkpoint {path} was written with rollout.{key}={theirs} and holds "
                f"iterations in flight whose responses its rollout may have cut: resume with its rollout.{key} "
                "(a final checkpoint takes any)"
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
    opened = doc.get("open_iterations", [doc["open_iteration"]] if doc["open_iteration"] is not None else [])
    reports = {int(k): v for k, v in (doc.get("reports") or {}).items()}
    return ResumePoint(checkpoint=path.resolve(), next_iteration=nxt, dock_uri=doc["dock_snapshot"],
                       open_iteration=doc["open_iteration"], summary=dict(doc.get("summary") or {}),
                       open_iterations=tuple(opened), reports=reports, prompts=doc.get("prompts"))


def resume_state(cfg: Config) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint ``run.resume`` names and its state, read and of this version; None for a fresh run
    (``run.resume`` empty), whose ``run.output_dir`` must not hold another run with a complete checkpoint (one that
    stopped before its first is set aside, ``dockrl.run.setup.set_aside_stopped_run``). ``find_resume`` and an
    SFT run's ``dockrl.sft.loop.find_sft_resume`` then check it against their run.

    Raises:
        ConfigError: a fresh run in a ``run.output_dir`` that holds another run with a complete checkpoint
            (they would mix, and ``latest`` would find the other run's); no such folder, no complete
            checkpoint, another format or version.
    """
    value = cfg.run.resume
    if not value:
        run_dir = Path(cfg.run.output_dir)
        held = [name for name in RUN_MARKERS if (run_dir / name).exists()]
        if held and latest_checkpoint(run_dir) is not None:  # one that stopped before any is set aside (dockrl.run.setup)
            raise ConfigError(f"run.output_dir: {run_dir} already holds a run ({', '.join(held)}); a fresh run there would mix "
                              "with it: continue it with run.resume=latest, or choose another run.output_dir (or delete that folder)")
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
    doc = read_state(path)
    if doc is None:
        raise ConfigError(f"run.resume: {path} is not a complete checkpoint: no readable {STATE_FILE} of format {FORMAT!r}")
    if doc.get("version") != VERSION:
        raise ConfigError(f"run.resume: {path} has checkpoint version {doc.get('version')!r}; this dockrl reads {VERSION}")
    return path, doc


def check_resume_prompts(point: ResumePoint | None, prompts: str) -> None:
    """What ``find_resume(cfg, None)`` left out: the checkpoint ``point`` was written with these
    training prompts (``prompts_fingerprint``). Nothing to check for a fresh run (None).

    Raises:
        ConfigError: other prompts (the data order depends on them).
    """
    if point is not None and point.prompts != prompts:
        raise data_order_differs(point.checkpoint, "the training prompts", point.prompts, prompts)


def data_order_differs(path: Path, field: str, theirs: Any, mine: Any) -> ConfigError:
    return ConfigError(f"run.resume: {path} was written with {field}={theirs!r}, this run has {mine!r}; "
                       "the data order depends on it: resume with the checkpoint's settings")
