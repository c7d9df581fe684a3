"""The local runs this machine records, read back: ``dockrl runs`` and ``dockrl teardown``.

The local backend (``dockrl.launch.local``) records each run it starts in
``<state_dir>/<run_id>.json``; a run whose stages all run in the driver's process records
itself there too while it runs (``recorded_run``). ``local_runs`` lists them, with the run ids
that live processes carry without a record (a SIGKILLed driver's workers), and
``teardown_local`` stops what a run left: its driver, while it holds the run folder, and its
workers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Iterator

# the module, not its names: the state folder is looked up on it at each call, so the backend and
# these records always agree on it (tests move it with one monkeypatch of local.default_state_dir)
from dockrl.launch import local
from dockrl.launch.procfs import run_processes, start_time
from dockrl.run.lock import LOCK_FILE, lock_holder

logger = logging.getLogger(__name__)


def local_runs(state_dir: str | Path | None = None) -> list[dict]:
    """The local runs this machine knows: each recorded run (its state file) and each run id that
    live processes carry without one. Each: ``run_id``, ``run_dir`` (or None), ``driver_pid``,
    ``driver_alive``, ``processes`` (live pids carrying the run id), sorted by run id."""
    folder = Path(state_dir) if state_dir else local.default_state_dir()
    live = run_processes()
    runs: dict[str, dict] = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        pid, start = doc.get("driver_pid"), doc.get("driver_start_time")
        runs[doc["run_id"]] = {"run_id": doc["run_id"], "run_dir": doc.get("run_dir"), "driver_pid": pid,
                               "driver_alive": pid is not None and start is not None and start_time(pid) == start}
    for rid in live.values():
        runs.setdefault(rid, {"run_id": rid, "run_dir": None, "driver_pid": None, "driver_alive": False})
    for run in runs.values():
        run["processes"] = sorted(pid for pid, rid in live.items() if rid == run["run_id"])
    return [runs[k] for k in sorted(runs)]


@contextlib.contextmanager
def recorded_run(run_id: str, run_dir: str | Path, *, state_dir: str | Path | None = None) -> Iterator[None]:
    """Record a run whose stages all run in this process (``dock.mode=inprocess``: no workers) where
    the backend records its runs, for as long as the block runs: ``local_runs`` (``dockrl runs``)
    lists it with this process as its driver, and ``teardown_local`` finds it by its folder or id.
    A record that cannot be written (a state folder of another user) is only a warning: the run goes on.
    """
    backend = local.LocalBackend(run_id, state_dir=state_dir, run_dir=run_dir)
    try:
        backend.state_dir.mkdir(parents=True, exist_ok=True)
        backend.write_state()
    except OSError as e:
        logger.warning("run %s is not recorded in %s (%s): `dockrl runs` will not list it", run_id, backend.state_dir, e)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            backend.state_file.unlink(missing_ok=True)


def teardown_local(target: str, *, state_dir: str | Path | None = None, grace_s: float = 5.0) -> dict:
    """Stop what a local run left running: ``target`` is a run folder (``run.output_dir``) or a run id.

    For a run folder: the driver that still holds its lock (``dockrl.run.lock``; SIGTERM, which
    tears its workers down, then SIGKILL after ``grace_s``) and the workers of every run recorded
    for that folder; for a run id: that run's driver while it runs (as recorded: an in-process
    run has no workers, ``recorded_run``) and its workers. Workers are found by the backend's record
    and by ``DOCKRL_RUN_ID`` in their environment, so those of a SIGKILLed driver are found too.

    Returns:
        ``{"driver": pid or None, "runs": {run_id: workers stopped}}``.

    Raises:
        ValueError: ``target`` is neither a run folder (one with a run's lock file, or recorded for a run) nor a run id
            this machine knows.
    """
    runs = local_runs(state_dir)
    folder = Path(target)
    out: dict = {"driver": None, "runs": {}}
    if folder.is_dir():
        where = str(folder.resolve())
        ids = [r["run_id"] for r in runs if r["run_dir"] == where]
        if not ids and not (folder / LOCK_FILE).exists():  # every run leaves its lock file in its folder
            raise ValueError(f"{folder} is not a run folder: it has no {LOCK_FILE} and no run is recorded for it; give a run's "
                             "run.output_dir or a run id (`dockrl runs` lists them)")
        holder = lock_holder(folder)
        if holder and holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
            out["driver"] = _stop_driver(holder["pid"], grace_s)
    elif (recorded := next((r for r in runs if r["run_id"] == target), None)) is not None:
        ids = [target]
        if recorded["driver_alive"]:  # its pid still has the start time recorded: never a reused pid
            out["driver"] = _stop_driver(recorded["driver_pid"], grace_s)
    else:
        known = ", ".join(r["run_id"] for r in runs) or "none"
        raise ValueError(f"{target!r} is neither a run folder nor a run id this machine knows (known run ids: {known}; "
                         "a run's record goes when it ends); `dockrl runs` lists them")
    for rid in ids:
        out["runs"][rid] = local.LocalBackend(rid, state_dir=state_dir, grace_s=grace_s).teardown()
    return out


def _stop_driver(pid: int, grace_s: float) -> int | None:
    """SIGTERM ``pid`` (a driver: its teardown stops its workers), SIGKILL after ``grace_s``; None if it was not running."""
    start = start_time(pid)
    if start is None or pid == os.getpid():
        return None
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s + 10  # its own teardown gives each worker grace_s
    while time.monotonic() < deadline and start_time(pid) == start:
        time.sleep(0.05)
    if start_time(pid) == start:
        logger.warning("driver pid %d ignored SIGTERM for %.0f s; killing it", pid, grace_s + 10)
        os.kill(pid, signal.SIGKILL)
    return pid
