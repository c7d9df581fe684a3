"""A fake Kubernetes API (FakeKubernetesApi: the CoreV1Api / CustomObjectsApi calls the worker
backend makes, and a fake Kubeflow Trainer controller that makes a TrainJob's JobSet from its
ClusterTrainingRuntime), and offline validators: kubernetes-validate for core objects, the JobSet,
agent-sandbox Sandbox and Trainer CRDs' OpenAPI schemas (tests/launch/reference/) for JobSets,
Sandboxes, TrainJobs and runtimes.

Objects are kept as API dicts; core list calls answer real ``kubernetes.client`` model objects
(deserialized as the real client does), so the backend is tested against the real types. What
the JobSet controller, the scheduler and the kubelet would do, tests script with ``add_pod``,
``set_pod``, ``replace_pod``, ``add_event`` and ``set_jobset``.
"""

from __future__ import annotations

import copy
import itertools
import json
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

REFERENCE = Path(__file__).parent / "reference"


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


class FakeKubernetesApi:
    """State of a fake API server: objects by (kind, namespace, name), pod logs and events, a call log."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.logs: dict[str, str] = {}
        self.events: dict[str, list[dict]] = {}
        self.calls: list[tuple[str, dict]] = []
        self.created: list[dict] = []  # every body created, as sent
        self.fail_create: dict[str, int] = {}  # kind -> HTTP status to answer create with
        self.not_installed: set[str] = set()  # kinds whose API the cluster lacks (a CRD not installed): 404 to every call
        # group -> (pod status, log): what the JobSet controller and the kubelet report for every
        # member of that replicated job as soon as the JobSet is created
        self.pods_on_create: dict[str, tuple[dict, str]] = {}
        # ClusterTrainingRuntimes by name, as a site administrator applied them (cluster-scoped)
        self.runtimes: dict[str, dict] = {}
        self._client = ApiClient()
        self._suffix = itertools.count()

    # ---- the API server ----

    def create(self, kind: str, namespace: str, body: dict) -> dict:
        self.calls.append((f"create {kind}", {"namespace": namespace, "name": body["metadata"]["name"]}))
        if kind in self.not_installed:
            raise ApiException(status=404, reason="NotFound")
        if kind in self.fail_create:
            raise ApiException(status=self.fail_create[kind], reason="Refused")
        key = (kind, namespace, body["metadata"]["name"])
        if key in self.objects:
            raise ApiException(status=409, reason="AlreadyExists")
        self.created.append(copy.deepcopy(body))
        obj = copy.deepcopy(body)
        obj["metadata"]["uid"] = str(uuid.uuid4())
        self.objects[key] = obj
        if kind == "TrainJob" and body["spec"]["runtimeRef"]["name"] in self.runtimes:
            self.create("JobSet", namespace, self.trainer_jobset(obj))
        if kind == "JobSet":
            obj["status"] = {}
            for rjob in obj["spec"]["replicatedJobs"]:
                if rjob["name"] in self.pods_on_create:
                    status, log = self.pods_on_create[rjob["name"]]
                    for i in range(rjob["template"]["spec"]["parallelism"]):
                        self.add_pod(namespace, rjob["name"], i, copy.deepcopy(status), log)
        return copy.deepcopy(obj)

    def get(self, kind: str, namespace: str, name: str) -> dict:
        if (kind, namespace, name) not in self.objects:
            raise ApiException(status=404, reason="NotFound")
        return copy.deepcopy(self.objects[(kind, namespace, name)])

    def patch(self, kind: str, namespace: str, name: str, body: dict) -> dict:
        self.calls.append((f"patch {kind}", {"namespace": namespace, "name": name}))
        obj = self.objects[(kind, namespace, name)]
        obj["metadata"].update(copy.deepcopy(body.get("metadata", {})))
        return copy.deepcopy(obj)

    def listed(self, kind: str, namespace: str, selector: str | None, model: str | None = None) -> Any:
        if kind in self.not_installed:
            raise ApiException(status=404, reason="NotFound")
        items = [copy.deepcopy(o) for (k, ns, _), o in self.objects.items() if k == kind and ns == namespace and _matches(o, selector)]
        data = {"items": items, "metadata": {}}
        return self._client.deserialize(_Response(data), model) if model else data

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self.calls.append((f"delete {kind}", {"namespace": namespace, "name": name}))
        obj = self.objects.pop((kind, namespace, name), None)
        if obj is None:
            raise ApiException(status=404, reason="NotFound")
        self._collect(kind, name, obj)

    def _collect(self, kind: str, name: str, obj: dict) -> None:
        """The garbage collector: what the object owned goes with it, and what that owned."""
        uid = obj["metadata"]["uid"]
        for key, other in list(self.objects.items()):
            if key not in self.objects:
                continue
            owners = other["metadata"].get("ownerReferences") or []
            owned_pod = kind == "JobSet" and key[0] == "Pod" and other["metadata"]["labels"].get("jobset.sigs.k8s.io/jobset-name") == name
            if owned_pod or any(o.get("uid") == uid for o in owners):
                del self.objects[key]
                self._collect(key[0], key[2], other)

    def core(self) -> FakeCoreV1Api:
        return FakeCoreV1Api(self)

    def custom(self) -> FakeCustomObjectsApi:
        return FakeCustomObjectsApi(self)

    # ---- what the Trainer, the JobSet controller, the scheduler and the kubelet would do ----

    def trainer_jobset(self, trainjob: dict) -> dict:
        """The JobSet a Trainer makes of ``trainjob``: its runtime's template, named and owned as the TrainJob, with the
        TrainJob's ``runtimePatches`` applied (labels merged, each container's env merged by name)."""
        runtime = self.runtimes[trainjob["spec"]["runtimeRef"]["name"]]
        template = copy.deepcopy(runtime["spec"]["template"])
        meta = trainjob["metadata"]
        labels = dict(template.get("metadata", {}).get("labels", {}))
        jobs = {r["name"]: r for r in template["spec"]["replicatedJobs"]}
        for patch in trainjob["spec"].get("runtimePatches", []):
            tpl = patch["trainingRuntimeSpec"]["template"]
            labels |= tpl.get("metadata", {}).get("labels", {})
            for rpatch in tpl["spec"]["replicatedJobs"]:
                job = jobs[rpatch["name"]]["template"]
                job["metadata"]["labels"] |= rpatch["template"]["metadata"]["labels"]
                pod = job["spec"]["template"]
                pod["metadata"]["labels"] |= rpatch["template"]["spec"]["template"]["metadata"]["labels"]
                containers = {c["name"]: c for c in pod["spec"]["containers"]}
                for cpatch in rpatch["template"]["spec"]["template"]["spec"]["containers"]:
                    env = {e["name"]: e for e in containers[cpatch["name"]].get("env", [])} | {e["name"]: e for e in cpatch["env"]}
                    containers[cpatch["name"]]["env"] = list(env.values())
        owner = {"apiVersion": trainjob["apiVersion"], "kind": "TrainJob", "name": meta["name"], "uid": meta["uid"],
                 "controller": True}
        return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
                "metadata": {"name": meta["name"], "namespace": meta["namespace"], "labels": labels, "ownerReferences": [owner]},
                "spec": template["spec"]}

    def set_trainjob(self, namespace: str, **fields: Any) -> None:
        [trainjob] = [o for (k, ns, _), o in self.objects.items() if k == "TrainJob" and ns == namespace]
        trainjob.update(copy.deepcopy(fields))

    def jobset(self, namespace: str) -> dict:
        [obj] = [o for (k, ns, _), o in self.objects.items() if k == "JobSet" and ns == namespace]
        return obj

    def add_pod(self, namespace: str, group: str, index: int, status: dict, log: str = "") -> str:
        """A pod of member ``index`` of replicated job ``group``, as the Job controller names and labels it."""
        jobset = self.jobset(namespace)
        [rjob] = [r for r in jobset["spec"]["replicatedJobs"] if r["name"] == group]
        template = rjob["template"]["spec"]["template"]
        js = jobset["metadata"]["name"]
        name = f"{js}-{group}-0-{index}-{next(self._suffix):05d}"
        self.objects[("Pod", namespace, name)] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4()),
                         "labels": {**template["metadata"]["labels"], "jobset.sigs.k8s.io/jobset-name": js,
                                    "batch.kubernetes.io/job-completion-index": str(index)},
                         "annotations": {**template["metadata"].get("annotations", {}),
                                         "batch.kubernetes.io/job-completion-index": str(index)}},
            "spec": {"containers": [{"name": "worker", "image": template["spec"]["containers"][0]["image"]}],
                     "hostname": f"{js}-{group}-0-{index}", "subdomain": js},
            "status": status,
        }
        self.logs[name] = log
        return name

    def pod_name(self, namespace: str, group: str, index: int) -> str:
        [name] = [n for (k, ns, n), o in self.objects.items() if k == "Pod" and ns == namespace
                  and o["metadata"]["labels"].get("dockrl.io/group") == group
                  and o["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] == str(index)]
        return name

    def set_pod(self, namespace: str, name: str, status: dict | None = None, **metadata: Any) -> None:
        pod = self.objects[("Pod", namespace, name)]
        if status is not None:
            pod["status"] = status
        pod["metadata"].update(metadata)

    def replace_pod(self, namespace: str, group: str, index: int, status: dict) -> str:
        """The old pod of the member gone (a drain, a preemption), a new one in its place."""
        del self.objects[("Pod", namespace, self.pod_name(namespace, group, index))]
        return self.add_pod(namespace, group, index, status)

    def add_event(self, pod: str, reason: str, message: str, count: int = 1) -> None:
        self.events.setdefault(pod, []).append({
            "metadata": {"name": f"{pod}.{len(self.events.get(pod, []))}"}, "involvedObject": {"kind": "Pod", "name": pod},
            "reason": reason, "message": message, "count": count, "type": "Warning",
        })

    def set_workload(self, namespace: str, conditions: list[dict]) -> str:
        """The Kueue Workload of the namespace's JobSet (named and labelled as Kueue does) with ``conditions``."""
        jobset = self.jobset(namespace)
        name = f"jobset-{jobset['metadata']['name']}-1a2b3"
        self.objects[("Workload", namespace, name)] = {
            "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload",
            "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4()),
                         "labels": {"kueue.x-k8s.io/job-uid": jobset["metadata"]["uid"]}},
            "status": {"conditions": [{"status": "False", "reason": "", "message": "", **c} for c in conditions]},
        }
        return name

    def sandbox_ready(self, namespace: str, name: str, *, ready: bool = True) -> None:
        """What the agent-sandbox controller and the kubelet do for Sandbox ``name``: its pod (named and labelled as its
        template says) running, and its ``Ready`` condition (pod ready, Service made) ``ready``."""
        box = self.objects[("Sandbox", namespace, name)]
        template = box["spec"]["podTemplate"]
        pod = self.objects.get(("Pod", namespace, name))
        self.objects[("Pod", namespace, name)] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": pod["metadata"]["uid"] if pod else str(uuid.uuid4()),
                         "labels": dict(template["metadata"]["labels"]),
                         "annotations": dict(template["metadata"].get("annotations", {}))},
            "spec": {"containers": [{"name": c["name"], "image": c["image"]} for c in template["spec"]["containers"]]},
            "status": {"phase": "Running", "containerStatuses": [{"name": "worker", "image": "x", "imageID": "", "ready": ready,
                                                                  "restartCount": 0, "state": {"running": {}}}]},
        }
        box["status"] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": "2026-01-01T00:00:00Z",
                                         "reason": "DependenciesReady" if ready else "DependenciesNotReady",
                                         "message": "Pod is Ready; Service Exists" if ready else "Pod is Running but not Ready"}]}

    def set_jobset(self, namespace: str, *, status: dict | None = None, suspend: bool | None = None) -> None:
        jobset = self.jobset(namespace)
        if status is not None:
            jobset["status"] = status
        if suspend is not None:
            jobset["spec"]["suspend"] = suspend


