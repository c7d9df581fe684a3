"""Dock shards beside the stages (``dock.placement=beside``, docs/dock.md "Shards beside the stages").

On Kubernetes every stage pod (a node-shaped pod of the hybrid actor, or a one-device stage's pod) runs a dock shard
as a native sidecar, and every stage process claims from the shard of its own pod first. The tests render the JobSet
of a hybrid tp2·dp4 run over two 4-device nodes and of a non-hybrid GRPO run, validate it against the JobSet v0.9.1
CRD, and derive from the rendered specs alone, for every stage process (every pod index, every local rank of
``dockrl node``), which shard is local: the shard named by its ``--local-shard`` (with ``+pod``, the pod's completion
index added) in its ``--dock`` list, whose address must be its own pod's DNS name and port, served by that pod's
sidecar. On this machine the launcher starts one shard process per stage group and hands each group its shard.
"""

from __future__ import annotations

import dataclasses

import pytest

from dockrl.config import ConfigError, load_config
from dockrl.launch.distributed import SHARDS_GROUP, dock_shards, shard_nodes, worker_groups
from dockrl.launch.kubernetes import SHARD_PORT, KubernetesBackend
from dockrl.launch.local import LocalBackend
from dockrl.launch.platform import PLATFORMS
from dockrl.launch.pod_spec import COMPLETION_INDEX
from dockrl.launch.trainjob import render_trainjob
from dockrl.stages.main import local_shard

RUN = "8a1e5b7c-3d2f-4e6a-9b0c-1d2e3f4a5b6c"
NS = "team-rl"
HYBRID = ("trainer.hybrid=true", "trainer.engine=megatron", "rollout.engine=vllm", "parallel.tp=2", "parallel.dp=4",
          "trainer.global_batch=8", "trainer.mini_batch=8")


def config(tiny_model_dir, tmp_path, *extra: str):
    return load_config(None, [f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'run'}", "dock.mode=distributed",
                              "dock.placement=beside", "algorithm.kl_loss_coef=0.05", *extra])


def rendered_jobset(cfg, platform) -> dict:
    backend = KubernetesBackend(RUN, namespace=NS, platform=platform, core_api=None, custom_api=None, launcher_ip="10.0.0.7")
    groups = worker_groups(cfg, backend, backend.serve_ports(dock_shards(cfg, backend)), "10.0.0.7:29500", "t", RUN)
    [jobset] = [o for o in backend.render(groups) if o["kind"] == "JobSet"]
    return jobset


