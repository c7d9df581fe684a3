"""Workers and dock shards stop when their run's driver is gone, on any worker backend.

Two ties, each enough alone:

* **parent** (local processes): a worker started by the driver knows the driver's pid
  (``DRIVER_PID_ENV``). On Linux it asks the kernel to send it SIGHUP when its parent exits
  (``prctl(PR_SET_PDEATHSIG)``), and on any POSIX system a watch thread compares
  ``os.getppid()`` with the driver's pid every ``PARENT_POLL_S`` (which also covers the
  handler, which a long call in C would delay).
* **lease** (any backend, pods on other machines included): the driver renews a lease on every
  dock shard (``DriverLease``: the ``driver_beat`` action every ``timeout/4`` seconds, from a
  thread of its own, so a driver busy starting pods still renews it). A shard whose lease has
  been quiet for ``run.driver_timeout_s`` stops (``dockrl dock-shard --driver-timeout-s``). A
  worker asks shard 0 how long the lease has been quiet (``driver_quiet``) every
  ``timeout/4`` seconds and stops when that exceeds ``run.driver_timeout_s``, or when shard 0
  has not answered for that long.

A worker whose driver is gone logs one error line and kills its whole process group: every
backend starts a worker in a session of its own, so what it started (vLLM engine processes,
the reward verifier's pool) stops with it. ``watch_driver`` is the worker side;
``DriverLease`` the driver side. The Flight half of the lease (``DriverLease``, the
``shard_lease_quiet`` a worker hands ``watch_driver``, and the readiness probe
``wait_for_shards``) lives in ``dockrl.run.driver_lease``, so this module needs no pyarrow.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)

DRIVER_PID_ENV = "DOCKRL_DRIVER_PID"
"""Pid of the driver that started this process (set by the local worker backend)."""
PARENT_POLL_S = 0.25
"""How often the watch thread compares the parent pid with the driver's, seconds."""
PARENT_DEATH_SIGNAL = signal.SIGHUP
"""What the kernel sends a worker when its driver exits (a worker leads a session of its own and
has no terminal, so nothing else sends it SIGHUP)."""
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux
    ``prctl(PR_SET_PDEATHSIG)``; the parent *thread*, in fact: call it in a child whose parent
    started it from a thread that lives as long as the parent). Returns False where not supported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def stop_process_group(reason: str) -> None:
    """Log ``reason`` and kill this process and every process of its group (SIGKILL); never returns.

    A process that leads its group (every worker does) takes the group with it; otherwise only itself.
    """
    logger.error("%s; stopping this process and the processes it started", reason)
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - best effort before dying
            pass
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def driver_pid_from_env() -> int | None:
    """The driver's pid from ``DRIVER_PID_ENV`` (None when unset or not a number)."""
    raw = os.environ.get(DRIVER_PID_ENV, "")
    return int(raw) if raw.isdigit() else None


