"""The launcher pod, as the Kubernetes backend finds it from inside: its namespace, name and uid.

The pipeline's train task (the launcher) sets ``POD_NAMESPACE``, ``POD_NAME``, ``POD_UID`` and
``POD_IP`` from the downward API. The launcher pod owns the run's JobSet (``OwnerPod``), so the
workers go when it goes; and since an owner reference cannot cross namespaces, the workers live
in the launcher's namespace (``launcher_namespace``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class OwnerPod:
    """The launcher pod that owns a run's JobSet (its name and uid, from the downward API)."""

    def __init__(self, *, name: str, uid: str):
        self.name, self.uid = name, uid

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OwnerPod) and (self.name, self.uid) == (other.name, other.uid)

    def __repr__(self) -> str:
        return f"OwnerPod(name={self.name!r}, uid={self.uid!r})"

    def reference(self) -> dict[str, Any]:
        # no blockOwnerDeletion: it would need update rights on pods/finalizers for the launcher
        return {"apiVersion": "v1", "kind": "Pod", "name": self.name, "uid": self.uid}


def launcher_namespace(namespace: str = "") -> tuple[str, OwnerPod | None]:
    """The namespace of a run's workers and the pod that owns them (``KubernetesBackend.from_cluster``).

    The namespace defaults to this pod's own: ``POD_NAMESPACE`` or the service account's
    namespace; the owner is the pod named by ``POD_NAME`` / ``POD_UID`` (None outside such a pod).

    Raises:
        ValueError: no namespace given or found; or, in an owner pod, a ``namespace`` other
            than the pod's own (the workers of a run live in its launcher's namespace).
    """
    own = os.environ.get("POD_NAMESPACE", "")
    if not own and Path(SA_NAMESPACE_FILE).is_file():
        own = Path(SA_NAMESPACE_FILE).read_text().strip()
    namespace = namespace or own
    if not namespace:
        raise ValueError("kubernetes backend: no namespace given and none found (POD_NAMESPACE, service account)")
    owner = None
    if os.environ.get("POD_NAME") and os.environ.get("POD_UID"):
        owner = OwnerPod(name=os.environ["POD_NAME"], uid=os.environ["POD_UID"])
    if owner is not None and own and namespace != own:
        # Kubernetes treats an owner reference to another namespace's pod as absent: the
        # garbage collector would delete the workers as soon as they exist
        raise ValueError(f"kubernetes backend: namespace={namespace!r}, but the launcher pod {owner.name} runs in {own!r}; "
                         "a run's workers live in its launcher's namespace (the JobSet is owned by the launcher pod, "
                         "and an owner reference cannot cross namespaces; the launcher's Role, the NetworkPolicy, the shared "
                         "volume and the Secrets are namespaced too): leave namespace empty, or run the pipeline in that namespace")
    return namespace, owner
