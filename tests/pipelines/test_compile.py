"""The compiled pipeline IR: strict protobuf parsing, compile-time settings where Kubeflow reads them, golden files.

Regenerate the golden files after an intended change of the pipeline or a component:
``DOCKRL_UPDATE_GOLDEN=1 python -m pytest tests/pipelines/test_compile.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from pathlib import Path

import pytest
import yaml
from google.protobuf import json_format
from kfp.kubernetes.kubernetes_executor_config_pb2 import KubernetesExecutorConfig
from kfp.pipeline_spec import pipeline_spec_pb2 as pb

from dockrl.kubeflow.steps import RUN_PARAMETERS, run_parameter_defaults
from dockrl.launch.platform import CPU_IMAGE, PLATFORMS, Platform
from dockrl.launch.platform_files import with_images

GOLDEN = Path(__file__).parent / "golden"
STEPS = ["resolve-config", "prepare-dataset", "train", "export-model", "evaluate"]
EXECUTORS = {f"exec-{s}" for s in STEPS + ["teardown-workers"]}


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


@pytest.fixture(scope="module")
def compiled_npu_kubernetes(tmp_path_factory) -> Path:
    from dockrl.pipelines.grpo import compile_pipeline

    return compile_pipeline(tmp_path_factory.mktemp("ir") / "grpo-npu-k8s.yaml", platform="npu", worker_backend="kubernetes")


def test_importing_the_pipeline_module_compiles_nothing():
    import importlib

    sys.modules.pop("dockrl.pipelines.grpo", None)
    module = importlib.import_module("dockrl.pipelines.grpo")
    assert not hasattr(module, "grpo")  # compiled when asked (build_pipeline / compile_pipeline), not at import


def resolved(output: str) -> str:
    """The placeholder KFP's driver replaces with resolve-config's output ``output`` (a string)."""
    return f"{{{{$.inputs.parameters['pipelinechannel--resolve-config-{output}']}}}}"


def test_local_backend_the_train_task_carries_the_accelerators_and_the_run_folders_volume(compiled_npu):
    spec, deployment, k8s = parse_ir(compiled_npu)
    npu = PLATFORMS["npu"]
    train = deployment.executors["exec-train"].container
    assert train.image == npu.image
    # the whole run happens in this pod: it holds the devices its run's processes use and the CPU and
    # memory of a pod holding them, which resolve-config computes from the run's config
    assert train.resources.accelerator.resource_type == "huawei.com/Ascend910"
    assert train.resources.accelerator.resource_count == resolved("devices")
    assert (train.resources.resource_cpu_request, train.resources.resource_memory_request) == (resolved("cpu"), resolved("memory"))
    inputs = spec.components["comp-exit-handler-1"].dag.tasks["train"].inputs.parameters
    for output in ("devices", "cpu", "memory"):
        source = inputs[f"pipelinechannel--resolve-config-{output}"].task_output_parameter
        assert (source.producer_task, source.output_parameter_key) == ("resolve-config", output)
        assert spec.components["comp-resolve-config"].output_definitions.parameters[output].parameter_type == pb.ParameterType.STRING
    cfg = k8s["exec-train"]
    assert dict(cfg.node_selector.labels) == {"accelerator": "huawei-Ascend910"}
    assert [(t.key, t.operator, t.effect) for t in cfg.tolerations] == [("huawei.com/Ascend910", "Exists", "NoSchedule")]
    [shm] = cfg.empty_dir_mounts  # NCCL, HCCL and vLLM exchange through /dev/shm; a container's default is 64 MiB
    assert (shm.mount_path, shm.medium, shm.size_limit) == ("/dev/shm", "Memory", npu.shm_size(npu.devices_per_node))
    # the run folder on the shared volume, where a retried train task finds its checkpoints; every task that reads
    # the run's paths mounts it too (tests/pipelines/test_task_inputs.py), the exit task alone does not
    assert {name for name, c in k8s.items() if c.pvc_mount} == EXECUTORS - {"exec-teardown-workers"}
    [pvc] = cfg.pvc_mount
    assert (pvc.constant, pvc.mount_path) == (npu.shared_volume_claim, npu.shared_mount_path)
    assert not spec.components["comp-exit-handler-1"].dag.tasks["train"].HasField("retry_policy")  # retries: train_retries
    # the object-store Secret only for the S3 warehouse or s3:// inputs: optional
    [secret, trackers] = cfg.secret_as_env  # the trackers' Secret: tests/pipelines/test_task_inputs.py
    assert secret.secret_name == "dockrl-object-store" and secret.HasField("optional") and secret.optional
    assert trackers.secret_name == "dockrl-trackers" and trackers.optional
    assert {name for name, c in k8s.items() if c.secret_as_env} == EXECUTORS - {"exec-teardown-workers"}
    assert {(f.name, f.field_path) for f in cfg.field_path_as_env} == {
        ("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace"), ("POD_UID", "metadata.uid"),
        ("POD_IP", "status.podIP")}
    inputs = spec.components["comp-exit-handler-1"].dag.tasks["train"].inputs.parameters
    assert inputs["run_id"].runtime_value.constant.string_value == "{{$.pipeline_job_uuid}}"
    assert inputs["worker_backend"].runtime_value.constant.string_value == "local"  # compiled in, not a parameter
    assert Platform.from_json(inputs["platform"].runtime_value.constant.string_value) == npu
    for name, executor in deployment.executors.items():
        if name not in ("exec-train", "exec-evaluate"):
            assert executor.container.image == CPU_IMAGE
            assert not executor.container.resources.HasField("accelerator")
            assert not k8s[name].node_selector.labels and not k8s[name].tolerations and not k8s[name].empty_dir_mounts


def test_evaluate_runs_on_the_accelerator_image_with_one_device_and_the_rollout_engine(compiled_npu):
    spec, deployment, k8s = parse_ir(compiled_npu)
    npu = PLATFORMS["npu"]
    evaluate = deployment.executors["exec-evaluate"].container
    assert evaluate.image == npu.image
    assert (evaluate.resources.accelerator.resource_type, evaluate.resources.accelerator.resource_count) == (npu.accelerator, "1")
    one = npu.pod_requests(1)
    assert (evaluate.resources.resource_cpu_request, evaluate.resources.resource_memory_request) == (one["cpu"], one["memory"])
    cfg = k8s["exec-evaluate"]
    assert dict(cfg.node_selector.labels) == npu.node_selector
    assert [(t.key, t.operator, t.effect) for t in cfg.tolerations] == [("huawei.com/Ascend910", "Exists", "NoSchedule")]
    assert [(m.mount_path, m.size_limit) for m in cfg.empty_dir_mounts] == [("/dev/shm", npu.shm_size(1))]
    # the step's device is the pod's accelerator (parallel.device=auto there), whatever the training used
    inputs = spec.components["comp-exit-handler-1"].dag.tasks["evaluate"].inputs.parameters
    assert inputs["device"].runtime_value.constant.string_value == "auto"
    # export-model stays on the CPU image
    assert deployment.executors["exec-export-model"].container.image == CPU_IMAGE


def test_kubernetes_backend_evaluate_drives_a_worker_group_of_the_run(compiled_npu_kubernetes):
    spec, deployment, k8s = parse_ir(compiled_npu_kubernetes)
    evaluate = deployment.executors["exec-evaluate"].container
    assert evaluate.image == CPU_IMAGE and not evaluate.resources.HasField("accelerator")  # its worker pod holds them
    assert (evaluate.resources.resource_cpu_request, evaluate.resources.resource_memory_request) == ("2", "8Gi")
    cfg = k8s["exec-evaluate"]
    assert not cfg.node_selector.labels and not cfg.tolerations and not cfg.empty_dir_mounts
    assert [(v.constant, v.mount_path) for v in cfg.pvc_mount] == [("dockrl-shared", "/mnt/dockrl")]
    assert {f.name for f in cfg.field_path_as_env} == {"POD_NAME", "POD_NAMESPACE", "POD_UID", "POD_IP"}  # the JobSet's owner
    inputs = spec.components["comp-exit-handler-1"].dag.tasks["evaluate"].inputs.parameters
    assert inputs["worker_backend"].runtime_value.constant.string_value == "kubernetes"
    assert Platform.from_json(inputs["platform"].runtime_value.constant.string_value) == PLATFORMS["npu"]
    assert inputs["run_id"].runtime_value.constant.string_value == "{{$.pipeline_job_uuid}}"


def test_site_hooks_kfp_can_apply_go_on_its_accelerator_pods_and_the_others_are_named(tmp_path, caplog):
    from dockrl.pipelines.grpo import PipelineSettings, compile_pipeline, kfp_unapplied_hooks

    site = dataclasses.replace(
        PLATFORMS["npu"], env={"HCCL_BUFFSIZE": "200"}, pod_labels={"ring-controller.atlas": "ascend-910b"},
        pod_annotations={"k8s.v1.cni.cncf.io/networks": "roce"}, host_paths={"/etc/hccn.conf": "/etc/hccn.conf"},
        extra_resources={"rdma/hca_shared_devices_a": "1"}, scheduler="volcano")
    with caplog.at_level("WARNING"):
        _, deployment, k8s = parse_ir(compile_pipeline(tmp_path / "p.yaml", settings=PipelineSettings(platform=site)))
    [warning] = [r.getMessage() for r in caplog.records if "KFP cannot put" in r.getMessage()]
    for hook in ("host_paths (hostPath volumes)", "accelerator_device_gid=1000 (supplementalGroups)",
                 "scheduler='volcano' (schedulerName)", "extra_resources (extended resources)", "--worker-backend kubernetes"):
        assert hook in warning
    for name in ("exec-train", "exec-evaluate"):  # the pods that hold the accelerators
        env = {e.name: e.value for e in deployment.executors[name].container.env}
        assert env["HCCL_BUFFSIZE"] == "200", name
        assert k8s[name].pod_metadata.labels["ring-controller.atlas"] == "ascend-910b", name
        assert k8s[name].pod_metadata.annotations["k8s.v1.cni.cncf.io/networks"] == "roce", name
    assert "ring-controller.atlas" not in k8s["exec-export-model"].pod_metadata.labels
    # the kubernetes backend's worker pods get every hook (tests/launch): nothing to warn about
    assert kfp_unapplied_hooks(PipelineSettings(platform=site, worker_backend="kubernetes")) == []
    assert kfp_unapplied_hooks(PipelineSettings(platform=PLATFORMS["gpu"])) == []


@pytest.mark.parametrize("platform, worker_backend", [(p, b) for p in ("npu", "gpu", "cpu") for b in ("local", "kubernetes")])
def test_every_task_lands_only_on_nodes_of_an_architecture_its_image_is_built_for(platform, worker_backend, tmp_path):
    from dockrl.pipelines.grpo import compile_pipeline

    preset = PLATFORMS[platform]
    _, deployment, k8s = parse_ir(compile_pipeline(tmp_path / "p.yaml", platform=platform, worker_backend=worker_backend))
    images = {preset.image: platform, preset.cpu_image: "cpu"}
    for name, executor in deployment.executors.items():
        [term] = k8s[name].node_affinity
        [expr] = term.match_expressions
        assert not term.HasField("weight"), name  # required, not preferred
        assert (expr.key, expr.operator) == ("kubernetes.io/arch", "In"), name
        assert tuple(expr.values) == preset.architectures_of(images[executor.container.image]), name
    if platform == "gpu":  # the CUDA image is built for amd64 only, and the platform keeps every pod there
        assert {v for c in k8s.values() for v in c.node_affinity[0].match_expressions[0].values} == {"amd64"}


def test_an_image_built_for_none_of_the_platforms_architectures_is_refused(tmp_path):
    import dataclasses

    from dockrl.pipelines.grpo import compile_pipeline

    arm_gpu = dataclasses.replace(PLATFORMS["gpu"], architectures=("arm64",))
    with pytest.raises(ValueError, match=r"architectures=\('arm64',\), but image dockrl-gpu is built for \('amd64',\) only"):
        compile_pipeline(tmp_path / "p.yaml", platform=arm_gpu)


def test_kubernetes_backend_the_launcher_drives_with_the_volume_and_secret_but_no_accelerators(compiled_npu_kubernetes):
    spec, deployment, k8s = parse_ir(compiled_npu_kubernetes)
    train = deployment.executors["exec-train"].container
    assert train.image == CPU_IMAGE and not train.resources.HasField("accelerator")
    assert (train.resources.resource_cpu_request, train.resources.resource_memory_request) == ("2", "8Gi")
    cfg = k8s["exec-train"]
    assert not cfg.node_selector.labels and not cfg.tolerations and not cfg.empty_dir_mounts
    [secret, _] = cfg.secret_as_env  # and the trackers' Secret (tests/pipelines/test_task_inputs.py)
    # optional: a run with the default in-memory warehouse starts without the Secret (manifests/components/object-store)
    assert secret.secret_name == "dockrl-object-store" and secret.HasField("optional") and secret.optional
    assert {(k.secret_key, k.env_var) for k in secret.key_to_env} == {
        ("AWS_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID"), ("AWS_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY"),
        ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL")}
    # the run folder (checkpoints, TensorBoard) on the shared volume; export-model reads the final checkpoint there
    for executor in ("exec-train", "exec-export-model"):
        assert [(v.constant, v.mount_path) for v in k8s[executor].pvc_mount] == [("dockrl-shared", "/mnt/dockrl")], executor
    assert {name for name, c in k8s.items() if c.pvc_mount} == EXECUTORS - {"exec-teardown-workers"}
    assert {name for name, c in k8s.items() if c.secret_as_env} == EXECUTORS - {"exec-teardown-workers"}
    assert "POD_IP" in {f.name for f in cfg.field_path_as_env}
    inputs = spec.components["comp-exit-handler-1"].dag.tasks["train"].inputs.parameters
    assert inputs["worker_backend"].runtime_value.constant.string_value == "kubernetes"
    assert Platform.from_json(inputs["platform"].runtime_value.constant.string_value) == PLATFORMS["npu"]  # the pods'
    assert "worker_backend" not in spec.root.input_definitions.parameters
    # the workers live in the launcher's namespace: no setting names another one
    assert not any("namespace" in name for name in inputs)
    assert "namespace" not in str(spec.components["comp-teardown-workers"].input_definitions)


def test_every_task_requests_cpu_and_memory_and_carries_the_label(compiled_npu, compiled_npu_kubernetes):
    for package in (compiled_npu, compiled_npu_kubernetes):
        _, deployment, k8s = parse_ir(package)
        assert set(deployment.executors) == EXECUTORS == set(k8s)
        for name, executor in deployment.executors.items():
            res = executor.container.resources
            assert res.resource_cpu_request and res.resource_memory_request, name
            assert dict(k8s[name].pod_metadata.labels) == {"app.kubernetes.io/part-of": "dockrl"}, name
            assert not k8s[name].image_pull_secret, name  # none unless asked


def test_run_time_parameters_are_the_knobs_with_the_config_defaults(compiled_npu):
    spec, deployment, _ = parse_ir(compiled_npu)
    params = spec.root.input_definitions.parameters
    assert set(params) == set(RUN_PARAMETERS) | {"config_overrides", "export_dtype", "copy_model", "export_uri"}
    defaults = run_parameter_defaults()
    assert defaults["iterations"] == 20 and defaults["group_size"] == 8 and defaults["model_path"] == "smollm2-135m"
    for name, default in defaults.items():
        value = params[name].default_value
        got = value.string_value if isinstance(default, str) else value.number_value
        assert got == default, name
    # one text field in the UI, one section.field=value per line; no JSON to write
    assert params["config_overrides"].parameter_type == pb.ParameterType.STRING
    assert params["config_overrides"].default_value.string_value == ""
    # the weights stay on the shared volume unless a run asks for a copy in the artifact store
    assert params["copy_model"].parameter_type == pb.ParameterType.BOOLEAN and not params["copy_model"].default_value.bool_value
    assert params["keep_checkpoints"].default_value.number_value == 2
    # every step reads the overrides that resolve-config checked
    body = spec.components["comp-exit-handler-1"].dag.tasks
    for step in ("prepare-dataset", "train", "evaluate"):
        ref = body[step].inputs.parameters["config_overrides"].task_output_parameter
        assert ref.producer_task == "resolve-config", step
    for name, executor in deployment.executors.items():  # images carry kfp: nothing installed at pod start
        assert "pip install" not in " ".join(executor.container.command), name


@pytest.mark.parametrize("pipeline", ["grpo-local", "grpo-kubernetes", "rescore"])
def test_every_parameter_of_every_pipeline_has_a_description(pipeline, tmp_path):
    """What the Kubeflow UI shows beside each parameter of a run: the pipeline function's docstring, read
    by the compiler into the IR's inputDefinitions."""
    from dockrl.pipelines.grpo import compile_pipeline
    from dockrl.pipelines.rescore import compile_rescore

    if pipeline == "rescore":
        path = compile_rescore(tmp_path / "rescore.yaml")
    else:
        path = compile_pipeline(tmp_path / "grpo.yaml", platform="npu", worker_backend=pipeline.removeprefix("grpo-"))
    spec = next(yaml.safe_load_all(path.read_text()))
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params and {name: p.get("description", "") for name, p in params.items() if len(p.get("description", "")) < 20} == {}
    for name, field in RUN_PARAMETERS.items() if pipeline != "rescore" else ():
        assert f"({field})" in " ".join(params[name]["description"].split()), name  # the config field it sets
    if pipeline != "rescore":
        assert "one section.field=value per line" in params["config_overrides"]["description"]


