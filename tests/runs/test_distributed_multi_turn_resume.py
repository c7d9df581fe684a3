"""A distributed run of multi-turn trajectories (a user environment in the rollout's process tree),
its reward process killed mid-iteration, resumes exactly: each iteration's metrics once, equal to the
uninterrupted run's, and the kept trajectories' turn columns equal row for row."""

from __future__ import annotations

import json

import pyarrow.dataset as ds
import pytest
from fake_envs import ending_model
from test_distributed import workers_path  # noqa: F401 - fixture: fakes importable, no process left behind
from test_distributed_resume import ROWS_PER_ITERATION, read_rows, run_config, same_rows

from dockrl import driver
from dockrl.launch.backend import WorkerFailed
from dockrl.checkpoint.resume import checkpoint_dir

MULTI_TURN = ("env.name=fake_envs:FakeScriptedToolEnvironment", "rollout.max_turns=3", "rollout.max_total_tokens=96",
              "rollout.max_response_length=16", "run.keep_rollouts=all", "trainer.eval_after=false",
              "trainer.lr=1e-4")  # at run_config's 1e-2 one update unlearns the ending model's EOS: single cut turns after it
TRAJECTORY = ["prompt_ids", "response_ids", "loss_mask", "turn_starts", "turn_ends", "turn_rewards", "tool_calls", "tool_errors",
              "rollout_log_prob", "truncated", "rm_score"]


def without_writer(rows: list[dict]) -> list[dict]:
    """The metrics rows without the kept rollouts' writer's (its waits are the clock's, its counters its process's since
    it started); what it wrote is compared row by row instead."""
    return [{k: v for k, v in r.items() if not k.startswith("rollouts/")} for r in rows]


def trajectories(run) -> dict[int, list[dict]]:
    """The kept rows of each iteration, in a canonical order (the shards' files do not fix one)."""
    table = ds.dataset(run / "rollouts", format="parquet", partitioning="hive").to_table(columns=["iteration", *TRAJECTORY])
    out: dict[int, list[dict]] = {}
    for row in table.to_pylist():
        out.setdefault(row.pop("iteration"), []).append(row)
    return {it: sorted(rows, key=lambda r: json.dumps([r["prompt_ids"], r["response_ids"], r["rm_score"]])) for it, rows in out.items()}


@pytest.mark.slow  # three distributed multi-turn runs of the tiny model: ~2-4 min on 2 busy cores
def test_a_multi_turn_run_killed_mid_iteration_resumes_exactly(tiny_model_dir, tmp_path, workers_path, monkeypatch):  # noqa: F811
    model = ending_model(tiny_model_dir, tmp_path / "ending-model")  # turns that end, so trajectories have several
    driver.train(run_config(model, tmp_path, "straight", "algorithm.scorer=fake_scorers:FakeHashScorer", *MULTI_TURN))
    straight = read_rows(tmp_path / "straight")
    assert all(r["rollout/turns_max"] >= 2 for r in straight), "no trajectory of several turns: nothing multi-turn was resumed"

    # the reward process kills itself as it starts scoring iteration 2: its trajectories are in the dock, unscored
    monkeypatch.setenv("FAKE_KILL_AFTER_ROWS", str(2 * ROWS_PER_ITERATION))
    with pytest.raises(WorkerFailed) as err:
        driver.train(run_config(model, tmp_path, "cut", "algorithm.scorer=fake_scorers:FakeKillingScorer", *MULTI_TURN))
    assert err.value.member == "reward-0"
    cut = tmp_path / "cut"
    assert [x["iteration"] for x in read_rows(cut)] == [0, 1]
    state = json.loads((checkpoint_dir(cut, 2) / "driver_state.json").read_text())
    assert (state["next_iteration"], state["open_iteration"]) == (2, 2)

    driver.train(run_config(model, tmp_path, "cut", "algorithm.scorer=fake_scorers:FakeHashScorer", "run.resume=latest", *MULTI_TURN))
    rows = read_rows(cut)
    assert [x["iteration"] for x in rows] == [0, 1, 2]  # each iteration once
    same_rows(without_writer(rows), without_writer(straight))  # turns, tool calls, rewards, the actor's loss: as uninterrupted
    kept, want = trajectories(cut), trajectories(tmp_path / "straight")
    assert sorted(kept) == [0, 1, 2] and all(len(kept[it]) == ROWS_PER_ITERATION for it in kept)
    for it in kept:
        for got, expected in zip(kept[it], want[it]):
            assert got.keys() == expected.keys()
            for name in TRAJECTORY:
                if name == "rollout_log_prob":
                    assert got[name] == pytest.approx(expected[name], abs=1e-5), (it, name)
                else:
                    assert got[name] == expected[name], (it, name)
            starts, ends, mask = got["turn_starts"], got["turn_ends"], got["loss_mask"]
            assert mask == [int(any(s <= t < e for s, e in zip(starts, ends))) for t in range(len(got["response_ids"]))]
