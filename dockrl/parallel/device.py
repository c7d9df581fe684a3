"""Device placement and process groups for every device kind: the one module that places and communicates.

| kind | torch device | collective backend | extra import |
|------|--------------|--------------------|--------------|
| cpu  | ``cpu``      | gloo               | —            |
| cuda | ``cuda:i``   | nccl               | —            |
| npu  | ``npu:i``    | hccl               | ``torch_npu`` (only when an NPU is asked for, or ``auto`` finds it installed) |

Every process that computes holds one device, chosen once: ``process_device(kind, local_rank)``
(``cuda:i``/``npu:i`` from the local rank; ``set_device`` on it). A process's own groups are made
by ``dockrl.parallel.ranks.join_groups``; the one group outside any layout, the actor → rollout
weight channel, by ``channel_group`` here (a group of its own beside the default one). Device-specific
calls go through torch's device-generic API (``torch.accelerator``, ``torch.get_device_module``),
not ``if cuda … elif npu`` chains.

``parallel.device=auto`` (the default) is resolved by ``resolve_kind``: the accelerator torch
reports (``torch.accelerator.current_accelerator``), an Ascend NPU when ``torch_npu`` is
installed, else the CPU. Asking for ``cuda``/``npu`` where none is visible is an error naming
``parallel.device``, never a silent fall-back to the CPU.

``torch_npu`` needs the CANN libraries; merely installing it without them breaks ``import torch``
(docs/design.md §7), so it is imported lazily here and nowhere else.

"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import logging
from types import ModuleType

import torch
import torch.distributed as dist

from dockrl.parallel.layout import DEVICE_KINDS

logger = logging.getLogger(__name__)

BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
AUTO = "auto"
"""``parallel.device`` value that picks the accelerator present, else the CPU (``resolve_kind``)."""


def check_kind(kind: str) -> str:
    """Return ``kind`` if it is a known device kind.

    Raises:
        ValueError: ``kind`` is not one of ``cpu``, ``cuda``, ``npu``.
    """
    if kind not in BACKENDS:
        raise ValueError(f"parallel.device: got {kind!r}; expected one of {', '.join(map(repr, DEVICE_KINDS))}")
    return kind


def backend_for(kind: str) -> str:
    """The collective backend of a device kind: gloo (cpu), nccl (cuda), hccl (npu)."""
    return BACKENDS[check_kind(kind)]


def _import_torch_npu() -> None:
    try:
        importlib.import_module("torch_npu")
    except ImportError as e:
        raise RuntimeError(
            "parallel.device='npu' needs the torch_npu package and the CANN libraries (Ascend images only); "
            f"importing torch_npu failed: {e}. Fix: run on the npu image, or set parallel.device=auto or cpu"
        ) from e


def device_module(kind: str) -> ModuleType:
    """``torch.cuda``, ``torch.npu`` (after importing ``torch_npu``) or ``torch.cpu``: the device
    module of ``kind`` (``torch.get_device_module``), for memory statistics and caches.

    Raises:
        ValueError: unknown kind.
        RuntimeError: ``npu`` without ``torch_npu``.
    """
    if check_kind(kind) == "npu":
        _import_torch_npu()
    return torch.get_device_module(kind)


def _current_accelerator():
    """``torch.accelerator.current_accelerator(check_available=True)``; torch before 2.8 (older
    torch_npu images) has no ``check_available``: then the device is checked by hand."""
    accelerator = torch.accelerator
    try:
        return accelerator.current_accelerator(check_available=True)
    except TypeError:
        found = accelerator.current_accelerator()
        return found if found is not None and accelerator.is_available() else None


def detect_kind() -> str:
    """The accelerator kind present in this process, else ``cpu``: what ``parallel.device=auto`` picks.

    ``torch.accelerator.current_accelerator(check_available=True)`` answers for CUDA (and for an
    NPU once ``torch_npu`` is imported). Otherwise, when ``torch_npu`` is installed (only Ascend
    images have it), it is imported and asked; an import that fails leaves the CPU, with a
    warning. A CUDA build on a machine without a GPU answers ``cpu``.
    """
    found = _current_accelerator()
    if found is not None and found.type in BACKENDS:
        return found.type
    if importlib.util.find_spec("torch_npu") is not None:
        try:
            importlib.import_module("torch_npu")
        except Exception as e:  # noqa: BLE001 - a broken CANN set-up must not stop a CPU run
            logger.warning("parallel.device=auto: torch_npu is installed but does not import (%s); using the CPU", e)
            return "cpu"
        found = _current_accelerator()
        if found is not None and found.type == "npu":
            return "npu"
    return "cpu"


def resolve_kind(requested: str) -> str:
    """``parallel.device`` as a device kind: ``auto`` → ``detect_kind()``; ``cpu``/``cuda``/``npu`` as given.

    The explicit kinds are not checked for presence here (a launcher on a CPU node writes the
    config of GPU pods): ``process_device`` checks where the model is placed.

    Raises:
        ValueError: not ``auto`` and not a device kind.
    """
    if requested == AUTO:
        kind = detect_kind()
        logger.info("parallel.device=auto: %s", kind)
        return kind
    return check_kind(requested)


def _missing(kind: str, what: str) -> RuntimeError:
    return RuntimeError(
        f"parallel.device={kind!r}: {what}. Fix: run where a {kind} device is visible to this process, "
        "or set parallel.device=auto (the accelerator present, else the CPU) or cpu"
    )


def torch_device(kind: str, local_rank: int = 0) -> torch.device:
    """The torch device of this process, made current (``set_device`` of the device module).

    Args:
        kind: ``cpu``, ``cuda`` or ``npu``.
        local_rank: index of the accelerator on this node (ignored for ``cpu``).

    Raises:
        ValueError: unknown kind or negative local rank.
        RuntimeError: the accelerator is not available (no such device visible, torch_npu
            missing, or ``local_rank`` beyond the visible devices); the message names
            ``parallel.device`` and the fix.
    """
    check_kind(kind)
    if local_rank < 0:
        raise ValueError(f"local_rank: got {local_rank}; expected >= 0")
    if kind == "cpu":
        return torch.device("cpu")
    module = device_module(kind)
    if not module.is_available():
        raise _missing(kind, f"no {kind} device is available to this process")
    count = module.device_count()
    if local_rank >= count:
        raise _missing(kind, f"local rank {local_rank} needs device {kind}:{local_rank}, but only {count} {kind} device(s) are visible")
    module.set_device(local_rank)
    return torch.device(kind, local_rank)


def local_rank_of(kind: str, rank: int) -> int:
    """The accelerator index of global rank ``rank`` on its node: ``rank`` modulo the devices this
    process sees (a node, or a pod, holds consecutive ranks, one device each); 0 on ``cpu``.

    Raises:
        RuntimeError: no device of ``kind`` is visible (``torch_device``'s message).
    """
    if check_kind(kind) == "cpu":
        return 0
    count = device_module(kind).device_count()
    if count < 1:
        raise _missing(kind, f"no {kind} device is available to this process")
    return rank % count


process_device = torch_device
"""The device of this process for a layout's device kind and this process's local rank (one device per rank process)."""


def native_bf16(kind: str) -> bool:
    """Whether devices of ``kind`` compute bf16 natively, not by emulation.

    CPU: AVX512-BF16 or AMX-BF16 (``torch.cpu.get_capabilities``); on an AVX2-only CPU torch
    emulates bf16 matmuls and they run several times slower than fp32. CUDA: compute
    capability 8.0 or newer (``torch.cuda.is_bf16_supported``). NPU: Ascend 910 computes bf16.
    Without a GPU present, ``cuda`` answers True (the config is written for the cluster).
    """
    if check_kind(kind) == "cpu":
        caps = torch.cpu.get_capabilities()
        return bool(caps.get("avx512_bf16") or caps.get("amx_bf16") or caps.get("bf16"))
    if kind == "cuda" and torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return True


def bf16_by_default(kind: str) -> bool:
    """Whether ``auto`` picks bf16 on devices of ``kind`` (``rollout.dtype``, ``trainer.autocast_bf16``):
    where bf16 is faster than fp32, not merely native.

    CPU: AMX-BF16 only. With AVX512-BF16 alone, torch's bf16 matmuls ran at 0.5–0.7× its fp32
    rate (66–77 against 104–155 GFLOP/s, shapes of SmolLM2-135M, torch 2.13, one core), the update
    under bf16 autocast took 1.75× as long, and a GRPO iteration with the vLLM rollout 1.4× as long
    (docs/benchmarks.md). Elsewhere as ``native_bf16``.
    """
    if check_kind(kind) == "cpu":
        return bool(torch.cpu.get_capabilities().get("amx_bf16"))
    return native_bf16(kind)


def _check_group_args(rank: int, world_size: int, timeout_s: float) -> None:
    if world_size < 1:
        raise ValueError(f"world_size: got {world_size}; expected >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: got {rank}; expected 0 <= rank < world_size={world_size}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: got {timeout_s}; expected > 0")


def channel_backend(kind: str) -> str:
    """Backend of a weight channel between processes on devices of ``kind``: nccl on CUDA (device
    tensors, GPU to GPU), gloo elsewhere — on ``npu`` over host tensors (torch_npu offers no
    public constructor of a stand-alone HCCL group), on ``cpu`` over the weights themselves."""
    return "nccl" if check_kind(kind) == "cuda" else "gloo"


def channel_group(
    kind: str, store: dist.Store, *, prefix: str, rank: int, world_size: int, timeout_s: float,
) -> dist.ProcessGroup:
    """A process group of its own over ``store`` (keys under ``prefix``), not the default group
    (which stays free for the engines), with ``channel_backend(kind)``; collectives are called
    on the returned object directly.

    Raises:
        ValueError: a bad rank, world size or timeout.
    """
    _check_group_args(rank, world_size, timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(prefix, store)
    if channel_backend(kind) == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)  # type: ignore[return-value]  # a backend, used as a group
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)  # type: ignore[return-value]


def synchronize(device: torch.device) -> None:
    """Wait for the queued kernels of ``device`` (no-op on CPU), so that timings are honest."""
    if device.type != "cpu":
        device_module(device.type).synchronize(device)


def empty_cache(device: torch.device) -> None:
    """Return the caching allocator's free blocks to the device (no-op on CPU), so that another
    allocator (vLLM's KV cache) can take the memory."""
    if device.type != "cpu":
        device_module(device.type).empty_cache()


def host_pinned(device: torch.device) -> bool:
    """Whether host copies of tensors on ``device`` should be in pinned (page-locked) memory."""
    return device.type in ("cuda", "npu")


def allocator_peak_bytes(device: torch.device) -> int | None:
    """Peak bytes of the device's caching allocator since the last reset; ``None`` on CPU."""
    if device.type == "cpu":
        return None
    return int(device_module(device.type).max_memory_allocated(device))


def reset_allocator_peak(device: torch.device) -> None:
    """Reset the allocator's peak counter (no-op on CPU)."""
    if device.type != "cpu":
        device_module(device.type).reset_peak_memory_stats(device)


def allocator_bytes(device: torch.device) -> int | None:
    """Bytes currently allocated by the device's caching allocator; ``None`` on CPU."""
    if device.type == "cpu":
        return None
    return int(device_module(device.type).memory_allocated(device))
