"""The Dockerfiles, parsed (no Docker engine here): pinned bases and versions, non-root, dockrl entry point."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from dockrl.launch.kubernetes import ENTRY_POINT
from dockrl.launch.platform import IMAGE_TAG, PLATFORMS

ROOT = Path(__file__).resolve().parents[2]
IMAGES = {"npu": "npu", "cuda": "gpu", "cpu": "cpu"}  # folder -> platform preset


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


@pytest.mark.parametrize("folder", sorted(IMAGES))
def test_dockerfile_is_pinned_non_root_and_enters_dockrl(folder):
    path = ROOT / "images" / folder / "Dockerfile"
    text = path.read_text()
    ins = instructions(path)
    assert "latest" not in text
    [base] = [args for op, args in ins if op == "FROM"]
    assert re.fullmatch(r"[\w./-]+:[\w.-]*\d[\w.-]*(@sha256:[0-9a-f]{64})?", base), f"base {base!r} is not pinned"
    args = dict(a.split("=", 1) for op, a in ins if op == "ARG")
    for name, value in args.items():
        if name.endswith("_VERSION"):
            assert re.fullmatch(r"\d+(\.\d+)+(\.?post\d+)?", value), f"{name}={value} is not an exact version"
    runs = " ".join(a for op, a in ins if op == "RUN")
    for var in ("TORCH_VERSION", "KFP_VERSION", "TRANSFORMERS_VERSION"):
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
    # the tag the platform preset (and the pipeline) uses is the one the build comment gives
    assert f"-t {PLATFORMS[IMAGES[folder]].image} " in text + " "
    assert PLATFORMS[IMAGES[folder]].image.endswith(f":{IMAGE_TAG}")


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
