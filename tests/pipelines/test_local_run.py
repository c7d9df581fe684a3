"""`dockrl pipeline run --local`: the whole pipeline through kfp.local on the tiny model."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_local_pipeline_run_end_to_end(tiny_model_dir, tmp_path, monkeypatch):
    """The runbook's step 5: the user's own model and data in a folder of the shared volume. As root (CI) each task
    sees that folder only where the compiled pipeline mounts the volume (``dockrl.launch.task_mounts``)."""
    from dockrl.run.data import generate_problems, write_jsonl

    shared = tmp_path / "shared"
    model = Path(shutil.copytree(tiny_model_dir, shared / "models" / "tiny"))
    train, test = write_jsonl(generate_problems(40, seed=1), shared / "data" / "train.jsonl"), write_jsonl(
        generate_problems(8, seed=2), shared / "data" / "test.jsonl")
    overrides = [
        f"model.path={model}", f"data.train_path={train}", f"data.test_path={test}", f"run.cache_dir={tmp_path / 'cache'}",
        "trainer.iterations=2", "trainer.global_batch=4", "trainer.mini_batch=2", "trainer.micro_batch=4", "rollout.n=4",
        "rollout.max_response_length=12", "rollout.dtype=float32", "trainer.autocast_bf16=false",
        "trainer.eval_before=false", "trainer.save_every=0", "data.eval_size=8", "run.keep_rollouts=all",
    ]
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # kfp.local leaves a temp folder per task
    proc = subprocess.run(
        [sys.executable, "-m", "dockrl", "pipeline", "run", "--local", "--pipeline-root", str(tmp_path / "root"),
         "--shared-dir", str(shared), "--export-dtype", "float32", *overrides],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout[proc.stdout.rindex("\n{\n") + 1:])  # the summary is the last thing printed
    run = Path(out["run_dir"])
    assert 0.0 <= out["eval/accuracy"] <= 1.0 and out["eval/count"] == 8.0
    [shared_run] = (shared / "runs").iterdir()  # the run's folder on the shared volume
    assert out["model"] == str(shared_run / "export") and out["run/seconds"] > 0

    dataset = run / "prepare-dataset" / "dataset"
    info = json.loads((dataset / "dataset.json").read_text())
    assert info["test_rows"] == 8 and info["train_rows"] > 0
    # the model artifacts name the models on the shared volume: no model-sized file in KFP's artifact store
    from dockrl.launch.artifacts import resolve_checkpoint
    from dockrl.pipelines.grpo import task_metadata

    for task, where in (("train", shared_run / "checkpoints" / "final"), ("export-model", shared_run / "export")):
        assert [p.name for p in (run / task / "model").iterdir()] == ["dockrl-checkpoint.json"], task
        assert resolve_checkpoint(run / task / "model") == where and (where / "model.safetensors").is_file(), task
        meta = task_metadata(run, task, "model")
        assert meta["path"] == str(where) and meta["pointer"] and meta["bytes"] == sum(f.stat().st_size for f in where.rglob("*") if f.is_file())
    artifacts = {str(p.relative_to(run)): p.stat().st_size for p in run.rglob("*") if p.is_file()}
    assert max(artifacts.values()) < (where / "model.safetensors").stat().st_size / 4, artifacts
    assert "keep_checkpoints: 2" in (shared_run / "config.yaml").read_text()  # the pipeline's default
    rows = [json.loads(x) for x in (run / "train" / "run_dir" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]

    train_metrics = json.loads((run / "train" / "executor_output.json").read_text())["artifacts"]["metrics"]["artifacts"][0]["metadata"]
    # the run's summary, not a number per metric and iteration: the curves are in the run_dir artifact and the curves page
    assert not [k for k in train_metrics if "/iter_" in k] and train_metrics["run/iterations"] == 2
    assert train_metrics["reward/mean/final"] == rows[-1]["reward/mean"] and train_metrics["run/seconds"] > 0
    assert train_metrics["reward/accuracy/best"] == max(r["reward/accuracy"] for r in rows)
    assert "eval/accuracy_after" not in train_metrics  # the evaluate step measures the exported model
    assert all(math.isfinite(v) for v in train_metrics.values())
    summary_page = (run / "train" / "summary").read_text()  # the Markdown visualization
    assert summary_page.startswith("# dockrl run") and "| iterations | 2 |" in summary_page and "| reward/mean |" in summary_page
    exported = json.loads((run / "export-model" / "executor_output.json").read_text())["artifacts"]["model"]["artifacts"][0]["metadata"]
    assert exported["dtype"] == "float32" and exported["parameters"] > 0
    assert (run / "teardown-workers" / "executor_output.json").is_file()  # the exit task ran
    # the run's overrides, checked once before the data step, are what every step read
    resolved = json.loads((run / "resolve-config" / "executor_output.json").read_text())["parameterValues"]
    assert resolved["overrides"] == ["trainer.keep_checkpoints=2", *overrides]  # the pipeline's own default first
    # and the size of the train pod that runs them: the cpu platform has no devices
    from dockrl.launch.platform import PLATFORMS

    cpu = PLATFORMS["cpu"].pod_requests(0)
    assert (resolved["devices"], resolved["cpu"], resolved["memory"]) == ("0", cpu["cpu"], cpu["memory"])
    curves = (run / "train" / "curves").read_text()  # the HTML of the run's curves, for the UI
    assert "data:image/png;base64," in curves and "<td>reward/mean</td>" in curves and out["curves"] == str(run / "train" / "curves")
    check_rollouts_artifact(run, out, rows=2 * 4 * 4)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    check_rescore_pipeline(run / "train" / "rollouts", tmp_path, rows=2 * 4 * 4)


@pytest.mark.parametrize("keep", ["all", "off"])
def test_the_summary_names_the_kept_rollouts_only_when_the_run_kept_them(tmp_path, keep):
    """``local_summary`` over a run folder as kfp.local leaves it: each task's ``executor_output.json`` (written here,
    with the metadata the tasks give their artifacts)."""
    from dockrl.pipelines.grpo import local_summary

    outputs = {"train": {"metrics": {"run/seconds": 3.0}, "rollouts": {"keep_rollouts": keep, "rows": 32 if keep == "all" else 0}},
               "export-model": {"model": {"path": str(tmp_path / "export")}}, "evaluate": {"metrics": {"eval/accuracy": 0.5}}}
    for task, artifacts in outputs.items():
        (tmp_path / task).mkdir()
        doc = {"artifacts": {name: {"artifacts": [{"metadata": meta}]} for name, meta in artifacts.items()}}
        (tmp_path / task / "executor_output.json").write_text(json.dumps(doc))
    out = local_summary(tmp_path)
    assert out["model"] == str(tmp_path / "export") and out["eval/accuracy"] == 0.5 and out["run/seconds"] == 3.0
    named = {k: out[k] for k in ("rollouts", "rollouts_page") if k in out}
    assert named == ({"rollouts": str(tmp_path / "train" / "rollouts"), "rollouts_page": str(tmp_path / "train" / "rollouts_page")}
                     if keep == "all" else {})


def test_a_shared_dir_whose_parent_does_not_exist_is_refused_before_anything_is_made(tmp_path):
    from dockrl.pipelines.grpo import run_local

    with pytest.raises(ValueError, match=f"^shared_dir {tmp_path}/typo/shared: the folder above it, {tmp_path}/typo, does not exist$"):
        run_local([], tmp_path / "root", shared_dir=tmp_path / "typo" / "shared")
    assert list(tmp_path.iterdir()) == []


def check_rollouts_artifact(run: Path, out: dict, rows: int) -> None:
    """The train task's ``rollouts`` Dataset: every trained row, readable without the run folder, its lineage in the metadata."""
    import pyarrow.dataset as ds

    from dockrl.dock.shard.kept_rollouts import SCHEMA_VERSION
    from dockrl.pipelines.grpo import task_metadata

    folder = run / "train" / "rollouts"
    assert out["rollouts"] == str(folder)
    meta = task_metadata(run, "train", "rollouts")
    assert meta["rows"] == rows and meta["iterations"] == 2 and (meta["first_iteration"], meta["last_iteration"]) == (0, 1)
    assert meta["schema_version"] == SCHEMA_VERSION and meta["keep_rollouts"] == "all" and len(meta["config_sha256"]) == 64
    assert meta["run_id"] and meta["bytes"] == sum(p.stat().st_size for p in folder.rglob("*.parquet"))
    table = ds.dataset(folder, format="parquet", partitioning="hive").to_table()
    assert table.num_rows == rows and table.column("advantages").null_count == 0
    assert (folder / "_config.yaml").is_file() and (folder / "_tokenizer" / "tokenizer.json").is_file()
    assert not (run / "train" / "run_dir" / "rollouts").exists()  # moved into the Dataset, not copied
    page = (run / "train" / "rollouts_page").read_text()  # the second Visualization: the kept rollouts' page
    assert 'id="rewards"' in page and 'data-iteration="1"' in page and out["rollouts_page"] == str(run / "train" / "rollouts_page")