def arg(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def processes_and_their_shards(jobset: dict, monkeypatch) -> list[dict]:
    """Every stage process of the JobSet, from the rendered specs alone: its group, pod index and local rank, the
    shard its ``--local-shard`` names, and where that shard is (the pod whose DNS name its location carries)."""
    name = jobset["metadata"]["name"]
    found = []
    for rjob in jobset["spec"]["replicatedJobs"]:
        job = rjob["template"]["spec"]
        [worker] = job["template"]["spec"]["containers"]
        env = {e["name"]: e for e in worker["env"]}
        # the pod's index reaches the worker as DOCKRL_REPLICA, from the Indexed Job's completion index
        assert env["DOCKRL_REPLICA"]["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{COMPLETION_INDEX}']"
        args = worker["args"]
        nproc = int(arg(args, "--nproc-per-node")) if args[0] == "node" else 1
        locations = arg(args, "--dock").split(",")
        spec = arg(args, "--local-shard")
        for pod in range(job["completions"]):
            monkeypatch.setenv("DOCKRL_REPLICA", str(pod))  # what the pod's worker reads
            shard = local_shard(spec, len(locations))
            host, port = locations[shard].split("://", 1)[1].rsplit(":", 1)
            pod_name, subdomain, namespace, _svc = host.split(".")
            assert (subdomain, namespace) == (name, NS)
            # <jobset>-<group>-<job 0>-<pod index>: the JobSet's DNS name of one pod
            group, job_index, index = pod_name.removeprefix(f"{name}-").rsplit("-", 2)
            found += [{"group": rjob["name"], "pod": pod, "local_rank": rank, "shard": shard, "shard_group": group,
                       "shard_pod": int(index), "shard_port": int(port), "job": job_index} for rank in range(nproc)]
    return found


def sidecar_of(jobset: dict, group: str) -> dict:
    [rjob] = [r for r in jobset["spec"]["replicatedJobs"] if r["name"] == group]
    [shard] = rjob["template"]["spec"]["template"]["spec"]["initContainers"]
    return shard


CASES = {
    # name: (overrides, platform changes, {group: pods}, stage processes)
    "hybrid tp2·dp4 on two 4-device nodes": (HYBRID, {"devices_per_node": 4}, {"hybrid": 2, "reward": 1, "reference": 1}, 8 + 1 + 1),
    "grpo, one process per stage": ((), {}, {"rollout": 1, "reward": 1, "reference": 1, "actor": 1}, 4),
    "grpo with a teacher (on-policy distillation)": (("teacher.enable=true", "teacher.model.path={model}"), {},
                                                      {"rollout": 1, "reward": 1, "reference": 1, "teacher": 1, "actor": 1}, 5),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_stage_process_claims_first_from_the_shard_in_its_own_pod(name, tiny_model_dir, tmp_path, validate_jobset,
                                                                        validate_strict, monkeypatch):
    overrides, changes, pods, processes = CASES[name]
    cfg = config(tiny_model_dir, tmp_path, *(o.format(model=tiny_model_dir) for o in overrides))
    jobset = rendered_jobset(cfg, dataclasses.replace(PLATFORMS["npu"], **changes))
    validate_jobset(jobset)
    rjobs = {r["name"]: r["template"]["spec"] for r in jobset["spec"]["replicatedJobs"]}
    for group, job in rjobs.items():  # native sidecars: Kubernetes 1.29 and later (restartPolicy of a container)
        validate_strict({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": group}, "spec": job}, ("1.29.0", "1.37.0"))
    assert {g: j["completions"] for g, j in rjobs.items()} == pods  # no pods of shards of their own
    assert SHARDS_GROUP not in rjobs

    found = processes_and_their_shards(jobset, monkeypatch)
    assert len(found) == processes
    for p in found:  # the local shard is served in the process's own pod
        assert (p["shard_group"], p["shard_pod"], p["job"]) == (p["group"], p["pod"], "0"), p
        shard = sidecar_of(jobset, p["group"])
        assert shard["restartPolicy"] == "Always" and shard["args"][0] == "dock-shard"  # a native sidecar: up first, down last
        assert {"name": "dock", "containerPort": p["shard_port"], "protocol": "TCP"} in shard["ports"]
        assert shard["startupProbe"]["tcpSocket"]["port"] == p["shard_port"] == SHARD_PORT
        assert arg(shard["args"], "--port") == str(SHARD_PORT)
    # one shard per stage pod, each the local shard of that pod's processes and no other's
    shards = sorted({(p["shard"], p["group"], p["pod"]) for p in found})
    assert [s for s, _, _ in shards] == list(range(sum(pods.values())))
    assert [(g, pod) for _, g, pod in shards] == shard_nodes(cfg, KubernetesBackend(
        RUN, namespace=NS, platform=dataclasses.replace(PLATFORMS["npu"], **changes), core_api=None, custom_api=None))
    if "hybrid" in pods:  # the 8 ranks: 4 per pod, a TP pair never split, each pod's 4 on its own shard
        assert sorted((p["pod"], p["local_rank"], p["shard"]) for p in found if p["group"] == "hybrid") == [
            (pod, rank, pod) for pod in range(2) for rank in range(4)]


def test_the_sidecar_holds_the_shards_secrets_and_the_stage_container_only_its_own(tiny_model_dir, tmp_path, validate_jobset):
    cfg = config(tiny_model_dir, tmp_path)
    backend = KubernetesBackend(RUN, namespace=NS, platform=PLATFORMS["gpu"], core_api=None, custom_api=None, launcher_ip="10.0.0.7")
    groups = worker_groups(cfg, backend, backend.serve_ports(dock_shards(cfg, backend)), "10.0.0.7:29500", "driver-token", RUN)
    objects = backend.render(groups)
    [secret] = [o for o in objects if o["kind"] == "Secret"]
    [jobset] = [o for o in objects if o["kind"] == "JobSet"]
    validate_jobset(jobset)
    assert secret["stringData"]["DOCKRL_DOCK_DRIVER_TOKEN"] == "driver-token"  # the sidecars' keys reach the run's Secret
    shard = sidecar_of(jobset, "reward")
    [worker] = [r for r in jobset["spec"]["replicatedJobs"] if r["name"] == "reward"][0]["template"]["spec"]["template"]["spec"]["containers"]
    secret_keys = {c: {e["valueFrom"]["secretKeyRef"]["key"] for e in x["env"] if "secretKeyRef" in e.get("valueFrom", {})}
                   for c, x in (("shard", shard), ("worker", worker))}
    assert "DOCKRL_DOCK_DRIVER_TOKEN" in secret_keys["shard"] and "DOCKRL_DOCK_TOKEN_ACTOR" in secret_keys["shard"]
    assert secret_keys["worker"] == {"DOCKRL_DOCK_TOKEN_REWARD"}
    assert shard["image"] == worker["image"] and shard["resources"]["requests"]["cpu"] == "1"
    with pytest.raises(ValueError, match="sidecars are rendered for Platform.workload='jobset' only"):
        render_trainjob(groups, run_id=RUN, namespace=NS, platform=PLATFORMS["gpu"])


def test_on_this_machine_each_stage_group_gets_a_shard_process_of_its_own(tiny_model_dir, tmp_path):
    cfg = config(tiny_model_dir, tmp_path, "trainer.hybrid=true", "trainer.engine=megatron", "rollout.engine=vllm", "parallel.dp=2")
    local = LocalBackend("dockrl-test", state_dir=tmp_path / "state")
    assert shard_nodes(cfg, local) == [("hybrid", 0), ("reward", 0), ("reference", 0)] and dock_shards(cfg, local) == 3
    groups = worker_groups(cfg, local, [5001, 5002, 5003], "127.0.0.1:29500", "secret")
    assert [(g.name, g.replicas) for g in groups] == [(SHARDS_GROUP, 3), ("hybrid", 2), ("reward", 1), ("reference", 1)]
    assert arg(list(groups[0].command), "--port") == "5001,5002,5003"  # shard s takes ports[s]
    for s, g in enumerate(groups[1:]):
        assert arg(list(g.command), "--local-shard") == str(s) and "--local-shard-of-replica" not in g.command
        assert arg(list(g.command), "--dock") == ",".join(f"grpc://127.0.0.1:{p}" for p in (5001, 5002, 5003))


def test_a_local_shard_spec_names_a_shard_of_the_list_or_is_refused(monkeypatch):
    monkeypatch.setenv("DOCKRL_REPLICA", "2")
    assert local_shard("1", 4) == 1 and local_shard("1+pod", 4) == 3
    for spec, message in (("1+pod", "shard 4 \\(pod 3\\), but --dock names 4"), ("x", "expected S or S\\+pod"),
                          ("1+node", "expected S or S\\+pod")):
        monkeypatch.setenv("DOCKRL_REPLICA", "3")
        with pytest.raises(ValueError, match=message):
            local_shard(spec, 4)


def test_beside_refuses_dynamic_sampling_which_needs_one_shard_and_runs_without_stage_processes(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="dock.placement.*needs one dock shard"):
        config(tiny_model_dir, tmp_path, "algorithm.filter_groups.enable=true")
    with pytest.raises(ConfigError, match="dock.placement.*use dock.mode=distributed"):
        config(tiny_model_dir, tmp_path, "dock.mode=inprocess")
