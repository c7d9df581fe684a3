"""The evaluate step with the ``kubernetes`` worker backend: a worker group of the run (its own
JobSet, one replicated job sized from the rollout's TP') whose pod gets every site hook of the
platform, driven by the step against the fake API (``FakeKubernetesApi``, named as a fake); the
pod's command runs as a process on this machine, as the kubelet would run it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dockrl.config import load_config
from dockrl.kubeflow.steps import EVALUATE_GROUP, evaluate_group, evaluate_on_cluster, evaluate_run_id, prepare_dataset
from dockrl.launch.backend import WorkerFailed
from dockrl.launch.jobset import KUEUE_QUEUE_LABEL, jobset_name, render_jobset
from dockrl.launch.kubernetes import KubernetesBackend
from dockrl.launch.platform import PLATFORMS, Platform

RUN = "3f2b1c9e-7a44-4c1e-9d0b-5e6f7a8b9c0d"  # a KFP run id
NS = "team-rl"
SITE = dataclasses.replace(
    PLATFORMS["npu"], host_paths={"/etc/hccn.conf": "/etc/hccn.conf", "/usr/local/Ascend/driver": "/usr/local/Ascend/driver"},
    env={"HCCL_BUFFSIZE": "200"}, extra_resources={"rdma/hca_shared_devices_a": "1"},
    pod_labels={"ring-controller.atlas": "ascend-910b"}, pod_annotations={"k8s.v1.cni.cncf.io/networks": "roce"},
    accelerator_device_gid=1001)
RUNNING = {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}], "containerStatuses": [
    {"name": "worker", "ready": True, "restartCount": 0, "image": "x", "imageID": "", "state": {"running": {}}}]}


def _terminated(code: int) -> dict:
    return {"phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [
        {"name": "worker", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
         "state": {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}}}]}


@pytest.mark.parametrize("scheduler", ["kueue", "volcano"])
def test_evaluate_renders_as_a_worker_group_of_the_run_with_every_site_hook(scheduler, validate_jobset, validate_strict):
    site = dataclasses.replace(SITE, scheduler=scheduler, queue="team-rl")
    cfg = load_config(None, [])
    shared = Path(site.shared_mount_path) / "runs" / RUN / EVALUATE_GROUP
    group = evaluate_group(shared / "model", shared / "dataset", shared / "metrics.json", ["rollout.n=4"], cfg)
    objects = render_jobset([group], run_id=evaluate_run_id(RUN), namespace=NS, platform=site)
    [jobset] = [o for o in objects if o["kind"] == "JobSet"]
    validate_jobset(jobset)
    validate_strict(objects[0])
    assert jobset["metadata"]["name"] == jobset_name(evaluate_run_id(RUN)) != jobset_name(RUN)  # beside the training's JobSet
    [rjob] = jobset["spec"]["replicatedJobs"]
    assert (rjob["name"], rjob["template"]["spec"]["completions"]) == (EVALUATE_GROUP, 1)
    pod = rjob["template"]["spec"]["template"]
    spec = pod["spec"]
    [c] = spec["containers"]
    assert c["image"] == site.image and c["args"][:4] == ["evaluate", "--out", str(shared / "metrics.json"), "--device"]
    assert c["args"][5:7] == [str(shared / "model"), str(shared / "dataset")]
    assert c["args"][-1] == "rollout.n=4"
    # sized from the rollout's TP' (parallel.infer_tp): its devices, and the extra resources of a pod holding devices
    assert c["resources"]["limits"] == {"huawei.com/Ascend910": cfg.parallel.infer_tp, "rdma/hca_shared_devices_a": "1"}
    assert {(m["mountPath"], m.get("readOnly", False)) for m in c["volumeMounts"]} >= {
        ("/etc/hccn.conf", True), ("/usr/local/Ascend/driver", True), (site.shared_mount_path, False)}
    assert {e["name"]: e.get("value") for e in c["env"]}["HCCL_BUFFSIZE"] == "200"
    assert pod["metadata"]["labels"]["ring-controller.atlas"] == "ascend-910b"
    assert pod["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "roce"
    assert spec["securityContext"]["supplementalGroups"] == [1001]
    assert spec["nodeSelector"] == site.node_selector
    if scheduler == "kueue":
        assert jobset["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "team-rl"
    else:
        assert spec["schedulerName"] == "volcano"
        [podgroup] = [o for o in objects if o["kind"] == "PodGroup"]
        assert podgroup["spec"] == {"minMember": 1, "queue": "team-rl"}


def test_dockrl_evaluate_refuses_a_folder_that_is_no_dataset_in_one_line(tmp_path, capsys):
    from dockrl.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["evaluate", "--out", str(tmp_path / "m.json"), str(tmp_path / "model"), str(tmp_path / "no-dataset")])
    assert exit_.value.code == 2
    assert f"data file {tmp_path / 'no-dataset'} does not exist" in capsys.readouterr().err and not (tmp_path / "m.json").exists()


def _backend(cluster, shared: Path) -> KubernetesBackend:
    platform = Platform.from_json(json.dumps(json.loads(PLATFORMS["cpu"].to_json()) | {"shared_mount_path": str(shared)}))
    return KubernetesBackend(evaluate_run_id(RUN), namespace=NS, platform=platform, core_api=cluster.core(),
                             custom_api=cluster.custom(), poll_s=0.05)


def test_a_failed_evaluate_pod_fails_the_step_with_its_log_and_leaves_nothing(cluster, tmp_path):
    dataset = tmp_path / "ds"
    dataset.mkdir()
    (dataset / "dataset.json").write_text("{}")
    model = tmp_path / "shared" / "runs" / RUN / "model"  # on the shared volume: evaluated where it lies
    model.mkdir(parents=True)
    cluster.pods_on_create[EVALUATE_GROUP] = (_terminated(1), "RuntimeError: no npu device is available to this process\n")
    with pytest.raises(WorkerFailed, match="exited with code 1") as err:
        evaluate_on_cluster(model, dataset, [], run_id=RUN, backend=_backend(cluster, tmp_path / "shared"), poll_s=0.05)
    assert "no npu device" in err.value.log_tail
    [created] = [o for o in cluster.created if o["kind"] == "JobSet"]
    [c] = created["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    assert c["args"][5] == str(model) and not (tmp_path / "shared" / "runs" / RUN / EVALUATE_GROUP / "model").exists()
    assert [kind for kind, _, _ in cluster.objects] == ["Secret"]  # torn down; the Secret goes with the launcher pod


def test_a_jobset_that_completes_without_the_metrics_fails_the_step(cluster, tmp_path):
    dataset, model = tmp_path / "ds", tmp_path / "shared" / "model"
    dataset.mkdir()
    model.mkdir(parents=True)
    cluster.pods_on_create[EVALUATE_GROUP] = (_terminated(0), "")

    def the_jobset_controller() -> None:  # marks the JobSet complete once its pod exited 0
        deadline = time.monotonic() + 30
        while not [o for o in cluster.created if o["kind"] == "JobSet"] and time.monotonic() < deadline:
            time.sleep(0.02)
        cluster.set_jobset(NS, status={"terminalState": "Completed"})

    controller = threading.Thread(target=the_jobset_controller, daemon=True)
    controller.start()
    with pytest.raises(RuntimeError, match=r"completed without writing .*metrics.json; its log: `kubectl logs -n team-rl -l "
                                           rf"dockrl.io/run={evaluate_run_id(RUN)}"):
        evaluate_on_cluster(model, dataset, [], run_id=RUN, backend=_backend(cluster, tmp_path / "shared"), poll_s=0.05)
    controller.join(timeout=30)
    assert [kind for kind, _, _ in cluster.objects] == ["Secret"]  # the Secret goes with the launcher pod


@pytest.mark.slow  # the tiny model's greedy evaluation in a process of its own: ~20-40 s on 2 cores
def test_the_evaluate_step_runs_its_pod_on_the_shared_volume_and_reports_its_metrics(cluster, tiny_model_dir, tmp_path):
    overrides = [f"run.cache_dir={tmp_path / 'cache'}", "data.generate_train=8", "data.generate_test=4", "data.eval_size=4",
                 "rollout.max_response_length=8", "rollout.engine=hf", "rollout.dtype=float32"]
    prepare_dataset(overrides, tmp_path / "ds")
    shared = tmp_path / "shared"
    shared.mkdir()
    cluster.pods_on_create[EVALUATE_GROUP] = (RUNNING, "")
    out: dict = {}

    def step() -> None:  # the evaluate task's launcher
        try:
            out["metrics"] = evaluate_on_cluster(tiny_model_dir, tmp_path / "ds", overrides, run_id=RUN,
                                                 backend=_backend(cluster, shared), poll_s=0.05)
        except BaseException as err:  # noqa: BLE001 - handed to the test's thread
            out["error"] = err

    launcher = threading.Thread(target=step, daemon=True)
    launcher.start()
    deadline = time.monotonic() + 60
    while not [o for o in cluster.created if o["kind"] == "JobSet"] and launcher.is_alive():
        assert time.monotonic() < deadline, "the step created no JobSet"
        time.sleep(0.05)
    [jobset] = [o for o in cluster.created if o["kind"] == "JobSet"]
    [c] = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    # the model was not on the shared volume: copied there, where the pod reads it
    assert c["args"][5] == str(shared / "runs" / RUN / EVALUATE_GROUP / "model")
    pod = subprocess.run([sys.executable, "-m", "dockrl", *c["args"]], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert pod.returncode == 0, pod.stderr[-3000:]
    launcher.join(timeout=60)
    assert "error" not in out, out.get("error")
    assert out["metrics"]["eval/count"] == 4.0 and 0 <= out["metrics"]["eval/accuracy"] <= 1
    # the step's JobSet and pod torn down once it has the metrics; its Secret goes with the launcher pod
    assert [kind for kind, _, _ in cluster.objects] == ["Secret"]