def watch_driver(
    *, driver_pid: int | None, lease_quiet: Callable[[], float] | None = None, timeout_s: float = 60.0, what: str = "worker",
    on_gone: Callable[[str], None] = stop_process_group,
) -> threading.Thread | None:
    """Stop this process (``on_gone(reason)``) once its driver is gone; returns the watch thread.

    Args:
        driver_pid: the driver's pid when it is this process's parent (local backend), else None.
            Arms the parent death signal (``PARENT_DEATH_SIGNAL``, handled as ``on_gone``) and the pid check.
        lease_quiet: seconds since the driver last renewed its lease (asked of dock shard 0);
            may raise when the shard does not answer. None: no lease check.
        timeout_s: ``run.driver_timeout_s``: longest quiet lease, or unanswered shard, seconds.
        what: this process, for the log line (``reward worker``).
        on_gone: called with the reason, maybe twice: in the main thread as the parent death signal's
            handler and in the watch thread. It must take no lock the main thread may hold (a
            ``threading.Event``'s ``set`` can deadlock in the handler); appending to a list or killing is safe.

    Returns None (and watches nothing) when there is neither a pid nor a lease to watch.
    """
    if driver_pid is None and lease_quiet is None:
        return None
    if driver_pid is not None:
        # SIGHUP, not SIGTERM: a Python handler waits for the main thread to leave a blocking call,
        # and the teardown's SIGTERM must keep its immediate default action (the watch thread
        # below does not wait for the main thread)
        if threading.current_thread() is threading.main_thread():
            signal.signal(PARENT_DEATH_SIGNAL, lambda signum, frame: on_gone(f"{what}: the driver (pid {driver_pid}) exited"))
        die_with_parent(PARENT_DEATH_SIGNAL)
        if os.getppid() != driver_pid:  # the driver died before the kernel was asked to tell us
            on_gone(f"{what}: the driver (pid {driver_pid}) is gone")
            return None

    def watch() -> None:
        period = min(timeout_s / 4, 5.0)
        next_lease, last_answer = time.monotonic(), time.monotonic()
        while True:
            if driver_pid is not None and os.getppid() != driver_pid:
                on_gone(f"{what}: the driver (pid {driver_pid}) is gone")
                return
            now = time.monotonic()
            if lease_quiet is not None and now >= next_lease:
                next_lease = now + period
                try:
                    quiet = lease_quiet()
                    last_answer = now
                except Exception as e:  # noqa: BLE001 - an unreachable shard counts as quiet
                    quiet = now - last_answer
                    logger.debug("driver lease: no answer from dock shard 0 (%s)", e)
                if quiet > timeout_s:
                    on_gone(f"{what}: the driver has not renewed its lease for {quiet:.0f} s "
                            f"(run.driver_timeout_s={timeout_s:g}): it is gone")
                    return
            time.sleep(PARENT_POLL_S if driver_pid is not None else min(period, 1.0))

    thread = threading.Thread(target=watch, name="dockrl-driver-watch", daemon=True)
    thread.start()
    return thread


def _start_time(pid: int) -> str | None:
    """Start time of ``pid`` (Linux ``/proc``, clock ticks) as text; "" where unknown; None when gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else fields[19]
    except FileNotFoundError:
        return None
    except OSError:
        pass
    try:  # no /proc: existence only
        os.kill(pid, 0)
        return ""
    except ProcessLookupError:
        return None
    except PermissionError:
        return ""


def exit_when_gone(pid: int, poll_s: float = PARENT_POLL_S) -> threading.Thread:
    """In a helper process that may outlive ``pid`` (a process pool's worker):
    exit (``os._exit``) as soon as process ``pid`` is gone. A thread polls every ``poll_s``."""
    started = _start_time(pid)

    def watch() -> None:
        while _start_time(pid) == started and started is not None:
            time.sleep(poll_s)
        os._exit(0)

    thread = threading.Thread(target=watch, name="dockrl-owner-watch", daemon=True)
    thread.start()
    return thread


def guard_pool_worker(owner_pid: int) -> None:
    """``initializer`` of a process pool's workers (the reward verifier's): they exit when the
    pool's owner ``owner_pid`` is gone, even by SIGKILL, and when their parent is. Without it they
    outlive the owner, waiting on their task queue forever, and the resource tracker stays too."""
    die_with_parent(signal.SIGKILL)
    exit_when_gone(owner_pid)


class sigterm_as_exit:
    """Context manager: SIGTERM raises ``SystemExit(143)`` in the main thread while inside, so the
    ``finally`` blocks of a run (closing the verifier's pool, tearing workers down, releasing the
    run folder) run when the run is stopped with ``kill``; the previous handler comes back on exit.
    Off the main thread it does nothing (signal handlers belong to the main thread).

    A signal handler's exception is lost where Python ignores exceptions: in a ``__del__`` the
    garbage collector runs, or a weakref callback ("Exception ignored in ..." on stderr), and the
    run would go on. The handler therefore also records the signal, SIGINT's too (its
    ``KeyboardInterrupt`` as Python's own handler raises it), and ``raise_if_stopped`` raises it
    again: the driver calls it between iterations."""

    def __enter__(self) -> sigterm_as_exit:
        self._previous: dict[int, object] = {}
        self.received: int | None = None
        if threading.current_thread() is threading.main_thread():
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._stop)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored
                self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._stop)
        return self

    def _stop(self, signum: int, frame: object) -> None:
        self.received = signum
        self.raise_if_stopped()

    def raise_if_stopped(self) -> None:
        """Raise what the signal received inside raises (``SystemExit(143)`` for SIGTERM,
        ``KeyboardInterrupt`` for SIGINT); nothing when none was."""
        if self.received == signal.SIGINT:
            raise KeyboardInterrupt
        if self.received is not None:
            raise SystemExit(128 + self.received)

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]
