"""The sandbox (dockrl.isolation.sandbox): each hostile program ends within its limit with the limit named,
and nothing it started is left running, nor its folder or cgroup."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from dockrl.config.env_sections import SandboxConfig
from dockrl.isolation.sandbox import run_python

LIMITS = SandboxConfig(cpu_s=1, wall_s=3.0, memory_mb=256, output_bytes=1000, max_processes=12)


@pytest.fixture
def no_leftovers():
    """Fails the test when a process started during it (a child of this process, at any depth) is still alive."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    alive = [p for p in me.children(recursive=True) if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running: {[(p.pid, p.cmdline()) for p in alive]}"


def isolation() -> tuple[str, ...]:
    return run_python("pass", LIMITS).isolation


def test_a_program_runs_and_prints(no_leftovers):
    program = "import sys\nprint(6 * 7)\nprint('oops', file=sys.stderr)\nopen('here.txt', 'w').write('x')\nprint(open('here.txt').read())"
    r = run_python(program, LIMITS)
    assert r.ok and r.exit_code == 0 and r.limit is None and not r.timed_out
    assert r.stdout == "42\nx\n" and r.stderr == "oops\n"


def test_an_exception_is_a_failure_without_a_limit(no_leftovers):
    r = run_python("raise ValueError('bad')", LIMITS)
    assert not r.ok and r.exit_code == 1 and r.limit is None and "ValueError: bad" in r.stderr
    assert "dockrl-sandbox-" not in r.stderr  # the folder's random name is not in the output


def test_an_infinite_loop_ends_at_the_cpu_limit(no_leftovers):
    r = run_python("while True:\n    pass", SandboxConfig(cpu_s=1, wall_s=20.0))
    assert not r.ok and r.limit == "cpu" and not r.timed_out
    assert r.seconds < 5, r.seconds


def test_a_sleeping_program_ends_at_the_wall_limit(no_leftovers):
    start = time.monotonic()
    r = run_python("import time\ntime.sleep(60)", SandboxConfig(cpu_s=5, wall_s=1.0))
    assert r.timed_out and r.limit == "wall" and r.exit_code is None and not r.ok
    assert 1.0 <= time.monotonic() - start < 4


def test_a_10_gb_allocation_fails_at_the_memory_limit(no_leftovers):
    r = run_python("x = bytearray(10 * 1024**3)\nprint('allocated')", LIMITS)
    assert not r.ok and r.limit == "memory" and "MemoryError" in r.stderr and "allocated" not in r.stdout
    assert r.seconds < 3


def test_a_fork_bomb_ends_and_leaves_nothing_running(no_leftovers):
    """With a pids cgroup the bomb is unbounded (the cgroup bounds it); without one (and as root, where
    RLIMIT_NPROC does not apply) the bomb stops itself at 40 processes: the test then proves the group kill."""
    bounded = "pids-cgroup" not in isolation()
    bomb = (
        "import os, sys, time\n"
        f"BOUNDED, made = {bounded}, 0\n"
        "print(os.getpid(), flush=True)\n"
        "while not (BOUNDED and (made >= 3 or len(sys.argv) > 3)):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        continue\n"
        "    made += 1\n"
        "    if pid == 0:\n"
        "        print(os.getpid(), flush=True)\n"
        "        made = 0\n"
        "        sys.argv.append('child')\n"
        "time.sleep(60)\n"
    )
    r = run_python(bomb, SandboxConfig(cpu_s=2, wall_s=2.0, max_processes=12, output_bytes=100_000))
    assert not r.ok and r.limit in ("processes", "wall")
    if not bounded:
        assert r.limit == "processes"
    pids = [int(line) for line in r.stdout.split()]
    assert len(pids) >= 2, r.stdout
    if not bounded:
        assert len(set(pids)) <= 12, "the cgroup let more processes live at once than max_processes"
    time.sleep(0.1)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_a_process_that_leaves_the_session_is_killed_too(no_leftovers):
    if "pids-cgroup" not in isolation():
        pytest.skip("without a pids cgroup a process that calls setsid() leaves the sandbox's process group (docs/agents.md)")
    r = run_python("import os, time\nif os.fork() == 0:\n    os.setsid()\n    print(os.getpid(), flush=True)\n    time.sleep(60)\nos.wait()", LIMITS)
    assert r.limit == "wall"
    pid = int(r.stdout.split()[0])
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_network_connect_fails(no_leftovers):
    if not {"userns+netns", "netns", "landlock-net"} & set(isolation()):
        pytest.skip("neither a network namespace nor Landlock's network rules are available here")
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        r = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')", LIMITS)
        assert not r.ok and "connected" not in r.stdout
        assert "PermissionError" in r.stderr or "unreachable" in r.stderr, r.stderr
        with pytest.raises(TimeoutError):
            server.accept()  # nothing reached the server
    finally:
        server.close()


