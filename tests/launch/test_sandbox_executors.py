"""Sandbox executors on Kubernetes (``env.sandbox.backend=pod``; dockrl.launch.sandbox_pod) against the fake API:
each stage that runs programs gets an agent-sandbox Sandbox, valid against its CRD (v1beta1) and as a pod against
Kubernetes, holding no credential but its own secret, with a NetworkPolicy that lets in that stage only and lets
nothing out; the launcher creates them before the JobSet, waits for them Ready, and deletes them with the run."""

from __future__ import annotations

import json
import re

import pytest
from test_kubernetes_backend import RUNNING
from test_kubernetes_run import LAUNCHER_IP, NS, OWNER, RUN, env_of, npu_platform, small_config
from test_manifests import admits, built  # noqa: F401 (a fixture)

from dockrl.launch.backend import WorkerGroup
from dockrl.launch.distributed import program_stages, worker_groups
from dockrl.launch.jobset import JOBSET_NAME_LABEL, jobset_name, run_labels
from dockrl.launch.kubernetes import SHARD_PORT, KubernetesBackend
from dockrl.launch.kubernetes_objects import PLURALS
from dockrl.launch.sandbox_pod import render_sandboxes, sandbox_name
from dockrl.process.env import DRIVER_TOKEN_ENV, SANDBOX_SECRET_ENV, SANDBOX_URL_ENV, SANDBOX_WAIT_ENV, TOKEN_ENV

EXECUTOR_SECRET = "executor-secret-of-this-run-0123456789"


@pytest.fixture
def pod_run(cluster, tiny_model_dir, tmp_path):
    """(backend, groups) of a distributed run with ``env.sandbox.backend=pod`` on the npu platform and the fake API."""
    backend = KubernetesBackend(RUN, namespace=NS, platform=npu_platform(tmp_path), core_api=cluster.core(), custom_api=cluster.custom(),
                                owner=OWNER, launcher_ip=LAUNCHER_IP, poll_s=0.05)
    cfg = small_config(tiny_model_dir, backend.shared_dir / "runs" / RUN, "env.sandbox.backend=pod", "env.sandbox.pod_slots=2")
    assert program_stages(cfg) == ["rollout", "reward"]
    ports = backend.serve_ports(4)
    groups = worker_groups(cfg, backend, ports[:2], f"{LAUNCHER_IP}:29500", "dock-token", RUN, first_wait=1234.0,
                           executor_ports=ports[2:], sandbox_secret=EXECUTOR_SECRET)
    return backend, groups


