"""What Linux's ``/proc`` tells of live processes: parents, process groups, start times, run ids.

The local worker backend (``local.py``) and ``dockrl runs`` / ``dockrl teardown`` find a run's
processes here: by the start time recorded for a pid (so a reused pid is never hit) and by the
``DOCKRL_RUN_ID`` in a process's environment (so the workers of a SIGKILLed driver are found too).
Off Linux, where there is no ``/proc``, the readers find nothing.
"""

from __future__ import annotations

import os
from pathlib import Path


def live_processes() -> dict[int, tuple[int, int]]:
    """pid → (parent pid, process group) of every live (non-zombie) process (Linux ``/proc``; empty elsewhere)."""
    out = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            out[int(entry.name)] = (int(fields[1]), int(fields[2]))
    return out


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    return [pid for pid, (_, group) in live_processes().items() if group == pgid]


def start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (Linux ``/proc``); None if gone, a zombie or unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces: split after its closing parenthesis
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # exited, not yet reaped: nothing left to stop
        return None
    return int(fields[19])


def pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def process_environ(pid: int) -> dict[bytes, bytes]:
    """The environment ``pid`` was started with (``/proc/<pid>/environ``; empty: gone, a zombie, or not ours to read)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(var.split(b"=", 1) for var in raw.split(b"\0") if b"=" in var)


def process_run_id(pid: int) -> str | None:
    """``DOCKRL_RUN_ID`` in the environment of live process ``pid`` (None: none, gone, a zombie, or not ours to read)."""
    run_id = process_environ(pid).get(b"DOCKRL_RUN_ID")
    return None if run_id is None else run_id.decode(errors="replace")


def run_processes(run_id: str | None = None) -> dict[int, str]:
    """pid → run id of every live process of this user started for a dockrl run (``DOCKRL_RUN_ID``
    in its environment: workers, shards and what they started), of ``run_id`` only when given."""
    found = {}
    for pid in live_processes():
        rid = process_run_id(pid)
        if rid is not None and (run_id is None or rid == run_id):
            found[pid] = rid
    return found