def test_a_write_outside_its_folder_fails(no_leftovers):
    if "landlock-fs" not in isolation():
        pytest.skip("Landlock is not available on this kernel")
    # a folder the sandbox sees (not under /tmp and the others its mount namespace replaces): Landlock refuses the write
    hidden = ("/tmp", "/var/tmp", "/dev/shm", "/run")
    visible = [d for d in (Path.home(), Path.cwd()) if not str(d.resolve()).startswith(hidden) and os.access(d, os.W_OK)]
    if not visible:
        pytest.skip(f"neither the home folder nor {Path.cwd()} lies outside the folders the sandbox hides")
    outside = Path(tempfile.mkdtemp(prefix=".dockrl-sandbox-test-", dir=visible[0]))
    try:
        target = outside / "outside.txt"
        r = run_python(f"open({str(target)!r}, 'w').write('escaped')", LIMITS)
        assert not r.ok and "PermissionError" in r.stderr and not target.exists()
        r = run_python(f"import os\nos.rmdir({str(outside)!r})", LIMITS)
        assert not r.ok and "PermissionError" in r.stderr and outside.is_dir()
    finally:
        shutil.rmtree(outside, ignore_errors=True)


def test_output_is_cut_and_the_folder_and_cgroup_are_removed(no_leftovers):
    r = run_python("import os\nprint(os.getcwd())\nprint('x' * 100_000)", LIMITS)
    assert r.ok and r.truncated and len(r.stdout.encode()) <= LIMITS.output_bytes
    assert r.stdout.startswith("/")
    assert not Path(r.stdout.splitlines()[0]).exists()
    assert not list(Path("/sys/fs/cgroup/pids").glob(f"dockrl-sandbox-{os.getpid()}-*"))


def test_a_large_file_hits_the_file_size_limit(no_leftovers):
    r = run_python("open('big', 'wb').write(b'x' * (3 * 1024 * 1024))", SandboxConfig(file_mb=1, wall_s=5.0))
    assert r.limit == "file_size" and not r.ok


def test_the_files_of_a_program_together_stop_at_disk_mb(no_leftovers):
    if "mountns" not in isolation():
        pytest.skip("no mount namespace here: only file_mb applies, per file")
    program = "for i in range(10):\n    open(f'part{i}', 'wb').write(b'x' * (1 << 20))"  # 10 files of 1 MiB, each under file_mb
    r = run_python(program, SandboxConfig(disk_mb=4, file_mb=2, wall_s=5.0))
    assert not r.ok and r.limit == "disk" and "No space left on device" in r.stderr, r
    assert run_python(program, SandboxConfig(disk_mb=16, file_mb=2, wall_s=5.0)).ok


def test_the_processes_of_a_program_together_stop_at_memory_mb(no_leftovers):
    """Each process within its own address space limit, together over it: the memory cgroup kills, reported as memory."""
    if "memory-cgroup" not in isolation():
        pytest.skip("no memory cgroup can be made here (not root, or no memory controller)")
    program = ("import os, time\nfor _ in range(3):\n    os.fork()\nblock = bytearray(100 << 20)\nfor i in range(0, len(block), 4096):\n"
               "    block[i] = 1\ntime.sleep(2)")
    r = run_python(program, SandboxConfig(memory_mb=300, wall_s=10.0))  # 8 processes x 100 MiB > 300 MiB; each < 300
    assert not r.ok and r.limit == "memory", r
