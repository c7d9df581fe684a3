#!/usr/bin/env python3
"""Do the images' requirements resolve, for every architecture each image is built for? Checked
without installing anything and without a container engine.

For one image and one architecture this runs

    pip install --dry-run --ignore-installed --report <json> --only-binary=:all:
        --python-version <the image's Python> --platform <every manylinux tag of that architecture
        up to the image's glibc> -r images/<folder>/requirements.txt

and checks that every pinned package resolves to its pin; it says where each package came from
(the report's ``download_info.url``). The image's Python and glibc are read from its Dockerfile
(base image, ``ARG PYTHON_VERSION``), its architectures from ``IMAGE_ARCHITECTURES``
(dockrl/launch/platform.py).

What cannot be resolved that way is set aside, listed in the output, and checked as far as it can
be. A set-aside package is replaced by a placeholder distribution (a fake: a wheel with only its
name, version and requirements), so that pip still checks every package that requires it against
the pin, and the placeholder's own requirements with the rest:

- a pin whose line says ``# from <index url>`` when that index is not reachable from here and PyPI
  lacks the exact version (triton-ascend on Ascend's index, torch's ``+cpu`` builds on PyTorch's).
  The placeholder of a ``+cpu`` build requires what PyPI's build of that version requires, less
  its CUDA libraries; any other's requirements are unknown here and said so. A pin from an
  unreachable index whose exact version PyPI also has is resolved from PyPI in its place;
- a package under ``--no-binary`` (built from its PyPI sdist in the image): its sdist is fetched
  and the placeholder requires what the sdist declares (vLLM built with
  ``VLLM_TARGET_DEVICE=empty`` declares requirements/common.txt: vLLM's setup.py,
  ``get_requirements``).

pip evaluates environment markers for the machine it runs on, not for ``--platform``
(pypa/pip#11664): pip runs here with ``platform_machine`` set to the target's (the report's
``environment`` shows it). pip's own configuration files and PIP_* index settings are ignored, so
that the resolution uses exactly the indexes of the requirements file.

Run from the repository root (any machine that reaches PyPI):

    python images/resolve.py                        # every image x architecture
    python images/resolve.py npu --arch arm64
    python images/resolve.py npu --requirements other.txt   # another set of pins, npu's Python and glibc

Exit status: 0 when every set resolves to its pins, 1 when one does not, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import email
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPI = "https://pypi.org/simple"
PYPI_JSON = "https://pypi.org/pypi/{name}/json"
FOLDERS = {"cpu": "cpu", "gpu": "cuda", "npu": "npu"}
"""Image name (the platform preset's) -> folder under images/."""
MACHINES = {"amd64": "x86_64", "arm64": "aarch64"}
"""Kubernetes/OCI architecture -> the machine name of wheel tags and of ``platform_machine``."""
GLIBC = {"bookworm": (2, 36), "ubuntu22.04": (2, 35), "ubuntu24.04": (2, 39)}
"""glibc of the base images' distributions (Debian 12, Ubuntu 22.04, Ubuntu 24.04): the newest manylinux tag they run."""
SDIST_REQUIREMENTS = {"vllm": "requirements/common.txt"}
"""Where an sdist's run-time requirements are when its metadata is computed at build time: vLLM's
setup.py installs requirements/common.txt when VLLM_TARGET_DEVICE=empty (``get_requirements``)."""
CUDA_LIBRARIES = re.compile(r"^(nvidia-|cuda-|triton$)")
"""Requirements of PyPI's CUDA build of torch that its ``+cpu`` build does not have."""
PROBE_TIMEOUT_S = 10
PIP_TIMEOUT_S = 900

# Run pip with the target's platform_machine in its marker environment (pypa/pip#11664): argv[1]
# is the machine, argv[2] the Python version; the rest goes to pip.
_PIP_FOR_TARGET = """\
import runpy, sys
from pip._vendor.packaging import markers
host = markers.default_environment
machine, python = sys.argv.pop(1), sys.argv.pop(1)
full = host()["python_full_version"] if host()["python_version"] == python else python + ".0"
markers.default_environment = lambda: {**host(), "platform_machine": machine, "python_version": python,
                                       "python_full_version": full}
sys.argv[0] = "pip"
runpy.run_module("pip", run_name="__main__", alter_sys=True)
"""


@dataclass(frozen=True, kw_only=True)
class Image:
    """What the resolution of one image needs from its Dockerfile."""

    name: str
    """Image name: ``cpu``, ``gpu`` or ``npu``."""
    folder: Path
    """images/<folder>: the Dockerfile and requirements.txt."""
    base: str
    """The base image, build args substituted."""
    python: str
    """The image's Python, ``3.11``."""
    glibc: tuple[int, int]
    """glibc of the base image's distribution."""


@dataclass(frozen=True, kw_only=True)
class Pin:
    """One requirement line of a requirements file."""

    requirement: Requirement
    source: str | None
    """The index URL of its ``# from <url>`` comment; None: the file's indexes (PyPI first)."""

    @property
    def name(self) -> str:
        return str(canonicalize_name(self.requirement.name))

    @property
    def version(self) -> str | None:
        """The pinned version of an exact ``==`` requirement, else None."""
        specs = list(self.requirement.specifier)
        if len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version:
            return specs[0].version
        return None


@dataclass(frozen=True, kw_only=True)
class Requirements:
    """A requirements file as pip reads it, restricted to what the images use."""

    pins: tuple[Pin, ...]
    index_url: str | None
    extra_index_urls: tuple[str, ...]
    no_binary: frozenset[str]


@dataclass(kw_only=True)
class Result:
    """The resolution of one image for one architecture."""

    image: str
    arch: str
    python: str
    platforms: list[str]
    seconds: float = 0.0
    resolved: list[dict] = field(default_factory=list)
    """The report's ``install`` entries."""
    set_aside: dict[str, str] = field(default_factory=dict)
    """Package -> why and how it was checked instead."""
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    pins: dict[str, str] = field(default_factory=dict)
    """Package -> pinned version."""

    def describe(self) -> str:
        """A table: per package its version and where it came from, then what was set aside."""
        head = (f"{self.image} linux/{self.arch} (Python {self.python}, up to {self.platforms[0]}): "
                f"{len(self.resolved)} packages resolved in {self.seconds:.1f} s")
        lines = [head]
        width = max((len(canonicalize_name(e["metadata"]["name"])) for e in self.resolved), default=10) + 2
        for entry in sorted(self.resolved, key=lambda e: (canonicalize_name(e["metadata"]["name"]) not in self.pins,
                                                          canonicalize_name(e["metadata"]["name"]))):
            name = canonicalize_name(entry["metadata"]["name"])
            url = entry["download_info"]["url"]
            where = "placeholder (set aside, see below)" if url.startswith("file:") else url
            mark = "pinned" if name in self.pins else "dep   "
            lines.append(f"  {mark} {name:<{width}} {entry['metadata']['version']:<18} {where}")
        for package, why in sorted(self.set_aside.items()):
            lines.append(f"  SET ASIDE {package}: {why}")
        lines += [f"  note: {note}" for note in self.notes]
        lines += [f"  PROBLEM: {problem}" for problem in self.problems]
        return "\n".join(lines)


def read_image(name: str) -> Image:
    """The image ``name`` (``cpu``, ``gpu``, ``npu``) as its Dockerfile declares it.

    Raises:
        ValueError: unknown image, or a base image whose distribution or Python is not known here.
    """
    if name not in FOLDERS:
        raise ValueError(f"image {name!r}: expected one of {', '.join(FOLDERS)}")
    folder = ROOT / "images" / FOLDERS[name]
    args, base = {}, None
    for op, rest in dockerfile_instructions(folder / "Dockerfile"):
        if op == "ARG" and "=" in rest:
            key, value = rest.split("=", 1)
            args[key] = value
        elif op == "FROM" and base is None:
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest.split()[0])
    if base is None:
        raise ValueError(f"{folder / 'Dockerfile'}: no FROM")
    distro = next((d for d in GLIBC if d in base), None)
    if distro is None:
        raise ValueError(f"{folder / 'Dockerfile'}: base {base!r} is none of the distributions known here ({', '.join(GLIBC)}); "
                         "add its glibc to GLIBC in images/resolve.py")
    tagged = re.search(r"(?:^python:|-py)(3\.\d+)", base)
    python = args.get("PYTHON_VERSION") or (tagged.group(1) if tagged else None)
    if not python:
        raise ValueError(f"{folder / 'Dockerfile'}: base {base!r} names no Python and there is no ARG PYTHON_VERSION")
    return Image(name=name, folder=folder, base=base, python=python, glibc=GLIBC[distro])


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        continued = line.rstrip().endswith("\\")
        pending += line.rstrip().rstrip("\\").strip() + " " if continued else line.strip()
        if not continued:
            if pending.strip():
                op, _, args = pending.strip().partition(" ")
                out.append((op.upper(), args.strip()))
            pending = ""
    return out


