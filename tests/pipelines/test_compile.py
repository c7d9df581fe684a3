"""The compiled pipeline IR: strict protobuf parsing, platform settings where Kubeflow reads them, golden file.

Regenerate the golden file after an intended change of the pipeline or a component:
``DOCKRL_UPDATE_GOLDEN=1 python -m pytest tests/pipelines/test_compile.py``.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml
from google.protobuf import json_format
from kfp.kubernetes.kubernetes_executor_config_pb2 import KubernetesExecutorConfig
from kfp.pipeline_spec import pipeline_spec_pb2 as pb

from dockrl.launch.platform import CPU_IMAGE, PLATFORMS, Platform

GOLDEN = Path(__file__).parent / "golden" / "grpo_npu.yaml"
STEPS = ["prepare-dataset", "train", "export-model", "evaluate"]


def parse_ir(path: Path):
    """(PipelineSpec, deployment config, {executor: KubernetesExecutorConfig}), all parsed strictly."""
    docs = list(yaml.safe_load_all(path.read_text()))
    assert len(docs) == 2, "expected the pipeline spec and a platform spec"
    spec = json_format.ParseDict(docs[0], pb.PipelineSpec(), ignore_unknown_fields=False)
    deployment = json_format.ParseDict(
        json_format.MessageToDict(spec.deployment_spec), pb.PipelineDeploymentConfig(), ignore_unknown_fields=False)
    platform = json_format.ParseDict(docs[1], pb.PlatformSpec(), ignore_unknown_fields=False)
    executors = platform.platforms["kubernetes"].deployment_spec.executors
    k8s = {name: json_format.ParseDict(json_format.MessageToDict(cfg), KubernetesExecutorConfig(), ignore_unknown_fields=False)
           for name, cfg in executors.items()}
    return spec, deployment, k8s


def test_train_task_carries_npu_accelerators_scheduling_and_credentials(compiled_npu):
    spec, deployment, k8s = parse_ir(compiled_npu)
    npu = PLATFORMS["npu"]
    train = deployment.executors["exec-train"].container
    assert train.image == npu.image
    assert train.resources.accelerator.resource_type == "huawei.com/Ascend910"
    assert train.resources.accelerator.resource_count == "8"

    cfg = k8s["exec-train"]
    assert dict(cfg.node_selector.labels) == {"accelerator": "huawei-Ascend910"}
    assert [(t.key, t.operator, t.effect) for t in cfg.tolerations] == [("huawei.com/Ascend910", "Exists", "NoSchedule")]
    [secret] = cfg.secret_as_env
    assert secret.secret_name == "dockrl-object-store" and not secret.optional
    assert {(k.secret_key, k.env_var) for k in secret.key_to_env} == {
        ("AWS_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID"), ("AWS_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY"),
        ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL")}
    assert {(f.name, f.field_path) for f in cfg.field_path_as_env} == {
        ("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace"), ("POD_UID", "metadata.uid"),
        ("POD_IP", "status.podIP")}  # the workers reach the launcher's weight channel store there
    # the shared volume of the run folder, where the worker pods mount it too
    assert [(v.constant, v.mount_path) for v in cfg.pvc_mount] == [("dockrl-shared", "/mnt/dockrl")]
    # the launcher learns its run id (the workers' label), namespace and the worker pods' platform
    inputs = spec.components["comp-exit-handler-1"].dag.tasks["train"].inputs.parameters
    assert inputs["run_id"].runtime_value.constant.string_value == "{{$.pipeline_job_uuid}}"
    assert Platform.from_json(inputs["platform"].runtime_value.constant.string_value) == npu
    assert dict(cfg.pod_metadata.labels) == {"app.kubernetes.io/part-of": "dockrl"}
    # nothing but the launcher gets accelerators or the credentials
    assert set(k8s) == {"exec-train", "exec-teardown-workers"}
    for name, executor in deployment.executors.items():
        if name != "exec-train":
            assert executor.container.image == CPU_IMAGE
            assert not executor.container.resources.HasField("accelerator")


def test_steps_run_in_order_inside_an_exit_handler_that_tears_workers_down(compiled_npu):
    spec, deployment, _ = parse_ir(compiled_npu)
    root = spec.root.dag.tasks
    assert set(root) == {"exit-handler-1", "teardown-workers"}
    teardown = root["teardown-workers"]
    assert teardown.trigger_policy.strategy == pb.PipelineTaskSpec.TriggerPolicy.ALL_UPSTREAM_TASKS_COMPLETED
    assert teardown.inputs.parameters["status"].task_final_status.producer_task == "exit-handler-1"
    assert teardown.inputs.parameters["run_id"].runtime_value.constant.string_value == "{{$.pipeline_job_uuid}}"
    body = spec.components["comp-exit-handler-1"].dag.tasks
    assert set(body) == set(STEPS)
    assert list(body["train"].dependent_tasks) == ["prepare-dataset"]
    assert list(body["export-model"].dependent_tasks) == ["train"]
    assert set(body["evaluate"].dependent_tasks) == {"export-model", "prepare-dataset"}
    assert not body["train"].caching_options.enable_cache
    params = spec.root.input_definitions.parameters
    assert params["config_overrides"].parameter_type == pb.ParameterType.LIST
    assert list(params["config_overrides"].default_value.list_value.values) == []
    assert params["worker_backend"].default_value.string_value == "local"
    for name, executor in deployment.executors.items():  # images carry kfp: nothing installed at pod start
        assert "pip install" not in " ".join(executor.container.command), name


@pytest.mark.parametrize("platform, resource", [("gpu", "nvidia.com/gpu"), ("cpu", None)])
def test_other_platforms(platform, resource, tmp_path):
    from pipelines.grpo import compile_pipeline

    _, deployment, k8s = parse_ir(compile_pipeline(tmp_path / f"{platform}.yaml", platform=platform))
    train = deployment.executors["exec-train"].container
    assert train.image == PLATFORMS[platform].image
    if resource:
        assert train.resources.accelerator.resource_type == resource
        assert dict(k8s["exec-train"].node_selector.labels) == {"nvidia.com/gpu.present": "true"}
    else:
        assert not train.resources.HasField("accelerator")
        assert not k8s["exec-train"].node_selector.labels and not k8s["exec-train"].tolerations
    assert k8s["exec-train"].secret_as_env[0].secret_name == "dockrl-object-store"


def test_compiled_for_stage_pods_the_launcher_holds_no_accelerators(tmp_path):
    from pipelines.grpo import compile_pipeline

    spec, deployment, k8s = parse_ir(compile_pipeline(tmp_path / "k8s.yaml", platform="npu", worker_backend="kubernetes"))
    train = deployment.executors["exec-train"].container
    assert train.image == CPU_IMAGE and not train.resources.HasField("accelerator")
    cfg = k8s["exec-train"]
    assert not cfg.node_selector.labels and not cfg.tolerations
    # still what the launcher needs to start the pods: credentials, shared volume, its own pod
    assert cfg.secret_as_env[0].secret_name == "dockrl-object-store" and cfg.pvc_mount[0].mount_path == "/mnt/dockrl"
    assert "POD_IP" in {f.name for f in cfg.field_path_as_env}
    assert spec.root.input_definitions.parameters["worker_backend"].default_value.string_value == "kubernetes"
    inputs = spec.components["comp-exit-handler-1"].dag.tasks["train"].inputs.parameters
    assert Platform.from_json(inputs["platform"].runtime_value.constant.string_value) == PLATFORMS["npu"]  # the pods' platform
    with pytest.raises(ValueError, match="worker_backend: got 'slurm'"):
        compile_pipeline(tmp_path / "x.yaml", worker_backend="slurm")


def test_strict_parsing_rejects_a_misspelt_field(compiled_npu):
    docs = list(yaml.safe_load_all(compiled_npu.read_text()))
    bad = copy.deepcopy(docs[1])
    bad["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-train"]["nodeSelecter"] = {"labels": {}}
    cfg = bad["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-train"]
    with pytest.raises(json_format.ParseError, match="nodeSelecter"):
        json_format.ParseDict(cfg, KubernetesExecutorConfig(), ignore_unknown_fields=False)


def test_matches_golden(compiled_npu):
    text = compiled_npu.read_text()
    if os.environ.get("DOCKRL_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert GOLDEN.is_file(), f"no golden file: run with DOCKRL_UPDATE_GOLDEN=1 to write {GOLDEN}"
    assert list(yaml.safe_load_all(text)) == list(yaml.safe_load_all(GOLDEN.read_text())), (
        "the compiled pipeline changed; if intended, regenerate the golden file (see the module docstring)")


def test_compile_rejects_an_unknown_platform_and_a_bad_file_name(tmp_path):
    from pipelines.grpo import compile_pipeline

    with pytest.raises(ValueError, match="platform: got 'tpu'"):
        compile_pipeline(tmp_path / "x.yaml", platform="tpu")
    with pytest.raises(ValueError, match=".yaml or .json"):
        compile_pipeline(tmp_path / "x.txt")
