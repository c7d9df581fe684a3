"""The sandbox's first program: confines its own process, then becomes the program it guards.

``dockrl.isolation.sandbox`` starts it as ``python -I -S sandbox_boot.py SPEC STATUS_FD`` in a new
session, in the program's working folder. It joins the run's pids cgroup, sets the resource
limits, leaves the network and the file system's shared folders (new network and mount
namespaces, in a new user namespace where the kernel allows: ``/tmp``, ``/var/tmp``, ``/dev/shm``
and ``/run`` become empty folders of its own, its working folder bound back at its path, so no
Unix socket of another process of the same user is reachable), restricts writes to the working
folder with Landlock, writes what it applied to the status pipe as one JSON line, and
``exec``\\ s ``python -I -S -B -X utf8 main.py``. The limits, namespaces and Landlock domain
outlive the ``exec`` and pass to every child.

Standard library only: it runs without ``site`` (``-S``), so nothing of dockrl imports here.
Landlock is the Linux security module of unprivileged sandboxing (kernel 5.13+; the constants are
those of ``include/uapi/linux/landlock.h``); its system calls have the same numbers on every
architecture.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys

_CLONE_NEWUSER, _CLONE_NEWNET, _CLONE_NEWNS = 0x10000000, 0x40000000, 0x00020000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 1 << 1, 1 << 2, 1 << 5, 1 << 12, 1 << 14, 1 << 18
# where processes of the same user leave Unix sockets (multiprocessing's forkserver, ZeroMQ's ipc://,
# the container runtime's and service account's files under /run): replaced by empty folders inside
_HIDDEN_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm", "/run")
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_PR_SET_NO_NEW_PRIVS = 38
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
# LANDLOCK_ACCESS_FS_*: write a file, remove a folder or file, make a char device, folder, file, socket,
# fifo, block device, symlink (ABI 1); refer (link or rename across folders, ABI 2); truncate (ABI 3)
_FS_WRITE_ABI1 = (1 << 1) | (1 << 4) | (1 << 5) | (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10) | (1 << 11) | (1 << 12)
_FS_REFER, _FS_TRUNCATE = 1 << 13, 1 << 14
_FILE_ONLY = (1 << 1) | _FS_TRUNCATE  # the rights a rule on a file (not a folder) may grant: write, truncate
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1  # LANDLOCK_ACCESS_NET_* (ABI 4)
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1 << 0, 1 << 1  # LANDLOCK_SCOPE_* (ABI 6)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _join_cgroup(procs: str) -> str:
    if not procs:
        return "none (no pids cgroup could be made: the cgroup file system is not writable here)"
    try:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
        return "pids-cgroup"
    except OSError as e:
        return f"none ({e.strerror})"


def _set_limits(spec: dict, own_user_namespace: bool) -> str:
    """The resource limits; returns how the program's processes are counted (``userns-nproc`` or why not).

    ``RLIMIT_NPROC`` counts every process and thread of the user in the user namespace where the limit is checked
    (Linux 5.14+): in a user namespace of its own, the program's alone; in the worker's, the worker's threads
    and every other process of the uid (other pods' on the node), which would refuse the program's first thread
    for what others hold. It is set in the first case only; the kernel never applies it to root."""
    mib = 1024 * 1024
    limits = [("RLIMIT_CPU", spec["cpu_s"], spec["cpu_s"] + 1), ("RLIMIT_AS", spec["memory_mb"] * mib, None),
              ("RLIMIT_FSIZE", spec["file_mb"] * mib, None), ("RLIMIT_CORE", 0, None), ("RLIMIT_NOFILE", 256, None)]
    if os.getuid() == 0:
        counted = "none (root: the kernel applies no RLIMIT_NPROC)"
    elif own_user_namespace:
        limits.append(("RLIMIT_NPROC", spec["max_processes"], None))
        counted = "userns-nproc"
    else:
        counted = "none (no user namespace: RLIMIT_NPROC would count the worker's threads too)"
    for name, soft, hard in limits:
        resource.setrlimit(getattr(resource, name), (soft, soft if hard is None else hard))
    return counted


def _leave_namespaces(libc: ctypes.CDLL) -> tuple[str, str]:
    """New network and mount namespaces: (the network layer that applied, ``mountns``; or why not, ``none (...)``).

    A new network namespace has only a loopback, down: connects fail, and its abstract Unix socket names are
    its own. In a new user namespace first, so the program holds no capability of the machine's namespaces
    (the user keeps its own id inside, so it can create files in its new folders); as root, the namespaces
    alone where that is refused; the network alone where a mount namespace is refused."""
    uid, gid = os.getuid(), os.getgid()
    errors = []
    for flags, network in ((_CLONE_NEWUSER | _CLONE_NEWNET | _CLONE_NEWNS, "userns+netns"), (_CLONE_NEWNET | _CLONE_NEWNS, "netns"),
                           (_CLONE_NEWUSER | _CLONE_NEWNET, "userns+netns"), (_CLONE_NEWNET, "netns")):
        if libc.unshare(flags) != 0:
            errors.append(os.strerror(ctypes.get_errno()))
            continue
        if flags & _CLONE_NEWUSER:
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        why = f"none (unshare: {'; '.join(dict.fromkeys(errors))})"
        return network, "mountns" if flags & _CLONE_NEWNS else why
    why = f"none (unshare: {'; '.join(dict.fromkeys(errors))})"
    return why, why


def _hide_shared_folders(libc: ctypes.CDLL, folder: str, disk_mb: int) -> str:
    """In the new mount namespace: an empty tmpfs over each of ``_HIDDEN_FOLDERS``, and over ``folder`` (the working
    folder, often under ``/tmp``) a tmpfs of ``disk_mb`` MiB holding its program: the total the program's files may
    take. Returns ``mountns`` or why not."""
    def fail(what: str) -> str:
        return f"none ({what}: {os.strerror(ctypes.get_errno())})"

    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:  # nothing below propagates back out
        return fail("mount --make-rprivate /")
    keep = os.open(folder, os.O_PATH | os.O_CLOEXEC)
    # the interpreter the program runs on stays visible where it lives under a hidden folder (a checkout in /tmp)
    interpreter = {path: os.open(path, os.O_PATH | os.O_CLOEXEC) for path in _interpreter_folders()}
    try:
        hidden: list[str] = []
        for path in dict.fromkeys(os.path.realpath(p) for p in _HIDDEN_FOLDERS):
            if os.path.isdir(path) and libc.mount(b"tmpfs", path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"size=1m,mode=1777") != 0:
                return fail(f"tmpfs on {path}")
            hidden.append(path)
        for path, fd in interpreter.items():
            if any(path.startswith(h + "/") for h in hidden):
                os.makedirs(path, exist_ok=True)
                if (libc.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, _MS_BIND | _MS_REC, None) != 0
                        or libc.mount(None, path.encode(), None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY, None) != 0):
                    return fail(f"bind {path} read-only")
        with open(os.path.join(f"/proc/self/fd/{keep}", "main.py"), "rb") as f:
            program = f.read()
        os.makedirs(folder, mode=0o700, exist_ok=True)  # under a hidden folder: its empty tmpfs
        if libc.mount(b"tmpfs", folder.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, f"size={disk_mb}m,mode=0700".encode()) != 0:
            return fail(f"tmpfs on {folder}")
        with open(os.path.join(folder, "main.py"), "wb") as out:
            out.write(program)
        os.chdir(folder)
    finally:
        for fd in (keep, *interpreter.values()):
            os.close(fd)
    return "mountns"


def _base_interpreter() -> str:
    """The interpreter the program runs on: this one's base installation (a virtual environment's own ``python``
    is only a link or copy, and the program runs with ``-I -S``, the standard library only)."""
    return os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable)


def _interpreter_folders() -> list[str]:
    """The folders the program's interpreter needs: its binary's and its standard library's (``sys.base_prefix``),
    a folder inside another left out."""
    folders = sorted({os.path.dirname(_base_interpreter()), os.path.realpath(sys.base_prefix)})
    return [f for f in folders if not any(f.startswith(o + "/") for o in folders if o != f)]


def _landlock(libc: ctypes.CDLL, folder: str) -> tuple[int, str]:
    """Writes only under ``folder`` (and to /dev/null), no TCP bind or connect (ABI 4+), no signal or abstract
    socket out of the sandbox (ABI 6+). Returns (ABI, what applied)."""
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    if abi < 1:
        return 0, f"none ({os.strerror(ctypes.get_errno())})"
    write = _FS_WRITE_ABI1 | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    attr = _RulesetAttr(write, (_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 else 0, (_SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL) if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8  # the struct grew with the ABI; an older kernel takes its prefix
    ruleset = libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        return abi, f"none (create_ruleset: {os.strerror(ctypes.get_errno())})"
    try:
        for path, allowed in ((folder, write), ("/dev/null", _FILE_ONLY & write)):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneathAttr(allowed, fd)
                if libc.syscall(_SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH), ctypes.byref(rule), ctypes.c_uint32(0)):
                    return abi, f"none (add_rule {path}: {os.strerror(ctypes.get_errno())})"
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) or libc.syscall(_SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)):
            return abi, f"none (restrict_self: {os.strerror(ctypes.get_errno())})"
    finally:
        os.close(ruleset)
    return abi, "landlock-fs" + (",landlock-net" if abi >= 4 else "") + (",landlock-scope" if abi >= 6 else "")


def main(argv: list[str]) -> None:
    spec, status_fd = json.loads(argv[1]), int(argv[2])
    status: dict[str, str | int] = {"cgroup": _join_cgroup(spec["cgroup_procs"])}
    if spec["memory_procs"]:  # cgroup v1: the memory limit's own hierarchy
        _join_cgroup(spec["memory_procs"])
    libc = _libc()
    folder = os.getcwd()
    status["network"], mounts = _leave_namespaces(libc)
    status["mounts"] = _hide_shared_folders(libc, folder, spec["disk_mb"]) if mounts == "mountns" else mounts
    status["abi"], status["landlock"] = _landlock(libc, folder)
    status["processes"] = _set_limits(spec, status["network"] == "userns+netns")  # last: the steps above must not count against them
    os.write(status_fd, (json.dumps(status) + "\n").encode())
    os.close(status_fd)
    python = _base_interpreter()
    os.execv(python, [python, "-I", "-S", "-B", "-X", "utf8", spec["main"]])


if __name__ == "__main__":
    main(sys.argv)
