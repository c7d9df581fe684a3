"""Stage-like worker processes and shard processes for the dock's multi-process property tests.

A worker runs claim → compute → put → ack loops over a ``DockClient``, like a stage worker, and
reports every ack to the test on an event queue. It can be told to stop at a kill point (after
its k-th claim, put or ack) and wait there to be SIGKILLed. The computations are small pure
functions of the claimed cells, so the test knows the table an uninterrupted run produces.
Imported by spawned processes: keep it free of pytest and hypothesis.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np

from dockrl.dock import GRPO_SCHEMA
from dockrl.dock.client.dock_client import DockClient

INPUTS = {"reward": ["prompt_ids"], "advantage": ["rm_score"], "reference": ["prompt_ids"]}
OUTPUTS = {"reward": ["rm_score", "correct"], "advantage": ["advantages"], "reference": ["ref_log_prob"]}


def prompt_cell(row: int) -> list[int]:
    return [row % 5, row // 3, 7][: 1 + row % 3]


def reward_cells(prompts: list[list[int]]) -> dict[str, list]:
    return {"rm_score": [float(sum(p) * 3 % 7) for p in prompts], "correct": [sum(p) % 2 == 0 for p in prompts]}


def advantage_cells(rows: list[int], scores: list[float], group_size: int) -> dict[str, list]:
    """Score minus its group's mean (the claim holds whole groups), float32, over 1 + row % 3 tokens."""
    scores_by_row = dict(zip(rows, scores))
    out = []
    for r in rows:
        start = r - r % group_size
        group = np.array([scores_by_row[k] for k in range(start, start + group_size)], dtype=np.float64)
        out.append([float(np.float32(scores_by_row[r] - group.mean()))] * (1 + r % 3))
    return {"advantages": out, "returns": out}  # every output of the stage: a row is finished once both are written


def reference_cells(prompts: list[list[int]]) -> dict[str, list]:
    return {"ref_log_prob": [[-0.5 * t for t in p] for p in prompts]}


def expected_table(num_rows: int, group_size: int) -> dict[str, list]:
    """The output columns an uninterrupted run writes."""
    prompts = [prompt_cell(r) for r in range(num_rows)]
    table = reward_cells(prompts) | reference_cells(prompts)
    table |= advantage_cells(list(range(num_rows)), table["rm_score"], group_size)
    return table


@dataclass(frozen=True)
class Job:
    """One worker's part of an iteration."""

    job_id: int
    locations: list[str]
    token: str
    consumer: str
    batch: int
    whole_groups: bool
    group_size: int
    lease_s: float
    kill_at: tuple[int, str] | None = None
    """(k, phase): stop after the k-th claim's phase ('claimed', 'put' or 'acked') and wait for SIGKILL."""


def run_job(job: Job, events: Connection) -> None:
    client = DockClient(job.locations, GRPO_SCHEMA, token=job.token, timeout_s=60.0, rpc_timeout_s=20.0, lease_s=job.lease_s)
    events.send(("owner", job.job_id, client.owner))

    def checkpoint(k: int, phase: str, rows: list[int]) -> None:
        if job.kill_at == (k, phase):
            events.send(("kill_me", job.job_id, phase, rows))
            threading.Event().wait()  # until the SIGKILL

    k = 0
    while claim := client.claim(job.consumer, INPUTS[job.consumer], job.batch, whole_groups=job.whole_groups):
        k += 1
        checkpoint(k, "claimed", claim.rows)
        if job.consumer == "reward":
            cells = reward_cells(claim.batch.column("prompt_ids").to_pylist())
        elif job.consumer == "advantage":
            cells = advantage_cells(claim.rows, claim.batch.column("rm_score").to_pylist(), job.group_size)
        else:
            cells = reference_cells(claim.batch.column("prompt_ids").to_pylist())
        client.put(claim.rows, cells)
        checkpoint(k, "put", claim.rows)
        client.ack(claim)
        events.send(("acked", job.job_id, job.consumer, claim.rows))
        checkpoint(k, "acked", claim.rows)
    events.send(("done", job.job_id))
    client.close()


def worker_main(jobs, events: Connection) -> None:
    """Process entry point: run jobs from ``jobs`` until a None; report events, errors included, on ``events``.

    Each worker has its own event pipe: a SIGKILL can then never leave a lock shared with
    other workers held (as a shared ``multiprocessing.Queue``'s write lock could be).
    """
    while (job := jobs.get()) is not None:
        try:
            run_job(job, events)
        except BaseException:  # noqa: BLE001 - handed to the test process
            events.send(("error", job.job_id, traceback.format_exc()))


def start_shards(n: int, token: str, lease_s: float) -> list[subprocess.Popen]:
    """``n`` shard processes (``python -m dockrl.dock.flight.shards``), started together; read ``.location`` after."""
    env = {**os.environ, "DOCKRL_TEST_SHARD_TOKEN": token}
    cmd = [sys.executable, "-m", "dockrl.dock.flight.shards", "--port", "0", "--token-env", "DOCKRL_TEST_SHARD_TOKEN",
           "--lease-s", str(lease_s)]
    return [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(n)]