class FakeCoreV1Api:
    def __init__(self, api: FakeKubernetesApi):
        self.api = api

    # Secrets: create only, as the launcher's Role allows (manifests/base/rbac.yaml)
    def create_namespaced_secret(self, namespace, body, **_):
        return self.api.create("Secret", namespace, body)

    def list_namespaced_pod(self, namespace, label_selector=None, **_):
        return self.api.listed("Pod", namespace, label_selector, "V1PodList")

    def list_namespaced_event(self, namespace, field_selector="", **_):
        key, _, pod = field_selector.partition("=")
        assert key == "involvedObject.name", field_selector
        data = {"items": self.api.events.get(pod, []), "metadata": {}}
        return self.api._client.deserialize(_Response(data), "CoreV1EventList")

    def read_namespaced_pod_log(self, name, namespace, container=None, tail_lines=None, previous=False, **_):
        self.api.calls.append(("read log", {"name": name, "container": container, "previous": previous, "tail_lines": tail_lines}))
        if ("Pod", namespace, name) not in self.api.objects:
            raise ApiException(status=404, reason="NotFound")
        lines = self.api.logs.get(name, "").splitlines(keepends=True)
        return "".join(deque(lines, maxlen=tail_lines) if tail_lines else lines)


_KINDS = {("jobset.x-k8s.io", "jobsets"): "JobSet", ("trainer.kubeflow.org", "trainjobs"): "TrainJob",
          ("scheduling.volcano.sh", "podgroups"): "PodGroup", ("kueue.x-k8s.io", "workloads"): "Workload",
          ("networking.k8s.io", "networkpolicies"): "NetworkPolicy", ("agents.x-k8s.io", "sandboxes"): "Sandbox"}


