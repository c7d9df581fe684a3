"""A run's sandbox executors as agent-sandbox ``Sandbox`` pods (``env.sandbox.backend=pod``): rendering only.

Where a worker pod cannot give the sandbox its layers (the container runtime's default seccomp profile refuses
``unshare``; no Landlock), the programs of the model run in a pod that holds nothing worth reaching.
``render_sandboxes`` turns each sandbox executor group (``backend.sandbox_group``, built by
``distributed.executor_group``) into two objects, created before the JobSet whose stages call them:

* a **NetworkPolicy** ``<sandbox>``: the executor's pod takes connections only from the pods of the one stage it
  serves (the JobSet name label, which the JobSet controller sets, and the stage's group label), on its port only,
  and makes none: no egress at all, DNS included (it needs none). So a program reaches no shard, object store, API
  server or other pod, whatever layers the node gives it inside;
* a **Sandbox** (``agents.x-k8s.io/v1beta1``, kubernetes-sigs/agent-sandbox) ``<jobset>-<group>``: one pod running
  ``dockrl sandbox serve --pod`` from the run's CPU image, with a headless Service of the same name
  (``spec.service``), so the stage reaches it at ``<sandbox>.<namespace>.svc``. Its pod: non-root (the images'
  uid), every capability dropped, no privilege escalation, seccomp ``RuntimeDefault``, a read-only root file
  system, no service-account token, no service links, one ``emptyDir`` at ``/tmp`` (the programs' folders) of the
  group's ephemeral storage, requests equal to limits for cpu, memory and ephemeral storage (the group's, sized
  from ``env.sandbox``: ``pod_slots`` programs and the server), ``restartPolicy: Never`` (a lost executor fails
  the run as any lost worker), a readiness probe on ``/healthz``. The only credential in it is the executor's
  secret, one key of the run's Secret (``secretKeyRef``: the pod sees no other key). Owned by the launcher pod
  like the JobSet, and ``shutdownTime`` at ``Platform.worker_deadline_s`` from now with ``shutdownPolicy: Delete``,
  so nothing outlives a lost launcher by more than the workers' deadline.

Its pod carries the run's labels (``dockrl.io/run``, ``dockrl.io/group``), so the backend watches it as any
worker (failures, log tail) and counts it among the members ``wait_ready`` waits for; ``wait_ready`` also waits for
each Sandbox's ``Ready`` condition (its pod ready, its Service made).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any, Sequence

from dockrl.launch.backend import WorkerGroup, served_stage
from dockrl.launch.jobset import (
    GROUP_LABEL,
    ISTIO_INJECT,
    JOBSET_NAME_LABEL,
    POLICY_GROUP,
    POLICY_VERSION,
    RUN_LABEL,
    jobset_name,
    run_labels,
)
from dockrl.launch.platform import Platform
from dockrl.launch.pod_spec import CONTAINER, WORKER_UID, arch_affinity

SANDBOX_GROUP, SANDBOX_VERSION, SANDBOX_PLURAL = "agents.x-k8s.io", "v1beta1", "sandboxes"
PROGRAMS_VOLUME = "programs"
"""The executor pod's one volume, at ``/tmp``: its programs' folders."""


def sandbox_name(run_id: str, group: str) -> str:
    """The Sandbox (and its pod and Service) of sandbox executor group ``group``: ``<jobset>-<group>``."""
    return f"{jobset_name(run_id)}-{group}"


def sandbox_host(run_id: str, group: str, namespace: str) -> str:
    """DNS name of the executor of ``group``: its Sandbox's headless Service."""
    return f"{sandbox_name(run_id, group)}.{namespace}.svc"


