"""Hardware platforms a run can target: image, accelerator resource, scheduling and credentials.

One ``Platform`` describes where the accelerator-bound work runs on Kubernetes. The KFP
pipeline (``pipelines/grpo.py``) puts it on the train task; the Kubernetes worker backend
(``dockrl/launch/kubernetes.py``) puts it on the accelerator worker groups. The three presets
match the images under ``images/`` and the overlays under ``manifests/overlays/``.

The shared volume (``shared_volume_claim``, a ReadWriteMany PersistentVolumeClaim from
``manifests/base/shared-volume.yaml``) is mounted at ``shared_mount_path`` in the train task
and in every worker pod: with the Kubernetes worker backend a run's folder (its data,
checkpoints, metrics) lives there, so the launcher and the stage pods see the same files.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from dockrl.launch.platform_checks import (
    DIGEST_PATTERN,
    K8S_NAME_PATTERN,
    QUANTITY,
    REGISTRY_PATTERN,
    TAG_PATTERN,
    check_field_types,
    quantity_bytes,
    scale_quantity,
)

IMAGE_REGISTRY = "ghcr.io/dockrl"
"""Default registry (and path) of the images; a site sets its own (``dockrl pipeline compile
--registry``, or the ``images:`` of its overlay in ``manifests/overlays``)."""
IMAGE_NAMES = ("cpu", "npu", "gpu")
"""The images ``scripts/build_images.sh`` builds: ``<registry>/dockrl-<name>`` (gpu from ``images/cuda``)."""
IMAGE_REPOSITORY = f"{IMAGE_REGISTRY}/dockrl"
"""Image repository; the image name is appended (``ghcr.io/dockrl/dockrl-npu``)."""
IMAGE_TAG = "0.1.0"
"""Image tag of this release (the package version); never ``latest``."""

OBJECT_STORE_SECRET = "dockrl-object-store"
"""Secret with the object-store credentials (``manifests/components/object-store/``), needed only with ``dock.warehouse=s3``."""
OBJECT_STORE_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL")
"""Keys of that Secret; each becomes the environment variable of the same name."""

TRACKER_SECRET = "dockrl-trackers"
"""Secret with the experiment trackers' settings and credentials (``manifests/components/trackers/``), needed only
with ``run.trackers`` naming ``mlflow`` or ``wandb``."""
TRACKER_KEYS = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                "WANDB_API_KEY", "WANDB_BASE_URL")
"""Keys of that Secret, each optional; each becomes the environment variable of the same name in the train task,
whose driver logs to the trackers (``dockrl.run.trackers``)."""

SHARED_VOLUME_CLAIM = "dockrl-shared"
"""PersistentVolumeClaim (ReadWriteMany) shared by the launcher and the worker pods."""
SHARED_MOUNT_PATH = "/mnt/dockrl"
"""Where it is mounted, in the launcher and in every worker pod."""

RUNTIME_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
"""A ClusterTrainingRuntime's name (an RFC 1035 label, as the Trainer's webhook wants TrainJob names)."""

ASCEND_RESOURCE = "huawei.com/Ascend910"
NVIDIA_RESOURCE = "nvidia.com/gpu"

ARCH_LABEL = "kubernetes.io/arch"
"""Node label with the node's CPU architecture (``amd64``, ``arm64``), set by the kubelet."""
IMAGE_ARCHITECTURES: dict[str, tuple[str, ...]] = {"cpu": ("amd64", "arm64"), "npu": ("amd64", "arm64"), "gpu": ("amd64",)}
"""Node architectures each image is built for (``scripts/build_images.sh``): most Ascend servers
are Kunpeng (arm64), some x86-64; the CUDA image follows PyPI's vLLM wheels (x86-64)."""



@dataclass(frozen=True, kw_only=True)
class Toleration:
    """A Kubernetes toleration (``operator="Exists"`` ignores ``value``)."""

    key: str
    operator: Literal["Equal", "Exists"] = "Exists"
    value: str = ""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = "NoSchedule"

    def __post_init__(self) -> None:
        check_field_types(self, f"toleration {self.key!r}")

    def to_k8s(self) -> dict[str, str]:
        out = {"key": self.key, "operator": self.operator, "effect": self.effect}
        if self.operator == "Equal":
            out["value"] = self.value
        return out


