"""Each image's requirements resolve, for every architecture the image is built for, against the
real registries (PyPI, and the other indexes of its requirements file where reachable): pip's
resolver run with ``--dry-run --report`` for the image's platform and Python (images/resolve.py),
nothing installed, no container engine.

What cannot be fetched from this machine (packages of an index it cannot reach, sdists built in
the image) is set aside, named in a warning of the test run, and checked as far as it can be: see
images/resolve.py. ``pytest -s`` prints, per image and architecture, each package's version and
the file it came from. Skips, saying so, only when PyPI itself is unreachable."""

from __future__ import annotations

import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest
from test_images import load_resolver  # images/resolve.py, loaded once for both files

from dockrl.launch.platform import IMAGE_ARCHITECTURES

ROOT = Path(__file__).resolve().parents[2]


resolver = load_resolver()

pytestmark = [pytest.mark.registries, pytest.mark.slow]


@pytest.fixture(scope="module")
def pypi():
    if not resolver.reachable(resolver.PYPI + "/pip/"):
        pytest.skip(f"PyPI ({resolver.PYPI}) is not reachable from this machine: the images' requirements cannot be resolved here")


CASES = [(name, arch) for name, archs in sorted(IMAGE_ARCHITECTURES.items()) for arch in archs]


@pytest.fixture(scope="module")
def resolutions(pypi) -> Iterator[dict[tuple[str, str], Future]]:
    """Every image and architecture resolved side by side (one pip process each, on the cores the rest of the run
    leaves free, their waits on the registry overlapping), started once for the module; each test takes its own
    result (a resolution's error fails only it)."""
    with ThreadPoolExecutor(len(CASES)) as pool:
        yield {case: pool.submit(resolver.resolve, resolver.read_image(case[0]), case[1]) for case in CASES}


@pytest.mark.parametrize(("name", "arch"), CASES)
def test_image_requirements_resolve_to_their_pins(resolutions, name, arch):
    result = resolutions[(name, arch)].result()
    print(result.describe())
    assert not result.problems, "\n".join(result.problems)
    resolved = {resolver.canonicalize_name(e["metadata"]["name"]) for e in result.resolved}
    assert set(result.pins) <= resolved and len(resolved) > len(result.pins)
    if result.set_aside:
        warnings.warn(f"images/{resolver.FOLDERS[name]} linux/{arch}: set aside, not fetched from here: "
                      + "; ".join(f"{pkg}: {why}" for pkg, why in sorted(result.set_aside.items())), stacklevel=1)


def test_the_resolver_fails_on_a_pin_pypi_does_not_have(pypi, tmp_path: Path):
    """triton-ascend 3.2.2 without its index: what vllm-ascend 0.23.0 requires and PyPI lacks."""
    path = tmp_path / "requirements.txt"
    path.write_text("triton-ascend==3.2.2\n")
    result = resolver.resolve(resolver.read_image("npu"), "arm64", path)
    assert result.problems and "No matching distribution found for triton-ascend==3.2.2" in result.problems[0]
    assert not result.set_aside and not result.resolved


def test_the_resolver_fails_on_pins_that_conflict(pypi, tmp_path: Path):
    """torchaudio 2.10.0 requires torch 2.10.0: a torch pin of another release cannot resolve."""
    path = tmp_path / "requirements.txt"
    path.write_text("torchaudio==2.10.0\ntorch==2.11.0\n")
    result = resolver.resolve(resolver.read_image("npu"), "arm64", path)
    assert result.problems and "pip could not resolve the set" in result.problems[0]
    assert "torch" in result.problems[0]
