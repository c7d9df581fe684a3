"""The prepared GPU check runs end to end on the CPU (``--cpu``: tiny shapes) with only what a
bare GPU machine offers: the packages it lacks (vLLM, megatron-core, kfp, ...) are made
unimportable for the run, its nested test run and its benchmark process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ABSENT_ON_THE_GPU_MACHINE = ("vllm", "megatron", "kfp", "kubernetes", "math_verify", "matplotlib", "gguf", "minio", "moto")

BLOCKER = f"""
import importlib.abc, sys

class AbsentPackages(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT_ON_THE_GPU_MACHINE!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (absent on the GPU machine)")
        return None

sys.meta_path.insert(0, AbsentPackages())
"""


@pytest.mark.slow
def test_the_gpu_check_runs_on_the_cpu_without_the_packages_a_gpu_machine_lacks(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)])}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["ok"] and report["device"] == "cpu"
    tests = report["parts"]["tests"]
    assert tests["failed"] == 0 and tests["skipped"] >= 6 and tests["passed"] == 0  # only the cuda cases are marked gpu
    assert any("needs a CUDA GPU" in reason for reason in tests["skip_reasons"])
    grpo = report["parts"]["grpo"]["tiny"]
    assert grpo["rows"] == 4 and grpo["response_tokens"] > 0 and grpo["iteration"] == 1
    assert grpo["rollout_tokens_per_s"] > 0 and grpo["update_tokens_per_s"] > 0 and 0 < grpo["mfu"] < 1
    reshard = report["parts"]["reshard"]
    assert reshard["allgather-swap"]["peak"] < reshard["naive co-residence"]["peak"]
    assert reshard["allgather-swap"]["s_per_gb"] > 0
    assert "| grpo | tiny" in proc.stdout and "| reshard | tiny allgather-swap |" in proc.stdout
