"""Keep a training process's heap from growing with freed activations: glibc's mmap threshold.

A training step allocates and frees gigabytes of tensors of a few MB each (the activations of a
micro-batch, the logits of each generated token). glibc serves an allocation of at least its
mmap threshold from a mapping of its own, returned to the system when freed, and smaller ones
from its heaps, which keep freed memory. The threshold starts at 128 KiB but is dynamic: each
freed mapping raises it to that size (up to 32 MiB), so after the first step tensors of a few MB
come from the heaps, whose free holes the next step's tensors do not fit, and the resident size
climbs step after step (``mallopt(3)``, ``M_MMAP_THRESHOLD``). Measured in process on
SmolLM2-135M in fp32 (8 × 4 samples × ≤128 tokens, micro-batch 8, ``benchmarks/vs_trl.py``'s
workload): resident between iterations 3.9 GB after the first and 6.2 GB after the second, 7.1 GB
at the second's peak; with a fixed 1 MiB threshold 2.6 GB, 2.6 GB and 5.6 GB.

``fix_mmap_threshold`` fixes the threshold (which also turns the dynamic adjustment off): tensors
of ``MMAP_THRESHOLD_BYTES`` or more are mapped and unmapped whole. The cost is a page fault per
page of every such tensor (first touch), small beside the matmuls that fill it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 1 << 20
"""Allocations of at least this size (1 MiB) get a mapping of their own (glibc's ``M_MMAP_THRESHOLD``)."""

_M_MMAP_THRESHOLD = -3  # <malloc.h>
_ENV = "MALLOC_MMAP_THRESHOLD_"


_reported = False  # fix_heap logs the first call of a process only


def fix_heap(what: str) -> bool:
    """``fix_mmap_threshold()`` at the start of a process that trains or generates with torch, before
    its models load; the first call of the process logs (info) whether it took effect, naming ``what``
    (the process, e.g. ``"rollout worker"``). Returns whether it took effect."""
    global _reported
    fixed = fix_mmap_threshold()
    if not _reported:
        _reported = True
        if fixed:
            logger.info("%s: glibc's mmap threshold fixed at %d bytes (dockrl.heap)", what, MMAP_THRESHOLD_BYTES)
        else:
            logger.info("%s: glibc's mmap threshold left as it was (%s set, or not glibc)", what, _ENV)
    return fixed


def fix_mmap_threshold(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold of this process at ``threshold_bytes``; returns whether it was set.

    Nothing is changed (False) where the C library is not glibc, or where the environment sets
    ``MALLOC_MMAP_THRESHOLD_`` (glibc applied that value at start: the user's choice stands).

    Raises:
        ValueError: ``threshold_bytes`` outside glibc's range (0 … 32 MiB).
    """
    if not 0 <= threshold_bytes <= 32 << 20:
        raise ValueError(f"mmap threshold: got {threshold_bytes} bytes; expected 0 to {32 << 20} (glibc's HEAP_MAX/2)")
    if os.environ.get(_ENV) is not None or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes) != 1:
        logger.warning("mallopt(M_MMAP_THRESHOLD, %d) failed: the heap may grow with freed tensors", threshold_bytes)
        return False
    return True