def test_the_dataset_step_is_never_cached_and_the_summary_is_a_markdown_visualization(compiled_npu):
    """prepare-dataset's cache key is its overrides, which name a data file by its path: a file changed at the
    same path must not give a cached dataset (nor, through the same dataset artifact, a cached training)."""
    spec, _, _ = parse_ir(compiled_npu)
    body = spec.components["comp-exit-handler-1"].dag.tasks
    assert not body["prepare-dataset"].caching_options.enable_cache and not body["train"].caching_options.enable_cache
    assert body["resolve-config"].caching_options.enable_cache  # a function of the run's parameters alone
    outputs = spec.components["comp-train"].output_definitions.artifacts
    assert outputs["summary"].artifact_type.schema_title == "system.Markdown"
    assert outputs["metrics"].artifact_type.schema_title == "system.Metrics"


def test_a_finished_runs_workflow_ttl_is_a_compile_setting(compiled_npu, tmp_path):
    from dockrl.pipelines.grpo import PipelineSettings, compile_pipeline

    assert "pipelineConfig" not in list(yaml.safe_load_all(compiled_npu.read_text()))[1]["platforms"]["kubernetes"]  # the cluster's
    path = compile_pipeline(tmp_path / "ttl.yaml", settings=PipelineSettings(ttl_after_finished_s=3 * 86400))
    platform = json_format.ParseDict(list(yaml.safe_load_all(path.read_text()))[1], pb.PlatformSpec(), ignore_unknown_fields=False)
    assert platform.platforms["kubernetes"].pipelineConfig.resource_ttl_on_completion == 3 * 86400
    with pytest.raises(ValueError, match="ttl_after_finished_s=-1: expected seconds"):
        PipelineSettings(ttl_after_finished_s=-1)


