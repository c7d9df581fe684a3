"""The sandbox: runs a Python program written by the model in a separate process under limits.

``run_python(code, limits)`` writes ``code`` to ``main.py`` in a throwaway folder and runs it as
``python -I -S -B`` (isolated: no site-packages, no ``PYTHON*`` variables, no user folder on the path;
the standard library only) through ``dockrl.envs.sandbox_boot``, which confines the process first:

* ``RLIMIT_CPU`` (``cpu_s``), ``RLIMIT_AS`` (``memory_mb``), ``RLIMIT_FSIZE`` (``file_mb``),
  ``RLIMIT_NPROC`` (``max_processes``; not applied by the kernel to root), no core files;
* a pids cgroup of its own (``max_processes``) where the cgroup file system is writable (root);
* a new network namespace (in a new user namespace where the kernel allows): no interface is up,
  so every connect fails;
* Landlock (kernel 5.13+): writes only inside its folder; no TCP bind or connect (ABI 4+); no
  signal or abstract socket out of the sandbox (ABI 6+);
* a new session: at the end, whether the program ended, timed out or left children behind, its
  process group is killed, then every process of its cgroup, and the folder is removed.

Where the machine refuses a layer (no user namespaces, no Landlock, no writable cgroup) the run goes
on without it and a warning says so once per process; ``SandboxResult.isolation`` lists what applied.
Reading files outside the folder is not prevented (the interpreter reads its standard library).

Libraries considered: ``epicbox`` runs programs in Docker containers (needs a Docker daemon; pods have
none); ``nsjail``/``bubblewrap`` (``bwrap``) are binaries, not installed with the package and needing
setuid or user namespaces all the same; the PyPI ``landlock`` binding is a development release.
The kernel interfaces are used directly instead (about 100 lines in ``sandbox_boot``).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dockrl.config.env_sections import SandboxConfig

logger = logging.getLogger(__name__)

_BOOT = Path(__file__).with_name("sandbox_boot.py")
_CGROUP_ROOTS = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))  # cgroup v1's pids hierarchy, then v2's unified one
_runs = itertools.count()
_warned: set[str] = set()
_warn_lock = threading.Lock()

Limit = Literal["wall", "cpu", "memory", "processes", "file_size"]


@dataclass(frozen=True, kw_only=True)
class SandboxResult:
    """What one program run in the sandbox did."""

    stdout: str
    """Standard output, at most ``output_bytes`` bytes (decoded as UTF-8, bad bytes replaced)."""
    stderr: str
    """Standard error, at most ``output_bytes`` bytes."""
    exit_code: int | None
    """The program's exit status; negative: the signal that ended it; None: it was killed at the wall limit."""
    timed_out: bool
    """It ran past ``wall_s`` and was killed."""
    limit: Limit | None
    """The limit it hit: ``wall``, ``cpu`` (``RLIMIT_CPU``), ``memory`` (a ``MemoryError``), ``processes``
    (a fork refused by the pids cgroup), ``file_size`` (``RLIMIT_FSIZE``); None when none."""
    truncated: bool
    """stdout or stderr was longer than ``output_bytes`` (the rest was read and dropped)."""
    seconds: float
    """Wall-clock time from start to the last process killed, seconds."""
    isolation: tuple[str, ...] = ()
    """The layers that applied: ``pids-cgroup``, ``userns+netns`` or ``netns``, ``landlock-fs``, ``landlock-net``, ``landlock-scope``."""

    @property
    def ok(self) -> bool:
        """Exit status 0 and no limit hit."""
        return self.exit_code == 0 and self.limit is None


def _warn_once(key: str, message: str) -> None:
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(message)


def _make_cgroup(max_processes: int) -> Path | None:
    """A new pids cgroup under this process's own, limited to ``max_processes``; None where none can be made."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    own = {parts[1]: parts[2] for parts in (line.split(":", 2) for line in lines) if len(parts) == 3}
    for root, key in zip(_CGROUP_ROOTS, ("pids", "")):
        base = root / own.get(key, "/").lstrip("/") if key in own else None
        if base is None or not (base / "cgroup.procs").is_file():
            continue
        path = base / f"dockrl-sandbox-{os.getpid()}-{next(_runs)}"
        try:
            path.mkdir()
            (path / "pids.max").write_text(str(max_processes))
            return path
        except OSError:
            if path.is_dir():
                _remove_cgroup(path)
    return None


def _kill_cgroup(path: Path, timeout_s: float = 5.0) -> None:
    """SIGKILL every process of the cgroup until it is empty (a fork between reading and killing is caught by the next round)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
        except OSError:
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    logger.warning("sandbox: processes of %s still alive %.0f s after SIGKILL", path, timeout_s)


def _remove_cgroup(path: Path) -> None:
    for _ in range(100):  # rmdir fails while the last killed processes are being reaped
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)
    logger.warning("sandbox: could not remove cgroup %s", path)


def _fork_refusals(cgroup: Path | None) -> int:
    if cgroup is None:
        return 0
    try:
        events = dict(line.split() for line in (cgroup / "pids.events").read_text().splitlines() if line.strip())
        return int(events.get("max", 0))
    except (OSError, ValueError):
        return 0


