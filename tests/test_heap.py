"""dockrl.heap: a fixed glibc mmap threshold returns freed tensors to the system."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from dockrl import heap

# a process that frees 400 tensors of 4 MB once, then allocates 200 of 8 MB while 200 of the
# 4 MB ones stay, interleaved: what the heap keeps is resident; printed in MiB
PROGRAM = """
import sys, torch, psutil
from dockrl.heap import fix_mmap_threshold
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
torch.set_num_threads(1)
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


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_a_fixed_threshold_gives_freed_tensors_back():
    def rss_mib(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=120, check=True)
        return int(out.stdout.split()[-1])

    dynamic, fixed = rss_mib("dynamic"), rss_mib("fixed")
    assert fixed < 500 and dynamic > fixed + 500, (dynamic, fixed)


def test_the_users_environment_setting_stands(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert heap.fix_mmap_threshold() is False


def test_a_threshold_out_of_glibcs_range_is_refused():
    with pytest.raises(ValueError, match="mmap threshold: got"):
        heap.fix_mmap_threshold(64 << 20)