def test_steps_run_in_order_inside_an_exit_handler_that_tears_workers_down(compiled_npu):
    spec, _, _ = parse_ir(compiled_npu)
    root = spec.root.dag.tasks
    assert set(root) == {"exit-handler-1", "teardown-workers"}
    teardown = root["teardown-workers"]
    assert teardown.trigger_policy.strategy == pb.PipelineTaskSpec.TriggerPolicy.ALL_UPSTREAM_TASKS_COMPLETED
    assert teardown.inputs.parameters["status"].task_final_status.producer_task == "exit-handler-1"
    assert teardown.inputs.parameters["run_id"].runtime_value.constant.string_value == "{{$.pipeline_job_uuid}}"
    assert teardown.inputs.parameters["worker_backend"].runtime_value.constant.string_value == "local"
    body = spec.components["comp-exit-handler-1"].dag.tasks
    assert set(body) == set(STEPS)
    assert list(body["prepare-dataset"].dependent_tasks) == ["resolve-config"]
    assert set(body["train"].dependent_tasks) == {"prepare-dataset", "resolve-config"}
    assert set(body["export-model"].dependent_tasks) == {"resolve-config", "train"}  # the run's S3 settings for export_uri
    assert set(body["evaluate"].dependent_tasks) == {"export-model", "prepare-dataset", "resolve-config"}
    assert not body["train"].caching_options.enable_cache
    # the curves of the run, for the UI's Visualizations
    outputs = spec.components["comp-train"].output_definitions.artifacts
    assert outputs["curves"].artifact_type.schema_title == "system.HTML"


