"""Preemption is a pause, not a failure (dockrl/kubeflow/train_task.py, dockrl/launch/kubernetes_watch.py).

Kueue preempts a run by suspending its JobSet; the JobSet controller deletes its Jobs, so every
worker pod goes away. The launcher tells that from a failure, keeps the run, tears the suspended
JobSet down, resumes from the newest checkpoint in a new JobSet and waits for Kueue to admit it.

The cluster is the fake API of conftest.py with ``FakeKueueControllers``: what Kueue, the JobSet
controller and the kubelet would do, done at each API call: Kueue suspends a JobSet as it is
created and admits it (its Workload's ``QuotaReserved`` and ``Admitted`` set) unless held; the pods
of an admitted JobSet run as processes of this machine, with the pod spec's arguments and
environment; a suspended JobSet's pods are stopped and deleted. The pods' network is this
machine's loopback (``LoopbackKubernetesBackend``: every member on a port of its own).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from test_distributed import workers_path  # noqa: F401 - fixture: fake scorers importable, no process left behind
from test_distributed_resume import read_rows, same_rows
from test_kubernetes_backend import AT_ONCE_S, RUNNING
from test_kubernetes_run import NS, RUN, use_fake_cluster
from test_retry import RUN_SETTINGS, cpu_platform

from dockrl import driver
from dockrl.checkpoint.resume import checkpoint_dir
from dockrl.kubeflow import train_task
from dockrl.kubeflow.steps import prepare_dataset
from dockrl.launch.backend import WorkerFailed, WorkersSuspended
from dockrl.launch.kubernetes import KubernetesBackend
from dockrl.launch.local import HOST, free_ports

GRACE_S = 5.0
"""How long a preempted pod's process has after SIGTERM before SIGKILL (a pod's grace period, shortened)."""


class FakeKueueControllers:
    """Kueue, the JobSet controller and the kubelet acting at each call of the fake API it is mixed
    into (``FakeKubernetesApi`` of conftest.py; see the module docstring). ``pod_dir``: where the
    pods' processes write their logs (``<pod>.log``)."""

    pod_dir: Path
    objects: dict
    logs: dict

    def __init__(self) -> None:
        super().__init__()
        self.procs: dict[str, subprocess.Popen] = {}  # pod name -> its process
        self.started: set[str] = set()  # JobSet uids whose pods were created
        self.preempted: set[str] = set()  # JobSet uids Kueue preempted: never admitted again (the launcher replaces them)
        self.reads: Counter[str] = Counter()  # JobSet uid -> times the launcher read it suspended
        self.admit_after_reads = 0  # Kueue admits a JobSet once the launcher read it suspended that often
        self.workloads = True  # False: Kueue suspends JobSets but makes no Workload (its controller not taking them)
        self.admitted = 0

    # ---- the API server, with the controllers acting first ----

    def create(self, kind: str, namespace: str, body: dict) -> dict:
        obj = super().create(kind, namespace, body)
        if kind == "JobSet":  # Kueue's webhook suspends it; its job controller makes its Workload
            self.objects[(kind, namespace, obj["metadata"]["name"])]["spec"]["suspend"] = True
            obj["spec"]["suspend"] = True
            if self.workloads:
                self.set_workload(namespace, [{"type": "QuotaReserved", "reason": "Pending", "message": "waiting for quota"}])
        self.reconcile()
        return obj

    def get(self, kind: str, namespace: str, name: str) -> dict:
        self.reconcile()
        obj = super().get(kind, namespace, name)
        if kind == "JobSet" and obj["spec"].get("suspend"):
            self.reads[obj["metadata"]["uid"]] += 1
        return obj

    def listed(self, kind: str, namespace: str, selector: str | None, model: str | None = None):
        self.reconcile()
        return super().listed(kind, namespace, selector, model)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        super().delete(kind, namespace, name)
        for key in [k for k in self.objects if k[0] == "Workload"]:  # its Workload goes with the JobSet
            if kind == "JobSet" and self.objects[key]["metadata"]["name"] == f"jobset-{name}-1a2b3":
                del self.objects[key]
        self.reconcile()

    # ---- Kueue, the JobSet controller, the kubelet ----

    def reconcile(self) -> None:
        for (kind, ns, _), obj in list(self.objects.items()):
            if kind != "JobSet":
                continue
            uid = obj["metadata"]["uid"]
            if obj["spec"].get("suspend") and self.workloads and uid not in self.preempted and self.reads[uid] >= self.admit_after_reads:
                obj["spec"]["suspend"] = False  # Kueue admits it
                self.admitted += 1
                self.set_workload(ns, [{"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved"},
                                       {"type": "Admitted", "status": "True", "reason": "Admitted"}])
            if not obj["spec"].get("suspend") and uid not in self.started:
                self.started.add(uid)
                for rjob in obj["spec"]["replicatedJobs"]:
                    for index in range(rjob["template"]["spec"]["parallelism"]):
                        self.run_pod(ns, rjob, index)
        for name, proc in list(self.procs.items()):
            pod = self.objects.get(("Pod", NS, name))
            if pod is None:  # deleted with its JobSet: the kubelet stops its container
                self.stop(name)
            elif proc.poll() is not None and pod["status"].get("phase") == "Running":
                code = proc.returncode
                pod["status"] = {"phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [
                    {"name": "worker", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
                     "state": {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}}}]}
                self.logs[name] = (self.pod_dir / f"{name}.log").read_text()

    def run_pod(self, namespace: str, rjob: dict, index: int) -> None:
        """Member ``index`` of the replicated job as a process: the image's entry point ``dockrl`` with the pod's arguments."""
        name = self.add_pod(namespace, rjob["name"], index, copy.deepcopy(RUNNING))
        [container] = rjob["template"]["spec"]["template"]["spec"]["containers"]
        env = {**os.environ, **{e["name"]: self.env_value(e, namespace, name, index) for e in container["env"]}}
        with open(self.pod_dir / f"{name}.log", "w") as log:
            self.procs[name] = subprocess.Popen([sys.executable, "-m", "dockrl", *container["args"]], env=env, stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True)

    def env_value(self, var: dict, namespace: str, pod: str, index: int) -> str:
        if "value" in var:
            return var["value"]
        source = var["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            return self.objects[("Secret", namespace, ref["name"])]["stringData"][ref["key"]]
        return {"metadata.annotations['batch.kubernetes.io/job-completion-index']": str(index), "metadata.name": pod,
                "metadata.namespace": namespace, "status.podIP": HOST}[source["fieldRef"]["fieldPath"]]

    def stop(self, pod: str) -> None:
        proc = self.procs.pop(pod)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def preempt(self, namespace: str, queued_reads: int) -> None:
        """What Kueue does to make room for a workload of higher priority: it suspends the JobSet (the
        JobSet controller deletes its Jobs: every pod goes away) and marks the Workload evicted and
        requeued; from now on it admits a JobSet only once the launcher read it queued ``queued_reads`` times."""
        jobset = self.jobset(namespace)
        jobset["spec"]["suspend"] = True
        self.preempted.add(jobset["metadata"]["uid"])
        self.admit_after_reads = queued_reads
        self.set_workload(namespace, [
            {"type": "Evicted", "status": "True", "reason": "Preempted", "message": "Preempted to accommodate a workload (UID: 9f1e) "
                                                                                   "due to prioritization in the ClusterQueue"},
            {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": "Preempted"}])
        for key in [k for k in self.objects if k[0] == "Pod" and k[1] == namespace]:
            del self.objects[key]
        self.reconcile()

    def close(self) -> None:
        for pod in list(self.procs):
            self.stop(pod)


class LoopbackKubernetesBackend(KubernetesBackend):
    """The Kubernetes backend with this machine's loopback as the pods' network (the fake kubelet runs
    the pods as local processes): each member serves on a port of its own at 127.0.0.1."""

    bind_host = HOST

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.poll_s = 0.2

    def serve_ports(self, n: int) -> list[int]:
        return free_ports(n)

    def address(self, group: str, replica: int, port: int) -> str:
        return f"{HOST}:{port}"


@pytest.fixture
def kueue_cluster(cluster, tmp_path):
    """The fake API (its class: the ``cluster`` fixture's) with ``FakeKueueControllers`` acting in it."""
    fake = type("FakeKueueCluster", (FakeKueueControllers, type(cluster)), {})()
    fake.pod_dir = tmp_path / "pods"
    fake.pod_dir.mkdir()
    yield fake
    fake.close()


@pytest.mark.slow  # an uninterrupted distributed run and a preempted one of the tiny model, 3 iterations: ~2-4 min on 2 cores
def test_a_run_kueue_preempts_pauses_and_resumes_to_the_uninterrupted_result(
    kueue_cluster, tiny_model_dir, tmp_path, workers_path, monkeypatch, caplog,  # noqa: F811
):
    overrides = [f"model.path={tiny_model_dir}", f"run.cache_dir={tmp_path / 'cache'}", *RUN_SETTINGS,
                 "algorithm.scorer=fake_scorers:FakeHashScorer"]
    prepare_dataset(overrides, tmp_path / "ds")
    train_task.run_training(overrides, tmp_path / "ds", tmp_path / "straight" / "model", tmp_path / "straight" / "run",
                            log_metric=lambda k, v: None)  # the uninterrupted run: local processes

    use_fake_cluster(kueue_cluster, monkeypatch, pod_ip=HOST)
    monkeypatch.setattr(train_task, "KubernetesBackend", LoopbackKubernetesBackend)
    logged: dict[str, float] = {}

    def preempt_after_iteration_1(iteration: int, metrics: dict) -> None:
        if iteration == 1 and not kueue_cluster.preempted:  # iteration 1 done: a workload of higher priority comes
            kueue_cluster.preempt(NS, queued_reads=3)

    train = driver.train
    monkeypatch.setattr(driver, "train", lambda cfg, backend=None: train(cfg, backend=backend, on_iteration=preempt_after_iteration_1))
    with caplog.at_level(logging.INFO):
        summary = train_task.run_training(overrides, tmp_path / "ds", tmp_path / "model", tmp_path / "run", log_metric=logged.__setitem__,
                                          worker_backend="kubernetes", run_id=RUN, platform=cpu_platform(tmp_path / "shared"))
    shared_run = tmp_path / "shared" / "runs" / RUN
    paused = [r for r in caplog.records if r.getMessage().startswith(f"run {RUN} paused")]
    assert len(paused) == 1 and "suspended by Kueue after it was admitted (preempted: Evicted (Preempted: Preempted to " \
                                "accommodate a workload" in paused[0].getMessage()
    assert f"retry of run {RUN}: resuming at iteration 1 from {checkpoint_dir(shared_run, 1)}" in caplog.text
    waited = [r.getMessage() for r in caplog.records if "waiting for admission" in r.getMessage()
              and r.created > paused[0].created]
    assert waited and "Kueue Workload" in waited[0]  # the resumed JobSet waited for Kueue's admission, and said so
    assert kueue_cluster.admitted == 2 and summary["run/seconds"] > 0  # not failed: admitted again, finished
    rows = read_rows(shared_run)
    assert [x["iteration"] for x in rows] == [0, 1, 2]
    same_rows(rows, read_rows(tmp_path / "straight" / "run"))  # from the resume on as if never preempted (fp32, CPU)
    assert logged["run/iterations"] == 3 and logged["reward/mean/final"] == pytest.approx(rows[2]["reward/mean"])
    assert (tmp_path / "run" / "metrics.jsonl").is_file() and json.loads((shared_run / "summary.json").read_text())


def test_a_suspension_after_admission_is_a_preemption_and_a_deactivated_workload_a_stop(cluster):
    """The watch alone: suspended before admission is queued; suspended after it, preempted; deactivated by hand, failed."""
    from test_kubernetes_backend import GROUPS, _running, backend

    b = backend(cluster)
    b.start(GROUPS)
    cluster.set_jobset(NS, suspend=True)
    b.check()  # queued: no error
    cluster.set_jobset(NS, suspend=False)
    _running(cluster)
    b.wait_ready(5)
    cluster.set_jobset(NS, suspend=True)
    cluster.set_workload(NS, [{"type": "Evicted", "status": "True", "reason": "Preempted", "message": "to make room"}])
    for key in [k for k in cluster.objects if k[0] == "Pod"]:  # the pods go away with it: not what the run reports
        del cluster.objects[key]
    time.sleep(0.06)
    with pytest.raises(WorkersSuspended, match=r"preempted: Evicted \(Preempted: to make room\)"):
        b.check()
    assert isinstance(b.preempted, WorkersSuspended)
    b.teardown()
    assert isinstance(b.preempted, WorkersSuspended)  # kept for the launcher

    b.start(GROUPS)
    assert b.preempted is None
    _running(cluster)
    b.wait_ready(5)
    cluster.set_jobset(NS, suspend=True)
    cluster.set_workload(NS, [{"type": "Evicted", "status": "True", "reason": "InactiveWorkload", "message": "deactivated"}])
    time.sleep(0.06)
    with pytest.raises(WorkerFailed, match="its Kueue Workload was deactivated") as err:
        b.check()
    assert not isinstance(err.value, WorkersSuspended) and b.preempted is None
    b.teardown()


def test_teardown_finds_a_preemption_the_run_met_first_as_a_lost_shard(cluster):
    from test_kubernetes_backend import GROUPS, _running, backend

    b = backend(cluster)
    b.start(GROUPS)
    _running(cluster)
    b.wait_ready(5)
    cluster.set_jobset(NS, suspend=True)  # the driver's next RPC to a shard fails before any check looks
    b.teardown()
    assert isinstance(b.preempted, WorkersSuspended) and "no Evicted condition on its Workload" in b.preempted.reason
    assert [kind for kind, _, _ in cluster.objects] == ["Secret"]  # it goes with the launcher pod (garbage collection)


def test_the_launcher_of_a_jobset_that_stays_suspended_says_why_and_fails_within_the_admission_timeout(
    kueue_cluster, tiny_model_dir, tmp_path, monkeypatch, caplog,
):
    """Kueue's webhook suspends the JobSet, which names no LocalQueue (platform scheduler 'default'),
    and no Workload ever appears for it. The launcher logs what it waits for at once and fails after
    Platform.admission_timeout_s, naming Kueue's condition, instead of after a day."""
    kueue_cluster.workloads = False
    use_fake_cluster(kueue_cluster, monkeypatch, pod_ip=HOST)
    monkeypatch.setattr(train_task, "KubernetesBackend", LoopbackKubernetesBackend)
    overrides = [f"model.path={tiny_model_dir}", *RUN_SETTINGS]
    prepare_dataset(overrides, tmp_path / "ds")
    platform = dataclasses.replace(cpu_platform(tmp_path / "shared"), admission_timeout_s=2)
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO), pytest.raises(WorkerFailed) as err:
        train_task.run_training(overrides, tmp_path / "ds", tmp_path / "model", tmp_path / "run", log_metric=lambda k, v: None,
                                worker_backend="kubernetes", run_id=RUN, platform=platform)
    assert 2.0 < time.monotonic() - t0 < 2.0 + AT_ONCE_S
    assert not isinstance(err.value, WorkersSuspended)
    assert "and no Kueue Workload for it (more than Platform.admission_timeout_s=2): Kueue never set its QuotaReserved " \
           "condition, nor will by waiting; check that the JobSet names no LocalQueue" in err.value.reason
    [said] = [r.getMessage() for r in caplog.records if "waiting for admission" in r.getMessage()]
    assert "JobSet suspended; no Kueue Workload for it yet; failing after Platform.admission_timeout_s=2 s" in said
    # torn down but the Secret, which goes with the launcher pod (garbage collection); no pod ever ran
    assert [kind for kind, _, _ in kueue_cluster.objects] == ["Secret"] and not kueue_cluster.procs