def test_each_program_stage_gets_a_sandbox_valid_against_the_crd_and_kubernetes(pod_run, validate_sandbox, validate_strict, validate_jobset):
    backend, groups = pod_run
    objects = backend.render(groups)
    name = jobset_name(RUN)
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("Secret", objects[0]["metadata"]["name"]), ("NetworkPolicy", name),
        ("NetworkPolicy", f"{name}-sandbox-rollout"), ("Sandbox", f"{name}-sandbox-rollout"),
        ("NetworkPolicy", f"{name}-sandbox-reward"), ("Sandbox", f"{name}-sandbox-reward"), ("JobSet", name)]
    secret, jobset = objects[0], objects[-1]
    validate_jobset(jobset)
    assert [r["name"] for r in jobset["spec"]["replicatedJobs"]] == ["dock-shard", "rollout", "reward", "reference", "actor"]
    assert secret["stringData"][SANDBOX_SECRET_ENV] == EXECUTOR_SECRET
    for box in (o for o in objects if o["kind"] == "Sandbox"):
        validate_sandbox(box)
        pod = box["spec"]["podTemplate"]["spec"]
        validate_strict({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": box["metadata"]["name"], "namespace": NS}, "spec": pod})
        assert box["metadata"]["ownerReferences"] == [OWNER.reference()] and box["metadata"]["namespace"] == NS
        assert box["spec"]["service"] is True and box["spec"]["shutdownPolicy"] == "Delete"
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", box["spec"]["shutdownTime"])
        [c] = pod["containers"]
        assert c["args"] == ["sandbox", "serve", "--host", "0.0.0.0", "--port", str(SHARD_PORT), "env.sandbox.memory_mb=512",
                             "env.sandbox.disk_mb=64", "env.sandbox.file_mb=16", "env.sandbox.max_processes=16",
                             "env.sandbox.pod_slots=2", "--pod"]
        assert c["image"] == "ghcr.io/dockrl/dockrl-cpu:0.1.0"
        # the one credential: its own secret, one key of the run's Secret; no dock token, no object-store keys
        assert env_of(c) == {SANDBOX_SECRET_ENV: {"secretKeyRef": {"name": secret["metadata"]["name"], "key": SANDBOX_SECRET_ENV}}}
        text = json.dumps(box)
        assert not [v for v in ("dock-token", TOKEN_ENV, DRIVER_TOKEN_ENV, "DOCKRL_DOCK_", "AWS_", EXECUTOR_SECRET) if v in text]
        # 2 slots of 512 MiB, 64 MiB of files and a core each, and the server's own 512 MiB and 256 MiB
        sized = {"cpu": "2", "memory": "1536Mi", "ephemeral-storage": "384Mi"}
        assert c["resources"] == {"requests": sized, "limits": sized}
        assert pod["volumes"] == [{"name": "programs", "emptyDir": {"sizeLimit": "384Mi"}}]
        assert c["volumeMounts"] == [{"name": "programs", "mountPath": "/tmp"}]
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True,
                                        "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
        assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
        assert pod["securityContext"]["runAsUser"] == 10001 and pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["restartPolicy"] == "Never" and "serviceAccountName" not in pod and "hostNetwork" not in pod
        assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": SHARD_PORT}
    for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
        validate_strict(policy)


def test_the_stages_that_run_programs_reach_their_own_executor_and_no_other_stage_holds_its_secret(pod_run):
    backend, groups = pod_run
    by_name = {g.name: g for g in groups}
    assert set(by_name) == {"dock-shard", "rollout", "reward", "reference", "actor", "sandbox-rollout", "sandbox-reward"}
    for stage in ("rollout", "reward"):
        g = by_name[stage]
        assert g.env[SANDBOX_URL_ENV] == f"http://{sandbox_name(RUN, 'sandbox-' + stage)}.{NS}.svc:{SHARD_PORT}"
        assert g.env[SANDBOX_WAIT_ENV] == "1234" and g.secret_env[SANDBOX_SECRET_ENV] == EXECUTOR_SECRET
        assert backend.address(f"sandbox-{stage}", 0, SHARD_PORT) == g.env[SANDBOX_URL_ENV].removeprefix("http://")
    for other in ("dock-shard", "reference", "actor"):
        assert SANDBOX_SECRET_ENV not in by_name[other].secret_env and SANDBOX_URL_ENV not in by_name[other].env
    for executor in ("sandbox-rollout", "sandbox-reward"):
        assert by_name[executor].secret_env == {SANDBOX_SECRET_ENV: EXECUTOR_SECRET}  # the dock's tokens: not there
        assert not by_name[executor].object_store and not by_name[executor].env


def test_an_executor_takes_connections_from_its_own_stage_only_and_makes_none(pod_run):
    backend, groups = pod_run
    policies = [o for o in backend.render(groups) if o["kind"] == "NetworkPolicy"]
    boxes = {o["metadata"]["name"]: o for o in backend.render(groups) if o["kind"] == "Sandbox"}
    executor = boxes[sandbox_name(RUN, "sandbox-reward")]["spec"]["podTemplate"]["metadata"]["labels"]

    def stage_pod(stage: str) -> dict[str, str]:  # as the JobSet controller labels a member of the stage
        return {**run_labels(RUN, stage), JOBSET_NAME_LABEL: jobset_name(RUN)}

    assert admits(policies, executor, namespace=NS, port=SHARD_PORT, source=stage_pod("reward"), source_namespace=NS)
    assert not admits(policies, executor, namespace=NS, port=9999, source=stage_pod("reward"), source_namespace=NS)
    for other in ("rollout", "actor", "reference", "dock-shard"):
        assert not admits(policies, executor, namespace=NS, port=SHARD_PORT, source=stage_pod(other), source_namespace=NS)
    assert not admits(policies, executor, namespace=NS, port=SHARD_PORT, source={**stage_pod("reward"), JOBSET_NAME_LABEL: "dockrl-other"},
                      source_namespace=NS)  # another run's reward stage
    assert not admits(policies, executor, namespace=NS, port=SHARD_PORT, source=stage_pod("reward"), source_namespace="elsewhere")
    [own] = [p for p in policies if p["metadata"]["name"] == sandbox_name(RUN, "sandbox-reward")]
    assert own["spec"]["policyTypes"] == ["Ingress", "Egress"] and own["spec"]["egress"] == []  # no connection out at all


def test_the_crd_schema_catches_a_misspelt_sandbox_field(pod_run, validate_sandbox):
    backend, groups = pod_run
    box = next(o for o in backend.render(groups) if o["kind"] == "Sandbox")
    box["spec"]["services"] = True
    with pytest.raises(pytest.fail.Exception, match="Additional properties are not allowed .'services'"):
        validate_sandbox(box)
    box = next(o for o in backend.render(groups) if o["kind"] == "Sandbox")
    box["spec"]["shutdownPolicy"] = "Remove"
    with pytest.raises(pytest.fail.Exception, match="'Remove' is not one of"):
        validate_sandbox(box)


def test_an_executor_whose_secret_no_stage_holds_is_refused(pod_run):
    backend, groups = pod_run
    secret = backend.render(groups)[0]
    lonely = WorkerGroup(name="sandbox-critic", command=("sandbox", "serve"), port=1, secret_env={"OTHER_SECRET": "x"})
    with pytest.raises(ValueError, match=r"sandbox executor 'sandbox-critic': its secret \['OTHER_SECRET'\] is no key of the run's Secret"):
        render_sandboxes([lonely], run_id=RUN, namespace=NS, platform=backend.platform, secret=secret)


def test_the_launcher_creates_the_sandboxes_before_the_jobset_waits_for_them_ready_and_deletes_them(cluster, pod_run):
    backend, groups = pod_run
    cluster.pods_on_create = {g.name: (RUNNING, "") for g in groups if not g.name.startswith("sandbox-")}
    backend.start(groups)
    created = [what for what, _ in cluster.calls if what.startswith("create")]
    assert created == ["create Secret", "create NetworkPolicy", "create NetworkPolicy", "create Sandbox", "create NetworkPolicy",
                       "create Sandbox", "create JobSet"]
    names = [sandbox_name(RUN, f"sandbox-{stage}") for stage in ("rollout", "reward")]
    with pytest.raises(TimeoutError, match=rf"'sandbox-rollout': '0/1'.*; Sandboxes not Ready: .*'Sandbox/{names[0]}': 'no Ready condition yet'"):
        backend.wait_ready(0.2)
    cluster.sandbox_ready(NS, names[0])
    cluster.sandbox_ready(NS, names[1], ready=False)
    with pytest.raises(TimeoutError, match=rf"'Sandbox/{names[1]}': 'DependenciesNotReady: Pod is Running but not Ready'"):
        backend.wait_ready(0.2)
    cluster.sandbox_ready(NS, names[1])
    backend.wait_ready(5.0)
    assert sorted(n for n in backend.remains() if n.startswith("Sandbox/")) == sorted(f"Sandbox/{n}" for n in names)
    backend.teardown()
    assert not [key for key in cluster.objects if key[0] in ("Sandbox", "NetworkPolicy", "JobSet")]


def test_a_cluster_without_agent_sandbox_is_named_and_still_tears_down(cluster, pod_run):
    backend, groups = pod_run
    cluster.not_installed = {"Sandbox"}
    with pytest.raises(RuntimeError, match="Sandbox is not a resource of this cluster: install kubernetes-sigs/agent-sandbox"):
        backend.start(groups)
    assert backend.teardown() == 2  # the run's NetworkPolicy and the first executor's, created before the refusal
    assert backend.remains() == []


def test_the_launchers_role_lets_it_create_list_and_delete_what_it_renders_and_no_more(pod_run, built):  # noqa: F811
    backend, groups = pod_run
    for overlay, objects in built.items():
        [role] = [o for o in objects if o["kind"] == "Role"]
        verbs = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
        for obj in backend.render(groups):
            if obj["kind"] == "Secret":
                assert verbs[("", "secrets")] == {"create"}, overlay  # never read, changed or deleted
            else:
                assert {"create", "list", "delete"} <= verbs[(obj["apiVersion"].rpartition("/")[0], PLURALS[obj["kind"]])], obj["kind"]
        assert verbs[("agents.x-k8s.io", "sandboxes")] == {"create", "list", "delete"}, overlay