@pytest.mark.parametrize("platform, resource", [("gpu", "nvidia.com/gpu"), ("cpu", None)])
def test_other_platforms(platform, resource, tmp_path):
    from dockrl.pipelines.grpo import compile_pipeline

    spec, deployment, k8s = parse_ir(compile_pipeline(tmp_path / f"{platform}.yaml", platform=platform))
    train = deployment.executors["exec-train"].container
    evaluate = deployment.executors["exec-evaluate"].container
    assert train.image == PLATFORMS[platform].image
    device = spec.components["comp-exit-handler-1"].dag.tasks["evaluate"].inputs.parameters["device"]
    if resource:
        assert train.resources.accelerator.resource_type == resource == evaluate.resources.accelerator.resource_type
        assert dict(k8s["exec-train"].node_selector.labels) == {"nvidia.com/gpu.present": "true"}
        assert evaluate.image == PLATFORMS[platform].image and device.runtime_value.constant.string_value == "auto"
    else:  # on CPU: no accelerators anywhere, evaluate on the CPU image and the CPU, as before
        assert not train.resources.HasField("accelerator") and not evaluate.resources.HasField("accelerator")
        assert not k8s["exec-train"].node_selector.labels and not k8s["exec-train"].tolerations
        assert evaluate.image == CPU_IMAGE and device.runtime_value.constant.string_value == "cpu"
        assert (evaluate.resources.resource_cpu_request, evaluate.resources.resource_memory_request) == ("4", "16Gi")
        assert not any(c.empty_dir_mounts for c in k8s.values())


