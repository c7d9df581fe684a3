"""The rescore pipeline: a new reward over the rollouts a GRPO run kept, as a pipeline of its own.

    from dockrl.pipelines.rescore import compile_rescore, run_rescore_local
    compile_rescore("rescore.yaml")                        # IR for the Kubeflow UI / kfp.Client
    run_rescore_local(".../train/rollouts", "mypkg.rewards:Strict", "pipeline-root")   # kfp.local
    run_rescore_local(".../train/rollouts", "", "pipeline-root", judge=["reward_model.model.path=/shared/judge", ...])

Its input is a GRPO run's train task's ``rollouts`` Dataset (``components/train.py``), named by
its URI (``rollouts_uri``; the Kubeflow UI shows it in the artifact's page) and brought in by a
``dsl.importer`` with ``reimport=False``, so the run's lineage links it to the train task that
wrote it. One step, ``rescore-rollouts`` (``components/rescore_rollouts.py``), writes the rescored
Dataset and the per-iteration means as Metrics. ``scorer`` must import in the task's image; or ``judge`` names a
generative judge (``reward_model.*`` lines, its model on the shared volume or baked into the image), which writes a
verdict on each kept response on the task's CPU (``dockrl.engines.judge``).

Nothing is compiled at import: ``build_rescore_pipeline`` and ``compile_rescore`` do it when asked.
"""

# no `from __future__ import annotations`: kfp reads the pipeline's parameter types at runtime
from pathlib import Path
from typing import Sequence

from kfp import compiler, dsl, local

from dockrl.components.rescore_rollouts import rescore_rollouts

RESCORE_PIPELINE_NAME = "dockrl-rescore"


def build_rescore_pipeline():
    """The rescore pipeline (parameters ``rollouts_uri``, ``scorer``, ``judge``)."""

    @dsl.pipeline(name=RESCORE_PIPELINE_NAME, description="A new reward over a GRPO run's kept rollouts, old and new side by side")
    def rescore(rollouts_uri: str, scorer: str = "", judge: str = ""):
        """A new reward over a GRPO run's kept rollouts.

        Args:
            rollouts_uri: URI of a GRPO run's rollouts: its train task's rollouts artifact, as that artifact's page
                in the Kubeflow UI shows it (e.g. minio://mlpipeline/v2/artifacts/.../train/rollouts).
            scorer: The new reward, as module:Class importable in the task's image (a dockrl reward or one of
                your own installed there), e.g. mypkg.rewards:Strict; empty with a judge.
            judge: Instead of a scorer, a generative judge: its reward_model.* settings, one section.field=value per
                line (reward_model.model.path, reward_model.generative.template, .parser, .labels, ...).
        """
        imported = dsl.importer(artifact_uri=rollouts_uri, artifact_class=dsl.Dataset, reimport=False)
        task = rescore_rollouts(rollouts=imported.output, scorer=scorer, judge=judge)
        task.set_cpu_request("1").set_memory_request("4Gi")

    return rescore


def compile_rescore(out: str | Path) -> Path:
    """Compile the rescore pipeline's IR to ``out`` (``.yaml`` or ``.json``); returns the path.

    Raises:
        ValueError: another file suffix.
    """
    out = Path(out)
    if out.suffix not in (".yaml", ".yml", ".json"):
        raise ValueError(f"pipeline package {out}: expected a .yaml or .json file name")
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(build_rescore_pipeline(), str(out))
    return out


def run_rescore_local(rollouts_uri: str | Path, scorer: str, pipeline_root: str | Path, *, judge: Sequence[str] = ()) -> Path:
    """Run the rescore pipeline on this machine with ``kfp.local`` (tasks as subprocesses of this Python), with
    ``scorer`` or the judge ``judge`` names (``reward_model.*`` override lines).

    Returns:
        The run's folder under ``pipeline_root`` (``rescore-rollouts/rescored``, ``rescore-rollouts/metrics``,
        ``executor_output.json``).

    Raises:
        FileNotFoundError: ``rollouts_uri`` is no folder here.
        RuntimeError: the task failed (kfp.local names it and shows its log).
    """
    if not Path(rollouts_uri).is_dir():
        raise FileNotFoundError(f"rollouts_uri {rollouts_uri}: no such folder (a train task's rollouts artifact, e.g. <run>/train/rollouts)")
    root = Path(pipeline_root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    before = set(root.glob(f"{RESCORE_PIPELINE_NAME}-*"))
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
    build_rescore_pipeline()(rollouts_uri=str(Path(rollouts_uri).resolve()), scorer=scorer, judge="\n".join(judge))
    new = sorted(set(root.glob(f"{RESCORE_PIPELINE_NAME}-*")) - before)
    if len(new) != 1:
        raise RuntimeError(f"expected one new run folder under {root}, found {[p.name for p in new]}")
    return new[0]


__all__ = ["RESCORE_PIPELINE_NAME", "build_rescore_pipeline", "compile_rescore", "run_rescore_local"]
