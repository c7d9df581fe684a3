"""The SFT and alignment (SFT → GRPO) pipelines: compiled for every platform, the GRPO phase started from the SFT
step's model artifact, and the alignment pipeline run end to end through kfp.local on the tiny model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_compile import parse_ir

from dockrl.kubeflow import pipeline_cli
from dockrl.kubeflow.steps import RUN_PARAMETERS

ACCELERATORS = {"npu": "huawei.com/Ascend910", "gpu": "nvidia.com/gpu", "cpu": None}


@pytest.mark.parametrize("platform", ["npu", "gpu", "cpu"])
def test_the_alignment_pipeline_starts_grpo_from_the_sft_model(platform, tmp_path, capsys):
    assert pipeline_cli.main(["compile", str(tmp_path / "alignment.yaml"), "--kind", "alignment", "--platform", platform]) == 0
    spec, deployment, k8s = parse_ir(Path(capsys.readouterr().out.strip()))
    assert spec.pipeline_info.name == "dockrl-alignment"
    body = spec.components["comp-exit-handler-1"].dag.tasks
    assert set(body) == {"resolve-config", "resolve-config-2", "prepare-dataset", "sft", "start-from", "train", "export-model", "evaluate"}
    start = body["start-from"].inputs
    assert (start.artifacts["model"].task_output_artifact.producer_task, start.artifacts["model"].task_output_artifact.output_artifact_key) \
        == ("sft", "model")
    assert start.parameters["config_overrides"].task_output_parameter.producer_task == "resolve-config-2"  # the GRPO phase's
    assert body["train"].inputs.parameters["config_overrides"].task_output_parameter.producer_task == "start-from"
    assert body["sft"].inputs.parameters["config_overrides"].task_output_parameter.producer_task == "resolve-config"  # the SFT phase's
    assert body["prepare-dataset"].inputs.parameters["config_overrides"].task_output_parameter.producer_task == "resolve-config"
    assert not body["sft"].caching_options.enable_cache
    sft = deployment.executors["exec-sft"].container
    assert (sft.resources.accelerator.resource_type or None) == ACCELERATORS[platform]
    assert sft.image.endswith(f"dockrl-{platform}:" + sft.image.rsplit(":", 1)[1])  # the platform's image, as the train task's
    assert {m.mount_path for m in k8s["exec-sft"].pvc_mount} == {m.mount_path for m in k8s["exec-train"].pvc_mount}  # the shared volume
    params = spec.root.input_definitions.parameters
    assert set(params) == set(RUN_PARAMETERS) | {"sft_config_overrides", "config_overrides", "export_dtype", "copy_model", "export_uri"}
    assert all(len(p.description) >= 20 for p in params.values())


@pytest.mark.parametrize("platform", ["npu", "gpu", "cpu"])
def test_the_sft_pipeline_exports_and_evaluates_the_sft_model(platform, tmp_path, capsys):
    assert pipeline_cli.main(["compile", str(tmp_path / "sft.yaml"), "--kind", "sft", "--platform", platform]) == 0
    spec, deployment, _ = parse_ir(Path(capsys.readouterr().out.strip()))
    assert spec.pipeline_info.name == "dockrl-sft"
    assert set(spec.root.dag.tasks) == {"exit-handler-1", "teardown-workers"}
    tasks = spec.components["comp-exit-handler-1"].dag.tasks
    assert set(tasks) == {"resolve-config", "prepare-dataset", "sft", "export-model", "evaluate"}
    assert tasks["export-model"].inputs.artifacts["checkpoint"].task_output_artifact.producer_task == "sft"
    assert (deployment.executors["exec-sft"].container.resources.accelerator.resource_type or None) == ACCELERATORS[platform]
    params = spec.root.input_definitions.parameters
    assert set(params) == {"model_path", "train_data", "test_data", "keep_checkpoints", "config_overrides", "export_dtype", "copy_model",
                           "export_uri"}


def test_sft_overrides_only_with_the_alignment_pipeline(tmp_path):
    from dockrl.pipelines.grpo import run_local

    with pytest.raises(ValueError, match=r"sft_overrides: only the alignment pipeline has an SFT phase of its own \(kind='grpo'\)"):
        run_local([], tmp_path / "root", sft_overrides=["sft.epochs=2"])


@pytest.mark.slow
def test_the_alignment_pipeline_runs_end_to_end_locally(tiny_model_dir, tmp_path):
    from dockrl.launch.artifacts import resolve_checkpoint
    from dockrl.run.data import generate_problems, write_jsonl

    shared = tmp_path / "shared"
    model = Path(shutil.copytree(tiny_model_dir, shared / "models" / "tiny"))
    train, test = write_jsonl(generate_problems(16, seed=1), shared / "data" / "train.jsonl"), write_jsonl(
        generate_problems(4, seed=2), shared / "data" / "test.jsonl")
    both = [f"model.path={model}", f"data.train_path={train}", f"data.test_path={test}", f"run.cache_dir={tmp_path / 'cache'}",
            "rollout.dtype=float32", "trainer.autocast_bf16=false", "trainer.eval_before=false", "trainer.save_every=0",
            "data.eval_size=4", "rollout.max_response_length=8", "trainer.micro_batch=4"]
    grpo = ["trainer.iterations=1", "trainer.global_batch=2", "trainer.mini_batch=2", "rollout.n=2"]
    sft = ["sft.batch_size=8", "trainer.lr=1e-3"]
    proc = subprocess.run(
        [sys.executable, "-m", "dockrl", "pipeline", "run", "--local", "--kind", "alignment", "--pipeline-root", str(tmp_path / "root"),
         "--shared-dir", str(shared), "--export-dtype", "float32", *[f"--sft-override={o}" for o in sft], *both, *grpo],
        cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout[proc.stdout.rindex("\n{\n") + 1:])
    run = Path(out["run_dir"])
    assert 0.0 <= out["eval/accuracy"] <= 1.0 and out["eval/count"] == 4.0 and out["sft/steps"] == 2  # 16 - 4 held out: 12 → 2 steps
    runs = {p.name: p for p in (shared / "runs").iterdir()}
    [sft_run] = [p for name, p in runs.items() if name.endswith("-sft")]
    sft_final = sft_run / "checkpoints" / "final"
    assert resolve_checkpoint(run / "sft" / "model") == sft_final and (sft_final / "model.safetensors").is_file()
    # the GRPO phase started from the SFT model: its config, as the run recorded it, names the SFT step's checkpoint
    [grpo_run] = [p for name, p in runs.items() if not name.endswith("-sft")]
    assert yaml.safe_load((grpo_run / "config.yaml").read_text())["model"]["path"] == str(sft_final)
    assert yaml.safe_load((sft_run / "config.yaml").read_text())["trainer"]["lr"] == 1e-3  # the SFT phase's own override
    assert yaml.safe_load((grpo_run / "config.yaml").read_text())["trainer"]["lr"] != 1e-3
    rows = [json.loads(x) for x in (run / "train" / "run_dir" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0]
    assert out["model"] == str(grpo_run / "export")
