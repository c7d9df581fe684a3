"""A fake Kubernetes API (the few CoreV1Api / AppsV1Api calls the worker backend makes).

Objects are kept as API dicts; list calls answer real ``kubernetes.client`` model objects
(deserialized as the real client does), so the backend is tested against the real types.
"""

from __future__ import annotations

import copy
import json
from collections import deque
from typing import Any

import pytest
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException


def _matches(obj: dict, selector: str | None) -> bool:
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, (selector or "").split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class _Response:  # what ApiClient.deserialize reads
    def __init__(self, data: Any):
        self.data = json.dumps(data)


class FakeCluster:
    """Shared state of the fake API: objects by (kind, namespace, name), pod logs, call log."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.logs: dict[tuple[str, bool], str] = {}
        self.calls: list[tuple[str, dict]] = []
        self.fail_create: dict[str, int] = {}  # kind -> HTTP status to answer create with
        # group label -> (pod status, log, previous container's log): what the StatefulSet controller
        # and the kubelet would report for every member as soon as the group's StatefulSet is created
        self.pods_on_create: dict[str, tuple[dict, str, str]] = {}
        self._client = ApiClient()

    def create(self, kind: str, namespace: str, body: dict) -> dict:
        self.calls.append((f"create {kind}", {"namespace": namespace, "name": body["metadata"]["name"]}))
        if kind in self.fail_create:
            raise ApiException(status=self.fail_create[kind], reason="Refused")
        key = (kind, namespace, body["metadata"]["name"])
        if key in self.objects:
            raise ApiException(status=409, reason="AlreadyExists")
        obj = copy.deepcopy(body)
        if kind == "StatefulSet":
            obj["status"] = {"replicas": 0, "readyReplicas": 0}
        self.objects[key] = obj
        group = obj["metadata"]["labels"].get("dockrl.io/group")
        if kind == "StatefulSet" and group in self.pods_on_create:
            status, log, previous_log = self.pods_on_create[group]
            for i in range(obj["spec"]["replicas"]):
                self.add_pod(namespace, obj["metadata"]["name"], i, copy.deepcopy(status), log, previous_log)
        return obj

    def listed(self, kind: str, namespace: str, selector: str | None, model: str):
        items = [o for (k, ns, _), o in self.objects.items() if k == kind and ns == namespace and _matches(o, selector)]
        return self._client.deserialize(_Response({"items": items, "metadata": {}}), model)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self.calls.append((f"delete {kind}", {"namespace": namespace, "name": name}))
        if self.objects.pop((kind, namespace, name), None) is None:
            raise ApiException(status=404, reason="NotFound")
        if kind == "StatefulSet":  # the garbage collector removes its pods
            for key in [k for k in self.objects if k[0] == "Pod" and k[2].rsplit("-", 1)[0] == name]:
                del self.objects[key]

    def core_api(self) -> "FakeCoreV1Api":
        return FakeCoreV1Api(self)

    def apps_api(self) -> "FakeAppsV1Api":
        return FakeAppsV1Api(self)

    # ---- what the kubelet and the StatefulSet controller would do ----

    def set_ready(self, namespace: str, name: str, ready: int) -> None:
        self.objects[("StatefulSet", namespace, name)]["status"]["readyReplicas"] = ready

    def add_pod(self, namespace: str, statefulset: str, index: int, status: dict, log: str = "", previous_log: str = "") -> str:
        sts = self.objects[("StatefulSet", namespace, statefulset)]
        name = f"{statefulset}-{index}"
        self.objects[("Pod", namespace, name)] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(sts["spec"]["template"]["metadata"]["labels"])},
            "spec": {"containers": [{"name": "worker", "image": "x"}]},
            "status": status,
        }
        self.logs[(name, False)], self.logs[(name, True)] = log, previous_log
        return name


class FakeCoreV1Api:
    def __init__(self, cluster: FakeCluster):
        self.cluster = cluster

    def create_namespaced_service(self, namespace, body, **_):
        return self.cluster.create("Service", namespace, body)

    def list_namespaced_service(self, namespace, label_selector=None, **_):
        return self.cluster.listed("Service", namespace, label_selector, "V1ServiceList")

    def delete_namespaced_service(self, name, namespace, **_):
        self.cluster.delete("Service", namespace, name)

    def list_namespaced_pod(self, namespace, label_selector=None, **_):
        return self.cluster.listed("Pod", namespace, label_selector, "V1PodList")

    def read_namespaced_pod_log(self, name, namespace, container=None, tail_lines=None, previous=False, **_):
        self.cluster.calls.append(("read log", {"name": name, "container": container, "previous": previous, "tail_lines": tail_lines}))
        if (name, previous) not in self.cluster.logs or ("Pod", namespace, name) not in self.cluster.objects:
            raise ApiException(status=400, reason="BadRequest")
        lines = self.cluster.logs[(name, previous)].splitlines(keepends=True)
        return "".join(deque(lines, maxlen=tail_lines) if tail_lines else lines)


class FakeAppsV1Api:
    def __init__(self, cluster: FakeCluster):
        self.cluster = cluster

    def create_namespaced_stateful_set(self, namespace, body, **_):
        return self.cluster.create("StatefulSet", namespace, body)

    def list_namespaced_stateful_set(self, namespace, label_selector=None, **_):
        return self.cluster.listed("StatefulSet", namespace, label_selector, "V1StatefulSetList")

    def delete_namespaced_stateful_set(self, name, namespace, **_):
        self.cluster.delete("StatefulSet", namespace, name)


@pytest.fixture
def cluster() -> FakeCluster:
    return FakeCluster()


K8S_VERSIONS = ("1.28.0", "1.37.0")  # the oldest with the pod-index label the workers read, and the newest schema


@pytest.fixture(scope="session")
def validate_strict():
    """``validate_strict(obj)``: kubernetes-validate --strict against K8S_VERSIONS, failing with a short message."""
    import kubernetes_validate

    def check(obj: dict) -> None:
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                where = "/".join(str(p) for p in err.path)
                pytest.fail(f"{obj.get('kind')} {obj.get('metadata', {}).get('name')} invalid for Kubernetes {version} "
                            f"at {where or '<root>'}: {err.message}")

    return check
