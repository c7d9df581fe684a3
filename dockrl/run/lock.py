"""One run at a time in a run folder: an exclusive lock on ``RUN/.dockrl.lock`` for the run's lifetime.

``RunLock(run_dir)`` (a context manager) takes an exclusive ``fcntl.flock`` on the lock file
before anything of the folder is read or written, and holds it until the run ends. A second
run into the same ``run.output_dir`` is refused at once (``RunLockedError``, a ``ConfigError``)
with the holder's pid, host and start time. The kernel releases a ``flock`` when the process
that holds it exits, however it exits (SIGKILL included): the file a dead run leaves behind is
held by nobody, so a stale lock is never an obstacle and needs no clean-up. The holder writes
its pid into the file only for the message and ``dockrl teardown``; the lock itself is the ``flock``.

A ``flock`` is per open file description: a child started with ``fork`` alone (no ``exec``)
shares it and keeps the folder locked while it lives, which is right for a process of the run.
Processes started by ``subprocess`` do not inherit it (close-on-exec). On a network file
system without ``flock`` support (some NFS set-ups) the lock is local to each machine.

A lock on a shared file system (NFS, CephFS) whose holder's node was lost is not released at
once: the server keeps it until the client's lease or session expires (NFSv4: the server's lease
time, 90 s by default; CephFS: the MDS evicts a silent client after ``mds_session_autoclose``,
300 s by default). A retried pipeline task that starts on another node within that time finds the
folder held by a process that no longer exists. With ``wait_s`` (the driver's
``run.lock_wait_s``) ``RunLock`` therefore waits up to that long, polling, for a lock whose holder
is on another host before it refuses; a holder that is a live process of this host is refused at
once, and a dead one never holds the lock.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from types import TracebackType

from dockrl.config import ConfigError

logger = logging.getLogger(__name__)

LOCK_FILE = ".dockrl.lock"
ACQUIRE_TRIES = 20
"""Attempts to lock the file at the path when a releasing run removed it in between (``RunLock.acquire``)."""
POLL_S = 2.0
"""Seconds between two tries at a lock held by a process of another host (``RunLock`` with ``wait_s``)."""


class RunLockedError(ConfigError):
    """``run.output_dir`` is held by another run; ``holder`` is what its lock file says (``lock_holder``)."""

    def __init__(self, message: str, holder: dict | None = None) -> None:
        super().__init__(message)
        self.holder = holder or {}


def live_here(holder: dict) -> bool:
    """The holder a lock file names is a live process of this host (no lease to wait for)."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        pass
    return True


