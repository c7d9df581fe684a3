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
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

IMAGE_REPOSITORY = "ghcr.io/dockrl/dockrl"
"""Image repository; the platform name is appended (``ghcr.io/dockrl/dockrl-npu``)."""
IMAGE_TAG = "0.1.0"
"""Image tag of this release (the package version); never ``latest``."""

OBJECT_STORE_SECRET = "dockrl-object-store"
"""Secret with the object-store credentials (``manifests/base/object-store-secret.yaml``)."""
OBJECT_STORE_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL")
"""Keys of that Secret; each becomes the environment variable of the same name."""

SHARED_VOLUME_CLAIM = "dockrl-shared"
"""PersistentVolumeClaim (ReadWriteMany) shared by the launcher and the worker pods."""
SHARED_MOUNT_PATH = "/mnt/dockrl"
"""Where it is mounted, in the launcher and in every worker pod."""

ASCEND_RESOURCE = "huawei.com/Ascend910"
NVIDIA_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True, kw_only=True)
class Toleration:
    """A Kubernetes toleration (``operator="Exists"`` ignores ``value``)."""

    key: str
    operator: Literal["Equal", "Exists"] = "Exists"
    value: str = ""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = "NoSchedule"

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
    accelerators_per_pod: int = 0
    """Accelerators requested by one accelerator pod (0 with no accelerator)."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels an accelerator pod must match."""
    tolerations: tuple[Toleration, ...] = ()
    """Taints of accelerator nodes that accelerator pods tolerate."""
    object_store_secret: str = OBJECT_STORE_SECRET
    """Secret whose ``OBJECT_STORE_KEYS`` become environment variables ("" for none)."""
    image_repository: str = IMAGE_REPOSITORY
    image_tag: str = IMAGE_TAG
    shared_volume_claim: str = SHARED_VOLUME_CLAIM
    """ReadWriteMany PersistentVolumeClaim mounted by the launcher and every worker pod ("" for
    none: then the Kubernetes worker backend cannot run the stages)."""
    shared_mount_path: str = SHARED_MOUNT_PATH
    """Absolute path of its mount, the same in every pod."""
    stage_cpu: str = "4"
    """CPU request of a pod holding a model (rollout, reference, actor; Kubernetes quantity)."""
    stage_memory: str = "16Gi"
    """Memory request of a pod holding a model (Kubernetes quantity)."""
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
    worker_deadline_s: int = 7 * 24 * 3600
    """Longest a run's workers may live, seconds (``activeDeadlineSeconds`` of their Jobs): a
    bound on what a lost launcher can leave running."""
    worker_ttl_s: int = 3600
    """Seconds a finished worker JobSet is kept for inspection before Kubernetes deletes it."""
    schedule_timeout_s: int = 600
    """Longest a worker pod may stay unschedulable (no node with its resources, selector or
    taints) before the run fails, seconds; the time queued for admission is not counted."""
    queue_timeout_s: int = 24 * 3600
    """Longest the workers may wait for admission by Kueue or Volcano, seconds."""
    image_pull_timeout_s: int = 1800
    """Longest a scheduled worker pod may take to pull its image and start, seconds (the NPU
    image is tens of GB)."""
    image_pull_retries: int = 3
    """Failed image pulls of one pod tolerated before the run fails (the kubelet retries with
    back-off: a registry hiccup passes, a wrong name or missing credentials does not)."""

    def __post_init__(self) -> None:
        if bool(self.accelerator) != (self.accelerators_per_pod > 0):
            raise ValueError(
                f"platform {self.name!r}: accelerator={self.accelerator!r} with accelerators_per_pod="
                f"{self.accelerators_per_pod}; set both (a resource name and a count >= 1) or neither"
            )
        if self.image_tag in ("", "latest"):
            raise ValueError(f"platform {self.name!r}: image_tag={self.image_tag!r}; pin a release tag, never 'latest'")
        if self.scheduler == "kueue" and not self.queue:
            raise ValueError(f"platform {self.name!r}: scheduler='kueue' needs queue (the LocalQueue of the workers' "
                             "namespace, e.g. queue='team-rl')")
        for name in ("worker_deadline_s", "worker_ttl_s", "schedule_timeout_s", "queue_timeout_s", "image_pull_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"platform {self.name!r}: {name}={getattr(self, name)}; expected seconds >= 1")
        if self.image_pull_retries < 0 or self.accelerator_device_gid < 0:
            raise ValueError(f"platform {self.name!r}: image_pull_retries={self.image_pull_retries}, accelerator_device_gid="
                             f"{self.accelerator_device_gid}; expected >= 0")
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
        data["tolerations"] = tuple(Toleration(**t) for t in data.get("tolerations", ()))
        try:
            return cls(**data)
        except TypeError as err:  # unknown or missing field
            raise ValueError(f"platform: {err}") from None

    @property
    def image(self) -> str:
        """Image of the accelerator-bound pods (``<repository>-<name>:<tag>``)."""
        return f"{self.image_repository}-{self.name}:{self.image_tag}"

    @property
    def cpu_image(self) -> str:
        """Image of the pods without accelerators (reward, dock shards): the cpu image of the same release."""
        return f"{self.image_repository}-cpu:{self.image_tag}"


PLATFORMS: dict[str, Platform] = {
    # Ascend device plugin: nodes carry accelerator=huawei-Ascend910 and the resource huawei.com/Ascend910
    "npu": Platform(
        name="npu", accelerator=ASCEND_RESOURCE, accelerators_per_pod=8,
        node_selector={"accelerator": "huawei-Ascend910"},
        tolerations=(Toleration(key=ASCEND_RESOURCE),), stage_cpu="32", stage_memory="256Gi",
        accelerator_device_gid=1000,  # HwHiAiUser, owner of /dev/davinci* on a typical Ascend node
    ),
    # NVIDIA GPU operator: nodes carry nvidia.com/gpu.present=true; GPU pools are usually tainted
    "gpu": Platform(
        name="gpu", accelerator=NVIDIA_RESOURCE, accelerators_per_pod=8,
        node_selector={"nvidia.com/gpu.present": "true"},
        tolerations=(Toleration(key=NVIDIA_RESOURCE),), stage_cpu="32", stage_memory="256Gi",
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
