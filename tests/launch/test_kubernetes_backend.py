"""The Kubernetes worker backend against a fake API (FakeKubernetesApi in conftest.py): the rendered
JobSet validated against the JobSet v0.9.1 CRD schema and every core object with
kubernetes-validate --strict; starting, watching (one test per way a worker pod fails or cannot
start, each failing within seconds of the event with the pod and the reason named), teardown."""

from __future__ import annotations

import dataclasses
import json
import re
import time

import pytest
from test_manifests import admits

from dockrl.kubeflow.steps import teardown_run
from dockrl.launch.backend import WorkerFailed, WorkerGroup
from dockrl.launch.jobset import jobset_name, member_host, render_jobset, secret_name
from dockrl.launch.kubernetes import KubernetesBackend
from dockrl.launch.launcher_pod import OwnerPod
from dockrl.launch.platform import PLATFORMS, Platform
from dockrl.launch.pod_spec import pod_shape

RUN = "3f2b1c9e-7a44-4c1e-9d0b-5e6f7a8b9c0d"  # a KFP run id
NS = "team-rl"
OWNER = OwnerPod(name="dockrl-grpo-abcde-train-123", uid="8c7e6d5f-0000-4000-8000-123456789abc")
TOKEN = "dock-token-of-this-run"
AT_ONCE_S = 5.0
"""A failure seen at once: far below the backend's default timeouts (600 s to schedule), above the
checks of a loaded machine (1.07 s was seen under pytest-xdist)."""
GROUPS = [
    WorkerGroup(name="dock-shard-0", command=("dockrl", "dock-shard"), port=8815, secret_env={"DOCKRL_DOCK_TOKEN": TOKEN}),
    WorkerGroup(name="hybrid", command=("dockrl", "worker", "--stage", "hybrid"), replicas=4, devices=1,
                secret_env={"DOCKRL_DOCK_TOKEN": TOKEN}),
    WorkerGroup(name="reference", command=("dockrl", "worker", "--stage", "reference"), devices=2),
    WorkerGroup(name="reward", command=("dockrl", "worker", "--stage", "reward"), replicas=2, cpu="2", memory="6Gi",
                env={"REWARD_TIMEOUT_S": "5"}, secret_env={"DOCKRL_DOCK_TOKEN": TOKEN}),
]
RUNNING = {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}], "containerStatuses": [
    {"name": "worker", "ready": True, "restartCount": 0, "image": "x", "imageID": "", "state": {"running": {}}}]}
PULLING = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}], "containerStatuses": [
    {"name": "worker", "ready": False, "restartCount": 0, "image": "x", "imageID": "", "state": {"waiting": {"reason": "ContainerCreating"}}}]}


def platform(name: str = "npu", **changes) -> Platform:
    return dataclasses.replace(PLATFORMS[name], **changes)


def backend(cluster, plat: Platform | None = None, **kw) -> KubernetesBackend:
    kw.setdefault("poll_s", 0.05)
    kw.setdefault("owner", OWNER)
    return KubernetesBackend(RUN, namespace=NS, platform=plat or PLATFORMS["npu"], core_api=cluster.core(),
                             custom_api=cluster.custom(), **kw)


def objects(plat: Platform, groups=GROUPS) -> dict[str, dict]:
    return {o["kind"]: o for o in render_jobset(groups, run_id=RUN, namespace=NS, platform=plat, owner=OWNER.reference())}


def replicated(jobset: dict) -> dict[str, dict]:
    return {r["name"]: r for r in jobset["spec"]["replicatedJobs"]}


def pod_spec(jobset: dict, group: str) -> dict:
    return replicated(jobset)[group]["template"]["spec"]["template"]["spec"]


# ---- rendering ----

@pytest.mark.parametrize(("name", "scheduler"), [("npu", "default"), ("npu", "kueue"), ("npu", "volcano"), ("gpu", "default"),
                                                ("cpu", "volcano")])
