"""Resident memory of this process, per stage: what ``memory/*`` metrics report.

Linux keeps a process's peak resident set (``VmHWM`` in ``/proc/self/status``) and lets the
process reset it to the current size (``echo 5 > /proc/self/clear_refs``, proc(5)): a stage's
own peak is then read without sampling. Elsewhere (no ``/proc``) nothing is reported.

After a stage, the heap's free pages are handed back to the kernel (glibc's ``malloc_trim``,
malloc_trim(3)): the rollout's KV cache and the update's activations are freed in many pieces
of less than glibc's mmap threshold (it rises to 32 MiB once a large block is freed), so
without it the next stage's allocations grow the heap past holes that are free but resident.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

logger = logging.getLogger(__name__)

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
GB = 2**30


def resident_bytes() -> tuple[int, int] | None:
    """``(current, peak)`` resident bytes of this process (``VmRSS``, ``VmHWM``); None without ``/proc``."""
    try:
        fields = dict(line.split(":", 1) for line in _STATUS.read_text().splitlines() if line.startswith(("VmRSS", "VmHWM")))
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024  # kB
    except (OSError, KeyError, ValueError):
        return None


_process_peak = 0  # bytes: the largest VmHWM this process read before a reset


def reset_peak() -> bool:
    """Set this process's peak resident size to its current one (``clear_refs`` 5); False where
    the kernel does not allow it (no ``/proc``, or a read-only one). The kernel's peak (``VmHWM``,
    and ``getrusage``'s ``ru_maxrss``, which reads the same counter) then covers the time since the
    reset only; ``process_peak_bytes`` keeps the whole process's."""
    global _process_peak
    if (now := resident_bytes()) is not None:
        _process_peak = max(_process_peak, now[1])
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def process_peak_bytes() -> int:
    """This process's peak resident bytes since it started, across ``reset_peak`` calls (0 without ``/proc``)."""
    now = resident_bytes()
    return max(_process_peak, now[1] if now else 0)


@functools.cache
def _libc() -> ctypes.CDLL | None:  # the C library, or None where it cannot be loaded
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def _malloc_trim():  # glibc's, or None (musl, macOS)
    return getattr(_libc(), "malloc_trim", None)


MADV_DONTNEED = 4  # <sys/mman.h> on Linux, every architecture


def release_pages(address: int, nbytes: int) -> int:
    """Hand the whole pages inside ``[address, address + nbytes)`` back to the kernel
    (``madvise(MADV_DONTNEED)``, madvise(2)): they stop counting in the resident set, and the
    next access to them reads zeros (private anonymous memory, what torch's CPU tensors are).
    The partial pages at either end are kept: they may hold another allocation.

    Returns:
        The bytes released (0 off Linux or where madvise is refused).
    """
    page = mmap.PAGESIZE
    start, end = -(-address // page) * page, (address + nbytes) // page * page
    if end <= start or sys.platform != "linux" or (libc := _libc()) is None:
        return 0
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return end - start if libc.madvise(start, end - start, MADV_DONTNEED) == 0 else 0


def trim_heap() -> None:
    """Return the heap's free pages to the kernel (glibc ``malloc_trim(0)``); nothing elsewhere."""
    if (trim := _malloc_trim()) is not None:
        trim(0)


@contextmanager
def stage_memory(stage: str, metrics: dict[str, float]) -> Iterator[None]:
    """Measure one stage's memory into ``metrics``: ``memory/peak_rss_gb/<stage>``, the process's
    peak resident GiB while the stage ran, and ``memory/rss_gb/<stage>``, what it left resident
    (after ``trim_heap``). Adds nothing where ``/proc`` is missing or the peak cannot be reset."""
    measured = reset_peak()
    try:
        yield
    finally:
        trim_heap()
        if measured and (now := resident_bytes()) is not None:
            metrics[f"memory/peak_rss_gb/{stage}"] = now[1] / GB
            metrics[f"memory/rss_gb/{stage}"] = now[0] / GB