def test_images_registry_tag_digest_and_pull_secret_are_compile_settings(tmp_path):
    from dockrl.pipelines.grpo import PipelineSettings, Requests, compile_pipeline

    digest = "sha256:" + "ab" * 32
    platform = with_images(PLATFORMS["npu"], registry="registry.example.com/ml", tag="0.2.0", digests={"npu": digest},
                           pull_secret="regcred")
    settings = PipelineSettings(platform=platform, worker_backend="local", requests={
        "evaluate": Requests(cpu="8", memory="32Gi"), "train": Requests(cpu="24", memory="200Gi")})
    spec, deployment, k8s = parse_ir(compile_pipeline(tmp_path / "site.yaml", settings=settings))
    for name, executor in deployment.executors.items():
        if name in ("exec-train", "exec-evaluate"):
            assert executor.container.image == f"registry.example.com/ml/dockrl-npu@{digest}"
        else:
            assert executor.container.image == "registry.example.com/ml/dockrl-cpu:0.2.0", name
        assert [s.secret_name for s in k8s[name].image_pull_secret] == ["regcred"], name
    res = deployment.executors["exec-evaluate"].container.resources
    assert (res.resource_cpu_request, res.resource_memory_request) == ("8", "32Gi")
    res = deployment.executors["exec-train"].container.resources  # given: fixed; the devices still follow the config
    assert (res.resource_cpu_request, res.resource_memory_request, res.accelerator.resource_count) == ("24", "200Gi", resolved("devices"))
    inputs = spec.components["comp-exit-handler-1"].dag.tasks["train"].inputs.parameters
    pods = Platform.from_json(inputs["platform"].runtime_value.constant.string_value)
    assert pods.image_pull_secret == "regcred" and pods.image == f"registry.example.com/ml/dockrl-npu@{digest}"
    assert pods.cpu_image == "registry.example.com/ml/dockrl-cpu:0.2.0"  # what the launcher gives the worker pods


