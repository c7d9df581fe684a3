"""One worker pod of a run's JobSet: how a group's members are placed in pods, and the pod's spec.

``pod_shape`` places the members of a worker group in pods shaped like nodes; ``pod_spec``
renders one such pod (``jobset.render_jobset`` puts it in the group's Indexed Job):

* every pod: requests for cpu, memory and ephemeral storage; devices (the platform's
  extended resource) as many as the layout places in the member (``WorkerGroup.devices``,
  one per rank process), requested and limited alike as extended resources must be; no cpu or
  memory limit (a limit equal to the request turns every peak into a throttle or an OOMKill;
  the request is what the scheduler reserves); Pod Security ``restricted`` (non-root, no
  privilege escalation, every capability dropped, seccomp ``RuntimeDefault``), with the
  accelerator's device group as a supplemental group on pods that hold devices (Ascend's
  ``/dev/davinci*``); no service-account token; no Istio sidecar (as KFP's own pods), since a
  sidecar would keep a finished Job's pod running.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple, Sequence

from dockrl.launch.backend import WorkerGroup
from dockrl.launch.platform import ARCH_LABEL, OBJECT_STORE_KEYS, Platform
from dockrl.process.env import RDZV_PORT, REPLICA_ENV, REPLICAS_ENV

logger = logging.getLogger(__name__)

COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
"""Annotation (and label) of an Indexed Job's pod with its index: the member's ``DOCKRL_REPLICA``."""
CONTAINER = "worker"
SHARED_VOLUME = "shared"
WORKER_UID = 10001  # the non-root user of the images (images/*/Dockerfile)
SHM_SIZE = "1Gi"
"""Cap of the ``/dev/shm`` of a pod without devices (RAM-backed: it counts against the pod's
memory); a pod with devices gets ``Platform.shm_size`` of them."""


class PodShape(NamedTuple):
    """How a worker group's members are placed in pods: ``pods`` pods of ``members`` rank processes each."""

    pods: int
    members: int

    @property
    def devices(self) -> int:
        """Members of one pod: with one device each, the devices a pod holds."""
        return self.members


