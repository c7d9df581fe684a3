"""The stage table: every stage of a run declared once, as plain data.

A row (``Stage``) says what a stage is: its name, how it runs (its own process, a part of the
hybrid actor, or in-process only), the config field that switches it on, its dock consumers and
the columns it may claim and write (the rights of its process's token on the dock shards,
``dockrl.launch.distributed.stage_rights``), whether it holds a device, the reports the driver waits for, and where its
loop lives. Everything that lists stages reads ``STAGES``: the in-process runner
(``dockrl/stages/inprocess.py``), the process runner and the worker-group builder
(``dockrl/launch/distributed.py``), the worker entry point (``dockrl/stages/main.py``) and
the reports the driver waits for (``iteration_reports``, ``checkpoint_reports``). Adding a stage
is a loop function plus one row.

Loops are named by import path (``module:function``) and imported only when a process runs
one: the worker backends import this module, and it imports neither torch nor pyarrow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from dockrl.config import Config
from dockrl.process.imports import import_object
from dockrl.stages.loop import Report

Kind = Literal["process", "hybrid-part", "in-process"]
"""How a stage runs in a distributed run: ``process``, its own group of processes;
``hybrid-part``, its own process, or with ``trainer.hybrid`` a part of the ``hybrid`` process
(rollout and actor); ``in-process``, inside another stage's process (the advantages, in the
reward's)."""


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One row of the stage table."""

    name: str
    """The stage's name: ``dockrl worker --stage``, its worker group and its ``final/<name>`` report."""
    kind: Kind
    """How it runs (``Kind``)."""
    when: str = ""
    """Dotted config field that switches it on (``reward_model.enable``); empty: every run."""
    inside: str = ""
    """Of kind ``in-process``: the stage process it runs inside."""
    consumers: tuple[str, ...] = ()
    """Its names as a dock consumer (``dockrl.dock.schema``'s ``consumers``): what its claims, acks and releases name."""
    claims: tuple[str, ...] = ()
    """Every dock column it may claim or read under any option (``dockrl.dock.schema``'s names; the actor's
    ``ref_log_prob`` only with a KL loss): the shards refuse its process's token any other."""
    writes: tuple[str, ...] = ()
    """Every dock column it may write under any option (the rollout's partial and multi-turn columns among them)."""
    sampling_writes: tuple[str, ...] = ()
    """With dynamic sampling (``algorithm.filter_groups.enable``): driver columns it writes too (each round's
    gate), and it drops the rows it filters out."""
    devices: bool = False
    """Each member holds one accelerator (it holds a model); else it computes on the CPU."""
    trains: bool = False
    """It holds the actor's training engine (a megatron one joins its process groups)."""
    weight_sync: bool = False
    """It meets the others on the launcher's ``TCPStore`` (the weight channel, the hybrid ranks' rendezvous)."""
    layout: bool = False
    """One member per rank of the parallel layout (``tp × pp × dp``), else one member."""
    programs: bool = False
    """It runs model-written programs (the ``python`` environment's tool calls, a scorer such as the code scorer): with
    ``env.sandbox.backend=pod`` a distributed run gives its process a sandbox executor of its own."""
    reports: tuple[str, ...] = ()
    """The reports the driver waits for every iteration (``Report`` values, their wire names)."""
    checkpoint_report: str = ""
    """The report that says its part of a due checkpoint is written; empty: it writes none."""
    process: str = ""
    """``module:function`` of its process body ``(cfg, dock, ranks, weight_sync, first_wait_s)``."""
    inprocess: str = ""
    """``module:function`` building its in-process workers (``dockrl.stages.inprocess.InProcessParts``)
    from an ``InProcessContext``; empty: the in-process runner builds it itself (rollout, actor, advantage)."""


