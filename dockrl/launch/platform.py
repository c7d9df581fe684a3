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
    """CPU request and limit of a pod holding a model (rollout, reference, actor; Kubernetes quantity)."""
    stage_memory: str = "16Gi"
    """Memory request and limit of a pod holding a model (Kubernetes quantity)."""

    def __post_init__(self) -> None:
        if bool(self.accelerator) != (self.accelerators_per_pod > 0):
            raise ValueError(
                f"platform {self.name!r}: accelerator={self.accelerator!r} with accelerators_per_pod="
                f"{self.accelerators_per_pod}; set both (a resource name and a count >= 1) or neither"
            )
        if self.image_tag in ("", "latest"):
            raise ValueError(f"platform {self.name!r}: image_tag={self.image_tag!r}; pin a release tag, never 'latest'")
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