@dataclass(frozen=True, kw_only=True)
class Platform:
    """Where and how accelerator-bound pods run."""

    name: Literal["npu", "gpu", "cpu"]
    """Preset name; also the image suffix and the manifests overlay."""
    accelerator: str = ""
    """Extended resource of one accelerator (``huawei.com/Ascend910``, ``nvidia.com/gpu``); "" for none."""
    devices_per_node: int = 0
    """Accelerators of one node (0 with no accelerator; 8 on Ascend 910 and H100/H200 nodes). A
    worker group whose members hold devices is placed as one pod per node holding up to this many
    rank processes (local ranks, ``dockrl node``), so a tensor-parallel group lives inside one pod
    whenever TP <= devices_per_node; ranks in different pods differ only in DP or PP."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels an accelerator pod must match."""
    tolerations: tuple[Toleration, ...] = ()
    """Taints of accelerator nodes that accelerator pods tolerate."""
    object_store_secret: str = OBJECT_STORE_SECRET
    """Secret whose ``OBJECT_STORE_KEYS`` become environment variables ("" for none)."""
    tracker_secret: str = TRACKER_SECRET
    """Secret whose ``TRACKER_KEYS`` become environment variables of the train task ("" for none)."""
    image_repository: str = IMAGE_REPOSITORY
    """Registry path and name prefix of the images (``<repository>-<name>:<tag>``)."""
    image_tag: str = IMAGE_TAG
    """Tag of every image of the run; never ``latest``."""
    image_digests: dict[str, str] = field(default_factory=dict)
    """Image name (``cpu``, ``npu``, ``gpu``) -> ``sha256:...``: that image is pulled by digest
    (``<repository>-<name>@sha256:...``), as the CI workflow publishes them."""
    image_pull_secret: str = ""
    """Secret (``kubernetes.io/dockerconfigjson``) for a private registry, on every pod of the run
    ("" for none: a public registry, or one the nodes or the service account can already pull from)."""
    shared_volume_claim: str = SHARED_VOLUME_CLAIM
    """ReadWriteMany PersistentVolumeClaim mounted by the launcher and every worker pod ("" for
    none: then the Kubernetes worker backend cannot run the stages)."""
    shared_mount_path: str = SHARED_MOUNT_PATH
    """Absolute path of its mount, the same in every pod."""
    cpu_per_device: str = "4"
    """CPU request per device of a pod holding devices (Kubernetes quantity; an integer or
    millicores): a pod of k devices requests k times this. On CPU platforms, of a pod holding a model."""
    memory_per_device: str = "16Gi"
    """Memory request per device of a pod holding devices (Kubernetes quantity): it holds the
    training state the weight sync swaps to host, and the pod's ``/dev/shm``."""
    shm_per_device: str = "8Gi"
    """``/dev/shm`` (a memory-backed emptyDir) per device of a pod holding devices: NCCL, HCCL and
    vLLM's workers exchange through it, and the 64 MiB default is too small. It counts against
    the pod's memory, so it must stay well below ``memory_per_device``."""
    stage_ephemeral_storage: str = "20Gi"
    """Ephemeral-storage request of a pod holding a model (logs, caches; checkpoints go to the
    shared volume or the object store, never the node's disk)."""
    accelerator_device_gid: int = 0
    """Supplemental group given to worker pods that hold accelerators, so that the non-root
    user can open the device files (Ascend: the group of ``/dev/davinci*``, HwHiAiUser, usually
    1000; look it up on a node with ``stat -c %g /dev/davinci0``); 0 for none."""
    scheduler: Literal["default", "kueue", "volcano"] = "default"
    """Gang scheduling of a run's worker pods: ``default`` (none), ``kueue`` (the JobSet is
    queued in ``queue`` and admitted whole) or ``volcano`` (schedulerName volcano and one
    PodGroup of all the run's pods, the usual choice on Ascend clusters)."""
    queue: str = ""
    """Kueue LocalQueue (required with ``scheduler=kueue``) or Volcano queue ("" for Volcano's
    ``default``) of a run's workers."""
    workload: Literal["jobset", "trainjob"] = "jobset"
    """What the Kubernetes worker backend creates for a run's workers: ``jobset``, one JobSet that dockrl renders
    whole (``jobset.py``), or ``trainjob``, one Kubeflow Trainer TrainJob that references the ClusterTrainingRuntime
    ``training_runtime`` and patches the run into it (``trainjob.py``): the Trainer makes the JobSet, so the site's
    runtime (placement, RDMA, scheduling, Kueue through the TrainJob) applies. docs/kubeflow.md says when to use which."""
    training_runtime: str = "dockrl-hybrid"
    """The ClusterTrainingRuntime a ``trainjob`` run references (``dockrl trainer-runtime`` renders one for a
    config's shape; a site administrator applies it)."""
    worker_deadline_s: int = 7 * 24 * 3600
    """Longest a run's workers may live, seconds (``activeDeadlineSeconds`` of their Jobs): a
    bound on what a lost launcher can leave running."""
    worker_ttl_s: int = 3600
    """Seconds a finished worker JobSet is kept for inspection before Kubernetes deletes it."""
    schedule_timeout_s: int = 600
    """Longest a worker pod may stay unschedulable (no node with its resources, selector or
    taints) before the run fails, seconds; the time queued for admission is not counted."""
    priority_class: str = ""
    """Kueue WorkloadPriorityClass of a run's workers (label ``kueue.x-k8s.io/priority-class`` on
    the JobSet, with ``scheduler=kueue``; "" for the queue's default): what Kueue orders and
    preempts by."""
    queue_timeout_s: int = 24 * 3600
    """Longest the workers may wait for admission by Kueue or Volcano, seconds."""
    admission_timeout_s: int = 300
    """Longest a suspended JobSet may wait for Kueue to take it, seconds: for its Workload to
    appear (none appears where Kueue manages the namespace but the JobSet names no LocalQueue,
    or Kueue is not running), and while Kueue calls it ``Inadmissible`` (its LocalQueue missing,
    its ClusterQueue stopped) or larger than the queue's maximum capacity; what can be admitted
    once quota frees up waits ``queue_timeout_s``."""
    image_pull_timeout_s: int = 1800
    """Longest a scheduled worker pod may take to pull its image and start, seconds (the NPU
    image is tens of GB)."""
    image_pull_retries: int = 3
    """Failed image pulls of one pod tolerated before the run fails (the kubelet retries with
    back-off: a registry hiccup passes, a wrong name or missing credentials does not)."""
    architectures: tuple[str, ...] = ("amd64", "arm64")
    """Node architectures (``kubernetes.io/arch``) the run's pods may land on; each pod is
    limited further to those its image is built for (``IMAGE_ARCHITECTURES``)."""
    network_interface: str = "eth0"
    """Network interface of the pods that the collectives bootstrap over (``HCCL_SOCKET_IFNAME``,
    ``NCCL_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``): the pod network's, ``eth0`` with most CNIs;
    a secondary (RDMA) network's name with Multus."""
    collective_timeout_s: int = 1800
    """How long HCCL may take to connect a communicator and to run one collective, seconds
    (``HCCL_CONNECT_TIMEOUT``, ``HCCL_EXEC_TIMEOUT``): ranks of pods that start minutes apart."""
    extra_resources: dict[str, str] = field(default_factory=dict)
    """Extended resources every pod holding devices requests and is limited to, besides the
    devices (RDMA: ``{"rdma/hca_shared_devices_a": "1"}``; values are Kubernetes quantities)."""
    pod_labels: dict[str, str] = field(default_factory=dict)
    """Labels of every pod holding devices (Ascend's device plugin with a rank-table controller:
    ``{"ring-controller.atlas": "ascend-910b"}``)."""
    pod_annotations: dict[str, str] = field(default_factory=dict)
    """Annotations of every pod holding devices (a secondary network: ``{"k8s.v1.cni.cncf.io/networks": "roce"}``)."""
    host_paths: dict[str, str] = field(default_factory=dict)
    """Node paths mounted read-only into every pod holding devices, node path -> path in the pod.
    Ascend: with Ascend Docker Runtime on the nodes (what the Ascend device plugin is installed
    with) the driver comes into the container by itself; without it mount
    ``/usr/local/Ascend/driver`` (and ``/usr/local/dcmi``, ``/usr/local/bin/npu-smi``) here. A
    hostPath volume needs the namespace's Pod Security level ``privileged``."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of every process holding devices (``NCCL_IB_HCA``, ``HCCL_BUFFSIZE``, ...);
    it wins over the collectives' environment dockrl sets."""

    def __post_init__(self) -> None:
        check_field_types(self, f"platform {self.name!r}")
        if bool(self.accelerator) != (self.devices_per_node > 0):
            raise ValueError(
                f"platform {self.name!r}: accelerator={self.accelerator!r} with devices_per_node="
                f"{self.devices_per_node}; set both (a resource name and a count >= 1) or neither"
            )
        for name in ("cpu_per_device", "memory_per_device", "shm_per_device", "stage_ephemeral_storage"):
            if not QUANTITY.match(getattr(self, name)):
                raise ValueError(f"platform {self.name!r}: {name}={getattr(self, name)!r}; expected an integer with an optional "
                                 "unit m, Ki, Mi, Gi or Ti (e.g. '16', '96Gi'; for 96G write 89Gi)")
        if quantity_bytes(self.shm_per_device) >= quantity_bytes(self.memory_per_device):
            raise ValueError(f"platform {self.name!r}: shm_per_device={self.shm_per_device!r} is not below memory_per_device="
                             f"{self.memory_per_device!r}; /dev/shm is memory of the pod: keep it well below")
        unknown = sorted(set(self.architectures) - {a for archs in IMAGE_ARCHITECTURES.values() for a in archs})
        if not self.architectures or unknown:
            raise ValueError(f"platform {self.name!r}: architectures={self.architectures!r}; expected some of amd64, arm64")
        if self.collective_timeout_s < 1:
            raise ValueError(f"platform {self.name!r}: collective_timeout_s={self.collective_timeout_s}; expected seconds >= 1")
        if self.image_tag in ("", "latest") or not TAG_PATTERN.match(self.image_tag):
            raise ValueError(f"platform {self.name!r}: image_tag={self.image_tag!r}; pin a release tag "
                             "(letters, digits, '_', '.', '-'; at most 128), never 'latest'")
        if not REGISTRY_PATTERN.match(self.image_repository):
            raise ValueError(f"platform {self.name!r}: image_repository={self.image_repository!r}; expected a registry "
                             "path in lower case without scheme, tag or trailing '/', e.g. registry.example.com/ml/dockrl")
        for image, digest in self.image_digests.items():
            if image not in IMAGE_NAMES or not DIGEST_PATTERN.match(digest):
                raise ValueError(f"platform {self.name!r}: image_digests[{image!r}]={digest!r}; expected an image name "
                                 f"({', '.join(IMAGE_NAMES)}) mapped to 'sha256:<64 hex digits>'")
        if self.image_pull_secret and not K8S_NAME_PATTERN.match(self.image_pull_secret):
            raise ValueError(f"platform {self.name!r}: image_pull_secret={self.image_pull_secret!r}; expected the name "
                             "of a Secret in the run's namespace (lower case, digits, '-', '.')")
        if self.scheduler == "kueue" and not self.queue:
            raise ValueError(f"platform {self.name!r}: scheduler='kueue' needs queue (the LocalQueue of the workers' "
                             "namespace, e.g. queue='team-rl')")
        if self.workload == "trainjob" and not RUNTIME_NAME.match(self.training_runtime):
            raise ValueError(f"platform {self.name!r}: training_runtime={self.training_runtime!r}; expected the name of a "
                             "ClusterTrainingRuntime (lower case, digits, '-'; starting with a letter), e.g. 'dockrl-hybrid'")
        if self.priority_class and not K8S_NAME_PATTERN.match(self.priority_class):
            raise ValueError(f"platform {self.name!r}: priority_class={self.priority_class!r}; expected the name of a "
                             "Kueue WorkloadPriorityClass (lower case, digits, '-', '.')")
        for name in ("worker_deadline_s", "worker_ttl_s", "schedule_timeout_s", "queue_timeout_s", "admission_timeout_s",
                     "image_pull_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"platform {self.name!r}: {name}={getattr(self, name)}; expected seconds >= 1")
        if self.image_pull_retries < 0 or self.accelerator_device_gid < 0:
            raise ValueError(f"platform {self.name!r}: image_pull_retries={self.image_pull_retries}, accelerator_device_gid="
                             f"{self.accelerator_device_gid}; expected >= 0")
        if not all(k.startswith("/") and v.startswith("/") for k, v in self.host_paths.items()):
            raise ValueError(f"platform {self.name!r}: host_paths={self.host_paths!r}; expected absolute node paths mapped to absolute paths")
        if not self.shared_mount_path.startswith("/"):
            raise ValueError(f"platform {self.name!r}: shared_mount_path={self.shared_mount_path!r}; expected an absolute path")

    def to_json(self) -> str:
        """This platform as JSON (what the pipeline hands the train task; ``from_json`` reads it)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Platform:
        """The platform ``to_json`` wrote.

        Raises:
            ValueError: not JSON of a platform (names the unknown or missing field), or a rule
                of the constructor broken.
        """
        try:
            data: dict[str, Any] = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"platform: not JSON ({err}): {text[:80]!r}") from None
        if not isinstance(data, dict):
            raise ValueError(f"platform: expected a JSON object, got {type(data).__name__}")
        try:
            tolerations = data.get("tolerations", ())
            if not isinstance(tolerations, list | tuple) or not all(isinstance(t, dict) for t in tolerations):
                raise ValueError(f"platform: tolerations={tolerations!r}; expected a list of mappings (key, operator, value, effect)")
            data["tolerations"] = tuple(Toleration(**t) for t in tolerations)
            if isinstance(data.get("architectures"), list):  # JSON has no tuples
                data["architectures"] = tuple(data["architectures"])
            return cls(**data)
        except TypeError as err:  # an unknown or missing field of the platform or a toleration
            raise ValueError(f"platform: {str(err).replace('.__init__()', '')}") from None

    def image_of(self, name: str) -> str:
        """Reference of image ``name`` (``cpu``, ``npu``, ``gpu``): ``<repository>-<name>:<tag>``, or
        ``<repository>-<name>@sha256:...`` when ``image_digests`` pins it."""
        digest = self.image_digests.get(name)
        return f"{self.image_repository}-{name}@{digest}" if digest else f"{self.image_repository}-{name}:{self.image_tag}"

    def architectures_of(self, image: str) -> tuple[str, ...]:
        """Node architectures a pod running image ``image`` (``cpu``, ``npu``, ``gpu``) may land on:
        those the image is built for, among the platform's ``architectures``.

        Raises:
            ValueError: none is left (the message names both lists).
        """
        archs = tuple(a for a in IMAGE_ARCHITECTURES[image] if a in self.architectures)
        if not archs:
            raise ValueError(f"platform {self.name!r}: architectures={self.architectures!r}, but image dockrl-{image} is built "
                             f"for {IMAGE_ARCHITECTURES[image]!r} only; allow one of those")
        return archs

    def pod_requests(self, devices: int) -> dict[str, str]:
        """CPU, memory and ephemeral storage a pod holding ``devices`` devices requests (Kubernetes
        quantities): ``cpu_per_device`` and ``memory_per_device`` times ``devices`` (at least one)."""
        n = max(devices, 1)
        return {"cpu": scale_quantity(self.cpu_per_device, n), "memory": scale_quantity(self.memory_per_device, n),
                "ephemeral-storage": self.stage_ephemeral_storage}

    def shm_size(self, devices: int) -> str:
        """Size of the ``/dev/shm`` of a pod holding ``devices`` devices (``shm_per_device`` each, at least one)."""
        return scale_quantity(self.shm_per_device, max(devices, 1))

    @property
    def image(self) -> str:
        """Image of the accelerator-bound pods (``<repository>-<name>:<tag>``)."""
        return self.image_of(self.name)

    @property
    def cpu_image(self) -> str:
        """Image of the pods without accelerators (reward, dock shards): the cpu image of the same release."""
        return self.image_of("cpu")


PLATFORMS: dict[str, Platform] = {
    # Ascend device plugin: nodes carry accelerator=huawei-Ascend910 and the resource huawei.com/Ascend910
    # An Atlas 800T A2 node: 8 NPUs, 4 × 48 Kunpeng 920 cores, 1-2 TB: a pod of 8 devices requests
    # 128 CPU and 768Gi, what such a node has allocatable beside the system's share.
    "npu": Platform(
        name="npu", accelerator=ASCEND_RESOURCE, devices_per_node=8,
        node_selector={"accelerator": "huawei-Ascend910"},
        tolerations=(Toleration(key=ASCEND_RESOURCE),), cpu_per_device="16", memory_per_device="96Gi",
        accelerator_device_gid=1000,  # HwHiAiUser, owner of /dev/davinci* on a typical Ascend node
    ),
    # NVIDIA GPU operator: nodes carry nvidia.com/gpu.present=true; GPU pools are usually tainted
    # An 8 × H100/H200 node: 96 vCPU and 1.9 TB (Azure ND H100 v5) to 224 threads and 2 TB (DGX H100):
    # 8 devices request 80 CPU and 800Gi, which every one of them has allocatable.
    "gpu": Platform(
        name="gpu", accelerator=NVIDIA_RESOURCE, devices_per_node=8,
        node_selector={"nvidia.com/gpu.present": "true"},
        tolerations=(Toleration(key=NVIDIA_RESOURCE),), cpu_per_device="10", memory_per_device="100Gi",
        architectures=("amd64",),
    ),
    "cpu": Platform(name="cpu"),
}

CPU_IMAGE = PLATFORMS["cpu"].image
"""Image of the components that need no accelerator (every component's ``base_image``)."""



def get_platform(name: str) -> Platform:
    """The preset ``name``; raises ``ValueError`` naming the allowed ones."""
    if name not in PLATFORMS:
        raise ValueError(f"platform: got {name!r}; expected one of {', '.join(repr(p) for p in PLATFORMS)}")
    return PLATFORMS[name]
