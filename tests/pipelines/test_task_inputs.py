"""Every task sees what it reads: a contract over the compiled IR of every platform and worker backend.

A task reads a path field when its inputs carry the run's config (``config_overrides``: ``model.path``,
``data.train_path``, ``data.test_path``, the run folder) or a Model artifact (a pointer to a checkpoint or an
exported model on the shared volume, ``dockrl.launch.artifacts``). Such a task must mount the shared volume
where the config's paths are (``Platform.shared_mount_path``) and get the object-store Secret (an ``s3://``
input). A pod without the mount dies with FileNotFoundError on a real cluster, whatever a local run showed.
"""

from __future__ import annotations

import pytest
from test_compile import parse_ir

from dockrl.launch.platform import OBJECT_STORE_KEYS, PLATFORMS


def path_readers(spec) -> dict[str, str]:
    """Executor -> why it reads a path field, from the components' input definitions."""
    out = {}
    for component in spec.components.values():
        if not component.executor_label:
            continue
        inputs = component.input_definitions
        if "config_overrides" in inputs.parameters:
            out[component.executor_label] = "the run's config (config_overrides)"
        models = [k for k, a in inputs.artifacts.items() if a.artifact_type.schema_title == "system.Model"]
        if models:
            out[component.executor_label] = f"a Model artifact ({', '.join(models)})"
    return out


@pytest.mark.parametrize("kind, platform, worker_backend", [(k, p, b) for k in ("grpo", "sft", "alignment") for p in ("npu", "gpu", "cpu")
                                                         for b in ("local", "kubernetes")])
def test_a_task_that_reads_a_path_field_mounts_the_volume_holding_it(kind, platform, worker_backend, tmp_path):
    from dockrl.pipelines.grpo import compile_pipeline

    preset = PLATFORMS[platform]
    spec, _, k8s = parse_ir(compile_pipeline(tmp_path / "p.yaml", platform=platform, worker_backend=worker_backend, kind=kind))
    readers = path_readers(spec)
    trains = {"grpo": {"exec-train"}, "sft": {"exec-sft"}, "alignment": {"exec-sft", "exec-start-from", "exec-train"}}[kind]
    assert {"exec-prepare-dataset", "exec-export-model", "exec-evaluate", *trains} <= set(readers)
    unmounted, no_secret = [], []
    for executor, why in sorted(readers.items()):
        if (preset.shared_volume_claim, preset.shared_mount_path) not in [(m.constant, m.mount_path) for m in k8s[executor].pvc_mount]:
            unmounted.append(f"{executor} reads {why}")
        secrets = {(s.secret_name, k.env_var) for s in k8s[executor].secret_as_env for k in s.key_to_env}
        if not {(preset.object_store_secret, key) for key in OBJECT_STORE_KEYS} <= secrets:
            no_secret.append(f"{executor} reads {why}")
    assert not unmounted, f"no volume holding {preset.shared_mount_path} mounted where a task reads a path: {unmounted}"
    assert not no_secret, f"no object-store Secret where a task reads an s3:// URI: {no_secret}"
    # the exit task reads nothing of the run's: it neither mounts nor needs the Secret
    assert not k8s["exec-teardown-workers"].pvc_mount and "exec-teardown-workers" not in readers



@pytest.mark.parametrize("worker_backend", ["local", "kubernetes"])
def test_the_train_task_reads_the_trackers_secret_as_optional_and_names_its_image(worker_backend, tmp_path):
    """The driver's trackers (run.trackers): their server and keys from the trackers' Secret (optional, as a run with
    TensorBoard alone has none), their lineage's image from the task's own image."""
    from dockrl.launch.platform import TRACKER_KEYS, TRACKER_SECRET
    from dockrl.pipelines.grpo import compile_pipeline

    spec, deployment, k8s = parse_ir(compile_pipeline(tmp_path / "p.yaml", platform="npu", worker_backend=worker_backend))
    [trackers] = [s for s in k8s["exec-train"].secret_as_env if s.secret_name == TRACKER_SECRET]
    assert {k.secret_key: k.env_var for k in trackers.key_to_env} == {k: k for k in TRACKER_KEYS} and trackers.optional
    train = deployment.executors["exec-train"].container
    assert {e.name: e.value for e in train.env}["DOCKRL_IMAGE"] == train.image
    assert all(s.secret_name != TRACKER_SECRET for name, c in k8s.items() if name != "exec-train" for s in c.secret_as_env)
