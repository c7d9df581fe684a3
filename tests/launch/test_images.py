"""The images, checked without a Docker engine: Dockerfiles parsed (pinned, non-root, one compatible
set of versions, everything the stages import), the build script run against a fake docker, the CI
workflow parsed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from dockrl.launch.kubernetes import ENTRY_POINT
from dockrl.launch.platform import IMAGE_NAMES, IMAGE_TAG, PLATFORMS, images_from_kustomization, with_images

ROOT = Path(__file__).resolve().parents[2]
IMAGES = {"npu": "npu", "cuda": "gpu", "cpu": "cpu"}  # folder -> platform preset and image name

# Ascend Extension for PyTorch's version table (torch-npu -> torch, CANN), the rows the image may use
ASCEND_TORCH_NPU = {
    "2.10.0.post4": ("2.10.0", "9.1.0"), "2.9.0": ("2.9.0", "8.5.0"), "2.8.0.post2": ("2.8.0", "8.5.0"),
    "2.6.0": ("2.6.0", "8.2.RC1"), "2.5.1.post1": ("2.5.1", "8.2.RC1"),
}
# what each vllm-ascend release pins on PyPI (its wheel's requirements): torch, torch-npu, transformers
VLLM_ASCEND_PINS = {"0.23.0": ("2.10.0", "2.10.0.post4", "5.5.4"), "0.18.0": ("2.9.0", "2.9.0", None)}
# what each CUDA vLLM release pins on PyPI: torch, transformers range (low inclusive, high exclusive)
VLLM_CUDA_PINS = {"0.33.0": ("2.14.0", ("5.16.1", "5.21.0"))}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        pending += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if not line.rstrip().endswith("\\"):
            if pending.strip():
                op, _, args = pending.strip().partition(" ")
                out.append((op.upper(), args.strip()))
            pending = ""
    return out


def build_args(ins: list[tuple[str, str]]) -> dict[str, str]:
    return dict(a.split("=", 1) for op, a in ins if op == "ARG" and "=" in a)


def base_image(ins: list[tuple[str, str]]) -> str:
    [base] = [args for op, args in ins if op == "FROM"]
    return re.sub(r"\$\{(\w+)\}", lambda m: build_args(ins)[m.group(1)], base)


def installed(ins: list[tuple[str, str]]) -> set[str]:
    """Distribution names the RUN lines pip-install (extras of the project expanded from pyproject.toml)."""
    runs = " ".join(a for op, a in ins if op == "RUN")
    names = {re.split(r"[=<>!\[]", req, maxsplit=1)[0].lower() for req in re.findall(r'"([A-Za-z][\w.-]*[^"]*)"', runs)}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for extras in re.findall(r'"\.\[([\w,-]+)\]"', runs):
        names |= {re.split(r"[=<>!\[]", r, maxsplit=1)[0].lower() for r in project["dependencies"]}
        for extra in extras.split(","):
            names |= {re.split(r"[=<>!\[]", r, maxsplit=1)[0].lower() for r in project["optional-dependencies"][extra]}
    return names


@pytest.mark.parametrize("folder", sorted(IMAGES))
def test_dockerfile_is_pinned_non_root_and_enters_dockrl(folder):
    path = ROOT / "images" / folder / "Dockerfile"
    text = path.read_text()
    ins = instructions(path)
    assert "latest" not in text
    assert re.fullmatch(r"[\w./-]+:[\w.-]*\d[\w.-]*(@sha256:[0-9a-f]{64})?", base_image(ins)), "base is not pinned"
    args = build_args(ins)
    for name, value in args.items():
        if name.endswith("_VERSION"):
            assert re.fullmatch(r"\d+(\.\d+)+(\.?post\d+)?", value), f"{name}={value} is not an exact version"
    runs = " ".join(a for op, a in ins if op == "RUN")
    for var in ("TORCH_VERSION", "KFP_VERSION", "TRANSFORMERS_VERSION", "MINIO_VERSION"):
        assert var in args and "${" + var + "}" in runs, var
    assert re.search(r"\"torch==\$\{TORCH_VERSION\}\"", runs)
    assert "dockrl prepare-model" in runs  # the model is in the image: nothing fetched at pod start
    users = [a for op, a in ins if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    # the program of every worker pod's command (dockrl worker ..., dockrl dock-shard ...)
    assert [json.loads(a) for op, a in ins if op == "ENTRYPOINT"] == [list(ENTRY_POINT)]
    assert ins[-1][0] in ("CMD", "ENTRYPOINT") and not any("pip" in a for op, a in ins if op in ("CMD", "ENTRYPOINT"))
    for op, a in ins:
        if op == "COPY":
            for src in a.split()[:-1]:
                assert (ROOT / src).exists(), f"COPY source {src} missing"
    # the tag the platform preset (and the pipeline) uses by default is the one the build comment gives
    assert f"-t {PLATFORMS[IMAGES[folder]].image} " in text + " "
    assert PLATFORMS[IMAGES[folder]].image.endswith(f":{IMAGE_TAG}")


@pytest.mark.parametrize("folder", sorted(IMAGES))
def test_every_image_installs_what_its_stages_import(folder):
    ins = instructions(ROOT / "images" / folder / "Dockerfile")
    names = installed(ins)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["kfp"], *project["optional-dependencies"]["s3"]]
    if folder != "cpu":  # the accelerator images train with megatron-core and generate with vLLM
        wanted += project["optional-dependencies"]["megatron"]
    missing = {re.split(r"[=<>!\[]", r, maxsplit=1)[0].lower() for r in wanted} - names
    assert not missing, f"images/{folder} does not install {sorted(missing)}"
    assert "minio" in names  # the S3 warehouse of the dock
    assert {"cpu": set(), "cuda": {"vllm"}, "npu": {"vllm", "vllm-ascend", "torch-npu"}}[folder] <= names


def test_npu_image_is_one_row_of_ascends_compatibility_tables():
    ins = instructions(ROOT / "images" / "npu" / "Dockerfile")
    args = build_args(ins)
    cann = re.fullmatch(r"quay\.io/ascend/cann:([\w.]+)-910b-ubuntu[\d.]+-py3\.11", base_image(ins))
    assert cann, f"base {base_image(ins)!r}: expected a CANN image for 910b with Python 3.11 (the project's)"
    torch_for_npu, cann_for_npu = ASCEND_TORCH_NPU[args["TORCH_NPU_VERSION"]]
    assert (args["TORCH_VERSION"], cann.group(1)) == (torch_for_npu, cann_for_npu)
    torch, torch_npu, transformers = VLLM_ASCEND_PINS[args["VLLM_ASCEND_VERSION"]]
    assert (args["TORCH_VERSION"], args["TORCH_NPU_VERSION"]) == (torch, torch_npu)
    assert transformers is None or args["TRANSFORMERS_VERSION"] == transformers
    assert args["VLLM_VERSION"] == args["VLLM_ASCEND_VERSION"]  # vllm-ascend x.y.z runs on vLLM x.y.z
    runs = " ".join(a for op, a in ins if op == "RUN")
    assert "VLLM_TARGET_DEVICE=empty" in runs  # vLLM built for no device: vllm-ascend is the platform


def test_cuda_image_pairs_vllm_with_its_torch_and_transformers():
    args = build_args(instructions(ROOT / "images" / "cuda" / "Dockerfile"))
    torch, (low, high) = VLLM_CUDA_PINS[args["VLLM_VERSION"]]
    assert args["TORCH_VERSION"] == torch
    version = tuple(int(x) for x in args["TRANSFORMERS_VERSION"].split("."))
    assert tuple(map(int, low.split("."))) <= version < tuple(map(int, high.split(".")))


def test_npu_image_user_reaches_the_devices_through_the_hwhiaiuser_group():
    ins = instructions(ROOT / "images" / "npu" / "Dockerfile")
    assert build_args(ins)["ASCEND_GID"] == "1000"  # HwHiAiUser's gid on a typical Ascend node
    [setup] = [a for op, a in ins if op == "RUN" and "useradd" in a]
    assert 'groupadd --gid "${ASCEND_GID}" HwHiAiUser' in setup
    assert re.search(r"useradd --uid 10001 --gid 10001 --groups HwHiAiUser ", setup)
    assert [a for op, a in ins if op == "USER"][-1] == "10001:10001"


def test_the_commands_the_images_run_exist(capsys):
    from dockrl.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])  # the images' default command
    assert exit_.value.code == 0
    assert "prepare-model" in capsys.readouterr().out
    # what the worker pods run: the console script of the entry point, and its two worker commands
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[ENTRY_POINT[0]] == "dockrl.cli:main"
    for command, usage in [("worker", "usage: dockrl worker"), ("dock-shard", "usage: dockrl dock-shard")]:
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0
        assert capsys.readouterr().out.startswith(usage), command


FAKE_DOCKER = r"""#!/usr/bin/env bash
# FakeDocker: records its arguments; for `buildx build --metadata-file F --push` writes a digest to F
echo "$*" >> "$FAKE_DOCKER_LOG"
args=("$@")
for i in "${!args[@]}"; do
    if [[ "${args[$i]}" == "--metadata-file" ]]; then metadata="${args[$((i + 1))]}"; fi
    if [[ "${args[$i]}" == "-t" ]]; then ref="${args[$((i + 1))]}"; fi
