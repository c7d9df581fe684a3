"""dockrl.heap: a fixed glibc mmap threshold returns freed tensors to the system."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from dockrl import heap

# a process that frees 400 tensors of 4 MB once, then allocates 200 of 8 MB while 200 of the
# 4 MB ones stay, interleaved: what the heap keeps is resident. Prints its resident size (MiB)
# after importing torch, then at the end: only the growth is compared, since what torch alone
# takes depends on its build (CPU here 220 MiB; a CUDA build much more)
PROGRAM = """
import sys, torch, psutil
from dockrl.heap import fix_mmap_threshold
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
torch.set_num_threads(1)
torch.ones(1 << 10).sum()  # torch's first op loads what it loads lazily: part of the base, not of the growth
print(psutil.Process().memory_info().rss >> 20)
for step in range(3):
    keep = []
    for i in range(200):
        a, b = torch.ones(1 << 20), torch.ones(1 << 20)  # 4 MiB each
        keep.append(a)
        del b
    grown = [torch.ones(2 << 20) for _ in range(100)]  # 8 MiB each: fit no 4 MiB hole
    del keep, grown
print(psutil.Process().memory_info().rss >> 20)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt: no other C library has M_MMAP_THRESHOLD")
@pytest.mark.skipif("MALLOC_MMAP_THRESHOLD_" in os.environ,
                    reason="MALLOC_MMAP_THRESHOLD_ is set: glibc fixed the threshold at start and fix_mmap_threshold leaves it")
def test_a_fixed_threshold_gives_freed_tensors_back():
    def growth_mib(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=120, check=True)
        base, end = (int(v) for v in out.stdout.split()[-2:])
        return end - base

    # measured (CPU torch, 223 MiB after import): dynamic +816 to +1,600 MiB, fixed +4 MiB
    dynamic, fixed = growth_mib("dynamic"), growth_mib("fixed")
    assert fixed < 200 and dynamic > fixed + 500, (dynamic, fixed)


def test_the_users_environment_setting_stands(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert heap.fix_mmap_threshold() is False


def test_a_threshold_out_of_glibcs_range_is_refused():
    with pytest.raises(ValueError, match="mmap threshold: got"):
        heap.fix_mmap_threshold(64 << 20)


def test_fix_heap_logs_the_first_call_of_a_process_only(monkeypatch, caplog):
    monkeypatch.setattr(heap, "_reported", False)
    monkeypatch.setattr(heap, "fix_mmap_threshold", lambda: False)
    with caplog.at_level("INFO", logger="dockrl.heap"):
        assert heap.fix_heap("actor worker") is False
        assert heap.fix_heap("actor worker") is False
    assert [r.getMessage() for r in caplog.records] == [
        "actor worker: glibc's mmap threshold left as it was (MALLOC_MMAP_THRESHOLD_ set, or not glibc)"]
