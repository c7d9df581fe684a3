"""The Kubeflow Trainer mode of the Kubernetes worker backend (``Platform.workload='trainjob'``): a hybrid tp2·dp4
run's ClusterTrainingRuntime and TrainJob against Trainer's CRDs, and the launcher's create, watch and delete against
the fake API (FakeKubernetesApi in conftest.py, whose fake Trainer makes the JobSet of a TrainJob from its runtime),
as the JobSet mode is tested in test_kubernetes_backend.py."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import pytest
import yaml
from test_kubernetes_backend import GROUPS, NS, OWNER, RUN, _running, _watch
from test_kubernetes_run import LAUNCHER_IP, npu_platform, small_config

from dockrl.launch.backend import WorkerFailed
from dockrl.launch.distributed import worker_groups
from dockrl.launch.jobset import jobset_name, render_jobset, secret_name
from dockrl.launch.kubernetes import KubernetesBackend, trainer_runtime_main
from dockrl.launch.platform import PLATFORMS, Platform
from dockrl.launch.trainjob import ANCESTOR_LABEL, ARGS_ENV, args_from_env, render_training_runtime, render_trainjob

TRAINJOB = dataclasses.replace(PLATFORMS["npu"], workload="trainjob")
TOKEN = "dock-token-of-this-run"


def hybrid_tp2_dp4(tiny_model_dir, tmp_path, platform: Platform):
    backend = KubernetesBackend(RUN, namespace=NS, platform=platform, core_api=None, custom_api=None, launcher_ip=LAUNCHER_IP)
    cfg = small_config(tiny_model_dir, backend.shared_dir / "r", "trainer.hybrid=true", "trainer.engine=megatron", "rollout.engine=vllm",
                       "parallel.tp=2", "parallel.dp=4", "trainer.global_batch=8", "trainer.mini_batch=8")
    return worker_groups(cfg, backend, backend.serve_ports(2), f"{LAUNCHER_IP}:29500", TOKEN, RUN)


@pytest.mark.parametrize("scheduler", ["default", "kueue", "volcano"])
def test_a_hybrid_runs_runtime_and_trainjob_are_valid_and_make_the_jobset_of_the_jobset_mode(
        scheduler, cluster, tiny_model_dir, tmp_path, validate_trainer, validate_jobset, validate_strict):
    platform = dataclasses.replace(npu_platform(tmp_path), workload="trainjob", scheduler=scheduler,
                                   queue="team-rl" if scheduler == "kueue" else "")
    groups = hybrid_tp2_dp4(tiny_model_dir, tmp_path, platform)
    runtime = render_training_runtime(groups, name="dockrl-hybrid", platform=platform)
    objects = render_trainjob(groups, run_id=RUN, namespace=NS, platform=platform, owner=OWNER.reference())
    secret, policy, trainjob = objects
    validate_trainer(runtime)
    validate_trainer(trainjob)
    validate_strict(secret)
    validate_strict(policy)
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", trainjob["metadata"]["name"])  # the CRD's CEL rule on the name
    assert trainjob["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                              "name": "dockrl-hybrid"}
    jobs = {r["name"]: r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"]}
    assert set(jobs) == {g.name for g in groups} and "hybrid" in jobs  # the dock shards and the reward beside the node job
    assert jobs["hybrid"]["template"]["metadata"]["labels"][ANCESTOR_LABEL] == "trainer"
    assert runtime["spec"]["mlPolicy"] == {"numNodes": 1}  # 8 ranks, tp2·dp4: one pod shaped like an 8-device node
    assert ("podGroupPolicy" in runtime["spec"]) == (scheduler == "volcano")
    assert ("kueue.x-k8s.io/queue-name" in trainjob["metadata"]["labels"]) == (scheduler == "kueue")
    text = json.dumps(runtime)  # nothing of one run in the runtime
    assert RUN not in text and LAUNCHER_IP not in text and jobset_name(RUN) not in text and TOKEN not in text

    # the Trainer's JobSet (the fake's) is the JobSet mode's: the same pods, the run's args and env patched in
    cluster.runtimes["dockrl-hybrid"] = runtime
    for obj in objects:
        cluster.create(obj["kind"], NS, copy.deepcopy(obj))
    made = cluster.jobset(NS)
    expected = {o["kind"]: o for o in render_jobset(groups, run_id=RUN, namespace=NS, platform=platform, owner=OWNER.reference())}
    validate_jobset(made)
    assert made["metadata"]["name"] == jobset_name(RUN) and made["metadata"]["labels"]["dockrl.io/run"] == RUN
    want = {r["name"]: r for r in expected["JobSet"]["spec"]["replicatedJobs"]}
    for rjob in made["spec"]["replicatedJobs"]:
        pod, mode = rjob["template"]["spec"]["template"], want[rjob["name"]]["template"]["spec"]["template"]
        [container], [jobset_container] = pod["spec"]["containers"], mode["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert container["args"] == ["from-env", ARGS_ENV]
        assert args_from_env([ARGS_ENV], {ARGS_ENV: env.pop(ARGS_ENV)["value"]}) == jobset_container["args"]
        assert env == {e["name"]: e for e in jobset_container["env"]}
        other = {k: v for k, v in container.items() if k not in ("args", "env")}
        assert other == {k: v for k, v in jobset_container.items() if k not in ("args", "env")}, rjob["name"]
        assert pod["spec"] | {"containers": None} == mode["spec"] | {"containers": None}, rjob["name"]
        assert pod["metadata"]["labels"] == mode["metadata"]["labels"]
        validate_strict({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x", **pod["metadata"]}, "spec": pod["spec"]})


def test_the_runtime_cli_prints_a_valid_runtime_for_a_configs_shape(tiny_model_dir, tmp_path, capsys, validate_trainer):
    platform_file = tmp_path / "platform.yaml"
    platform_file.write_text(yaml.safe_dump({"workload": "trainjob", "training_runtime": "rl-hybrid-tp2-dp4"}))
    assert trainer_runtime_main([
        "--platform", "npu", "--platform-config", str(platform_file), "--name", "rl-hybrid-tp2-dp4", f"model.path={tiny_model_dir}",
        "dock.mode=distributed", "dock.shards=2", "trainer.hybrid=true", "trainer.engine=megatron", "rollout.engine=vllm",
        "parallel.tp=2", "parallel.dp=4", "trainer.global_batch=8", "trainer.mini_batch=8", "trainer.micro_batch=2", "rollout.n=2",
    ]) == 0
    runtime = yaml.safe_load(capsys.readouterr().out)
    validate_trainer(runtime)
    assert runtime["metadata"]["name"] == "rl-hybrid-tp2-dp4"
    assert {r["name"] for r in runtime["spec"]["template"]["spec"]["replicatedJobs"]} == {"dock-shard", "hybrid", "reward"}


def test_a_bad_workload_or_runtime_name_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="workload"):
        dataclasses.replace(PLATFORMS["npu"], workload="trainjobs")
    with pytest.raises(ValueError, match="training_runtime='Dockrl_Hybrid'; expected the name of a ClusterTrainingRuntime"):
        dataclasses.replace(TRAINJOB, training_runtime="Dockrl_Hybrid")


def test_from_env_runs_the_json_list_of_arguments_and_refuses_anything_else():
    assert args_from_env(["DOCKRL_ARGS"], {"DOCKRL_ARGS": '["worker", "--stage", "reward"]'}) == ["worker", "--stage", "reward"]
    with pytest.raises(ValueError, match=r"\$DOCKRL_ARGS is not set"):
        args_from_env(["DOCKRL_ARGS"], {})
    with pytest.raises(ValueError, match="expected a JSON list of strings"):
        args_from_env(["DOCKRL_ARGS"], {"DOCKRL_ARGS": "worker --stage reward"})
    with pytest.raises(ValueError, match="expected the name of one variable"):
        args_from_env([], {})


# ---- the launcher's TrainJob mode against the fake API, as the JobSet mode ----

def trainjob_backend(cluster, plat: Platform = TRAINJOB, **kw) -> KubernetesBackend:
    kw.setdefault("poll_s", 0.05)
    return KubernetesBackend(RUN, namespace=NS, platform=plat, core_api=cluster.core(), custom_api=cluster.custom(), owner=OWNER, **kw)


def with_runtime(cluster, plat: Platform = TRAINJOB) -> None:
    cluster.runtimes[plat.training_runtime] = render_training_runtime(GROUPS, name=plat.training_runtime, platform=plat)


def test_start_creates_the_trainjob_the_trainer_makes_the_jobset_and_every_pod_is_waited_for(cluster):
    with_runtime(cluster)
    b = trainjob_backend(cluster)
    b.start(GROUPS)
    created = [c for c in cluster.calls if c[0].startswith("create")]
    assert created == [("create Secret", {"namespace": NS, "name": secret_name(RUN, OWNER.uid)}),
                       ("create NetworkPolicy", {"namespace": NS, "name": jobset_name(RUN)}),
                       ("create TrainJob", {"namespace": NS, "name": jobset_name(RUN)}),
                       ("create JobSet", {"namespace": NS, "name": jobset_name(RUN)})]  # the fake Trainer's
    jobset = cluster.jobset(NS)
    assert jobset["metadata"]["ownerReferences"][0]["kind"] == "TrainJob"
    with pytest.raises(TimeoutError, match=r"running/expected per group \{'dock-shard-0': '0/1', 'hybrid': '0/1'"):
        b.wait_ready(timeout_s=0.1)
    _running(cluster)
    b.wait_ready(timeout_s=5)
    for g in GROUPS:  # the addresses are the JobSet mode's: the Trainer names the JobSet after the TrainJob
        pod = cluster.objects[("Pod", NS, cluster.pod_name(NS, g.name, 0))]
        assert b.address(g.name, 0, 1).rsplit(":", 1)[0] == f"{pod['spec']['hostname']}.{pod['spec']['subdomain']}.{NS}.svc"
    assert {r for r in b.remains() if not r.startswith("Pod/")} == {
        f"JobSet/{jobset_name(RUN)}", f"NetworkPolicy/{jobset_name(RUN)}", f"TrainJob/{jobset_name(RUN)}"}


def test_a_failing_worker_of_a_trainjob_fails_the_run_as_in_the_jobset_mode(cluster):
    with_runtime(cluster)
    b = trainjob_backend(cluster)
    b.start(GROUPS)
    _running(cluster)
    b.wait_ready(timeout_s=5)
    pod = cluster.pod_name(NS, "reward", 1)
    cluster.logs[pod] = "Traceback (most recent call last):\nMemoryError: out of memory\n"
    cluster.set_pod(NS, pod, {"phase": "Failed", "containerStatuses": [{
        "name": "worker", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
        "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]})
    err, _ = _watch(b)
    assert err.member == pod and "OOMKilled" in err.reason


def test_a_trainjob_that_failed_or_is_gone_fails_the_run(cluster):
    with_runtime(cluster)
    b = trainjob_backend(cluster)
    b.start(GROUPS)
    _running(cluster)
    b.wait_ready(timeout_s=5)
    cluster.set_trainjob(NS, status={"conditions": [{"type": "Failed", "status": "True", "reason": "JobSetFailed",
                                                     "message": "trainer node failed"}]})
    err, _ = _watch(b)
    assert err.reason == "TrainJob failed (Failed=True (JobSetFailed: trainer node failed))"
    cluster.delete("TrainJob", NS, jobset_name(RUN))  # its JobSet and pods go with it
    err, _ = _watch(b)
    assert "the run's TrainJob is gone" in err.reason


def test_a_trainjob_of_no_runtime_waits_for_its_jobset_then_fails_naming_the_runtime(cluster):
    now = [0.0]
    b = trainjob_backend(cluster, dataclasses.replace(TRAINJOB, admission_timeout_s=60), clock=lambda: now[0])
    b.start(GROUPS)  # no runtime in the fake: its Trainer makes no JobSet
    b.check()  # waits
    now[0] = 61.0
    with pytest.raises(WorkerFailed, match="no JobSet made of it after 61 s .* ClusterTrainingRuntime 'dockrl-hybrid' exists"):
        b.check()


def test_teardown_deletes_the_trainjob_and_what_it_owns_and_is_idempotent(cluster):
    with_runtime(cluster)
    b = trainjob_backend(cluster)
    b.start(GROUPS)
    _running(cluster)
    assert b.teardown() == 2  # the NetworkPolicy and the TrainJob (its JobSet and pods with it)
    assert list(cluster.objects) == [("Secret", NS, secret_name(RUN, OWNER.uid))]  # it goes with the launcher pod
    assert b.teardown() == 0


def test_a_cluster_without_the_trainer_and_a_refused_trainjob_are_clear_errors(cluster):
    from kubernetes.client.exceptions import ApiException

    cluster.fail_create["TrainJob"] = 404
    with pytest.raises(RuntimeError, match=r"TrainJob is not a resource of this cluster: install Kubeflow Trainer v2"):
        trainjob_backend(cluster).start(GROUPS)
    cluster.objects.clear()
    del cluster.fail_create["TrainJob"]

    def refuse(kind, namespace, body, create=cluster.create):
        if kind == "TrainJob":
            raise ApiException(status=422, reason="Invalid")
        return create(kind, namespace, body)

    cluster.create = refuse
    with pytest.raises(RuntimeError, match=r"refused .*does the ClusterTrainingRuntime 'dockrl-hybrid' exist"):
        trainjob_backend(cluster).start(GROUPS)
