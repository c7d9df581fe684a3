"""Pods shaped like nodes: the hybrid actor's rank processes go ``devices_per_node`` to a pod, its
tensor-parallel groups inside one pod, started as local ranks by ``dockrl node`` (torchrun).

For each layout the JobSet is rendered, validated against the JobSet v0.9.1 CRD, and every rank
process's global rank and TP/DP/PP coordinates are derived from the pod spec alone (the pod's
completion index, ``--nproc-per-node``, torchrun's ``rank = node_rank × nproc + local_rank``) and
checked against ``ParallelLayout``. The last test runs ``dockrl node`` as two "pods" on this
machine with the arguments and environment of a rendered pod spec and checks that torchrun gives
the processes exactly the ranks the spec promises."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys

import pytest

from dockrl.launch.backend import WorkerGroup
from dockrl.launch.distributed import stage_members
from dockrl.launch.jobset import member_host, render_jobset
from dockrl.launch.platform import PLATFORMS, Platform, Toleration
from dockrl.launch.pod_spec import pod_shape
from dockrl.parallel.layout import ParallelLayout
from dockrl.process.env import RDZV_PORT

RUN = "5d0c9a1e-2b3f-4c5d-8e9f-0a1b2c3d4e5f"
NS = "team-rl"


def hybrid_group(layout: ParallelLayout) -> WorkerGroup:
    members, colocate = stage_members(layout, "hybrid")  # what worker_groups gives the hybrid actor
    return WorkerGroup(name="hybrid", command=("worker", "--stage", "hybrid"), replicas=members, devices=1, colocate=colocate)


def rendered(layout: ParallelLayout, platform: Platform) -> dict:
    groups = [WorkerGroup(name="dock-shard-0", command=("dock-shard",), port=8815), hybrid_group(layout)]
    return render_jobset(groups, run_id=RUN, namespace=NS, platform=platform)[-1]  # after the Secret and the NetworkPolicy


def hybrid_job(jobset: dict) -> dict:
    [job] = [r["template"]["spec"] for r in jobset["spec"]["replicatedJobs"] if r["name"] == "hybrid"]
    return job


def ranks_from_pod_spec(job: dict) -> dict[int, tuple[int, int]]:
    """Global rank -> (pod index, local rank), from the Job's pod spec only."""
    pods = job["completions"]
    [c] = job["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["DOCKRL_REPLICAS"]["value"] == str(pods)  # dockrl node's node count
    assert env["DOCKRL_REPLICA"]["valueFrom"]["fieldRef"]["fieldPath"].endswith("['batch.kubernetes.io/job-completion-index']")
    args = c["args"]
    nproc = int(args[args.index("--nproc-per-node") + 1]) if args[0] == "node" else 1
    return {pod * nproc + local: (pod, local) for pod in range(pods) for local in range(nproc)}


CASES = [
    # (platform, layout, pods, devices per pod)
    pytest.param("npu", ParallelLayout(tp=2, dp=4, device="npu"), 1, 8, id="npu-tp2-dp4"),
    pytest.param("gpu", ParallelLayout(tp=1, dp=16, device="cuda"), 2, 8, id="cuda-tp1-dp16"),
    pytest.param("gpu", ParallelLayout(tp=8, pp=2, dp=1, device="cuda"), 2, 8, id="cuda-pp2-tp8"),
    pytest.param("npu", ParallelLayout(tp=4, dp=3, device="npu"), 3, 4, id="npu-tp4-dp3"),  # 12 ranks: 8 per pod would split a TP group
]


@pytest.mark.parametrize(("name", "layout", "pods", "per_pod"), CASES)
def test_rank_processes_fill_pods_shaped_like_nodes(name, layout, pods, per_pod, validate_jobset, validate_strict):
    platform = PLATFORMS[name]
    jobset = rendered(layout, platform)
    validate_jobset(jobset)
    job = hybrid_job(jobset)
    validate_strict({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "hybrid"}, "spec": job})
    assert job["completions"] == job["parallelism"] == pods
    spec = job["template"]["spec"]
    [c] = spec["containers"]
    # one pod per node: its devices, cpu and memory scale with the rank processes it holds
    requests, limits = c["resources"]["requests"], c["resources"]["limits"]
    assert requests[platform.accelerator] == limits[platform.accelerator] == per_pod
    assert (requests["cpu"], requests["memory"]) == (platform.pod_requests(per_pod)["cpu"], platform.pod_requests(per_pod)["memory"])
    assert int(requests["cpu"]) == per_pod * int(platform.cpu_per_device)
    [shm] = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": platform.shm_size(per_pod)}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert c["args"][:6] == ["node", "--nproc-per-node", str(per_pod), "--rdzv-timeout-s",
                             str(platform.schedule_timeout_s + platform.image_pull_timeout_s), "--"]
    assert c["args"][6:] == ["worker", "--stage", "hybrid"]
    env = {e["name"]: e for e in c["env"]}
    assert env["MASTER_ADDR"]["value"] == member_host(RUN, "hybrid", 0, NS) and env["MASTER_PORT"]["value"] == str(RDZV_PORT)
    assert {"name": "rdzv", "containerPort": RDZV_PORT, "protocol": "TCP"} in c["ports"]
    assert env["OMP_NUM_THREADS"]["value"] == platform.cpu_per_device
    if name == "npu":
        assert env["HCCL_IF_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["HCCL_SOCKET_IFNAME"]["value"] == env["GLOO_SOCKET_IFNAME"]["value"] == "eth0"
        assert env["HCCL_CONNECT_TIMEOUT"]["value"] == str(platform.collective_timeout_s)
    else:
        assert env["NCCL_SOCKET_IFNAME"]["value"] == "eth0" and "HCCL_IF_IP" not in env

    # every process's rank, from the pod spec, against the layout
    where = ranks_from_pod_spec(job)
    assert sorted(where) == list(range(layout.world_size))  # each rank once
    assert all(local < per_pod for _, local in where.values())  # a local rank is a device of its pod
    for tp_group in layout.tp_groups():  # a TP group's collectives never leave its pod (DP and PP may)
        assert len({where[r][0] for r in tp_group}) == 1, tp_group
    for rank, (pod, _local) in where.items():
        coords = layout.train_coords(rank)
        assert layout.train_rank(*coords) == rank
        infer_group = [r for r in where if layout.infer_coords(r).dp_rank == layout.infer_coords(rank).dp_rank]
        assert {where[r][0] for r in infer_group} == {pod}  # the rollout's TP' group too
    if pods > 1:  # so what crosses pods is data or pipeline parallelism only
        assert any(len({where[r][0] for r in group}) > 1 for group in layout.dp_groups() + layout.pp_groups())


def test_pods_spread_over_architectures_their_image_is_built_for():
    npu = rendered(ParallelLayout(tp=2, dp=4), PLATFORMS["npu"])
    for rjob in npu["spec"]["replicatedJobs"]:
        [term] = rjob["template"]["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert term["matchExpressions"] == [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64", "arm64"]}]
    gpu = rendered(ParallelLayout(tp=2, dp=4), PLATFORMS["gpu"])
    archs = {r["name"]: r["template"]["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]
        for r in gpu["spec"]["replicatedJobs"]}
    assert archs == {"dock-shard-0": ["amd64"], "hybrid": ["amd64"]}  # the CUDA image is x86-64 only
    with pytest.raises(ValueError, match="built for \\('amd64',\\) only"):
        dataclasses.replace(PLATFORMS["gpu"], architectures=("arm64",)).architectures_of("gpu")


def test_the_platform_hooks_add_resources_labels_annotations_and_env(validate_jobset):
    platform = dataclasses.replace(
        PLATFORMS["npu"], extra_resources={"rdma/hca_shared_devices_a": "1"}, pod_labels={"ring-controller.atlas": "ascend-910b"},
        pod_annotations={"k8s.v1.cni.cncf.io/networks": "roce"}, env={"HCCL_SOCKET_IFNAME": "net1", "HCCL_BUFFSIZE": "200"},
        network_interface="net1", host_paths={"/usr/local/Ascend/driver": "/usr/local/Ascend/driver"})
    jobset = rendered(ParallelLayout(tp=2, dp=4), platform)
    validate_jobset(jobset)
    template = hybrid_job(jobset)["template"]
    [c] = template["spec"]["containers"]
    assert c["resources"]["limits"] == {"huawei.com/Ascend910": 8, "rdma/hca_shared_devices_a": "1"}
    assert template["metadata"]["labels"]["ring-controller.atlas"] == "ascend-910b"
    assert template["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "roce"
    names = [e["name"] for e in c["env"]]
    assert len(names) == len(set(names))  # the platform's env replaces dockrl's, never doubles it
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert (env["HCCL_SOCKET_IFNAME"], env["HCCL_BUFFSIZE"], env["GLOO_SOCKET_IFNAME"]) == ("net1", "200", "net1")
    assert "HCCL_IF_IP" not in env  # the pod's IP is eth0's: on a secondary network the interface alone chooses
    # the node's driver where no container runtime hook brings it: read-only
    assert {"name": "host-0", "mountPath": "/usr/local/Ascend/driver", "readOnly": True} in c["volumeMounts"]
    assert {"name": "host-0", "hostPath": {"path": "/usr/local/Ascend/driver"}} in template["spec"]["volumes"]
    shard = [r for r in jobset["spec"]["replicatedJobs"] if r["name"] == "dock-shard-0"][0]["template"]["spec"]["template"]
    assert "ring-controller.atlas" not in shard["metadata"]["labels"]  # CPU pods get none of it


def test_a_group_larger_than_a_node_keeps_its_tensor_parallel_blocks_whole():
    platform = dataclasses.replace(PLATFORMS["gpu"], devices_per_node=4)
    assert pod_shape(hybrid_group(ParallelLayout(tp=8, dp=2)), platform) == (4, 4)  # TP 8 > 4 devices: each spans 2 pods (warned)
    assert pod_shape(hybrid_group(ParallelLayout(tp=2, dp=3)), platform) == (3, 2)  # 6 ranks: 3 pods of 2, never 4 + 2
    cpu = PLATFORMS["cpu"]  # no accelerator: no node shape, a pod per member
    assert pod_shape(hybrid_group(ParallelLayout(tp=2, dp=2)), cpu) == (4, 1)
    with pytest.raises(ValueError, match="colocate=4 with replicas=6"):
        WorkerGroup(name="hybrid", command=("worker",), replicas=6, devices=1, colocate=4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_dockrl_node_gives_the_processes_the_ranks_the_pod_spec_promises(tmp_path):
    """Two pods of a rendered JobSet, as two `dockrl node` processes on this machine: torchrun's
    rendezvous at "pod 0" orders them, and each rank process reports its rank and coordinates."""
    layout = ParallelLayout(tp=2, dp=2, device="cpu")
    platform = dataclasses.replace(PLATFORMS["npu"], devices_per_node=2, schedule_timeout_s=30, image_pull_timeout_s=30)
    job = hybrid_job(rendered(layout, platform))
    [c] = job["template"]["spec"]["containers"]
    promised = ranks_from_pod_spec(job)
    node_args = c["args"][: c["args"].index("--") + 1]  # the pod's own `node ... --`; its processes report instead of working
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    port = _free_port()
    procs = []
    for pod in range(job["completions"]):
        pod_env = {**os.environ, "DOCKRL_REPLICA": str(pod), "DOCKRL_REPLICAS": env["DOCKRL_REPLICAS"],
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "dockrl", *node_args, "ranks", "parallel.tp=2", "parallel.dp=2", "parallel.device=cpu"],
            env=pod_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path))
    reports = []
    for pod, proc in enumerate(procs):
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-2000:]
        reports += [dict(json.loads(line), pod=pod) for line in out.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in reports) == list(range(layout.world_size))
    for r in reports:
        assert (r["pod"], r["local_rank"]) == promised[r["rank"]]
        assert (r["tp_rank"], r["dp_rank"], r["pp_rank"]) == layout.train_coords(r["rank"])
        assert r["world_size"] == layout.world_size


