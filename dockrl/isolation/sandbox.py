"""The sandbox: runs a Python program written by the model in a separate process under limits.

``run_python(code, limits)`` writes ``code`` to ``main.py`` in a throwaway folder and runs it as
``python -I -S -B`` (isolated: no site-packages, no ``PYTHON*`` variables, no user folder on the path;
the standard library only) through ``dockrl.isolation.sandbox_boot``, which confines the process first:

* ``RLIMIT_CPU`` (``cpu_s``), ``RLIMIT_AS`` (``memory_mb``), ``RLIMIT_FSIZE`` (``file_mb``),
  ``RLIMIT_NPROC`` (``max_processes``; not applied by the kernel to root), no core files;
* a pids cgroup of its own (``max_processes``) where the cgroup file system is writable (root);
* a new network namespace (in a new user namespace where the kernel allows): no interface is up,
  so every connect fails, and abstract Unix socket names are its own;
* a new mount namespace with empty ``/tmp``, ``/var/tmp``, ``/dev/shm`` and ``/run`` of its own (its
  folder bound back at its path): no Unix socket another process of the same user left there (a
  ``multiprocessing`` forkserver's, ZeroMQ's ``ipc://``) is reachable;
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dockrl.config import ConfigError
from dockrl.config.env_sections import SandboxConfig

logger = logging.getLogger(__name__)

_BOOT = Path(__file__).with_name("sandbox_boot.py")
_CGROUP_ROOTS = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))  # cgroup v1's pids hierarchy, then v2's unified one
_MEMORY_ROOT = Path("/sys/fs/cgroup/memory")  # cgroup v1's memory hierarchy
_runs = itertools.count()
_warned: set[str] = set()
_warn_lock = threading.Lock()

Limit = Literal["wall", "cpu", "memory", "processes", "file_size", "disk"]


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
    """The limit it hit: ``wall``, ``cpu`` (``RLIMIT_CPU``), ``memory`` (a ``MemoryError``, or a process killed
    by the memory cgroup), ``processes`` (a fork or thread refused), ``file_size`` (``RLIMIT_FSIZE``),
    ``disk`` (its folder full); None when none."""
    truncated: bool
    """stdout or stderr was longer than ``output_bytes`` (the rest was read and dropped)."""
    seconds: float
    """Wall-clock time from start to the last process killed, seconds."""
    isolation: tuple[str, ...] = ()
    """The layers that applied: ``pids-cgroup``, ``userns-nproc``, ``userns+netns`` or ``netns``, ``mountns`` (with its
    folder a tmpfs of ``disk_mb``), ``landlock-fs``, ``landlock-net``, ``landlock-scope``, ``memory-cgroup``."""

    not_in_force: dict[str, str] = field(default_factory=dict)
    """The boot's reason for each layer it could not apply (keys ``cgroup``, ``network``, ``mounts``, ``landlock``,
    ``processes``), e.g. ``none (unshare: Operation not permitted)``."""

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


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per hierarchy (``pids``, ``memory``, … in cgroup v1; ``""``: v2's unified one)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return {}
    return {parts[1]: parts[2] for parts in (line.split(":", 2) for line in lines) if len(parts) == 3}


def _make_cgroup(max_processes: int) -> Path | None:
    """A new pids cgroup under this process's own, limited to ``max_processes``; None where none can be made."""
    own = _own_cgroups()
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


def _make_memory_cgroup(pids: Path | None, memory_mb: int) -> Path | None:
    """A limit of ``memory_mb`` MiB on the resident memory of all the program's processes together (its files in
    its tmpfs folder included, no swap): ``memory.max`` of its pids cgroup in cgroup v2 where the memory
    controller is on there, else a memory cgroup of its own in v1's memory hierarchy; None where neither can be made."""
    limit = str(memory_mb << 20)
    if pids is not None and (pids / "memory.max").is_file():
        try:
            (pids / "memory.max").write_text(limit)
            if (pids / "memory.swap.max").is_file():
                (pids / "memory.swap.max").write_text("0")
            return pids
        except OSError:
            return None
    own = _own_cgroups().get("memory")
    base = _MEMORY_ROOT / own.lstrip("/") if own is not None else None
    if base is None or not (base / "cgroup.procs").is_file():
        return None
    path = base / f"dockrl-sandbox-{os.getpid()}-{next(_runs)}"
    try:
        path.mkdir()
        (path / "memory.limit_in_bytes").write_text(limit)
        return path
    except OSError:
        if path.is_dir():
            _remove_cgroup(path)
    return None


def _oom_kills(memory: Path | None) -> int:
    """Processes the kernel killed for the memory limit (``oom_kill`` of v2's ``memory.events``, v1's ``memory.oom_control``)."""
    for name in ("memory.events", "memory.oom_control"):
        try:
            counts = dict(line.split() for line in (memory / name).read_text().splitlines() if line.strip()) if memory else {}
        except (OSError, ValueError):
            continue
        return int(counts.get("oom_kill", 0))
    return 0


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