def test_every_rendered_jobset_is_valid_against_the_crd_and_kubernetes(name, scheduler, validate_jobset, validate_strict):
    plat = platform(name, scheduler=scheduler, queue="team-rl" if scheduler == "kueue" else "")
    objs = objects(plat)
    assert list(objs) == (["Secret", "NetworkPolicy", "PodGroup", "JobSet"] if scheduler == "volcano" else
                          ["Secret", "NetworkPolicy", "JobSet"])
    validate_jobset(objs["JobSet"])
    validate_strict(objs["Secret"])
    validate_strict(objs["NetworkPolicy"])
    for rjob in objs["JobSet"]["spec"]["replicatedJobs"]:  # the Job and pod template, as the Job controller gets them
        validate_strict({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{jobset_name(RUN)}-{rjob['name']}-0"},
                         "spec": rjob["template"]["spec"]})


def test_the_crd_schema_catches_a_misspelt_field(validate_jobset):
    jobset = objects(PLATFORMS["npu"])["JobSet"]
    jobset["spec"]["failurePolicy"]["maxRestart"] = 0
    with pytest.raises(pytest.fail.Exception, match="failurePolicy: Additional properties are not allowed .'maxRestart'"):
        validate_jobset(jobset)
    jobset = objects(PLATFORMS["npu"])["JobSet"]
    jobset["spec"]["failurePolicy"]["rules"][0]["action"] = "Fail"
    with pytest.raises(pytest.fail.Exception, match="'Fail' is not one of"):
        validate_jobset(jobset)


def test_the_pull_secret_goes_on_every_worker_pod_and_only_when_set(validate_jobset, validate_strict):
    jobset = objects(platform("npu", image_pull_secret="regcred"))["JobSet"]
    validate_jobset(jobset)
    for group in replicated(jobset):
        assert pod_spec(jobset, group)["imagePullSecrets"] == [{"name": "regcred"}]
    assert all("imagePullSecrets" not in pod_spec(objects(PLATFORMS["npu"])["JobSet"], g) for g in replicated(jobset))


