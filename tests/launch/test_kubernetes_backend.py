"""The Kubernetes worker backend against a fake API (FakeCoreV1Api / FakeAppsV1Api in conftest.py);
every rendered object validated with kubernetes-validate --strict."""

from __future__ import annotations

import pytest

from dockrl.launch.backend import WorkerFailed, WorkerGroup, teardown_run
from dockrl.launch.kubernetes import KubernetesBackend, OwnerPod, object_name, render_group
from dockrl.launch.platform import PLATFORMS

RUN = "3f2b1c9e-7a44-4c1e-9d0b-5e6f7a8b9c0d"  # a KFP run id
NS = "team-rl"
OWNER = OwnerPod(name="dockrl-grpo-abcde-train-123", uid="8c7e6d5f-0000-4000-8000-123456789abc")
GROUPS = [
    WorkerGroup(name="actor", command=("dockrl", "worker", "actor"), replicas=2, accelerators=True, cpu="16", memory="256Gi", port=29500),
    WorkerGroup(name="reference", command=("dockrl", "worker", "reference"), accelerators=True, cpu="8", memory="128Gi"),
    WorkerGroup(name="reward", command=("dockrl", "worker", "reward"), replicas=4, cpu="2", memory="4Gi", env={"REWARD_TIMEOUT_S": "5"}),
    WorkerGroup(name="dock-shard", command=("dockrl", "dock", "serve"), replicas=2, cpu="4", memory="32Gi", port=8815),
]


def backend(cluster, platform="npu", **kw) -> KubernetesBackend:
    return KubernetesBackend(RUN, namespace=NS, platform=PLATFORMS[platform], core_api=cluster.core_api(),
                             apps_api=cluster.apps_api(), owner=OWNER, poll_s=0.01, **kw)


def by_kind(objects, kind):
    return {o["metadata"]["labels"]["dockrl.io/group"]: o for o in objects if o["kind"] == kind}


def test_every_rendered_object_is_valid_kubernetes(cluster, validate_strict):
    for platform in ("npu", "gpu", "cpu"):
        objects = backend(cluster, platform).render(GROUPS)
        assert [o["kind"] for o in objects] == ["Service", "StatefulSet"] * len(GROUPS)
        for obj in objects:
            validate_strict(obj)


