"""A local pipeline run shaped like the cluster: each task sees only the volumes it mounts (``dockrl.launch.task_mounts``).

The runbook's step 5 (the user's own model and data on the shared volume) runs in ``test_local_run.py``'s end-to-end
test, whose model and data are in the local run's shared folder; here: the mechanism (a task that reads the folder
without mounting it fails as in its pod) and the same run with ``s3://`` model and data on the test S3 server.
"""

# no `from __future__ import annotations`: kfp reads the component's parameter types at runtime

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dock.conftest import s3_server  # noqa: F401 - the fixture: moto's S3 server in a process of its own
from kfp import dsl, kubernetes, local

from dockrl.launch.task_mounts import can_isolate, isolate_volumes

pytestmark = pytest.mark.skipif(not can_isolate(), reason="mount namespaces need root")  # CI runs as root


def test_a_hidden_folder_is_an_empty_read_only_tmpfs_for_the_command_and_its_children(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "train.jsonl").write_text("{}\n")
    probe = "import os, sys; print(sorted(os.listdir(sys.argv[1]))); open(os.path.join(sys.argv[1], 'x'), 'w')"
    proc = subprocess.run([sys.executable, "-m", "dockrl.launch.task_mounts", "--hide", str(shared), "--",
                           "sh", "-c", f'{sys.executable} -c "{probe}" {shared}'], capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines() == ["[]"]  # a child of the command sees the namespace too
    assert "Read-only file system" in proc.stderr and proc.returncode != 0
    assert sorted(p.name for p in shared.iterdir()) == ["train.jsonl"]  # the machine's view is untouched


@dsl.component(base_image="python:3.11")
def count_lines(path: str) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


def test_a_task_that_does_not_mount_the_volume_does_not_see_it(tmp_path):
    """Two tasks read the same file on the shared volume; only the one that mounts it in its compiled spec sees it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    data = shared / "data.jsonl"
    data.write_text("{}\n{}\n")

    @dsl.pipeline(name="two-readers")
    def readers(path: str):
        mounted = count_lines(path=path).set_caching_options(False)
        kubernetes.mount_pvc(mounted, pvc_name="dockrl-shared", mount_path=str(shared))
        count_lines(path=path).set_caching_options(False).after(mounted)

    assert isolate_volumes(readers, {"dockrl-shared": shared}) == {"exec-count-lines": [], "exec-count-lines-2": [str(shared)]}
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"), raise_on_error=False)
    readers(path=str(data))
    tasks = {p.name: json.loads((p / "executor_output.json").read_text()) for p in (tmp_path / "root").glob("*/*")
             if (p / "executor_output.json").is_file()}
    assert tasks == {"count-lines": {"parameterValues": {"Output": 2}}}  # count-lines-2 failed: FileNotFoundError


def test_a_volume_mounted_elsewhere_than_its_local_folder_is_refused(tmp_path):
    @dsl.pipeline(name="elsewhere")
    def elsewhere(path: str):
        kubernetes.mount_pvc(count_lines(path=path), pvc_name="dockrl-shared", mount_path="/mnt/dockrl")

    with pytest.raises(ValueError, match="exec-count-lines mounts dockrl-shared at /mnt/dockrl; a local run has it at"):
        isolate_volumes(elsewhere, {"dockrl-shared": tmp_path})


def test_a_shared_folder_that_holds_the_pipeline_root_is_refused(tmp_path):
    from dockrl.pipelines.grpo import run_local

    with pytest.raises(ValueError, match="holds the pipeline root .*: the tasks that do not mount the shared volume could not"):
        run_local([], tmp_path / "root", shared_dir=tmp_path)


def test_the_grpo_pipeline_hides_the_volume_from_the_exit_task_alone(tmp_path):
    from dockrl.launch.platform import get_platform
    from dockrl.pipelines.grpo import build_pipeline, replace

    platform = replace(get_platform("cpu"), shared_mount_path=str(tmp_path))
    hidden = isolate_volumes(build_pipeline(platform, "local"), {"dockrl-shared": tmp_path})
    assert hidden == {f"exec-{t}": [] for t in ("resolve-config", "prepare-dataset", "train", "export-model", "evaluate")} | {
        "exec-teardown-workers": [str(tmp_path)]}


@pytest.mark.slow  # a moto server and a whole local pipeline run (2-5 min on 2 loaded cores)
def test_the_runbooks_step_5_with_s3_model_and_data(s3_server, tiny_model_dir, tmp_path):  # noqa: F811 - the fixture
    import pyarrow.fs as pafs

    from dockrl.run.data import generate_problems, write_jsonl

    store = pafs.S3FileSystem(endpoint_override=f"http://{s3_server.endpoint}", scheme="http", region="us-east-1",
                              access_key=s3_server.access_key, secret_key=s3_server.secret_key, allow_bucket_creation=True)
    store.create_dir("team-data")
    pafs.copy_files(str(tiny_model_dir), "team-data/models/tiny", source_filesystem=pafs.LocalFileSystem(), destination_filesystem=store)
    for name, rows in (("train", generate_problems(40, seed=1)), ("test", generate_problems(8, seed=2))):
        write_jsonl(rows, tmp_path / f"{name}.jsonl")
        pafs.copy_files(str(tmp_path / f"{name}.jsonl"), f"team-data/gsm/{name}.jsonl", source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=store)
    overrides = [f"dock.endpoint=http://{s3_server.endpoint}", "dock.region=us-east-1", *SHORT]
    env = {**os.environ, "TMPDIR": str(tmp_path), "AWS_ACCESS_KEY_ID": s3_server.access_key,
           "AWS_SECRET_ACCESS_KEY": s3_server.secret_key}
    run = run_pipeline(tmp_path, env, overrides, model="s3://team-data/models/tiny", train="s3://team-data/gsm/train.jsonl",
                       test="s3://team-data/gsm/test.jsonl")
    info = json.loads((run / "prepare-dataset" / "dataset" / "dataset.json").read_text())
    assert (info["train_rows"], info["test_rows"]) == (40, 8)
    [folder] = (tmp_path / "shared" / "runs").iterdir()
    assert not (folder / "model").exists()  # the fetched copy is gone after the run; the final checkpoint stays
    assert (folder / "checkpoints" / "final" / "config.json").is_file()


SHORT = ["trainer.iterations=2", "trainer.global_batch=4", "trainer.mini_batch=2", "trainer.micro_batch=4", "rollout.n=4",
         "rollout.max_response_length=12", "rollout.dtype=float32", "trainer.autocast_bf16=false", "trainer.eval_before=false",
         "data.eval_size=8"]


def run_pipeline(tmp_path: Path, env: dict, overrides: list[str], *, model: str, train: str, test: str) -> Path:
    """``dockrl pipeline run --local`` with the shared folder ``tmp_path/shared``; the run's folder."""
    proc = subprocess.run(
        [sys.executable, "-m", "dockrl", "pipeline", "run", "--local", "--pipeline-root", str(tmp_path / "root"),
         "--shared-dir", str(tmp_path / "shared"), "--export-dtype", "float32", f"model.path={model}", f"data.train_path={train}",
         f"data.test_path={test}", *overrides],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout[proc.stdout.rindex("\n{\n") + 1:])
    assert 0.0 <= out["eval/accuracy"] <= 1.0 and out["eval/count"] == 8.0
    return Path(out["run_dir"])