class FakeCustomObjectsApi:
    def __init__(self, api: FakeKubernetesApi):
        self.api = api

    def create_namespaced_custom_object(self, group, version, namespace, plural, body, **_):
        assert body["apiVersion"] == f"{group}/{version}"
        return self.api.create(_KINDS[(group, plural)], namespace, body)

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, **_):
        return self.api.get(_KINDS[(group, plural)], namespace, name)

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body, **_):
        return self.api.patch(_KINDS[(group, plural)], namespace, name, body)

    def list_namespaced_custom_object(self, group, version, namespace, plural, label_selector=None, **_):
        return self.api.listed(_KINDS[(group, plural)], namespace, label_selector)

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, propagation_policy=None, **_):
        self.api.delete(_KINDS[(group, plural)], namespace, name)


@pytest.fixture
def cluster() -> FakeKubernetesApi:
    return FakeKubernetesApi()


def _strict(schema: Any) -> Any:
    """The CRD's structural schema with unknown fields refused (the API server would drop them
    silently: a misspelt field must fail here), and nothing else changed."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="session")
def validate_jobset():
    """``validate_jobset(obj)``: the JobSet CRD's OpenAPI v3 schema (JobSet v0.9.1, v1alpha2) with
    ``jsonschema``, unknown fields refused, failing with the path and message."""
    import jsonschema

    crd = yaml.safe_load((REFERENCE / "jobset-v0.9.1-crd.yaml").read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    validator = jsonschema.Draft202012Validator(schema)

    def check(obj: dict) -> None:
        assert obj["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and obj["kind"] == "JobSet"
        errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.path))
        if errors:
            pytest.fail("JobSet invalid against the v0.9.1 CRD:\n" + "\n".join(
                f"  {'/'.join(map(str, e.path)) or '<root>'}: {e.message[:300]}" for e in errors[:10]))

    return check


def _validator(crd_file: str, kind: str, version: str):
    """``check(obj)``: the OpenAPI v3 schema of ``crd_file``'s ``version`` with ``jsonschema``, unknown fields refused,
    failing with the path and message."""
    import jsonschema

    crd = yaml.safe_load((REFERENCE / crd_file).read_text())
    [served] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    validator = jsonschema.Draft202012Validator(_strict(served["schema"]["openAPIV3Schema"]),
                                                format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)

    def check(obj: dict) -> None:
        assert obj["apiVersion"] == f"{crd['spec']['group']}/{version}" and obj["kind"] == kind
        errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.path))
        if errors:
            pytest.fail(f"{kind} invalid against {crd_file}:\n" + "\n".join(
                f"  {'/'.join(map(str, e.path)) or '<root>'}: {e.message[:300]}" for e in errors[:10]))

    return check


@pytest.fixture(scope="session")
def validate_sandbox():
    """``validate_sandbox(obj)``: the agent-sandbox Sandbox CRD's OpenAPI v3 schema (v1beta1), unknown fields refused."""
    return _validator("agent-sandbox-sandboxes-crd.yaml", "Sandbox", "v1beta1")