def test_accelerator_groups_get_the_platform_resources_scheduling_and_credentials(cluster):
    objects = backend(cluster, "npu").render(GROUPS)
    sets = by_kind(objects, "StatefulSet")
    actor = sets["actor"]["spec"]["template"]["spec"]
    [container] = actor["containers"]
    assert container["image"] == PLATFORMS["npu"].image
    assert container["resources"]["limits"]["huawei.com/Ascend910"] == 8
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert actor["nodeSelector"] == {"accelerator": "huawei-Ascend910"}
    assert actor["tolerations"] == [{"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoSchedule"}]
    assert container["command"] == ["dockrl", "worker", "actor"]
    env = {e["name"]: e for e in container["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "dockrl-object-store", "key": "AWS_SECRET_ACCESS_KEY"}}
    assert env["DOCKRL_RUN_ID"]["value"] == RUN and env["DOCKRL_REPLICAS"]["value"] == "2"
    assert "pod-index" in env["DOCKRL_REPLICA"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert actor["securityContext"]["runAsNonRoot"] is True and actor["automountServiceAccountToken"] is False

    reward = sets["reward"]["spec"]["template"]["spec"]
    assert "nodeSelector" not in reward and "tolerations" not in reward
    assert set(reward["containers"][0]["resources"]["limits"]) == {"cpu", "memory"}
    assert reward["containers"][0]["image"] == PLATFORMS["cpu"].image  # no accelerator: the cpu image of the release
    assert container["resources"]["limits"]["memory"] == PLATFORMS["npu"].stage_memory  # the platform sizes stage pods
    assert {"name": "REWARD_TIMEOUT_S", "value": "5"} in reward["containers"][0]["env"]

    gpu = by_kind(backend(cluster, "gpu").render(GROUPS), "StatefulSet")["reference"]["spec"]["template"]["spec"]
    assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert gpu["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


def test_objects_are_labelled_owned_and_wired_to_their_headless_service(cluster):
    objects = backend(cluster).render(GROUPS)
    services, sets = by_kind(objects, "Service"), by_kind(objects, "StatefulSet")
    for group in ("actor", "reference", "reward", "dock-shard"):
        svc, sts = services[group], sets[group]
        for obj in (svc, sts):
            assert obj["metadata"]["namespace"] == NS
            assert obj["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Pod", "name": OWNER.name, "uid": OWNER.uid}]
            assert obj["metadata"]["labels"]["dockrl.io/run"] == RUN
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
        assert sts["spec"]["serviceName"] == svc["metadata"]["name"] == sts["metadata"]["name"]
        selector = sts["spec"]["selector"]["matchLabels"]
        assert selector == svc["spec"]["selector"]
        assert selector.items() <= sts["spec"]["template"]["metadata"]["labels"].items()
        assert len(sts["metadata"]["name"]) <= 52  # room for the controller-revision-hash label
    assert services["actor"]["spec"]["ports"] == [{"name": "rpc", "port": 29500, "targetPort": 29500, "protocol": "TCP"}]
    assert services["reward"]["spec"]["ports"] == []
    assert sets["actor"]["spec"]["replicas"] == 2 and sets["dock-shard"]["spec"]["replicas"] == 2


def test_render_rejects_bad_input(cluster):
    with pytest.raises(ValueError, match="must be a Kubernetes label value"):
        render_group(GROUPS[0], run_id="run/1", namespace=NS, platform=PLATFORMS["cpu"])
    with pytest.raises(ValueError, match="duplicate names"):
        backend(cluster).render([GROUPS[2], GROUPS[2]])
    with pytest.raises(ValueError, match="namespace is empty"):
        KubernetesBackend(RUN, namespace="", platform=PLATFORMS["cpu"], core_api=None, apps_api=None)


def test_start_creates_everything_and_waits_until_ready(cluster):
    b = backend(cluster)
    b.start(GROUPS)
    assert sorted(k[:2] for k in cluster.objects) == sorted([("Service", NS)] * 4 + [("StatefulSet", NS)] * 4)
    with pytest.raises(TimeoutError, match="not ready after 0 s"):
        b.wait_ready(timeout_s=0.05)
    running = {"phase": "Running", "containerStatuses": [
        {"name": "worker", "ready": True, "restartCount": 0, "image": "x", "imageID": "", "state": {"running": {}}}]}
    for g in GROUPS:
        name = object_name(RUN, g.name)
        for i in range(g.replicas):
            cluster.add_pod(NS, name, i, running)
        cluster.set_ready(NS, name, g.replicas)
    b.wait_ready(timeout_s=1)


def test_start_twice_and_missing_rights_are_clear_errors(cluster):
    backend(cluster).start(GROUPS[:1])
    with pytest.raises(RuntimeError, match="already exists: run .* was started before"):
        backend(cluster).start(GROUPS[:1])
    cluster.fail_create["Service"] = 403
    with pytest.raises(RuntimeError, match="not allowed to create Service .* dockrl-launcher Role"):
        backend(cluster).start(GROUPS[2:3])


def _started(cluster):
    b = backend(cluster)
    b.start(GROUPS)
    return b, object_name(RUN, "reward")


def test_crash_loop_fails_fast_with_the_previous_containers_log(cluster):
    b, reward = _started(cluster)
    log = "".join(f"line {i}\n" for i in range(100)) + "ValueError: reward model unreachable\n"
    cluster.add_pod(NS, reward, 1, {"phase": "Running", "containerStatuses": [{
        "name": "worker", "ready": False, "restartCount": 3, "image": "x", "imageID": "",
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}}}]}, previous_log=log)
    with pytest.raises(WorkerFailed) as err:
        b.wait_ready(timeout_s=30)
    e = err.value
    assert e.group == "reward" and e.member == f"{reward}-1"
    assert "CrashLoopBackOff" in e.reason and "last exit code 1" in e.reason
    assert e.log_tail.endswith("ValueError: reward model unreachable\n") and len(e.log_tail.splitlines()) == 50
    assert ("read log", {"name": f"{reward}-1", "container": "worker", "previous": True, "tail_lines": 50}) in cluster.calls


def test_image_pull_failure_fails_fast(cluster):
    b, reward = _started(cluster)
    cluster.add_pod(NS, reward, 0, {"phase": "Pending", "containerStatuses": [{
        "name": "worker", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
        "state": {"waiting": {"reason": "ImagePullBackOff", "message": "pull access denied"}}}]})
    with pytest.raises(WorkerFailed, match="ImagePullBackOff: pull access denied"):
        b.check()


def test_exited_worker_and_failed_pod_fail_with_their_log(cluster):
    b, reward = _started(cluster)
    cluster.add_pod(NS, reward, 0, {"phase": "Running", "containerStatuses": [{
        "name": "worker", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
        "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}, log="loading\n")
    with pytest.raises(WorkerFailed, match=r"exited with code 137 \(OOMKilled\)") as err:
        b.check()
    assert err.value.log_tail == "loading\n"
    cluster.objects.pop(("Pod", NS, f"{reward}-0"))
    cluster.add_pod(NS, reward, 0, {"phase": "Failed", "reason": "Evicted", "message": "node low on memory"})
    with pytest.raises(WorkerFailed, match="pod failed: Evicted node low on memory") as err:
        b.check()
    assert err.value.log_tail == ""


def test_restarted_worker_fails_even_when_running_again(cluster):
    b, reward = _started(cluster)
    cluster.add_pod(NS, reward, 0, {"phase": "Running", "containerStatuses": [{
        "name": "worker", "ready": True, "restartCount": 1, "image": "x", "imageID": "", "state": {"running": {}},
        "lastState": {"terminated": {"exitCode": 2, "reason": "Error"}}}]}, previous_log="segfault\n")
    with pytest.raises(WorkerFailed, match="restarted 1x; last exit code 2") as err:
        b.check()
    assert err.value.log_tail == "segfault\n"


def test_unschedulable_workers_are_named_at_the_timeout(cluster):
    b, reward = _started(cluster)
    cluster.add_pod(NS, reward, 0, {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]})
    with pytest.raises(TimeoutError, match=rf"not scheduled .*\['{reward}-0'\]"):
        b.wait_ready(timeout_s=0.05)


def test_teardown_deletes_only_this_runs_objects_and_is_idempotent(cluster):
    b = backend(cluster)
    b.start(GROUPS)
    other = KubernetesBackend("other-run", namespace=NS, platform=PLATFORMS["cpu"], core_api=cluster.core_api(),
                              apps_api=cluster.apps_api())
    other.start(GROUPS[2:3])
    cluster.add_pod(NS, object_name(RUN, "reward"), 0, {"phase": "Running"})
    assert b.teardown() == 8
    assert sorted(k[2] for k in cluster.objects) == [object_name("other-run", "reward")] * 2
    assert b.teardown() == 0


def test_teardown_run_finds_the_cluster_namespace_and_owner(cluster, monkeypatch):
    import kubernetes

    monkeypatch.setattr(kubernetes.config, "load_incluster_config", lambda: None)
    monkeypatch.setattr(kubernetes.client, "CoreV1Api", lambda: cluster.core_api())
    monkeypatch.setattr(kubernetes.client, "AppsV1Api", lambda: cluster.apps_api())
    monkeypatch.setenv("POD_NAMESPACE", NS)
    monkeypatch.setenv("POD_NAME", OWNER.name)
    monkeypatch.setenv("POD_UID", OWNER.uid)
    b = KubernetesBackend.from_cluster(RUN, platform="npu")
    assert (b.namespace, b.owner, b.platform.name) == (NS, OWNER, "npu")
    b.start(GROUPS[2:])
    assert teardown_run("kubernetes", RUN) == 4  # the exit handler: run id only
    assert cluster.objects == {}