def pod_shape(group: WorkerGroup, platform: Platform) -> PodShape:
    """Pods shaped like nodes: the members of a group with devices go ``k`` to a pod, ``k`` the
    most members a node of ``Platform.devices_per_node`` devices holds that divides the group and
    keeps every block of ``group.colocate`` members (a tensor-parallel group) in one pod; member
    ``p·k + i`` is local rank ``i`` of pod ``p`` (as torchrun numbers ranks). A block larger than a
    node spans whole pods (warned: its collectives cross the pod network). Members without
    devices, and every member of a platform without accelerators, get a pod each.

    Raises:
        ValueError: one member needs more devices than a node has.
    """
    if not group.devices or not platform.devices_per_node:
        return PodShape(group.replicas, 1)
    per_node = platform.devices_per_node // group.devices
    if per_node < 1:
        raise ValueError(f"worker group {group.name!r}: {group.devices} devices per member, but a node has "
                         f"Platform.devices_per_node={platform.devices_per_node}")
    block = group.colocate
    if block <= per_node:
        fits = [k for k in range(block, per_node + 1, block) if group.replicas % k == 0]
    else:
        fits = [k for k in range(1, per_node + 1) if block % k == 0]
        logger.warning("worker group %r: blocks of %d members (the tensor-parallel group) do not fit a node of %d devices; "
                       "each spans %d pods and its collectives cross the pod network", group.name, block,
                       platform.devices_per_node, block // max(fits))
    k = max(fits)
    return PodShape(group.replicas // k, k)


def _resources(group: WorkerGroup, platform: Platform, shape: PodShape) -> dict[str, dict[str, Any]]:
    if group.devices:
        requests: dict[str, Any] = platform.pod_requests(group.devices * shape.members)
    else:
        requests = {"cpu": group.cpu, "memory": group.memory, "ephemeral-storage": group.ephemeral_storage}
    limits: dict[str, Any] = {}
    if group.devices and platform.accelerator:
        # an extended resource cannot be overcommitted: Kubernetes needs request == limit
        requests[platform.accelerator] = limits[platform.accelerator] = group.devices * shape.members
        for resource, quantity in platform.extra_resources.items():  # RDMA and the like: the platform's hook
            requests[resource] = limits[resource] = quantity
    return {"requests": requests, "limits": limits} if limits else {"requests": requests}


def _collective_env(group: WorkerGroup, platform: Platform, master_addr: str) -> list[dict[str, Any]]:
    """Environment of the collectives of a pod holding devices: the rendezvous of the group's pods
    (``MASTER_ADDR``: pod 0 in the JobSet's DNS), the interface the communicators bootstrap over,
    on Ascend the pod's IP for HCCL (``HCCL_IF_IP``, from the downward API, when the interface is
    the pod network's ``eth0``; on another one ``HCCL_SOCKET_IFNAME`` alone chooses) and HCCL's timeouts;
    then the platform's own ``env``, which wins."""
    iface = platform.network_interface
    env: list[dict[str, Any]] = [
        {"name": "MASTER_ADDR", "value": master_addr},
        {"name": "MASTER_PORT", "value": str(RDZV_PORT)},
        {"name": "GLOO_SOCKET_IFNAME", "value": iface},
    ]
    if platform.name == "npu":
        timeout = str(platform.collective_timeout_s)
        if iface == "eth0":  # the pod network's interface, whose address is the pod's IP; HCCL prefers HCCL_IF_IP
            env.append({"name": "HCCL_IF_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
        env += [{"name": "HCCL_SOCKET_IFNAME", "value": iface},
                {"name": "HCCL_CONNECT_TIMEOUT", "value": timeout}, {"name": "HCCL_EXEC_TIMEOUT", "value": timeout}]
    elif platform.name == "gpu":
        env += [{"name": "NCCL_SOCKET_IFNAME", "value": iface}]
    own = {e["name"] for e in env} & set(platform.env)
    return [e for e in env if e["name"] not in own] + [{"name": k, "value": v} for k, v in sorted(platform.env.items())]


def _env(run_id: str, group: WorkerGroup, platform: Platform, secret: str, shape: PodShape, master_addr: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "DOCKRL_RUN_ID", "value": run_id},
        {"name": "DOCKRL_GROUP", "value": group.name},
        # the pod's index among the group's pods: the member's index, or with several members
        # per pod the node rank `dockrl node` hands torchrun
        {"name": REPLICAS_ENV, "value": str(shape.pods)},
        {"name": REPLICA_ENV, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    env += [{"name": k, "value": v} for k, v in sorted(group.env.items())]
    env += [{"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": k}}} for k in sorted(group.secret_env)]
    if group.object_store and platform.object_store_secret:
        env += [{"name": k, "valueFrom": {"secretKeyRef": {"name": platform.object_store_secret, "key": k}}}
                for k in OBJECT_STORE_KEYS]
    if group.devices:
        env += _collective_env(group, platform, master_addr)
    # torchrun would set 1 thread per process: give each its device's share of the pod's CPUs
    if shape.members > 1 and "OMP_NUM_THREADS" not in platform.env:
        cpus = platform.pod_requests(group.devices)["cpu"]
        env.append({"name": "OMP_NUM_THREADS", "value": str(max(1, int(cpus[:-1]) // 1000) if cpus.endswith("m") else cpus)})
    return env


def pod_args(group: WorkerGroup, platform: Platform, shape: PodShape) -> list[str]:
    """The container's arguments (the image's entry point is ``dockrl``, which on the NPU image
    first sources CANN's environment): the member's command, or with several members per pod
    ``node`` starting them as local ranks (``dockrl/launch/node.py``)."""
    if shape.members == 1:
        return list(group.command)
    wait = platform.schedule_timeout_s + platform.image_pull_timeout_s  # the group's pods may start that far apart
    return ["node", "--nproc-per-node", str(shape.members), "--rdzv-timeout-s", str(wait), "--", *group.command]


def arch_affinity(archs: Sequence[str]) -> dict[str, Any]:
    """A pod's node affinity: nodes of one of the CPU architectures ``archs`` (those its image is built for)."""
    term = {"matchExpressions": [{"key": ARCH_LABEL, "operator": "In", "values": list(archs)}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


SIDECAR_START_S = 120
"""Longest a pod's dock shard may take to answer on its port before the pod fails (its startup probe), seconds."""


def shard_sidecar(run_id: str, shard: WorkerGroup, platform: Platform, *, secret: str, image: str, pods: int,
                  mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """The dock shard beside the stage processes of a pod (``dock.placement=beside``, ``WorkerGroup.sidecar``): a
    native sidecar (an init container with ``restartPolicy: Always``, Kubernetes >= 1.29), so it answers on its port
    (the startup probe) before the stage's container starts, and is stopped once that container has ended: the pod
    completes with its stage. It has the shard group's requests and secrets (the stage container has neither: each
    container reads only its own ``secretKeyRef``), the pod's image, and the pod's index as ``DOCKRL_REPLICA``."""
    container: dict[str, Any] = {
        "name": shard.name, "image": image, "imagePullPolicy": "IfNotPresent", "restartPolicy": "Always",
        "args": list(shard.command), "env": _env(run_id, shard, platform, secret, PodShape(pods, 1), master_addr=""),
        "resources": _resources(shard, platform, PodShape(pods, 1)),
        "ports": [{"name": "dock", "containerPort": shard.port, "protocol": "TCP"}],
        "startupProbe": {"tcpSocket": {"port": shard.port}, "periodSeconds": 1, "failureThreshold": SIDECAR_START_S},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    if mounts:
        container["volumeMounts"] = mounts
    return container


def pod_spec(run_id: str, group: WorkerGroup, platform: Platform, *, secret: str, master_addr: str) -> dict[str, Any]:
    """The pod of a member of ``group`` (see the module docstring): ``secret`` is the run's Secret, ``master_addr``
    pod 0 of the group in the JobSet's DNS (the collectives' rendezvous, ``jobset.member_host``)."""
    shape = pod_shape(group, platform)
    image_name = platform.name if group.devices else "cpu"
    shm = platform.shm_size(group.devices * shape.members) if group.devices else SHM_SIZE
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    # NCCL, HCCL, vLLM and torch's dataloaders need more shared memory than the default 64 MiB
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}}]
    if group.devices:  # the platform's hook: a node's driver files where no container runtime hook brings them
        for i, (node_path, pod_path) in enumerate(sorted(platform.host_paths.items())):
            mounts.append({"name": f"host-{i}", "mountPath": pod_path, "readOnly": True})
            volumes.append({"name": f"host-{i}", "hostPath": {"path": node_path}})
    if platform.shared_volume_claim:
        mounts.append({"name": SHARED_VOLUME, "mountPath": platform.shared_mount_path})
        volumes.append({"name": SHARED_VOLUME, "persistentVolumeClaim": {"claimName": platform.shared_volume_claim}})
    container: dict[str, Any] = {
        "name": CONTAINER, "image": platform.image_of(image_name), "imagePullPolicy": "IfNotPresent",
        "args": pod_args(group, platform, shape), "env": _env(run_id, group, platform, secret, shape, master_addr),
        "resources": _resources(group, platform, shape), "volumeMounts": mounts,
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    ports = [{"name": "rpc", "containerPort": group.port, "protocol": "TCP"}] if group.port else []
    if shape.members > 1:
        ports.append({"name": "rdzv", "containerPort": RDZV_PORT, "protocol": "TCP"})
    if ports:
        container["ports"] = ports
    # OnRootMismatch: the kubelet re-owns the volumes only when their root is not the pod's group
    # already; with Always (the default) every pod start walks the whole checkpoint volume
    security: dict[str, Any] = {"runAsNonRoot": True, "runAsUser": WORKER_UID, "runAsGroup": WORKER_UID, "fsGroup": WORKER_UID,
                                "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"}}
    spec: dict[str, Any] = {
        "restartPolicy": "Never",  # a restarted worker has lost its state: the Job fails instead
        "automountServiceAccountToken": False,  # workers never call the API server
        "enableServiceLinks": False,
        "securityContext": security,
        "terminationGracePeriodSeconds": 30,
        "affinity": arch_affinity(platform.architectures_of(image_name)),
        "containers": [container],
        "volumes": volumes,
    }
    if group.sidecar is not None:
        shared = [m for m in mounts if m["name"] == SHARED_VOLUME]  # dock snapshots go with the checkpoints
        spec["initContainers"] = [shard_sidecar(run_id, group.sidecar, platform, secret=secret, image=container["image"],
                                                pods=shape.pods, mounts=shared)]
    if group.devices:
        if platform.accelerator_device_gid:
            security["supplementalGroups"] = [platform.accelerator_device_gid]
        if platform.node_selector:
            spec["nodeSelector"] = dict(platform.node_selector)
        if platform.tolerations:
            spec["tolerations"] = [t.to_k8s() for t in platform.tolerations]
    if platform.image_pull_secret:
        spec["imagePullSecrets"] = [{"name": platform.image_pull_secret}]
    if platform.scheduler == "volcano":
        spec["schedulerName"] = "volcano"
    return spec