def read_requirements(path: Path) -> Requirements:
    """Parse a requirements file: requirement lines (with an optional ``# from <url>``) and the
    options ``--index-url``, ``--extra-index-url`` and ``--no-binary``.

    Raises:
        ValueError: another option, or a line that is not a requirement (names the file and line).
    """
    pins, extra, no_binary, index_url = [], [], set(), None
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line, _, comment = raw.partition(" #") if not raw.lstrip().startswith("#") else ("", "", raw)
        line = line.strip()
        if not line:
            continue
        if line.startswith("-"):
            option, _, value = line.replace("=", " ", 1).partition(" ")
            value = value.strip()
            if option == "--index-url":
                index_url = value
            elif option == "--extra-index-url":
                extra.append(value)
            elif option == "--no-binary":
                no_binary |= {canonicalize_name(n) for n in value.split(",")}
            else:
                raise ValueError(f"{path}:{number}: option {option!r} is not one images/resolve.py reads; "
                                 "use --index-url, --extra-index-url or --no-binary")
            continue
        try:
            requirement = Requirement(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {line!r} is not a requirement ({exc})") from None
        source = re.search(r"\bfrom\s+(https?://\S+)", comment)
        pins.append(Pin(requirement=requirement, source=source.group(1).rstrip(".,;:)") if source else None))
    return Requirements(pins=tuple(pins), index_url=index_url, extra_index_urls=tuple(extra), no_binary=frozenset(no_binary))


def platform_tags(arch: str, glibc: tuple[int, int]) -> list[str]:
    """Every platform tag pip accepts on a glibc ``glibc`` Linux of ``arch`` (``amd64``, ``arm64``),
    newest first: pip's ``--platform`` takes tags literally and does not expand manylinux_2_N to
    the older ones that such a system also runs."""
    machine = MACHINES[arch]
    tags = [f"manylinux_{glibc[0]}_{minor}_{machine}" for minor in range(glibc[1], 16, -1)]
    tags.append(f"manylinux2014_{machine}")
    if machine == "x86_64":
        tags += [f"manylinux2010_{machine}", f"manylinux1_{machine}"]
    return [*tags, f"linux_{machine}"]


@cache
def reachable(url: str) -> bool:
    """Whether an HTTP request to ``url`` gets any answer within PROBE_TIMEOUT_S seconds."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return True  # an answer, even 404: the host is there
    except (urllib.error.URLError, OSError):
        return False
    return True


@cache
def pypi_releases(name: str) -> dict[str, list[dict]]:
    """PyPI's files of each release of ``name`` (its JSON API); {} when PyPI has no such project."""
    try:
        with urllib.request.urlopen(PYPI_JSON.format(name=name), timeout=60) as answer:
            return json.load(answer)["releases"]
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return {}
        raise


@cache
def sdist_requirements(name: str, version: str) -> tuple[str, ...]:
    """The run-time requirements the PyPI sdist of ``name==version`` declares (SDIST_REQUIREMENTS'
    file where listed, else PKG-INFO's Requires-Dist without extras).

    Raises:
        LookupError: PyPI has no sdist of that version.
    """
    files = [f for f in pypi_releases(name).get(version, []) if f["packagetype"] == "sdist"]
    if not files:
        raise LookupError(f"PyPI has no sdist of {name}=={version}")
    url = files[0]["url"]
    if url.startswith("../"):  # some mirrors of the JSON API answer relative to /pypi/<name>/json
        url = urllib.parse.urljoin(PYPI_JSON.format(name=name), url)
    with urllib.request.urlopen(url, timeout=300) as answer:
        data = answer.read()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
        top = archive.getnames()[0].split("/")[0]
        inner = SDIST_REQUIREMENTS.get(canonicalize_name(name))
        member = archive.extractfile(f"{top}/{inner or 'PKG-INFO'}")
        assert member is not None, f"{name}: {inner or 'PKG-INFO'} is not a file"
        text = member.read().decode()
    if inner:
        lines = (line.split(" #")[0].strip() for line in text.splitlines())
        return tuple(line for line in lines if line and not line.startswith(("#", "-")))
    metadata = email.message_from_string(text)
    return tuple(r for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r.replace("extra==", "extra =="))


def placeholder_wheel(folder: Path, name: str, version: str, requires: list[str], why: str) -> Path:
    """A fake wheel with only metadata: it stands in for a package the resolution cannot fetch."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    metadata = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                        f"Summary: placeholder of images/resolve.py: {why}\n",
                        *(f"Requires-Dist: {r}\n" for r in requires)])
    wheel = "Wheel-Version: 1.0\nGenerator: images/resolve.py\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{dist}.dist-info/METADATA", metadata)
        archive.writestr(f"{dist}.dist-info/WHEEL", wheel)
        archive.writestr(f"{dist}.dist-info/RECORD", f"{dist}.dist-info/METADATA,,\n{dist}.dist-info/WHEEL,,\n{dist}.dist-info/RECORD,,\n")
    return path


def pip_environment() -> dict[str, str]:
    """This environment without pip's configuration files and PIP_* settings (only certificates,
    proxy and timeout kept), so that only the requirements file's indexes are used."""
    keep = {"PIP_CERT", "PIP_CLIENT_CERT", "PIP_PROXY", "PIP_DEFAULT_TIMEOUT", "PIP_TIMEOUT", "PIP_RETRIES"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in keep}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


