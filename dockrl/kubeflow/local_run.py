"""``dockrl pipeline run --local`` around its ``kfp.local`` run: the output and the stop signal.

* ``LocalRunOutput``: the run's output passes through (without raw colour codes when not on a
  terminal) and its last lines are kept, so that a failure ends with the failed task and the
  error its log ends with (``task_error``).
* ``forward_sigterm``: a SIGTERM to ``dockrl pipeline`` reaches the running task and its workers too.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections import deque

from dockrl.launch.procfs import live_processes


def _descendants(pid: int) -> list[int]:
    """Live processes below ``pid`` in the process tree, parents first."""
    children: dict[int, list[int]] = {}
    for child, (parent, _) in live_processes().items():
        children.setdefault(parent, []).append(child)
    out, todo = [], list(children.get(pid, []))
    while todo:
        out.append(todo.pop(0))
        todo += children.get(out[-1], [])
    return out


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TASK_FAILED = re.compile(r"Task '([^']+)' finished with status FAILURE")


class _Tee:
    """A text stream that writes through to ``stream`` (without ANSI colour codes unless it is a
    terminal) and keeps the last lines written in ``tail``."""

    def __init__(self, stream, tail: deque) -> None:
        self._stream, self._tail, self._part = stream, tail, ""
        self._strip = not (hasattr(stream, "isatty") and stream.isatty())

    def write(self, text: str) -> int:
        plain = _ANSI.sub("", text)
        lines = (self._part + plain).split("\n")
        self._part = lines.pop()
        self._tail.extend(lines)
        return self._stream.write(plain if self._strip else text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class LocalRunOutput:
    """While a ``kfp.local`` run goes on: its output (the tasks' logs and kfp's lines) passes
    through without raw colour codes when not on a terminal, and its last lines are kept, so
    that a failure can end with the failed task and the error its log ends with."""

    def __init__(self, keep: int = 2000) -> None:
        self.tail: deque = deque(maxlen=keep)

    def __enter__(self) -> LocalRunOutput:
        self._saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(sys.stdout, self.tail), _Tee(sys.stderr, self.tail)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stdout, sys.stderr = self._saved

    def failure(self, error: BaseException) -> str:
        """``task 'train' failed: <the last error in its log>`` (or kfp's message, without colour codes)."""
        lines = list(self.tail)
        failed = [m.group(1) for line in lines if (m := _TASK_FAILED.search(line))]
        task = f"task {failed[-1]!r} failed" if failed else _ANSI.sub("", str(error))
        cause = task_error(lines)
        return f"{task}: {cause}" if cause else task


def task_error(lines: list[str]) -> str:
    """The error a task's log (its lines indented by ``kfp.local``) ends with: the exception of
    its last traceback, with the lines of its message, or its last ``dockrl: ...`` line."""
    task = [line[4:] if line.startswith("    ") else None for line in lines]  # None: kfp's own line
    starts = [i for i, line in enumerate(task) if line is not None and line.startswith("Traceback (most recent call last):")]
    if not starts:
        said = [line for line in task if line and line.startswith("dockrl")]
        return said[-1] if said else ""
    message, body = [], task[starts[-1] + 1:]
    frames = True
    for line in body:
        if line is None:
            break
        if frames and (line.startswith(" ") or not line.strip()):
            continue
        frames = False
        message.append(line)
    return "\n".join(message).strip()


def forward_sigterm() -> None:
    """On SIGTERM, pass it on to every process below this one — the running ``kfp.local`` task
    (a shell that runs the executor), whose launcher then tears its workers down, and the
    workers — and exit with 143. Ctrl-C reaches the whole foreground process group by itself;
    a SIGTERM from a supervisor reaches only this process."""
    def handler(signum: int, frame: object) -> None:
        for pid in _descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