def lock_holder(run_dir: str | Path) -> dict | None:
    """Who holds the lock of ``run_dir`` (``pid``, ``host``, ``since``), or None when no live process does."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(path)
        fcntl.flock(fd, fcntl.LOCK_UN)  # nobody holds it: a file left by a finished or killed run
        return None
    finally:
        os.close(fd)


def _read_holder(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}  # the holder has not written its pid yet


def _who(holder: dict) -> str:
    if not holder:
        return "a process that is starting"
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('since', '?')}"


class RunLock:
    """Exclusive lock of a run folder (see the module docstring). It creates the folder (and the
    folders above it that are missing) and writes its pid into the lock file at once, so that a
    second run and ``dockrl teardown`` name it while it starts.

    Until ``accept`` a refused or failed start leaves no trace: on release the lock file of a
    stopped run gets its content back, one this lock created goes, and so does every folder it
    created that holds nothing else (never a folder that was there before). An accepted run's
    pid stays in the lock file, held by nobody once it ends.

    Args:
        run_dir: the run folder.
        wait_s: how long to wait, seconds, for a lock whose holder is not a live process of this
            host (a lost node's, until its file system lease expires: the module docstring)
            before refusing; 0 refuses at once.
        poll_s: seconds between two tries while waiting.

    Raises (on enter):
        RunLockedError: another live process holds the folder (after ``wait_s`` for one on
            another host: the message says how long it waited).
        ConfigError: the folder cannot be created or the lock file not written (names the path
            and the OS error, e.g. a read-only folder).
    """

    def __init__(self, run_dir: str | Path, *, wait_s: float = 0.0, poll_s: float = POLL_S) -> None:
        if not (wait_s >= 0 and poll_s > 0):
            raise ValueError(f"run lock: wait_s={wait_s}, poll_s={poll_s}; expected wait_s >= 0 and poll_s > 0")
        self.wait_s, self.poll_s = wait_s, poll_s
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self._top: Path | None = None  # the highest folder this lock created (run_dir or one above it)
        self._previous: bytes | None = None  # the lock file's content before this run; None: this lock created it
        self._accepted = False

    def acquire(self) -> RunLock:
        deadline = None
        try:
            while True:
                try:
                    fd = self._lock()
                    break
                except RunLockedError as refused:
                    if not self.wait_s or live_here(refused.holder):
                        raise
                    now = time.monotonic()
                    if deadline is None:
                        deadline = now + self.wait_s
                        logger.warning("%s is locked by %s, a process of another host; if that host was lost its lock lasts "
                                       "until the file system's lease expires: waiting up to %.0f s (run.lock_wait_s)",
                                       self.run_dir, _who(refused.holder), self.wait_s)
                    if now >= deadline:
                        raise RunLockedError(f"{refused} (still held after waiting run.lock_wait_s={self.wait_s:g} s for "
                                             "the lock of a lost host to expire)", refused.holder) from None
                    time.sleep(min(self.poll_s, max(deadline - now, 0.0)))
        except BaseException:
            self._remove_folders()  # a failed start leaves none of the folders it made (one the holder uses is not empty)
            raise
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return self

    def _lock(self) -> int:
        """The locked descriptor of the lock file, taking it again while a releasing run removes it."""
        for _ in range(ACQUIRE_TRIES):
            fd = self._lock_once()
            if fd is not None:
                return fd
        raise ConfigError(f"run.output_dir: the lock file {self.path} was removed {ACQUIRE_TRIES} times while this "
                          "run took it; another process keeps deleting that folder: choose another run.output_dir")

    def accept(self) -> None:
        """The run is accepted and writes into the folder: release leaves the lock file with this
        run's pid (and with it the folder) instead of putting back what was there."""
        self._accepted = True

    def _lock_once(self) -> int | None:
        """The locked descriptor of the lock file now at ``self.path``; None when that file or its
        folder went away meanwhile (a refused run's ``release`` removes both): try again."""
        top = None
        for folder in (self.run_dir, *self.run_dir.parents):  # the folders mkdir is about to create
            if folder.exists():
                break
            top = folder
        if top is not None and (self._top is None or len(top.parts) < len(self._top.parts)):
            self._top = top  # kept over the tries: an earlier one may have created more
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            try:
                fd, created = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                fd, created = os.open(self.path, os.O_RDWR), False
        except FileNotFoundError:  # the folder or the file was removed between mkdir and open
            return None
        except OSError as e:
            raise ConfigError(f"run.output_dir: cannot create the run folder's lock file {self.path} "
                              f"({e.strerror or e}); choose a writable run.output_dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = _read_holder(self.path)
            raise RunLockedError(
                f"run.output_dir: {self.run_dir} is in use by another dockrl run ({_who(holder)}); two runs in one folder "
                "would mix their metrics and checkpoints: wait for it to end (or stop it: dockrl teardown "
                f"{self.run_dir}), or choose another run.output_dir", holder
            ) from None
        try:  # the file locked must still be the one at the path: not one a releasing run unlinked after we opened it
            current = os.stat(self.path)
        except FileNotFoundError:
            current = None
        held = os.fstat(fd)
        if current is None or (current.st_dev, current.st_ino) != (held.st_dev, held.st_ino):
            os.close(fd)
            return None
        self._previous = None if created else os.pread(fd, held.st_size, 0)  # read while locked: nobody writes it
        return fd

    def release(self) -> None:
        """Release the lock: the lock file stays, held by nobody, unless the run was not accepted
        (see the class docstring). Safe to call twice."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        previous = self._previous
        try:
            if not self._accepted and previous is None:  # unlinked while held: a run that has it open finds it
                self.path.unlink(missing_ok=True)            # gone after its flock and takes the file at the path
            elif not self._accepted and previous is not None:  # while held: no other run writes its pid in between
                os.pwrite(fd, previous, 0)
                os.ftruncate(fd, len(previous))
        except OSError:  # the folder is gone, or the disk full: the pid of this run stays, which nothing relies on
            pass
        finally:
            os.close(fd)  # closing the only descriptor releases the flock
        if not self._accepted:
            self._remove_folders()

    def _remove_folders(self) -> None:
        """Remove the folders this lock created, from the run folder up, while each is empty."""
        if self._top is None:
            return
        for folder in (self.run_dir, *self.run_dir.parents):
            try:
                folder.rmdir()
            except OSError:  # it holds something else (another run's lock file, a user's file) or is gone: it and those above stay
                return
            if folder == self._top:
                return

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()
