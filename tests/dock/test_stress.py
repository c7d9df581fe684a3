"""The dock under load, the short version of ``benchmarks/dock_stress.py``.

16 client processes claim, put and ack through 4 shard processes for 3 iterations while
clients are SIGKILLed (before their put, after it, anywhere) and shard 1 is snapshotted,
killed and restored; then the benchmark's accounting must hold: every row consumed exactly
once per consumer, no cell written twice or lost, dead clients' rows returned, no process
left (by PID). ``account`` itself is checked on ledgers with a duplicated and a lost row.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def dock_stress(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the client processes import it by name too
    import dock_stress

    return dock_stress


def test_accounting_names_a_duplicated_a_lost_and_an_unreturned_row(dock_stress):
    ledger, stats = dock_stress.Ledger(8), dock_stress.Stats()
    for s in dock_stress.STAGES:
        ledger.acks[s][:] = 1
        ledger.puts[s][:] = 1
    assert dock_stress.account(ledger, stats) == {"duplicated": 0, "lost": 0, "returned": 0, "by_dead_put": 0, "errors": 0}
    ledger.acks["reward"][3] = 2  # consumed twice
    ledger.acks["actor"][5] = 0  # never consumed, nobody died holding it
    ledger.acks["rollout"][6], ledger.unput_by_dead["rollout"][6] = 0, 1  # a dead client's row that never came back
    ledger.acks["advantage"][7], ledger.unknown_by_dead["advantage"][7] = 0, 1  # killed anywhere: its put landed
    ledger.unput_by_dead["reference"][2] = 1  # came back: acked once by another client
    stats.errors.append("put: column 'rm_score' is already written for rows [4]")
    acc = dock_stress.account(ledger, stats)
    assert acc == {"duplicated": 2, "lost": 2, "returned": 1, "by_dead_put": 1, "errors": 1}


def test_cells_check_names_the_row_whose_cell_differs(dock_stress):
    cells = dock_stress.Cells(dock_stress.Shape(16, 4, 8, 32))
    rows = np.arange(4, 12)
    good = cells.column("response_ids", 3, rows)
    cells.check("response_ids", 3, rows, good)
    with pytest.raises(ValueError, match=r"rows \[7, 6\] differs"):
        cells.check("response_ids", 3, rows[[0, 1, 3, 2, 4, 5, 6, 7]], good)  # the cells of rows 6 and 7 swapped
    with pytest.raises(ValueError, match="'advantages' of rows"):
        cells.check("advantages", 3, rows, cells.column("advantages", 2, rows))


@pytest.mark.slow
def test_sixteen_clients_killed_and_a_restored_shard_lose_and_repeat_nothing(dock_stress):
    args = dock_stress.parse_args([
        "--clients", "16", "--shards", "4", "--iterations", "3", "--rows", "1024", "--group-size", "4",
        "--prompt-tokens", "32", "--tokens", "128", "--max-claim", "48", "--kills", "4", "--snapshot-iteration", "1",
        "--lease-s", "10", "--release-share", "0.75", "--claim-wait-s", "3", "--timeout-s", "120",
    ])
    out = dock_stress.Stress(args).run()
    text, ok = dock_stress.report(args, out, os.getloadavg())
    assert ok, f"{text}\nthe shards' log: {out['shard_log']}"
    os.unlink(out["shard_log"])
    assert out["left"] == [], text
    stats = [st for _, st in out["results"]]
    assert sum(sum(st.faults.values()) for st in stats) >= 6, text  # most of the 12 scheduled kills land
    assert [st.snapshot != "-" for st in stats] == [False, True, False], text
    totals = [dock_stress.account(ledger, st) for ledger, st in out["results"]]
    assert sum(t["returned"] + t["by_dead_put"] for t in totals) > 0, text  # dead clients held rows