def run_pip(arch: str, python: str, platforms: list[str], args: list[str]) -> subprocess.CompletedProcess:
    """``pip <args>`` resolving for ``arch`` and ``python`` (markers included)."""
    target = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    target += [a for p in platforms for a in ("--platform", p)]
    command = [sys.executable, "-c", _PIP_FOR_TARGET, MACHINES[arch], python, *args, *target]
    return subprocess.run(command, env=pip_environment(), capture_output=True, text=True, timeout=PIP_TIMEOUT_S)


def pypi_metadata(arch: str, python: str, platforms: list[str], specs: list[str], workdir: Path) -> dict[str, dict]:
    """PyPI's metadata of each ``name==version`` in ``specs`` for that target, without dependencies."""
    if not specs:
        return {}
    report = workdir / "metadata.json"
    proc = run_pip(arch, python, platforms, ["install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet",
                                             "--report", str(report), "--index-url", PYPI, *specs])
    if proc.returncode != 0:
        raise LookupError(f"PyPI's metadata of {', '.join(specs)}: {last_lines(proc.stderr)}")
    entries = json.loads(report.read_text())["install"]
    return {canonicalize_name(e["metadata"]["name"]): e["metadata"] for e in entries}


def last_lines(text: str, count: int = 6) -> str:
    """The end of pip's error output on one line, without its list of releases for other Pythons."""
    lines = [line for line in text.strip().splitlines() if line.strip() and "require a different python version" not in line]
    return " | ".join(lines[-count:])