def _limit_hit(code: int | None, stderr: str, timed_out: bool, refusals: int, oom_kills: int = 0) -> Limit | None:
    if refusals:  # before the wall: a fork bomb spins on refused forks until the wall limit
        return "processes"
    if oom_kills:  # before the CPU limit: both end the program with SIGKILL
        return "memory"
    if "[Errno 28] No space left on device" in stderr:  # its folder, a tmpfs of disk_mb, is full
        return "disk"
    if "[Errno 11] Resource temporarily unavailable" in stderr or "can't start new thread" in stderr:  # EAGAIN: RLIMIT_NPROC
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
    memory = _make_memory_cgroup(cgroup, limits.memory_mb)
    status_r, status_w = os.pipe()
    spec = {"main": "main.py", "cgroup_procs": str(cgroup / "cgroup.procs") if cgroup else "",
            "memory_procs": str(memory / "cgroup.procs") if memory and memory != cgroup else "", "cpu_s": limits.cpu_s,
            "memory_mb": limits.memory_mb, "file_mb": limits.file_mb, "disk_mb": limits.disk_mb, "max_processes": limits.max_processes}
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
        for group in dict.fromkeys(g for g in (cgroup, memory) if g is not None):
            _kill_cgroup(group)  # and those that left the process group (setsid)
        if proc is not None:
            proc.wait(timeout=10)
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        refusals, oom_kills = _fork_refusals(cgroup), _oom_kills(memory)
        for group in dict.fromkeys(g for g in (cgroup, memory) if g is not None):
            _remove_cgroup(group)
        if status_w >= 0:
            os.close(status_w)
        status = _read_status(status_r)
        shutil.rmtree(folder, ignore_errors=True)
    seconds = time.monotonic() - started
    isolation = _isolation(status, cgroup is not None) + (("memory-cgroup",) if memory is not None and status else ())
    # the folder's random name would make the same program's output differ from run to run
    out_text, stderr = (b.decode("utf-8", "replace").replace(f"{folder}/", "") for b in (out, err))
    code_ = None if timed_out else proc.returncode
    not_in_force = {k: str(v) for k, v in status.items() if str(v).startswith("none")}
    return SandboxResult(stdout=out_text, stderr=stderr, exit_code=code_, timed_out=timed_out,
                         limit=_limit_hit(code_, stderr, timed_out, refusals, oom_kills), truncated=truncated, seconds=seconds, isolation=isolation,
                         not_in_force=not_in_force)


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
    if status.get("processes") == "userns-nproc":
        applied.append("userns-nproc")
    missing = {  # the boot's status key -> what a program can do without that layer
        "network": "programs can reach the network unless Landlock (ABI 4+) refuses their TCP connects",
        "mounts": "programs can reach the Unix sockets other processes of this user left in /tmp, /dev/shm and /run",
        "landlock": "programs can write outside their folder wherever their user may",
    }
    for key, risk in missing.items():
        said = str(status.get(key, "none"))
        if said.startswith("none"):
            _warn_once(key, f"sandbox: no {key} layer ({said}): {risk}")
        else:
            applied.extend(said.split(","))  # landlock reports its parts comma-separated
    return tuple(applied)


LAYERS: dict[str, tuple[str, ...]] = {
    "network": ("userns+netns", "netns", "landlock-net"),
    "mounts": ("mountns",),
    "writes": ("landlock-fs",),
    "processes": ("pids-cgroup", "userns-nproc"),
}
"""Each name of ``env.sandbox.require`` (``SANDBOX_LAYERS``) and the layers that give it, any one of them."""

_NAMESPACES = ("user namespaces enabled (sysctl user.max_user_namespaces > 0) and a seccomp profile that allows unshare "
               "(the container runtime's default refuses it without CAP_SYS_ADMIN: a Localhost profile in the pod's "
               "securityContext.seccompProfile)")
HOW_TO_GET = {
    "network": f"a network namespace ({_NAMESPACES}), or Landlock ABI 4+ (kernel 6.7+)",
    "mounts": f"a mount namespace ({_NAMESPACES})",
    "writes": "Landlock: kernel 5.13+ with landlock in its LSM list (cat /sys/kernel/security/lsm) and a seccomp profile "
              "that allows the landlock_* system calls",
    "processes": "a pids cgroup of its own (a writable, delegated cgroup) or a user namespace, whose RLIMIT_NPROC counts "
                 "the program's processes alone",
}

_checked: dict[tuple[str, ...], tuple[str, ...]] = {}


class SandboxUnavailable(ConfigError):
    """The machine does not give the sandbox a layer that ``env.sandbox.require`` asks for."""


def require_layers(limits: SandboxConfig) -> tuple[str, ...]:
    """Check, once per process, that the sandbox's layers ``limits.require`` are in force on this machine, by
    running an empty program in it; returns the layers that applied. ``require`` empty: no check, and a
    warning that programs run with whatever the machine gives (trusted code only).

    Raises:
        SandboxUnavailable: a required layer is missing; the message names it, the machine's reason and how to get it.
    """
    if not limits.require:
        _warn_once("require", "sandbox: env.sandbox.require=[]: model-written programs run with whatever isolation this "
                   "machine gives, possibly none (its network, its files, the worker's user); for trusted code only")
        return run_python("pass", limits).isolation
    key = tuple(sorted(limits.require))
    if key not in _checked:
        result = run_python("pass", limits)
        missing = [name for name in LAYERS if name in key and not set(LAYERS[name]) & set(result.isolation)]
        if missing:
            why = "; ".join(f"{name}: {HOW_TO_GET[name]} (here: {_reason(name, result)})" for name in missing)
            raise SandboxUnavailable(
                f"env.sandbox.require: {', '.join(missing)} not in force on this machine, so no model-written program may run "
                f"here; {why}. Or run the stage where they are (docs/agents.md, the sandbox), or set env.sandbox.require=[] "
                "for trusted code only")
        _checked[key] = result.isolation
    return _checked[key]


def _reason(name: str, result: SandboxResult) -> str:
    """Why the machine gave no layer of ``name``: the boot's own words, or the program's error when it did not start."""
    keys = {"network": ("network", "landlock"), "mounts": ("mounts",), "writes": ("landlock",), "processes": ("cgroup", "processes")}[name]
    said = [result.not_in_force[k] for k in keys if k in result.not_in_force]
    return "; ".join(said) if said else f"the sandbox did not start: {result.stderr.strip()[-300:] or result.exit_code}"