def check_rescore_pipeline(rollouts: Path, tmp_path: Path, rows: int) -> None:
    """The rescore pipeline, run locally, consumes the train task's ``rollouts`` artifact through its importer
    (``PYTHONPATH`` holds tests/, where ``fake_scorers`` is, for the task's subprocess and the scorer's)."""
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    from dockrl.pipelines.grpo import task_metadata
    from dockrl.pipelines.rescore import run_rescore_local

    run = run_rescore_local(rollouts, "fake_scorers:FakeDigitScorer", tmp_path / "rescore-root")
    table = pq.read_table(run / "rescore-rollouts" / "rescored" / "rescored.parquet")
    stored = ds.dataset(rollouts, format="parquet", partitioning="hive").to_table().sort_by([("iteration", "ascending"), ("row", "ascending")])
    assert table.num_rows == rows and table.column("old").to_pylist() == stored.column("rm_score").to_pylist()
    assert table.column("new").null_count == 0 and not any(table.column("new_bad").to_pylist())
    meta = task_metadata(run, "rescore-rollouts", "rescored")
    assert meta["rows"] == rows and meta["scorer"] == "fake_scorers:FakeDigitScorer" and meta["source"] == str(rollouts.resolve())
    metrics = task_metadata(run, "rescore-rollouts", "metrics")
    assert metrics["rescore/rows"] == rows and set(metrics) >= {"rescore/old_mean/iter_0000", "rescore/new_mean/iter_0001"}


def test_failed_step_still_runs_the_exit_handler_and_fails_the_command(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    missing = tmp_path / "missing.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "dockrl", "pipeline", "run", "--local", "--pipeline-root", str(tmp_path / "root"),
         f"data.train_path={missing}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1
    assert "prepare-dataset" in proc.stderr + proc.stdout and str(missing) in proc.stderr + proc.stdout
    # the end names the failed task and its error, not kfp's "Inner task failed" alone; no colour codes in a file
    assert proc.stderr.strip().splitlines()[-1] == (
        f"dockrl pipeline run: task 'prepare-dataset' failed: dockrl.config.errors.ConfigError: data.train_path: data file {missing} does not exist")
    assert "\x1b[" not in proc.stdout + proc.stderr
    [run] = (tmp_path / "root").glob("dockrl-grpo-*")
    assert (run / "teardown-workers" / "executor_output.json").is_file()  # teardown ran after the failure
    assert not (run / "train").exists()