def resolve(image: Image, arch: str, requirements_path: Path | None = None, keep_report: Path | None = None) -> Result:
    """Resolve ``image``'s requirements (or those at ``requirements_path``) for ``arch`` against
    PyPI, setting aside what cannot be fetched from here; every pin is checked against what
    resolved; ``keep_report``: where to copy pip's report. Network: PyPI (and the file's other
    indexes, probed)."""
    path = requirements_path or image.folder / "requirements.txt"
    spec = read_requirements(path)
    platforms = platform_tags(arch, image.glibc)
    result = Result(image=image.name, arch=arch, python=image.python, platforms=platforms)
    result.pins = {p.name: p.version for p in spec.pins if p.version is not None}
    started = time.monotonic()
    indexes = [spec.index_url or PYPI, *spec.extra_index_urls, *(p.source for p in spec.pins if p.source)]
    unreachable = {u for u in indexes if u != PYPI and not reachable(u)}
    for url in sorted({p.source for p in spec.pins if p.source} - set(indexes[: 1 + len(spec.extra_index_urls)])):
        result.problems.append(f"{path}: '# from {url}' names an index that is not one of the file's --extra-index-url lines")
    for url in sorted(unreachable):
        result.notes.append(f"index {url} is not reachable from here: resolved without it")
    if spec.index_url not in (None, PYPI):
        result.notes.append(f"--index-url {spec.index_url}: PyPI is used as the first index here all the same")

    with tempfile.TemporaryDirectory(prefix="resolve-") as tmp:
        workdir = Path(tmp)
        lines = [f"--index-url {PYPI}", *(f"--extra-index-url {u}" for u in spec.extra_index_urls if u not in unreachable)]
        off_pypi = []  # pins that live only on an unreachable index
        for pin in spec.pins:
            if pin.name in spec.no_binary:
                lines.append(_sdist_placeholder(pin, workdir, result))
            elif pin.source in unreachable and pin.version:
                if Version(pin.version).local is None and pin.version in pypi_releases(pin.name):
                    result.notes.append(f"{pin.requirement}: the image takes it from {pin.source}; "
                                        "resolved from PyPI's release of that version in its place")
                    lines.append(str(pin.requirement))
                else:
                    off_pypi.append(pin)
            else:
                lines.append(str(pin.requirement))
        lines += _index_placeholders(off_pypi, image, arch, platforms, workdir, result)

        if result.problems:
            result.seconds = time.monotonic() - started
            return result
        (workdir / "requirements.txt").write_text("\n".join(lines) + "\n")
        report = workdir / "report.json"
        proc = run_pip(arch, image.python, platforms, ["install", "--dry-run", "--ignore-installed", "--quiet",
                                                       "--report", str(report), "-r", str(workdir / "requirements.txt")])
        result.seconds = time.monotonic() - started
        if proc.returncode != 0:
            result.problems.append(f"pip could not resolve the set: {last_lines(proc.stderr)}")
            return result
        data = json.loads(report.read_text())
        if keep_report:
            keep_report.write_text(report.read_text())

    machine = data["environment"]["platform_machine"]
    if machine != MACHINES[arch]:
        result.problems.append(f"pip evaluated markers for platform_machine={machine!r}, not {MACHINES[arch]!r}")
    result.resolved = data["install"]
    versions = {str(canonicalize_name(e["metadata"]["name"])): e["metadata"]["version"] for e in result.resolved}
    for name, pinned in result.pins.items():
        got = versions.get(name)
        if got is None:
            result.problems.append(f"{name}=={pinned} is pinned but was not resolved")
        elif not SpecifierSet(f"=={pinned}").contains(Version(got), prereleases=True) or (Version(pinned).local and got != pinned):
            result.problems.append(f"{name}=={pinned} resolved to {got}")
    return result