@pytest.mark.parametrize("kwargs, message", [
    ({"tag": "latest"}, "never 'latest'"),
    ({"registry": "https://registry.example.com"}, "without scheme"),
    ({"registry": "Registry.example.com"}, "lower case"),
    ({"digests": {"npu": "sha256:abc"}}, "sha256:<64 hex digits>"),
    ({"digests": {"tpu": "sha256:" + "0" * 64}}, r"image_digests\['tpu'\]"),
    ({"pull_secret": "Reg_Cred"}, "image_pull_secret='Reg_Cred'"),
])
def test_bad_image_settings_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        with_images(PLATFORMS["npu"], **kwargs)


def test_bad_settings_name_the_field(tmp_path):
    from dockrl.pipelines.grpo import PipelineSettings, Requests, compile_pipeline

    with pytest.raises(ValueError, match="worker_backend: got 'slurm'"):
        compile_pipeline(tmp_path / "x.yaml", worker_backend="slurm")
    with pytest.raises(ValueError, match="platform: got 'tpu'"):
        compile_pipeline(tmp_path / "x.yaml", platform="tpu")
    with pytest.raises(ValueError, match=".yaml or .json"):
        compile_pipeline(tmp_path / "x.txt")
    with pytest.raises(ValueError, match=r"requests for \['trian'\]: no such task"):
        PipelineSettings(requests={"trian": Requests(cpu="1", memory="1Gi")})
    with pytest.raises(ValueError, match="cpu request 'lots'"):
        Requests(cpu="lots", memory="1Gi")
    with pytest.raises(ValueError, match="memory request '16GB'"):
        Requests(cpu="1", memory="16GB")


