"""Device kinds and their collective backends: one communication interface for CPU, CUDA and Ascend.

| kind | torch device | collective backend | extra import |
|------|--------------|--------------------|--------------|
| cpu  | ``cpu``      | gloo               | —            |
| cuda | ``cuda:i``   | nccl               | —            |
| npu  | ``npu:i``    | hccl               | ``torch_npu`` (only when an NPU is asked for) |

``torch_npu`` needs the CANN libraries; merely installing it without them breaks ``import torch``
(STACK.md), so it is imported lazily here and nowhere else.

The process group is initialised from explicit arguments: library code never reads ``RANK`` or
``WORLD_SIZE`` from the environment; the launcher (or a test) passes them in.
"""

from __future__ import annotations

import datetime
import importlib
import logging

import torch
import torch.distributed as dist

from dockrl.resharding.layout import DEVICE_KINDS

logger = logging.getLogger(__name__)

BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


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


def _import_torch_npu() -> None:
    try:
        importlib.import_module("torch_npu")
    except ImportError as e:
        raise RuntimeError(
            "parallel.device='npu' needs the torch_npu package and the CANN libraries (Ascend images only); "
            f"importing torch_npu failed: {e}"
        ) from e


def torch_device(kind: str, local_rank: int = 0) -> torch.device:
    """The torch device of this process.

    Args:
        kind: ``cpu``, ``cuda`` or ``npu``.
        local_rank: index of the accelerator on this node (ignored for ``cpu``).

    Raises:
        ValueError: unknown kind or negative local rank.
        RuntimeError: the accelerator is not available (no CUDA device, torch_npu missing, or
            ``local_rank`` beyond the visible devices).
    """
    check_kind(kind)
    if local_rank < 0:
        raise ValueError(f"local_rank: got {local_rank}; expected >= 0")
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "npu":
        _import_torch_npu()
    module = getattr(torch, kind)
    if not module.is_available():
        raise RuntimeError(f"parallel.device={kind!r}: no {kind} device is available to this process")
    count = module.device_count()
    if local_rank >= count:
        raise RuntimeError(f"local_rank {local_rank}: only {count} {kind} device(s) are visible")
    module.set_device(local_rank)
    return torch.device(kind, local_rank)


def init_process_group(
    *,
    kind: str,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout_s: float,
    local_rank: int | None = None,
    external_store: bool = False,
) -> torch.device:
    """Join the default process group with the backend of ``kind`` and return this rank's device.

    Args:
        kind: device kind (``cpu`` → gloo, ``cuda`` → nccl, ``npu`` → hccl).
        rank, world_size: this process's global rank and the number of processes.
        master_addr, master_port: TCP rendezvous of rank 0.
        timeout_s: seconds any collective (and the rendezvous) may wait before failing.
        local_rank: accelerator index on this node; defaults to ``rank``.
        external_store: the rendezvous store is already served at ``master_addr:master_port``
            (by the launcher, or a test holding ``torch.distributed.TCPStore(..., is_master=True)``
            on a port it bound, so no port can be taken in between); otherwise rank 0 serves it.

    Raises:
        ValueError: a bad argument (named in the message).
        RuntimeError: a process group already exists, or the accelerator is not available.
    """
    if world_size < 1:
        raise ValueError(f"world_size: got {world_size}; expected >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: got {rank}; expected 0 <= rank < world_size={world_size}")
    if not 0 < master_port < 65536:
        raise ValueError(f"master_port: got {master_port}; expected 1..65535")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: got {timeout_s}; expected > 0")
    if dist.is_initialized():
        raise RuntimeError("init_process_group: this process already belongs to a process group")
    device = torch_device(kind, rank if local_rank is None else local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_addr, master_port, is_master=rank == 0 and not external_store, timeout=timeout, wait_for_workers=False
    )
    dist.init_process_group(
        backend=backend_for(kind),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if kind == "cuda" else None,  # eager NCCL communicator on this GPU
    )
    logger.debug("rank %d/%d joined the %s process group on %s", rank, world_size, backend_for(kind), device)
    return device


def destroy_process_group() -> None:
    """Leave the default process group (no-op when none exists)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def synchronize(device: torch.device) -> None:
    """Wait for the queued kernels of ``device`` (no-op on CPU), so that timings are honest."""
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


def host_pinned(device: torch.device) -> bool:
    """Whether host copies of tensors on ``device`` should be in pinned (page-locked) memory."""
    return device.type in ("cuda", "npu")


def allocator_peak_bytes(device: torch.device) -> int | None:
    """Peak bytes of the device's caching allocator since the last reset; ``None`` on CPU."""
    if device.type == "cpu":
        return None
    return int(getattr(torch, device.type).max_memory_allocated(device))


def reset_allocator_peak(device: torch.device) -> None:
    """Reset the allocator's peak counter (no-op on CPU)."""
    if device.type != "cpu":
        getattr(torch, device.type).reset_peak_memory_stats(device)


def allocator_bytes(device: torch.device) -> int | None:
    """Bytes currently allocated by the device's caching allocator; ``None`` on CPU."""
    if device.type == "cpu":
        return None
    return int(getattr(torch, device.type).memory_allocated(device))