def _sdist_placeholder(pin: Pin, workdir: Path, result: Result) -> str:
    """The requirement line of a placeholder for ``pin``, built from its sdist in the image: it
    requires what the sdist declares."""
    why = ""
    requires: list[str] = []
    if not pin.version:
        result.problems.append(f"{pin.requirement}: a --no-binary package needs an exact pin to be checked")
    else:
        try:
            requires = list(sdist_requirements(pin.name, pin.version))
        except LookupError as exc:
            result.problems.append(f"{pin.requirement} (--no-binary): {exc}")
        why = (f"built from its PyPI sdist in the image (--no-binary), which the resolver does not build; the "
               f"{len(requires)} requirements the sdist declares ({SDIST_REQUIREMENTS.get(pin.name, 'PKG-INFO')}) "
               "were resolved with the rest")
    wheel = placeholder_wheel(workdir, pin.requirement.name, pin.version or "0", requires, why)
    result.set_aside[pin.name] = why
    return f"{pin.requirement.name} @ {wheel.as_uri()}"


def _index_placeholders(pins: list[Pin], image: Image, arch: str, platforms: list[str], workdir: Path, result: Result) -> list[str]:
    """Requirement lines of placeholders for ``pins``, which live only on an index not reachable
    from here. A ``+cpu`` build's placeholder requires what PyPI's build of the same release
    requires, less its CUDA libraries; any other's requires nothing (its metadata is not here)."""
    cpu_builds = {p.name: Version(p.version or "0").public for p in pins if Version(p.version or "0").local == "cpu"}
    cpu_builds = {name: release for name, release in cpu_builds.items() if release in pypi_releases(name)}
    try:
        known = pypi_metadata(arch, image.python, platforms, [f"{n}=={r}" for n, r in cpu_builds.items()], workdir)
    except LookupError as exc:
        result.problems.append(str(exc))
        known = {}
    lines = []
    for pin in pins:
        assert pin.version is not None
        if pin.name in known:
            requires = [r for r in known[pin.name].get("requires_dist") or [] if not CUDA_LIBRARIES.match(canonicalize_name(Requirement(r).name))]
            origin = f"requires what PyPI's {pin.name} {cpu_builds[pin.name]} requires ({len(requires)}), less its CUDA libraries"
        else:
            requires = []
            origin = "declares no requirements: the package's own are not known here (its metadata lives only on that index)"
        why = (f"=={pin.version} lives only on {pin.source}, not reachable from here (PyPI has no {pin.version}); every "
               f"package requiring it was checked against the pin; its placeholder {origin}")
        wheel = placeholder_wheel(workdir, pin.requirement.name, pin.version, requires, why)
        result.set_aside[pin.name] = why
        lines.append(f"{pin.requirement.name} @ {wheel.as_uri()}")
    return lines