def test_one_jobset_per_run_with_a_replicated_job_per_group():
    plat = PLATFORMS["npu"]
    jobset = objects(plat)["JobSet"]
    name = jobset_name(RUN)
    assert jobset["metadata"]["name"] == name and jobset["metadata"]["namespace"] == NS
    assert jobset["metadata"]["ownerReferences"] == [OWNER.reference()]
    assert jobset["metadata"]["labels"]["dockrl.io/run"] == RUN
    spec = jobset["spec"]
    assert spec["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True, "subdomain": name}
    assert spec["failurePolicy"] == {"maxRestarts": 0, "rules": [{"name": "FailRunOnAnyWorkerFailure", "action": "FailJobSet"}]}
    assert spec["ttlSecondsAfterFinished"] == plat.worker_ttl_s
    # what the CRD's descriptions and its CEL rules ask beyond its schema (the JobSet webhook checks them)
    assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", spec["failurePolicy"]["rules"][0]["name"])
    assert "startupPolicy" not in spec and not any("dependsOn" in r for r in spec["replicatedJobs"])  # all start at once
    assert all(re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", r["name"]) for r in spec["replicatedJobs"])  # DNS-1035 labels
    rjobs = replicated(jobset)
    assert list(rjobs) == ["dock-shard-0", "hybrid", "reference", "reward"]
    for g in GROUPS:
        rjob = rjobs[g.name]
        job = rjob["template"]["spec"]
        pods = pod_shape(g, plat).pods  # the hybrid's 4 ranks share one pod of an 8-device node
        assert rjob["replicas"] == 1 and job["parallelism"] == job["completions"] == pods == (1 if g.name == "hybrid" else g.replicas)
        assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
        assert job["activeDeadlineSeconds"] == plat.worker_deadline_s == 7 * 24 * 3600
        assert job["template"]["spec"]["restartPolicy"] == "Never"
        assert job["template"]["metadata"]["labels"]["dockrl.io/group"] == g.name
        env = {e["name"]: e for e in job["template"]["spec"]["containers"][0]["env"]}
        assert env["DOCKRL_REPLICA"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        assert env["DOCKRL_REPLICAS"]["value"] == str(pods)
    # pod host names within a DNS label: <jobset>-<group>-<job>-<index>
    assert max(len(f"{name}-{g.name}-0-{g.replicas - 1}") for g in GROUPS) <= 63
    assert member_host(RUN, "hybrid", 3, NS) == f"{name}-hybrid-0-3.{name}.{NS}.svc"


def test_devices_and_requests_per_pod_follow_the_groups():
    npu = objects(PLATFORMS["npu"])["JobSet"]
    hybrid = pod_spec(npu, "hybrid")["containers"][0]
    assert hybrid["resources"] == {  # 4 ranks in one pod: 4 devices, and 4 times a device's cpu and memory
        "requests": {"cpu": "64", "memory": "384Gi", "ephemeral-storage": "20Gi", "huawei.com/Ascend910": 4},
        "limits": {"huawei.com/Ascend910": 4},  # the extended resource only: no cpu or memory limit
    }
    assert hybrid["image"] == PLATFORMS["npu"].image
    reference = pod_spec(npu, "reference")["containers"][0]["resources"]
    assert reference["requests"]["huawei.com/Ascend910"] == reference["limits"]["huawei.com/Ascend910"] == 2
    assert (reference["requests"]["cpu"], reference["requests"]["memory"]) == ("32", "192Gi")
    for group in ("hybrid", "reference"):
        assert pod_spec(npu, group)["nodeSelector"] == {"accelerator": "huawei-Ascend910"}
        assert pod_spec(npu, group)["tolerations"] == [{"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoSchedule"}]
    reward = pod_spec(npu, "reward")
    assert reward["containers"][0]["resources"] == {"requests": {"cpu": "2", "memory": "6Gi", "ephemeral-storage": "2Gi"}}
    assert reward["containers"][0]["image"] == PLATFORMS["cpu"].image  # reward and dock shards on CPU nodes
    assert "nodeSelector" not in reward and "tolerations" not in reward
    assert {"name": "REWARD_TIMEOUT_S", "value": "5"} in reward["containers"][0]["env"]
    shard = pod_spec(npu, "dock-shard-0")["containers"][0]
    assert shard["ports"] == [{"name": "rpc", "containerPort": 8815, "protocol": "TCP"}]
    assert set(shard["resources"]["requests"]) == {"cpu", "memory", "ephemeral-storage"}
    gpu = objects(PLATFORMS["gpu"])["JobSet"]
    assert pod_spec(gpu, "hybrid")["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 4}
    cpu = objects(PLATFORMS["cpu"])["JobSet"]
    assert "limits" not in pod_spec(cpu, "hybrid")["containers"][0]["resources"]


def test_pods_meet_pod_security_restricted_without_a_sidecar_and_npu_pods_open_the_devices():
    npu = objects(PLATFORMS["npu"])["JobSet"]
    for rjob in npu["spec"]["replicatedJobs"]:
        template = rjob["template"]["spec"]["template"]
        spec, [container] = template["spec"], template["spec"]["containers"]
        assert template["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
        assert template["metadata"]["labels"]["sidecar.istio.io/inject"] == "false"
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 10001
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                                "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
        assert spec["automountServiceAccountToken"] is False
        holds_devices = rjob["name"] in ("hybrid", "reference")
        assert spec["securityContext"].get("supplementalGroups") == ([1000] if holds_devices else None)  # HwHiAiUser
    gpu = objects(PLATFORMS["gpu"])["JobSet"]
    assert "supplementalGroups" not in pod_spec(gpu, "hybrid")["securityContext"]


def test_the_runs_worker_pods_take_connections_from_the_run_only():
    objs = objects(platform("npu"))
    [policy] = [objs["NetworkPolicy"]]
    assert policy["metadata"]["ownerReferences"] == [OWNER.reference()]
    # a worker pod as the JobSet controller labels it (the pod template's labels and the JobSet name)
    rjob = objs["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]["labels"]
    worker = {**rjob, "jobset.sigs.k8s.io/jobset-name": jobset_name(RUN)}
    other_run = {**rjob, "dockrl.io/run": "other", "jobset.sigs.k8s.io/jobset-name": jobset_name("other")}
    launcher = {"app.kubernetes.io/part-of": "dockrl", "pipeline/runid": RUN}  # KFP's API server labels the run's pods
    for source in (worker, launcher):
        assert admits([policy], worker, namespace=NS, source_namespace=NS, port=8815, source=source)
    for source in (other_run, rjob, {"app.kubernetes.io/part-of": "dockrl", "pipeline/runid": "another-run"}):
        assert not admits([policy], worker, namespace=NS, source_namespace=NS, port=8815, source=source), source
    assert not admits([policy], worker, namespace=NS, source_namespace="elsewhere", port=8815, source=worker)


def test_the_dock_token_is_in_the_runs_secret_never_a_plain_value():
    objs = objects(PLATFORMS["npu"])
    secret = objs["Secret"]
    assert secret["metadata"]["name"] == secret_name(RUN, OWNER.uid) and secret["stringData"] == {"DOCKRL_DOCK_TOKEN": TOKEN}
    assert TOKEN not in json.dumps(objs["JobSet"])
    for group in ("dock-shard-0", "hybrid", "reward"):
        env = {e["name"]: e for e in pod_spec(objs["JobSet"], group)["containers"][0]["env"]}
        assert env["DOCKRL_DOCK_TOKEN"] == {"name": "DOCKRL_DOCK_TOKEN",
                                            "valueFrom": {"secretKeyRef": {"name": secret_name(RUN, OWNER.uid), "key": "DOCKRL_DOCK_TOKEN"}}}
    assert "DOCKRL_DOCK_TOKEN" not in {e["name"] for e in pod_spec(objs["JobSet"], "reference")["containers"][0]["env"]}


def test_kueue_queues_the_whole_jobset_and_volcano_gangs_every_pod():
    kueue = objects(platform("npu", scheduler="kueue", queue="team-rl"))["JobSet"]
    assert kueue["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-rl"
    assert "schedulerName" not in pod_spec(kueue, "hybrid")
    volcano = objects(platform("npu", scheduler="volcano", queue="ascend"))
    assert volcano["PodGroup"]["spec"] == {"minMember": 1 + 1 + 1 + 2, "queue": "ascend"}  # every pod of the run, or none
    assert volcano["PodGroup"]["metadata"]["name"] == jobset_name(RUN)
    for rjob in volcano["JobSet"]["spec"]["replicatedJobs"]:
        template = rjob["template"]["spec"]["template"]
        assert template["spec"]["schedulerName"] == "volcano"
        assert template["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == jobset_name(RUN)
    assert "kueue.x-k8s.io/queue-name" not in volcano["JobSet"]["metadata"]["labels"]
    with pytest.raises(ValueError, match="scheduler='kueue' needs queue"):
        platform("npu", scheduler="kueue")


def test_render_rejects_bad_input(cluster):
    with pytest.raises(ValueError, match="must be a Kubernetes label value"):
        render_jobset(GROUPS, run_id="run/1", namespace=NS, platform=PLATFORMS["cpu"])
    with pytest.raises(ValueError, match="duplicate names"):
        render_jobset([GROUPS[3], GROUPS[3]], run_id=RUN, namespace=NS, platform=PLATFORMS["cpu"])
    with pytest.raises(ValueError, match="secret_env 'DOCKRL_DOCK_TOKEN' differs between groups"):
        render_jobset([GROUPS[0], dataclasses.replace(GROUPS[3], secret_env={"DOCKRL_DOCK_TOKEN": "other"})], run_id=RUN,
                      namespace=NS, platform=PLATFORMS["cpu"])
    with pytest.raises(ValueError, match="namespace is empty"):
        KubernetesBackend(RUN, namespace="", platform=PLATFORMS["cpu"], core_api=None, custom_api=None)
    with pytest.raises(ValueError, match="devices=-1"):
        WorkerGroup(name="actor", command=("x",), devices=-1)


# ---- starting ----

def _running(cluster, groups=GROUPS) -> None:
    for g in groups:
        for i in range(g.replicas):
            cluster.add_pod(NS, g.name, i, json.loads(json.dumps(RUNNING)))


def test_start_creates_the_secret_then_one_jobset_owning_it_and_waits_for_every_pod(cluster):
    b = backend(cluster)
    b.start(GROUPS)
    created = [c for c in cluster.calls if c[0].startswith("create")]
    assert created == [("create Secret", {"namespace": NS, "name": secret_name(RUN, OWNER.uid)}),
                       ("create NetworkPolicy", {"namespace": NS, "name": jobset_name(RUN)}),  # before any pod exists
                       ("create JobSet", {"namespace": NS, "name": jobset_name(RUN)})]  # every stage at once
    assert not [c for c in cluster.calls if "Secret" in c[0] and not c[0].startswith("create")]  # the Role: create only
    with pytest.raises(TimeoutError, match=r"not running after 0 s: running/expected per group \{'dock-shard-0': '0/1', 'hybrid': '0/1'"):
        b.wait_ready(timeout_s=0.1)
    _running(cluster)
    b.wait_ready(timeout_s=5)
    for g in GROUPS:  # the address the backend gives is the pod's DNS name (hostname.subdomain)
        pod = cluster.objects[("Pod", NS, cluster.pod_name(NS, g.name, 0))]
        host = b.address(g.name, 0, 1).rsplit(":", 1)[0]
        assert host == f"{pod['spec']['hostname']}.{pod['spec']['subdomain']}.{NS}.svc"


def test_volcano_podgroup_is_created_first_and_handed_to_the_jobset(cluster):
    b = backend(cluster, platform("npu", scheduler="volcano"))
    b.start(GROUPS)
    assert [c[0] for c in cluster.calls if c[0].startswith("create")] == ["create Secret", "create NetworkPolicy", "create PodGroup",
                                                                                  "create JobSet"]
    uid = cluster.jobset(NS)["metadata"]["uid"]
    assert cluster.objects[("PodGroup", NS, jobset_name(RUN))]["metadata"]["ownerReferences"][0]["uid"] == uid
    assert b.teardown() == 3
    assert list(cluster.objects) == [("Secret", NS, secret_name(RUN, OWNER.uid))]  # it goes with the launcher pod


def test_start_twice_missing_rights_and_a_cluster_without_jobset_are_clear_errors(cluster):
    backend(cluster).start(GROUPS[:1])
    with pytest.raises(RuntimeError, match="already exists: run .* was started before"):
        backend(cluster).start(GROUPS[:1])
    # a retried launcher is a pod of its own: it tears the JobSet down and creates a Secret of its own
    b = backend(cluster, owner=OwnerPod(name="dockrl-grpo-abcde-train-456", uid="9d8f7e6a-0000-4000-8000-123456789abc"))
    b.teardown()
    b.start(GROUPS[:1])
    assert [k for k in cluster.objects if k[0] == "Secret"] == [("Secret", NS, secret_name(RUN, OWNER.uid)),
                                                                ("Secret", NS, secret_name(RUN, "9d8f7e6a"))]
    with pytest.raises(RuntimeError, match="start takes every group at once"):
        b.start(GROUPS[1:])
    b.teardown()
    cluster.objects.clear()  # the launcher pods gone, their Secrets with them
    cluster.fail_create["JobSet"] = 403
    with pytest.raises(RuntimeError, match="not allowed to create JobSet .* Role dockrl-launcher adds these rights to KFP's pipeline-runner"):
        backend(cluster).start(GROUPS)
    cluster.objects.clear()
    cluster.fail_create["JobSet"] = 404
    with pytest.raises(RuntimeError, match=r"JobSet is not a resource of this cluster: install the JobSet controller"):
        backend(cluster).start(GROUPS)


# ---- watching: one test per way a worker fails or cannot start ----

def _watch(b: KubernetesBackend, limit_s: float = 10.0) -> tuple[WorkerFailed, float]:
    """Call ``check`` as the driver does (every few hundred ms) until it raises; the error and the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            b.check()
        except WorkerFailed as err:
            return err, time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"no failure detected within {limit_s} s")


def _started(cluster, plat: Platform | None = None, running: bool = True) -> KubernetesBackend:
    b = backend(cluster, plat)
    b.start(GROUPS)
    if running:
        _running(cluster)
        b.wait_ready(timeout_s=5)
    return b


def test_unschedulable_pod_fails_after_the_scheduling_timeout_with_the_schedulers_message(cluster, caplog):
    b = _started(cluster, platform("npu", schedule_timeout_s=1), running=False)
    pod = cluster.add_pod(NS, "hybrid", 2, {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/12 nodes are available: 12 Insufficient huawei.com/Ascend910."}]})
    err, seconds = _watch(b)
    assert (err.group, err.member) == ("hybrid", pod)
    assert "Unschedulable for 1 s (more than Platform.schedule_timeout_s=1): 0/12 nodes are available: 12 Insufficient" in err.reason
    assert 1.0 <= seconds < 5.0  # the timeout, plus checks slowed by a loaded machine (2.5 was once too tight)
    assert f"worker pod {pod} unschedulable" in caplog.text  # said at once, failed at the timeout


def test_unschedulable_pod_the_autoscaler_cannot_fit_fails_at_once(cluster):
    b = _started(cluster, running=False)  # schedule_timeout_s 600: only the autoscaler's word fails it early
    pod = cluster.add_pod(NS, "reference", 0, {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes are available"}]})
    cluster.add_event(pod, "NotTriggerScaleUp", "pod didn't trigger scale-up: 2 Insufficient huawei.com/Ascend910")
    err, seconds = _watch(b)
    assert err.member == pod and "cluster autoscaler adds no node for it: pod didn't trigger scale-up" in err.reason
    assert seconds < AT_ONCE_S


def test_time_queued_by_kueue_does_not_count_as_scheduling_and_has_its_own_timeout(cluster):
    b = _started(cluster, platform("npu", scheduler="kueue", queue="team-rl", schedule_timeout_s=1, queue_timeout_s=2), running=False)
    cluster.set_jobset(NS, suspend=True)  # Kueue holds it until the quota admits the whole run
    err, seconds = _watch(b)
    assert err.member == jobset_name(RUN) and "not admitted by kueue (queue 'team-rl') within Platform.queue_timeout_s=2 s" in err.reason
    assert 2.0 <= seconds < 6.0  # as above


def test_image_pull_failures_within_the_budget_pass_and_beyond_it_fail(cluster):
    b = _started(cluster, running=False)  # image_pull_retries 3
    pod = cluster.add_pod(NS, "reward", 1, {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}],
                                            "containerStatuses": [{"name": "worker", "ready": False, "restartCount": 0, "image": "x",
                                                                   "imageID": "",
                                                                   "state": {"waiting": {"reason": "ErrImagePull", "message": "i/o timeout"}}}]})
    message = 'Failed to pull image "ghcr.io/dockrl/dockrl-cpu:0.1.0": unexpected EOF'
    cluster.add_event(pod, "Failed", message, count=2)  # a registry hiccup: the kubelet retries
    for _ in range(5):
        b.check()
        time.sleep(0.06)
    cluster.events[pod][0]["count"] = 4  # a fourth failure: over the budget
    err, seconds = _watch(b)
    assert err.member == pod and err.reason == f"ErrImagePull: image pull failed 4 times (more than Platform.image_pull_retries=3): {message}"
    assert seconds < AT_ONCE_S
    cluster.objects.clear()
    b = _started(cluster, running=False)
    pod = cluster.add_pod(NS, "reward", 0, {"phase": "Pending", "containerStatuses": [{
        "name": "worker", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
        "state": {"waiting": {"reason": "InvalidImageName", "message": 'couldn\'t parse image name "dockrl:"'}}}]})
    err, _ = _watch(b)
    assert err.member == pod and err.reason.startswith("InvalidImageName: couldn't parse")


def test_a_pull_that_outlasts_its_own_timeout_fails_naming_the_waiting_state(cluster):
    b = _started(cluster, platform("npu", image_pull_timeout_s=1), running=False)
    pod = cluster.add_pod(NS, "hybrid", 0, json.loads(json.dumps(PULLING)))
    err, seconds = _watch(b)
    assert err.member == pod
    assert "scheduled but not started after 1 s (more than Platform.image_pull_timeout_s=1): ['ContainerCreating']" in err.reason
    assert 1.0 <= seconds < 5.0  # the timeout, plus checks slowed by a loaded machine (2.5 was once too tight)


def test_oom_killed_worker_fails_with_its_log(cluster):
    b = _started(cluster)
    pod = cluster.pod_name(NS, "hybrid", 3)
    cluster.logs[pod] = "".join(f"step {i}\n" for i in range(80)) + "allocating KV cache\n"
    cluster.set_pod(NS, pod, {"phase": "Failed", "containerStatuses": [{
        "name": "worker", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
        "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]})
    err, seconds = _watch(b)
    assert (err.group, err.member) == ("hybrid", pod) and "exited with code 137 (OOMKilled)" in err.reason
    assert err.log_tail.endswith("allocating KV cache\n") and len(err.log_tail.splitlines()) == 50
    assert seconds < AT_ONCE_S


def test_evicted_worker_fails_with_the_kubelets_message(cluster):
    b = _started(cluster)
    pod = cluster.pod_name(NS, "reward", 0)
    cluster.set_pod(NS, pod, {"phase": "Failed", "reason": "Evicted",
                              "message": "The node was low on resource: ephemeral-storage. Container worker was using 25Gi."})
    err, seconds = _watch(b)
    assert err.member == pod and err.reason == ("pod failed: Evicted The node was low on resource: ephemeral-storage. "
                                                "Container worker was using 25Gi.")
    assert seconds < AT_ONCE_S


def test_a_replaced_worker_fails_naming_the_pod_it_replaced(cluster):
    b = _started(cluster)
    old = cluster.pod_name(NS, "dock-shard-0", 0)
    new = cluster.replace_pod(NS, "dock-shard-0", 0, json.loads(json.dumps(RUNNING)))  # drained: recreated elsewhere, running
    err, seconds = _watch(b)
    assert err.member == old and f"replaced by pod {new}" in err.reason and "lost its state" in err.reason
    assert seconds < AT_ONCE_S


def test_a_worker_being_deleted_fails_with_its_disruption(cluster):
    b = _started(cluster)
    pod = cluster.pod_name(NS, "reference", 0)
    status = json.loads(json.dumps(RUNNING))
    status["conditions"].append({"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler",
                                 "message": "Preempted in order to admit critical pod"})
    cluster.set_pod(NS, pod, status, deletionTimestamp="2026-12-01T17:00:00Z")
    err, seconds = _watch(b)
    assert err.member == pod and err.reason.startswith("pod is being deleted (PreemptionByScheduler: Preempted in order to admit")
    assert seconds < AT_ONCE_S
    cluster.objects.pop(("Pod", NS, pod))  # gone without a replacement
    err, _ = _watch(b)
    assert err.member == pod and err.reason.startswith("pod vanished")


def test_a_failed_or_deleted_jobset_fails_the_run(cluster):
    b = _started(cluster)
    cluster.set_jobset(NS, status={"terminalState": "Failed", "conditions": [
        {"type": "Failed", "status": "True", "reason": "FailedJobs", "message": "jobset failed due to reaching max restarts",
         "lastTransitionTime": "2026-12-01T17:00:00Z"}]})
    cluster.objects.pop(("Pod", NS, cluster.pod_name(NS, "reward", 1)))  # gone with the JobSet: not the cause
    err, _ = _watch(b)
    assert err.member == jobset_name(RUN) and err.reason == "JobSet failed (FailedJobs: jobset failed due to reaching max restarts)"
    cluster.objects.pop(("JobSet", NS, jobset_name(RUN)))
    err, _ = _watch(b)
    assert "the run's JobSet is gone" in err.reason


def test_finished_stages_are_not_failures(cluster):
    b = _started(cluster)
    cluster.set_pod(NS, cluster.pod_name(NS, "reward", 0), {"phase": "Succeeded", "containerStatuses": [{
        "name": "worker", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
        "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]})
    for _ in range(5):
        b.check()
        time.sleep(0.06)


# ---- teardown ----

def test_teardown_deletes_only_this_runs_objects_and_is_idempotent(cluster):
    b = _started(cluster)
    other = KubernetesBackend("other-run", namespace=NS, platform=PLATFORMS["cpu"], core_api=cluster.core(), custom_api=cluster.custom())
    cluster_objects_before = set(cluster.objects)
    assert b.teardown() == 2  # the NetworkPolicy and the JobSet (its pods with it); the Secret goes with the launcher pod
    assert list(cluster.objects) == [("Secret", NS, secret_name(RUN, OWNER.uid))]
    assert len(cluster_objects_before) == 3 + sum(g.replicas for g in GROUPS)
    other_groups = [GROUPS[3]]
    other.start(other_groups)
    assert b.teardown() == 0 and len(cluster.objects) == 4  # the other run's JobSet, NetworkPolicy and Secret stay


def test_teardown_waits_for_the_pods_within_its_bound(cluster, caplog):
    b = _started(cluster)
    b.teardown_wait_s = 0.3
    cluster.objects[("Pod", NS, "straggler")] = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "straggler", "namespace": NS, "labels": {"dockrl.io/run": RUN}}, "spec": {"containers": []}, "status": {}}
    t0 = time.monotonic()
    b.teardown()
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert "1 pod(s) still terminating after 0 s: ['straggler']" in caplog.text


def test_teardown_run_finds_the_cluster_namespace_and_owner(cluster, monkeypatch):
    import kubernetes

    monkeypatch.setattr(kubernetes.config, "load_incluster_config", lambda: None)
    monkeypatch.setattr(kubernetes.client, "CoreV1Api", lambda: cluster.core())
    monkeypatch.setattr(kubernetes.client, "CustomObjectsApi", lambda: cluster.custom())
    monkeypatch.setenv("POD_NAMESPACE", NS)
    monkeypatch.setenv("POD_NAME", OWNER.name)
    monkeypatch.setenv("POD_UID", OWNER.uid)
    b = KubernetesBackend.from_cluster(RUN, platform="npu")
    assert (b.namespace, b.owner, b.platform.name) == (NS, OWNER, "npu")
    b.start(GROUPS)
    assert teardown_run("kubernetes", RUN) == 2  # the exit handler: run id only
    assert list(cluster.objects) == [("Secret", NS, secret_name(RUN, OWNER.uid))]  # it goes with the launcher pod


def test_teardown_without_credentials_is_one_clear_error(tmp_path, monkeypatch, capsys):
    """Outside a cluster with no kubeconfig, `dockrl teardown --backend kubernetes` says which
    credentials it looked for (exit code 2), not a client library's traceback."""
    from dockrl.cli import main

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing-kubeconfig"))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["teardown", "--backend", "kubernetes", "some-run"]) == 2
    err = capsys.readouterr().err
    assert "no Kubernetes credentials" in err and "KUBECONFIG" in err and "Traceback" not in err
