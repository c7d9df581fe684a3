"""No way out of the sandbox through a Unix socket: a sandboxed program can reach no socket of the processes
around it (the reward verifier's pool, the rollout worker), neither the ``multiprocessing`` forkserver's
listener, which unpickles what it receives, nor any other pathname or abstract socket (docs/reliability.md,
security)."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from dockrl.config.env_sections import SandboxConfig
from dockrl.isolation.sandbox import run_python
from dockrl.rewards.scorer import RewardScorer

LIMITS = SandboxConfig(cpu_s=5, wall_s=10.0, memory_mb=512, output_bytes=20_000, max_processes=12)

# What an attacker's program does with a forkserver's listener: it sends the four descriptors the server
# expects (SCM_RIGHTS), the first a pipe holding a pickle; the server forks and unpickles it there, which
# runs the pickle's code outside the sandbox.
EXPLOIT = """
import glob, os, pickle, socket, time
class Payload:
    def __reduce__(self):
        return (exec, ({code!r},))
reached = []
for path in sorted(glob.glob({tmp!r} + "/pymp-*/listener-*")):
    r, w = os.pipe()
    os.write(w, pickle.dumps(Payload()))
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(2)
            s.connect(path)
            socket.send_fds(s, [bytes([4])], [r, w, r, r])
            reached.append(path)
    except OSError as e:
        print("refused", path, type(e).__name__)
print("reached", len(reached))
time.sleep(1.5 if reached else 0)
"""


def _unix_sockets_of(pids: set[int]) -> tuple[set[str], set[str]]:
    """The pathname and abstract Unix sockets that processes ``pids`` hold: (paths, abstract names without their
    leading ``@``), from ``/proc/<pid>/fd`` and ``/proc/net/unix``."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:["):-1])
        except OSError:
            continue
    paths, abstract = set(), set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[6] in inodes:
            name = parts[7]
            (abstract.add(name[1:]) if name.startswith("@") else paths.add(name))
    return paths, abstract


def test_the_verifier_pools_listener_cannot_run_a_sandboxed_programs_code(tmp_path: Path):
    marker = tmp_path / "escaped.txt"
    code = f"open({str(marker)!r}, 'w').write('outside the sandbox')"
    with RewardScorer(num_workers=1) as scorer:
        assert scorer.score(["#### 3"], ["3"]) == [1.1]  # the pool is up, as during a rollout
        r = run_python(EXPLOIT.format(code=code, tmp=tempfile.gettempdir()), LIMITS)
        deadline = time.monotonic() + 3
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    assert not marker.exists(), f"a sandboxed program ran code outside the sandbox: {r.stdout}"
    assert r.exit_code == 0, r.stderr
    assert "reached 0" in r.stdout, r.stdout


def test_no_unix_socket_of_the_worker_is_reachable_from_the_sandbox():
    """A sweep: every Unix socket this process and its children hold (the verifier's pool running), and a
    listening socket of the worker's user in the temporary folder and in the abstract namespace (as an
    engine's IPC would have), tried from inside the sandbox: none connects."""
    isolation = run_python("pass", LIMITS).isolation
    if "mountns" not in isolation:
        pytest.skip(f"no mount namespace here (layers: {isolation}): a same-user socket in /tmp stays reachable")
    planted_path = Path(tempfile.mkdtemp(prefix="dockrl-ipc-")) / "engine.sock"
    planted = socket.socket(socket.AF_UNIX)
    planted.bind(str(planted_path))
    planted.listen()
    planted_abstract = socket.socket(socket.AF_UNIX)
    abstract_name = f"dockrl-test-{os.getpid()}"
    planted_abstract.bind("\0" + abstract_name)
    planted_abstract.listen()
    try:
        with RewardScorer(num_workers=1) as scorer:
            scorer.score(["#### 1"], ["1"])
            me = psutil.Process()
            paths, abstract = _unix_sockets_of({me.pid} | {p.pid for p in me.children(recursive=True)})
            assert str(planted_path) in paths and abstract_name in abstract  # the sweep sees what is there
            probe = (
                "import socket\n"
                f"targets = [(p, p) for p in {sorted(paths)!r}] + [('@' + a, chr(0) + a) for a in {sorted(abstract)!r}]\n"
                "for label, address in targets:\n"
                "    s = socket.socket(socket.AF_UNIX)\n"
                "    s.settimeout(2)\n"
                "    try:\n"
                "        s.connect(address)\n"
                "        print('CONNECTED', label)\n"
                "    except OSError as e:\n"
                "        print('refused', label, type(e).__name__)\n"
                "    finally:\n"
                "        s.close()\n"
            )
            r = run_python(probe, LIMITS)
    finally:
        planted.close()
        planted_abstract.close()
        planted_path.unlink(missing_ok=True)
        planted_path.parent.rmdir()
    assert r.exit_code == 0, r.stderr
    assert r.stdout.count("refused") == len(paths) + len(abstract), r.stdout
    assert "CONNECTED" not in r.stdout, r.stdout


def test_the_temporary_folders_are_the_sandboxs_own():
    """/tmp, /dev/shm and /run inside are empty folders of the sandbox's own: nothing of the worker's is there,
    while the program's own folder and its TMPDIR keep working."""
    isolation = run_python("pass", LIMITS).isolation
    if "mountns" not in isolation:
        pytest.skip(f"no mount namespace here (layers: {isolation})")
    outside = Path(tempfile.mkdtemp(prefix="dockrl-visible-"))
    try:
        program = (
            "import os, tempfile\n"
            f"print('outside', os.path.exists({str(outside)!r}))\n"
            "print('shm', sorted(os.listdir('/dev/shm')) if os.path.isdir('/dev/shm') else [])\n"
            "with tempfile.NamedTemporaryFile(dir=os.environ['TMPDIR']) as f:\n"
            "    f.write(b'x')\n"
            "open('mine.txt', 'w').write('ok')\n"
            "print('cwd', os.getcwd() == os.environ['TMPDIR'], open('mine.txt').read())\n"
        )
        r = run_python(program, LIMITS)
    finally:
        outside.rmdir()
    assert r.ok, r.stderr
    assert "outside False" in r.stdout and "shm []" in r.stdout and "cwd True ok" in r.stdout, r.stdout