def test_the_compiled_backend_can_be_read_back(compiled_npu, compiled_npu_kubernetes, tmp_path):
    from dockrl.pipelines.grpo import compiled_worker_backend

    assert compiled_worker_backend(compiled_npu) == "local"
    assert compiled_worker_backend(compiled_npu_kubernetes) == "kubernetes"
    other = tmp_path / "other.yaml"
    other.write_text("pipelineInfo: {name: x}\nroot: {}\n")
    with pytest.raises(ValueError, match="no train task with a compiled-in worker_backend"):
        compiled_worker_backend(other)


def test_strict_parsing_rejects_a_misspelt_field(compiled_npu):
    docs = list(yaml.safe_load_all(compiled_npu.read_text()))
    bad = copy.deepcopy(docs[1])
    bad["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-train"]["nodeSelecter"] = {"labels": {}}
    cfg = bad["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-train"]
    with pytest.raises(json_format.ParseError, match="nodeSelecter"):
        json_format.ParseDict(cfg, KubernetesExecutorConfig(), ignore_unknown_fields=False)


@pytest.mark.parametrize("golden, fixture", [("grpo_npu.yaml", "compiled_npu"),
                                             ("grpo_npu_kubernetes.yaml", "compiled_npu_kubernetes")])
def test_matches_golden(golden, fixture, request):
    text = request.getfixturevalue(fixture).read_text()
    path = GOLDEN / golden
    if os.environ.get("DOCKRL_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"no golden file: run with DOCKRL_UPDATE_GOLDEN=1 to write {path}"
    assert list(yaml.safe_load_all(text)) == list(yaml.safe_load_all(path.read_text())), (
        "the compiled pipeline changed; if intended, regenerate the golden files (see the module docstring)")


def test_cli_compile_takes_the_images_from_an_overlay_and_the_options(tmp_path, capsys):
    from dockrl.kubeflow import pipeline_cli

    overlay = tmp_path / "site"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({"images": [
        {"name": "ghcr.io/dockrl/dockrl-cpu", "newName": "registry.example.com/ml/dockrl-cpu", "newTag": "0.3.0"},
        {"name": "ghcr.io/dockrl/dockrl-gpu", "newName": "registry.example.com/ml/dockrl-gpu", "newTag": "0.3.0"}]}))
    out = tmp_path / "site.yaml"
    rc = pipeline_cli.main(["compile", str(out), "--platform", "gpu", "--overlay", str(overlay), "--pull-secret", "regcred",
                            "--request", "evaluate=1,2Gi"])
    assert rc == 0, capsys.readouterr().err
    spec, deployment, k8s = parse_ir(out)
    assert deployment.executors["exec-train"].container.image == "registry.example.com/ml/dockrl-gpu:0.3.0"
    assert deployment.executors["exec-evaluate"].container.image == "registry.example.com/ml/dockrl-gpu:0.3.0"
    assert deployment.executors["exec-export-model"].container.image == "registry.example.com/ml/dockrl-cpu:0.3.0"
    assert deployment.executors["exec-evaluate"].container.resources.resource_memory_request == "2Gi"
    assert [s.secret_name for s in k8s["exec-train"].image_pull_secret] == ["regcred"]
    # the workers live in the run's namespace: the option is gone
    with pytest.raises(SystemExit):
        pipeline_cli.main(["compile", str(out), "--workers-namespace", "dockrl-workers"])
    assert "unrecognized arguments: --workers-namespace" in capsys.readouterr().err
    rc = pipeline_cli.main(["compile", str(out), "--tag", "latest"])
    assert rc == 2 and "never 'latest'" in capsys.readouterr().err
    rc = pipeline_cli.main(["compile", str(out), "--request", "train=4"])
    assert rc == 2 and "expected TASK=CPU,MEMORY" in capsys.readouterr().err