def _read_capped(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout and stderr until both close or ``deadline``: (stdout, stderr, truncated, timed_out).

    Once the program itself has exited, its leftover children may hold the pipes open: the caller
    kills them, so this returns as soon as the program exits and its pipes are drained for 0.1 s.
    """
    assert proc.stdout is not None and proc.stderr is not None
    kept = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    truncated = False
    exited_at: float | None = None
    with selectors.DefaultSelector() as sel:
        for fd in kept:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                return bytes(kept[proc.stdout.fileno()]), bytes(kept[proc.stderr.fileno()]), truncated, True
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.1:
                break
            for key, _ in sel.select(timeout=min(0.05, deadline - now)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                room = cap - len(kept[key.fd])
                truncated |= len(chunk) > room
                kept[key.fd] += chunk[: max(0, room)]
    return bytes(kept[proc.stdout.fileno()]), bytes(kept[proc.stderr.fileno()]), truncated, False


def _limit_hit(code: int | None, stderr: str, timed_out: bool, refusals: int) -> Limit | None:
    if refusals:  # before the wall: a fork bomb spins on refused forks until the wall limit
        return "processes"
    if timed_out:
        return "wall"
    if code in (-signal.SIGXCPU, -signal.SIGKILL):  # SIGKILL: the hard CPU limit, one second past the soft one
        return "cpu"
    if code == -signal.SIGXFSZ or "[Errno 27] File too large" in stderr:  # Python ignores SIGXFSZ: the write fails with EFBIG
        return "file_size"
    if "MemoryError" in stderr:
        return "memory"
    return None


def run_python(code: str, limits: SandboxConfig, *, stdin: str = "") -> SandboxResult:
    """Run the Python program ``code`` in the sandbox (module docstring) and return what it did.

    Thread-safe: each call has its own process, folder and cgroup. Never raises for what the
    program does; the call returns within about ``limits.wall_s`` + 1 s.

    Raises:
        OSError: the sandbox itself could not start (no temporary folder, no processes left).
    """
    folder = Path(tempfile.mkdtemp(prefix="dockrl-sandbox-"))
    cgroup = _make_cgroup(limits.max_processes)
    status_r, status_w = os.pipe()
    spec = {"main": "main.py", "cgroup_procs": str(cgroup / "cgroup.procs") if cgroup else "", "cpu_s": limits.cpu_s,
            "memory_mb": limits.memory_mb, "file_mb": limits.file_mb, "max_processes": limits.max_processes}
    started = time.monotonic()
    proc = None
    try:
        (folder / "main.py").write_text(code, encoding="utf-8")
        env = {"PATH": "/usr/bin:/bin", "HOME": str(folder), "TMPDIR": str(folder), "LANG": "C.UTF-8"}
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", str(_BOOT), json.dumps(spec), str(status_w)], cwd=folder, env=env,
                                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(status_w,), start_new_session=True)
        os.close(status_w)
        status_w = -1
        if stdin:
            assert proc.stdin is not None
            try:
                proc.stdin.write(stdin.encode()[:1 << 20])
                proc.stdin.close()
            except BrokenPipeError:
                pass
        out, err, truncated, timed_out = _read_capped(proc, started + limits.wall_s, limits.output_bytes)
    finally:
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the program's leftover children too
            except ProcessLookupError:
                pass
        if cgroup is not None:
            _kill_cgroup(cgroup)  # and those that left the process group (setsid)
        if proc is not None:
            proc.wait(timeout=10)
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        refusals = _fork_refusals(cgroup)
        if cgroup is not None:
            _remove_cgroup(cgroup)
        if status_w >= 0:
            os.close(status_w)
        status = _read_status(status_r)
        shutil.rmtree(folder, ignore_errors=True)
    seconds = time.monotonic() - started
    isolation = _isolation(status, cgroup is not None)
    # the folder's random name would make the same program's output differ from run to run
    out_text, stderr = (b.decode("utf-8", "replace").replace(f"{folder}/", "") for b in (out, err))
    code_ = None if timed_out else proc.returncode
    return SandboxResult(stdout=out_text, stderr=stderr, exit_code=code_, timed_out=timed_out,
                         limit=_limit_hit(code_, stderr, timed_out, refusals), truncated=truncated, seconds=seconds, isolation=isolation)


def _read_status(fd: int) -> dict:
    try:
        os.set_blocking(fd, False)
        raw = os.read(fd, 65536)
    except OSError:
        raw = b""
    finally:
        os.close(fd)
    try:
        return json.loads(raw.decode()) if raw else {}
    except ValueError:
        return {}


def _isolation(status: dict, cgroup: bool) -> tuple[str, ...]:
    """The layers that applied, warning once per process about each that did not."""
    if not status:  # the boot program died before it reported (e.g. no memory to start); nothing to warn about
        return ()
    applied = []
    if cgroup and status.get("cgroup") == "pids-cgroup":
        applied.append("pids-cgroup")
    elif os.geteuid() == 0:
        _warn_once("cgroup", "sandbox: no pids cgroup could be made (cgroup file system not writable): a program's processes "
                   "are bounded by nothing while running as root; its process group is still killed at the end")
    network = str(status.get("network", "none"))
    if network.startswith("none"):
        _warn_once("network", f"sandbox: no new network namespace ({network}): programs can reach the network "
                   "unless Landlock (ABI 4+) refuses their TCP connects")
    else:
        applied.append(network)
    landlock = str(status.get("landlock", "none"))
    if landlock.startswith("none"):
        _warn_once("landlock", f"sandbox: Landlock unavailable ({landlock}): programs can write outside their folder "
                   "wherever their user may")
    else:
        applied.extend(landlock.split(","))
    return tuple(applied)