STAGES: tuple[Stage, ...] = (
    # in dataflow order: the driver waits for their reports in this order (each may take dock.timeout_s after the one before)
    Stage(name="rollout", kind="hybrid-part", consumers=("rollout",), claims=("prompt_ids", "released", "ground_truth"),
          writes=("response_ids", "truncated", "rollout_log_prob", "weight_version", "rollout_cut", "partial_ids", "partial_log_prob",
                  "partial_weight_version", "loss_mask", "turn_starts", "turn_ends", "turn_rewards", "tool_calls", "tool_errors",
                  "session_reward"),
          devices=True, weight_sync=True, programs=True, reports=(Report.ROLLOUT,), process="dockrl.stages.rollout_process:run_rollout"),
    Stage(name="hybrid", kind="process", when="trainer.hybrid", devices=True, trains=True, weight_sync=True, layout=True, programs=True,
          process="dockrl.stages.hybrid:run_hybrid"),  # its reports are those of its parts, rollout and actor
    Stage(name="reward-model", kind="process", when="reward_model.enable", consumers=("reward_model",),
          claims=("prompt_ids", "response_ids", "ground_truth"),
          writes=("rm_model_score",), devices=True, reports=(Report.REWARD_MODEL,),
          process="dockrl.stages.reward_model:run_reward_model", inprocess="dockrl.stages.reward_model:inprocess_parts"),
    Stage(name="reward", kind="process", consumers=("reward",),
          claims=("response_ids", "ground_truth", "rm_model_score", "turn_starts", "turn_ends", "turn_rewards", "session_reward"),
          writes=("rm_score", "correct"),
          programs=True,
          reports=(Report.REWARD,), process="dockrl.stages.reward:run_reward", inprocess="dockrl.stages.reward:inprocess_parts"),
    Stage(name="reference", kind="process", when="algorithm.uses_reference", consumers=("reference",),
          claims=("prompt_ids", "response_ids", "advantages"),
          writes=("ref_log_prob",), devices=True, reports=(Report.REFERENCE,), process="dockrl.stages.reference:run_reference",
          inprocess="dockrl.stages.reference:inprocess_parts"),
    Stage(name="teacher", kind="process", when="teacher.enable", consumers=("teacher",), claims=("prompt_ids", "response_ids"),
          writes=("teacher_log_prob",), devices=True, reports=(Report.TEACHER,), process="dockrl.stages.teacher:run_teacher",
          inprocess="dockrl.stages.teacher:inprocess_parts"),
    Stage(name="advantage", kind="in-process", inside="reward", consumers=("advantage",),
          claims=("rm_score", "response_ids", "correct", "rollout_log_prob", "ref_log_prob", "teacher_log_prob", "values", "loss_mask"),
          writes=("advantages", "returns"), sampling_writes=("released",)),
    Stage(name="critic", kind="process", when="critic.enable", consumers=("critic", "critic_update"),
          claims=("prompt_ids", "response_ids", "values", "returns", "loss_mask"), writes=("values",),
          devices=True, reports=(Report.CRITIC,), checkpoint_report=Report.CRITIC_CHECKPOINT,
          process="dockrl.stages.critic:run_critic", inprocess="dockrl.stages.critic:inprocess_parts"),
    Stage(name="actor", kind="hybrid-part", consumers=("actor",),
          claims=("prompt_ids", "response_ids", "advantages", "ref_log_prob", "truncated", "loss_mask", "rollout_log_prob", "weight_version"),
          writes=("old_log_prob",),
          devices=True, trains=True, weight_sync=True, reports=(Report.ACTOR,), checkpoint_report=Report.CHECKPOINT,
          process="dockrl.stages.actor:run_actor"),
)
"""Every stage a run may have, in dataflow order."""


def stage(name: str) -> Stage:
    """The row named ``name``.

    Raises:
        KeyError: no such stage (the message lists the table's names).
    """
    for row in STAGES:
        if row.name == name:
            return row
    raise KeyError(f"stage {name!r}: expected one of {[row.name for row in STAGES]}")


def process_rows(name: str) -> list[Stage]:
    """The rows stage process ``name`` runs: its own, with ``hybrid`` its parts (rollout and actor), and
    the in-process rows it holds (the reward's advantages).

    Raises:
        KeyError: no such stage (as ``stage``).
    """
    own = stage(name)
    return [own] + [row for row in STAGES if row.inside == name or (name == "hybrid" and row.kind == "hybrid-part")]


def enabled(cfg: Config, row: Stage) -> bool:
    """Whether the run of ``cfg`` has ``row``: its ``when`` field is true (every run when empty)."""
    value: Any = cfg
    for part in row.when.split(".") if row.when else ():
        value = getattr(value, part)
    return bool(value)


def run_stages(cfg: Config) -> list[Stage]:
    """The stages of the run of ``cfg``, in dataflow order (the hybrid row and its parts both)."""
    return [row for row in STAGES if enabled(cfg, row)]


def stage_processes(cfg: Config) -> list[str]:
    """The stage processes of a run (``dockrl worker --stage``), the one that evaluates first:
    ``hybrid`` (rollout and actor in one, ``trainer.hybrid``) or ``rollout`` … ``actor``; then
    the stages of kind ``process`` the config switches on, in table order."""
    return [row.name for row in run_stages(cfg) if row.kind == "process" or (row.kind == "hybrid-part" and not cfg.trainer.hybrid)]


def iteration_reports(cfg: Config) -> list[str]:
    """The reports of each iteration, in the order the driver waits for them and merges their metrics."""
    sync = [] if cfg.trainer.hybrid else [Report.WEIGHT_SYNC]  # the rollout's, after the actor's; the hybrid actor syncs inside its ACTOR report
    return [report for row in run_stages(cfg) for report in row.reports] + sync


def checkpoint_reports(cfg: Config) -> list[str]:
    """The reports that say a due checkpoint's trained state is written: the actor's first (every run has it), then the others'."""
    reports = [row.checkpoint_report for row in run_stages(cfg) if row.checkpoint_report]
    return sorted(reports, key=lambda report: report != Report.CHECKPOINT)


def load(path: str) -> Any:
    """The object a row names as ``module:attribute`` (a process body, an in-process builder), imported now."""
    return import_object(path)