done
digest=$(printf '%s' "$ref" | sha256sum | cut -d' ' -f1)
if [[ " $* " == *" --push "* ]]; then
    printf '{"containerimage.digest": "sha256:%s", "image.name": "%s"}\n' "$digest" "$ref" > "$metadata"
fi
"""


def run_build(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    fake = tmp_path / "docker"
    fake.write_text(FAKE_DOCKER)
    fake.chmod(0o755)
    full = {**os.environ, "DOCKER": str(fake), "FAKE_DOCKER_LOG": str(tmp_path / "docker.log"),
            "DIGESTS_FILE": str(tmp_path / "digests.yaml"), **env}
    return subprocess.run(["bash", str(ROOT / "scripts" / "build_images.sh")], env=full, capture_output=True, text=True,
                          timeout=60)


def test_build_script_builds_the_three_images_and_writes_their_digests(tmp_path):
    proc = run_build(tmp_path, REGISTRY="registry.example.com/ml/", PUSH="1")
    assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "docker.log").read_text().splitlines()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    expected = {"cpu": ("images/cpu", "linux/amd64"), "gpu": ("images/cuda", "linux/amd64"), "npu": ("images/npu", "linux/arm64")}
    assert len(calls) == 3
    for call, (name, (folder, platform)) in zip(calls, expected.items()):
        assert call.startswith(f"buildx build --platform {platform} -f {folder}/Dockerfile "
                               f"-t registry.example.com/ml/dockrl-{name}:{version} "), call
        assert call.endswith(" --push .")
    # the digests file is an images: list that `dockrl pipeline compile --overlay` reads
    images = images_from_kustomization(tmp_path / "digests.yaml")
    assert images["registry"] == "registry.example.com/ml" and images["tag"] == version
    assert set(images["digests"]) == set(IMAGE_NAMES)
    npu = with_images(PLATFORMS["npu"], **images)
    assert re.fullmatch(r"registry\.example\.com/ml/dockrl-npu@sha256:[0-9a-f]{64}", npu.image)


def test_build_script_refuses_latest_and_unknown_images(tmp_path):
    proc = run_build(tmp_path, TAG="latest")
    assert proc.returncode == 2 and "never 'latest'" in proc.stderr
    proc = run_build(tmp_path, IMAGES="cpu tpu")
    assert proc.returncode == 2 and "IMAGES has 'tpu'" in proc.stderr
    proc = run_build(tmp_path, REGISTRY="https://registry.example.com")
    assert proc.returncode == 2 and "without scheme" in proc.stderr
    assert not (tmp_path / "docker.log").exists()  # nothing was built
    proc = run_build(tmp_path, IMAGES="cpu", TAG="0.2.0")  # without PUSH: loaded into the local engine
    assert proc.returncode == 0, proc.stderr
    [call] = (tmp_path / "docker.log").read_text().splitlines()
    assert "-t ghcr.io/dockrl/dockrl-cpu:0.2.0 " in call and call.endswith(" --load .")
    assert not (tmp_path / "digests.yaml").exists()


def test_make_images_runs_the_build_script():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^images:\n\tbash scripts/build_images\.sh$", makefile, flags=re.M)


def test_ci_workflow_builds_and_pushes_each_image_by_digest():
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "images.yml").read_text())
    on = workflow[True]  # YAML 1.1 reads the key `on` as true
    assert on["push"]["tags"] == ["v*"] and "workflow_dispatch" in on
    assert workflow["permissions"]["packages"] == "write"
    job = workflow["jobs"]["build"]
    assert sorted(job["strategy"]["matrix"]["image"]) == sorted(IMAGE_NAMES)
    [step] = [s for s in job["steps"] if s.get("name") == "build and push"]
    assert step["env"]["PUSH"] == "1" and "bash scripts/build_images.sh" in step["run"]
    assert step["env"]["IMAGES"] == "${{ matrix.image }}"
    for s in job["steps"]:
        if "uses" in s:
            assert re.fullmatch(r"[\w-]+/[\w-]+@v\d+", s["uses"]), s["uses"]  # pinned to a major release