@pytest.fixture(scope="session")
def validate_trainer():
    """``validate_trainer(obj)``: a TrainJob or ClusterTrainingRuntime against Kubeflow Trainer's CRDs
    (trainer.kubeflow.org/v1alpha1, tests/launch/reference/), unknown fields refused."""
    checks = {kind: _validator(f"kubeflow-trainer-8c0f505-{plural}-crd.yaml", kind, "v1alpha1")
              for kind, plural in (("TrainJob", "trainjobs"), ("ClusterTrainingRuntime", "clustertrainingruntimes"))}
    return lambda obj: checks[obj["kind"]](obj)


K8S_VERSIONS = ("1.28.0", "1.37.0")  # the oldest with the pod-index label the workers read, and the newest schema


@pytest.fixture(scope="session")
def validate_strict():
    """``validate_strict(obj, versions=None)``: kubernetes-validate --strict against each of ``versions`` (None: K8S_VERSIONS),
    failing with a short message."""
    import kubernetes_validate

    def check(obj: dict, versions: tuple[str, ...] | None = None) -> None:
        for version in versions or K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                where = "/".join(str(p) for p in err.path)
                pytest.fail(f"{obj.get('kind')} {obj.get('metadata', {}).get('name')} invalid for Kubernetes {version} "
                            f"at {where or '<root>'}: {err.message}")

    return check