@pytest.mark.parametrize(("change", "message"), [
    ({"devices_per_node": "8"}, "devices_per_node='8'; expected int"),
    ({"architectures": "arm64"}, "architectures='arm64'; expected tuple"),
    ({"scheduler": "slurm"}, "scheduler='slurm'; expected 'default' or 'kueue' or 'volcano'"),
    ({"env": {"HCCL_BUFFSIZE": 200}}, "env=.*expected dict\\[str, str\\]"),
    ({"memory_per_device": "96G"}, "memory_per_device='96G'; expected an integer with an optional unit"),
    ({"shm_per_device": "200Gi"}, "shm_per_device='200Gi' is not below memory_per_device='96Gi'"),
    ({"host_paths": {"driver": "/usr/local/Ascend/driver"}}, "host_paths=.*expected absolute node paths"),
])
def test_a_platform_field_of_the_wrong_kind_is_refused_naming_it(change, message):
    with pytest.raises(ValueError, match=f"platform 'npu': {message}"):
        dataclasses.replace(PLATFORMS["npu"], **change)
    with pytest.raises(ValueError, match="toleration 'x': effect='NoSchedul'"):
        dataclasses.replace(PLATFORMS["npu"], tolerations=(Toleration(key="x", effect="NoSchedul"),))  # type: ignore[arg-type]


def test_a_config_for_another_device_than_the_platforms_is_refused():
    from dockrl.config import load_config
    from dockrl.kubeflow.train_task import check_platform_device

    check_platform_device(load_config(None, []), PLATFORMS["npu"])  # auto: the pods' own
    check_platform_device(load_config(None, ["parallel.device=cpu"]), PLATFORMS["cpu"])
    with pytest.raises(ValueError, match="parallel.device='cpu': the pipeline was compiled for platform 'npu'"):
        check_platform_device(load_config(None, ["parallel.device=cpu"]), PLATFORMS["npu"])
