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
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from types import TracebackType

from dockrl.config import ConfigError

LOCK_FILE = ".dockrl.lock"
ACQUIRE_TRIES = 20
"""Attempts to lock the file at the path when a releasing run removed it in between (``RunLock.acquire``)."""


class RunLockedError(ConfigError):
    """``run.output_dir`` is held by another live run."""


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


class RunLock:
    """Exclusive lock of a run folder (see the module docstring). It creates the folder (and the
    folders above it that are missing) and writes its pid into the lock file at once, so that a
    second run and ``dockrl teardown`` name it while it starts.

    Until ``accept`` a refused or failed start leaves no trace: on release the lock file of a
    stopped run gets its content back, one this lock created goes, and so does every folder it
    created that holds nothing else (never a folder that was there before). An accepted run's
    pid stays in the lock file, held by nobody once it ends.

    Raises (on enter):
        RunLockedError: another live process holds the folder.
        ConfigError: the folder cannot be created or the lock file not written (names the path
            and the OS error, e.g. a read-only folder).
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self._top: Path | None = None  # the highest folder this lock created (run_dir or one above it)
        self._previous: bytes | None = None  # the lock file's content before this run; None: this lock created it
        self._accepted = False

    def acquire(self) -> RunLock:
        try:
            for _ in range(ACQUIRE_TRIES):
                fd = self._lock_once()
                if fd is not None:
                    break
            else:
                raise ConfigError(f"run.output_dir: the lock file {self.path} was removed {ACQUIRE_TRIES} times while this "
                                  "run took it; another process keeps deleting that folder: choose another run.output_dir")
        except BaseException:
            self._remove_folders()  # a failed start leaves none of the folders it made (one the holder uses is not empty)
            raise
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return self

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
            who = (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('since', '?')}"
                   if holder else "a process that is starting")
            raise RunLockedError(
                f"run.output_dir: {self.run_dir} is in use by another dockrl run ({who}); two runs in one folder "
                "would mix their metrics and checkpoints: wait for it to end (or stop it: dockrl teardown "
                f"{self.run_dir}), or choose another run.output_dir"
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
