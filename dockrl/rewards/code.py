"""The code-execution reward: a response's program run against its problem's tests in the sandbox.

``algorithm.scorer=dockrl.rewards.code:CodeScorer`` with ``data.train_path`` and ``data.test_path`` the
bundled programming problems (``dockrl.envs.tasks.CODE_PROBLEMS``; the ground truth of a row is its
``task_id``). For each response the last ```` ```python ```` block is the program; it runs once in the
sandbox (``dockrl.isolation.sandbox``; here or in a sandbox executor's pod, ``env.sandbox.backend``)
followed by a harness that runs each ``assert`` test in turn and reports each result on stdout, marked
with a random nonce so that the program's own prints cannot pose as results. The reward is

    correct_reward × (tests passed / tests) + format_reward when the response holds a program, else 0,

the pass rate as in code RL (e.g. CodeRL, Le et al. 2022, arXiv 2207.01780, reward per unit test;
with ``format_reward`` as the math verifier gives for a well-formed answer). A test that hangs ends the
run at the sandbox's limits: the tests passed before it count.

The tests run in the program's own interpreter, as MBPP's and HumanEval's harnesses run them: a
program written to tamper with the harness (patching builtins, reading its frames) is not stopped.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, Sequence

from dockrl.config.env_sections import SANDBOX_LAYERS, SandboxConfig
from dockrl.envs.tasks import CODE_PROBLEMS, load_code_problems
from dockrl.envs.tool_calls import ToolCall, parse_tool_calls
from dockrl.isolation.runner import require_layers, run_program

_HARNESS = """
import io as _io, sys as _sys
_out = _sys.stdout
def _report(index, passed):
    _out.write({nonce!r} + " " + str(index) + " " + ("pass" if passed else "fail") + "\\n")
    _out.flush()
_ns = {{"__name__": "solution"}}
_sys.stdout = _io.StringIO()  # the program's prints: not on the harness's stdout, which the output cap counts
try:
    exec(compile({program!r}, "solution.py", "exec"), _ns)
except BaseException:
    _sys.exit(1)
for _i, _test in enumerate({tests!r}):
    try:
        exec(compile(_test, "test_" + str(_i) + ".py", "exec"), _ns)
        _report(_i, True)
    except BaseException:
        _report(_i, False)
"""


def extract_program(response: str) -> str | None:
    """The last fenced Python block of ``response`` (```` ```python ````, ```` ```py ```` or no language), or None."""
    blocks = [c.arguments["code"] for c in parse_tool_calls(response, "fenced") if isinstance(c, ToolCall)]
    return blocks[-1] if blocks else None


class CodeScorer:
    """Scores programs against the bundled problems' tests (module docstring); the scorer protocol
    of ``dockrl.rewards.guard`` (``score``, ``counters``, ``close``).

    Args:
        timeout_s: ``algorithm.reward_timeout_s``: the sandbox's wall-clock limit per response (CPU: its ceiling).
        correct_reward, format_reward: the reward's scale and the bonus for holding a program.
        problems: a JSONL of problems with ``task_id`` and ``tests`` (default the bundled ones).
        workers: sandboxes run at once (default the CPUs, at most 8).
        sandbox_backend: ``env.sandbox.backend`` (``build_scorer`` passes it): ``pod`` sends each program to the
            stage's sandbox executor (``dockrl.isolation.runner``).

    Counters: ``scored`` responses, ``errors`` (no program in the response), ``timeouts`` (a run
    stopped at a limit), ``tests_passed`` and ``tests_run``.

    It refuses to start where a layer of ``require`` (the class attribute: every layer) is not in force
    (``SandboxUnavailable``); for trusted programs, a subclass with ``require = ()`` runs them with
    whatever the machine gives.
    """

    require: tuple[str, ...] = SANDBOX_LAYERS
    """The sandbox's layers that must be in force (``env.sandbox.require``'s names)."""

    def __init__(self, *, timeout_s: float = 5.0, correct_reward: float = 1.0, format_reward: float = 0.0,
                 problems: str | Path = CODE_PROBLEMS, workers: int = 0, sandbox_backend: Literal["local", "pod"] = "local") -> None:
        self.tests = load_code_problems(problems)
        self.correct_reward, self.format_reward = float(correct_reward), float(format_reward)
        self.limits = SandboxConfig(wall_s=float(timeout_s), cpu_s=max(1, math.ceil(timeout_s)), output_bytes=65536,
                                    require=tuple(self.require), backend=sandbox_backend)
        require_layers(self.limits)  # fail closed: before the first program of the model
        self.workers = workers or min(8, os.cpu_count() or 1)
        self._counts = {"scored": 0, "errors": 0, "timeouts": 0, "tests_passed": 0, "tests_run": 0}
        self._lock = threading.Lock()  # responses are scored from a thread pool

    def _count(self, **add: int) -> None:
        with self._lock:
            for key, n in add.items():
                self._counts[key] += n

    def score(self, responses: Sequence[str], ground_truths: Sequence[str]) -> list[float]:
        """Rewards of ``responses[i]`` against the tests of problem ``ground_truths[i]`` (a ``task_id``).

        Raises:
            ValueError: the sequences differ in length, or a ground truth is no problem's ``task_id``
                (the data is not the problems this scorer was built with).
        """
        if len(responses) != len(ground_truths):
            raise ValueError(f"CodeScorer.score: {len(responses)} responses but {len(ground_truths)} ground truths")
        unknown = sorted({str(t) for t in ground_truths} - set(self.tests))
        if unknown:
            raise ValueError(f"CodeScorer: ground truths {unknown[:5]} are no task_id of its problems (task_ids {sorted(self.tests, key=int)}); "
                             "train on the problems' file (dockrl.envs.tasks.CODE_PROBLEMS) or pass problems=")
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            return list(pool.map(self._score_one, responses, [str(t) for t in ground_truths]))

    def _score_one(self, response: str, task_id: str) -> float:
        passed, total = self.run_tests(response, task_id)
        self._count(scored=1)
        if passed is None:
            return 0.0
        return self.correct_reward * passed / total + self.format_reward

    def run_tests(self, response: str, task_id: str) -> tuple[int | None, int]:
        """``(tests passed, tests)`` of the response's program on problem ``task_id``; ``(None, tests)`` without a program."""
        tests = self.tests[task_id]
        program = extract_program(response)
        if program is None:
            self._count(errors=1)
            return None, len(tests)
        nonce = secrets.token_hex(16)
        result = run_program(_HARNESS.format(nonce=nonce, program=program, tests=tests), self.limits)
        passed = set()
        for line in result.stdout.splitlines():
            mark, _, rest = line.partition(" ")
            index, _, verdict = rest.partition(" ")
            if mark == nonce and verdict == "pass" and index.isdigit():
                passed.add(int(index))
        self._count(timeouts=int(result.limit in ("wall", "cpu")), tests_passed=len(passed), tests_run=len(tests))
        return len(passed), len(tests)

    def counters(self) -> dict[str, int]:
        """Cumulative counters over all ``score`` calls."""
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        """Nothing to release: every run's process and folder are gone when it returns."""


def reference_solutions(path: str | Path = CODE_PROBLEMS) -> dict[str, str]:
    """Each problem's reference answer (``answer`` of its row), by ``task_id``: a response that passes every test."""
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    return {str(row["task_id"]): row["answer"] for row in rows}