def main(argv: list[str] | None = None) -> int:
    from dockrl.launch.platform import IMAGE_ARCHITECTURES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("images", nargs="*", metavar="IMAGE", help=f"images to check, of {', '.join(FOLDERS)} (default: all)")
    parser.add_argument("--arch", choices=sorted(MACHINES), help="only this architecture (default: every one the image is built for)")
    parser.add_argument("--reports", type=Path, help="write pip's report of each resolution to DIR/<image>-<arch>.json")
    parser.add_argument("--requirements", type=Path, help="resolve this file instead of the image's requirements.txt (one image)")
    args = parser.parse_args(argv)
    names = args.images or list(FOLDERS)
    for name in names:
        if name not in FOLDERS:
            parser.error(f"IMAGE {name!r}: expected some of {', '.join(FOLDERS)}")
    if args.requirements and len(names) != 1:
        parser.error("--requirements needs exactly one IMAGE (whose Python and glibc it uses)")
    failed = False
    for name in names:
        image = read_image(name)
        for arch in [args.arch] if args.arch else IMAGE_ARCHITECTURES[name]:
            keep = args.reports / f"{name}-{arch}.json" if args.reports else None
            if keep:
                keep.parent.mkdir(parents=True, exist_ok=True)
            result = resolve(image, arch, args.requirements, keep)
            print(result.describe(), flush=True)
            failed |= bool(result.problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