def _pod(group: WorkerGroup, platform: Platform, secret: str) -> dict[str, Any]:
    sized = {"cpu": group.cpu, "memory": group.memory, "ephemeral-storage": group.ephemeral_storage}
    container: dict[str, Any] = {
        "name": CONTAINER, "image": platform.image_of("cpu"), "imagePullPolicy": "IfNotPresent",
        "args": [*group.command, "--pod"],  # the executor checks that it is the pod rendered here, or refuses to start
        "env": [{"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": k}}} for k in sorted(group.secret_env)],
        "ports": [{"name": "executor", "containerPort": group.port, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": group.port}, "periodSeconds": 2, "failureThreshold": 3},
        "resources": {"requests": sized, "limits": dict(sized)},
        "volumeMounts": [{"name": PROGRAMS_VOLUME, "mountPath": "/tmp"}],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": WORKER_UID, "runAsGroup": WORKER_UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "terminationGracePeriodSeconds": 5,
        "affinity": arch_affinity(platform.architectures_of("cpu")),
        "containers": [container],
        "volumes": [{"name": PROGRAMS_VOLUME, "emptyDir": {"sizeLimit": group.ephemeral_storage}}],
    }
    if platform.image_pull_secret:
        spec["imagePullSecrets"] = [{"name": platform.image_pull_secret}]
    return spec


def render_sandboxes(executors: Sequence[WorkerGroup], *, run_id: str, namespace: str, platform: Platform, secret: dict[str, Any],
                     owner: dict[str, Any] | None = None, now: float | None = None) -> list[dict[str, Any]]:
    """The NetworkPolicy and the Sandbox of each sandbox executor group (module docstring), in creation order.

    Args:
        executors: groups named ``sandbox-<stage>`` (``backend.sandbox_group``), one member each.
        secret: the run's Secret as rendered (``jobset.render_jobset``): it must hold every executor's ``secret_env``.
        owner: owner reference of every object (the launcher pod), or None.
        now: epoch seconds the ``shutdownTime`` counts from (default: now).

    Raises:
        ValueError: a group is no sandbox executor, has more than one member or no port, or its secret is no key of the
            run's Secret (no stage it serves holds it).
    """
    meta: dict[str, Any] = {"namespace": namespace, "labels": run_labels(run_id)}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    shutdown = datetime.fromtimestamp((time.time() if now is None else now) + platform.worker_deadline_s, UTC)
    objects: list[dict[str, Any]] = []
    for group in executors:
        stage = served_stage(group.name)
        if not stage or group.replicas != 1 or not group.port:
            raise ValueError(f"worker group {group.name!r}: a sandbox executor is a group 'sandbox-<stage>' of one member with a port")
        unheld = sorted(set(group.secret_env) - set(secret.get("stringData", {})))
        if unheld:
            raise ValueError(f"sandbox executor {group.name!r}: its secret {unheld} is no key of the run's Secret "
                             f"{secret['metadata']['name']}: no stage it serves ({stage!r}) holds it")
        name, labels = sandbox_name(run_id, group.name), run_labels(run_id, group.name)
        objects.append({
            "apiVersion": f"{POLICY_GROUP}/{POLICY_VERSION}", "kind": "NetworkPolicy", "metadata": {"name": name, **meta},
            "spec": {  # a podSelector without namespaceSelector: pods of this namespace only
                "podSelector": {"matchLabels": {RUN_LABEL: run_id, GROUP_LABEL: group.name}},
                "policyTypes": ["Ingress", "Egress"],  # and no egress rule: no connection out at all
                "ingress": [{"from": [{"podSelector": {"matchLabels": {JOBSET_NAME_LABEL: jobset_name(run_id), GROUP_LABEL: stage}}}],
                             "ports": [{"protocol": "TCP", "port": group.port}]}],
                "egress": [],
            },
        })
        objects.append({
            "apiVersion": f"{SANDBOX_GROUP}/{SANDBOX_VERSION}", "kind": "Sandbox", "metadata": {"name": name, **meta},
            "spec": {
                "podTemplate": {"metadata": {"labels": {**labels, ISTIO_INJECT: "false"}, "annotations": {ISTIO_INJECT: "false"}},
                                "spec": _pod(group, platform, secret["metadata"]["name"])},
                "service": True,
                "shutdownTime": shutdown.strftime("%Y-%m-%dT%H:%M:%SZ"),
                "shutdownPolicy": "Delete",
            },
        })
    return objects