def test_the_wheel_ships_the_pipeline_and_its_components():
    """The packages pyproject.toml gives setuptools are every package under dockrl/, and the
    pipeline's and the components' folders (pipelines/, components/ at the top of the repository)
    as dockrl.pipelines and dockrl.components: `dockrl pipeline` imports them as installed
    packages, no source tree needed, and the wheel adds no top-level package but dockrl."""
    import tomllib

    from setuptools import find_packages

    root = Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {"dockrl.pipelines": "pipelines", "dockrl.components": "components"}
    assert config["package-dir"] == mapped
    for folder in mapped.values():
        assert (root / folder / "__init__.py").is_file()
        assert not find_packages(str(root / folder)), f"{folder}/ has a subpackage: list it in pyproject.toml"
    # a package added under dockrl/ must be listed too (the mapping rules out setuptools' find)
    assert set(config["packages"]) == set(find_packages(str(root), include=["dockrl", "dockrl.*"])) | set(mapped)


def test_the_wheel_builds_without_a_packaging_warning_and_ships_the_bundled_tasks(tmp_path):
    """setuptools warns of a folder of data inside a package that it is not given ("Package would be ignored", as
    ``pip install -e .`` showed it): the wheel of what pyproject.toml packages builds without it, the tasks' JSONL in it."""
    import shutil
    import subprocess
    import zipfile

    root = Path(__file__).resolve().parents[2]
    src = tmp_path / "src"
    for name in ("dockrl", "pipelines", "components"):
        shutil.copytree(root / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
                           str(tmp_path / "wheel"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Warning" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    [wheel] = (tmp_path / "wheel").glob("dockrl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"dockrl/envs/data/{p.name}" for p in (root / "dockrl" / "envs" / "data").glob("*.jsonl")} <= names


def test_train_retries_and_a_sites_platform_file_are_compiled_in(tmp_path):
    from dockrl.launch.platform_files import platform_from_file
    from dockrl.pipelines.grpo import PipelineSettings, compile_pipeline

    site = tmp_path / "site-platform.yaml"
    site.write_text("devices_per_node: 16\nnetwork_interface: net1\nextra_resources: {rdma/hca_shared_devices_a: '1'}\n"
                    "architectures: [arm64]\n")
    platform = platform_from_file(PLATFORMS["npu"], site)
    assert (platform.devices_per_node, platform.network_interface, platform.architectures) == (16, "net1", ("arm64",))
    assert platform.extra_resources == {"rdma/hca_shared_devices_a": "1"} and platform.accelerator == "huawei.com/Ascend910"
    out = compile_pipeline(tmp_path / "p.yaml", settings=PipelineSettings(platform=platform, train_retries=2))
    spec, _, k8s = parse_ir(out)
    retry = spec.components["comp-exit-handler-1"].dag.tasks["train"].retry_policy
    assert retry.max_retry_count == 2 and retry.backoff_duration.seconds == 60
    train_input = spec.components["comp-exit-handler-1"].dag.tasks["train"].inputs.parameters["platform"]
    assert Platform.from_json(train_input.runtime_value.constant.string_value) == platform  # the workers get the site's fields
    [term] = k8s["exec-train"].node_affinity
    assert [list(e.values) for e in term.match_expressions] == [["arm64"]]
    site.write_text("devices_per_nod: 16\n")
    with pytest.raises(ValueError, match=r"site-platform.yaml: unknown platform field\(s\) \['devices_per_nod'\]"):
        platform_from_file(PLATFORMS["npu"], site)
    site.write_text("cpu_per_device: lots\n")
    with pytest.raises(ValueError, match=r"site-platform.yaml: platform 'npu': cpu_per_device='lots'; expected an integer"):
        platform_from_file(PLATFORMS["npu"], site)
    with pytest.raises(ValueError, match="train_retries=-1"):
        PipelineSettings(train_retries=-1)
