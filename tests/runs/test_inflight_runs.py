"""Iterations in flight (``dock.max_inflight=2``, distributed): the rollout of iteration k+1 overlaps
the update of k with bounded staleness, every row is trained once, and a checkpoint taken while two
iterations are open resumes to the uninterrupted result."""

from __future__ import annotations

import json

import pytest
import torch
from test_distributed import workers_path  # noqa: F401 - fixture: fake scorers importable, no process left behind
from test_distributed_resume import ROWS_PER_ITERATION, read_rows, run_config, same_rows
from transformers import AutoModelForCausalLM

from dockrl import driver
from dockrl.launch.backend import WorkerFailed
from dockrl.checkpoint.resume import checkpoint_dir
from dockrl.stages.rollout_process import sync_target

ITERATIONS = 4


def inflight_config(tiny_model_dir, tmp_path, name: str, *extra: str):
    return run_config(tiny_model_dir, tmp_path, name, "dock.max_inflight=2", f"trainer.iterations={ITERATIONS}", *extra)


def optimizer_steps(folder) -> set[float]:
    return {float(v["step"]) for v in torch.load(folder / "optimizer.pt", weights_only=True)["state"].values()}


def test_the_rollout_takes_update_k_after_generating_the_iterations_in_flight():
    assert [sync_target(k, 1, 4) for k in range(4)] == [0, 1, 2, 3]  # on-policy: each update right after its rollout
    assert [sync_target(k, 2, 4) for k in range(4)] == [-1, 0, 1, 3]  # k generated with update k-2; all before the end
    assert [sync_target(k, 3, 5) for k in range(5)] == [-2, -1, 0, 1, 4]


@pytest.mark.slow  # three distributed runs of the tiny model, four iterations each: ~2-4 min on one busy core
def test_two_iterations_in_flight_bound_staleness_train_every_row_once_and_resume_mid_overlap(
    tiny_model_dir, tmp_path, workers_path, monkeypatch,  # noqa: F811 - the fixture
):
    driver.train(inflight_config(tiny_model_dir, tmp_path, "straight", "algorithm.scorer=fake_scorers:FakeHashScorer"))
    rows = read_rows(tmp_path / "straight")
    assert [x["iteration"] for x in rows] == list(range(ITERATIONS))
    for k, x in enumerate(rows):
        # staleness: iteration k was generated with the weights of update k-2 (-1: the initial ones), never newer
        assert (x["rollout/policy_version"], x["rollout/staleness"]) == (max(k - 2, -1), 0 if k == 0 else 1), k
        # per token (the dock's weight_version): the same lag, seen by the actor that trains on the tokens
        assert (x["actor/rollout_staleness_mean"], x["actor/rollout_staleness_max"]) == ((0.0, 0.0) if k == 0 else (1.0, 1.0)), k
        # exactly once: the actor trained every row of every iteration, one whole global batch each
        assert x["actor/sequences"] == ROWS_PER_ITERATION, k
    # the weights the rollout sampled with are not the actor's from iteration 1 on (the log-probs of the same tokens
    # differ), and are before it: iteration 0 samples and trains from the initial weights alike
    diffs = [x["actor/rollout_log_prob_diff_max"] for x in rows]
    assert diffs[0] < 1e-4 and all(d > 1e-3 for d in diffs[1:]), diffs
    straight_final = tmp_path / "straight" / "checkpoints" / "final"
    assert optimizer_steps(straight_final) == {2.0 * ITERATIONS}  # two mini-batches per iteration, none repeated or lost

    # the reward process kills itself as it starts scoring iteration 2: the checkpoint after iteration 1 holds
    # iterations 2 (generated with update 0's weights, untouched by the other stages) and 3 (its prompts) open
    monkeypatch.setenv("FAKE_KILL_AFTER_ROWS", str(2 * ROWS_PER_ITERATION))
    with pytest.raises(WorkerFailed) as err:
        driver.train(inflight_config(tiny_model_dir, tmp_path, "cut", "algorithm.scorer=fake_scorers:FakeKillingScorer"))
    assert err.value.member == "reward-0"
    cut = tmp_path / "cut"
    assert [x["iteration"] for x in read_rows(cut)] == [0, 1]
    state = json.loads((checkpoint_dir(cut, 2) / "driver_state.json").read_text())
    assert (state["next_iteration"], state["open_iterations"], state["generated_through"]) == (2, [2, 3], 2)
    assert list(state["reports"]) == ["2"] and "rollout/policy_version" in state["reports"]["2"]["rollout"]
    dock_meta = json.loads((checkpoint_dir(cut, 2) / "dock" / "meta.json").read_text())
    assert (dock_meta["layout"]["iteration"], [m["iteration"] for m in dock_meta["more"]]) == (2, [3])

    driver.train(inflight_config(tiny_model_dir, tmp_path, "cut", "algorithm.scorer=fake_scorers:FakeHashScorer", "run.resume=latest"))
    resumed_rows = read_rows(cut)
    assert [x["iteration"] for x in resumed_rows] == list(range(ITERATIONS))
    same_rows(resumed_rows, rows)
    resumed = AutoModelForCausalLM.from_pretrained(cut / "checkpoints" / "final").state_dict()
    straight = AutoModelForCausalLM.from_pretrained(straight_final).state_dict()
    for name, p in straight.items():
        torch.testing.assert_close(resumed[name], p, rtol=1e-5, atol=1e-6, msg=name)
    assert optimizer_steps(cut / "checkpoints" / "final") == {2.0 * ITERATIONS}


@pytest.mark.slow  # three distributed runs of the tiny model, four iterations each: ~2-4 min on one busy core
def test_partial_rollout_finishes_cut_responses_in_the_next_pass_once_and_resumes_mid_overlap(
    tiny_model_dir, tmp_path, workers_path, monkeypatch,  # noqa: F811 - the fixture
):
    partial = ("rollout.partial_tokens=5",)  # of rollout.max_response_length=12: the tiny random model rarely ends sooner
    driver.train(inflight_config(tiny_model_dir, tmp_path, "straight", "algorithm.scorer=fake_scorers:FakeHashScorer", *partial))
    rows = read_rows(tmp_path / "straight")
    assert [x["iteration"] for x in rows] == list(range(ITERATIONS))
    for k, x in enumerate(rows):
        last = k == ITERATIONS - 1
        # the pass for iteration k cuts its responses (but the last pass, which has no budget) and finishes those cut in
        # the pass before, with the weights synced since: none spans more than two passes
        assert x["rollout/partial_cut"] > 0 or last, k
        assert x["rollout/partial_continued"] == (rows[k - 1]["rollout/partial_cut"] if k else 0), k
        assert x["rollout/response_passes_max"] == (2 if x["rollout/partial_continued"] else 1)  # rollout.partial_max_age=2
        assert x["rollout/responses"] == ROWS_PER_ITERATION - x["rollout/partial_cut"] + x["rollout/partial_continued"], k
        # staleness: the pass for k samples with update k-2 as before; a continued response's first segment is one
        # update older (k-3), and iteration k-1, which it belongs to, trains with update k-1: at most 2 behind
        assert x["rollout/policy_version"] == max(k - 2, -1), k
        assert x["rollout/oldest_policy_version"] == (max(k - 3, -1) if x["rollout/partial_continued"] else x["rollout/policy_version"])
        assert x["actor/sequences"] == ROWS_PER_ITERATION, k  # exactly once: every row, complete, one global batch
        # per token (the dock's weight_version), seen by the actor of update k: the tokens of the pass for k are one update
        # behind (k >= 1), those its cut responses got in the next pass none, so a row's segments differ
        assert x["actor/rollout_staleness_max"] == (0.0 if k == 0 else 1.0), k
        if k and x["rollout/partial_cut"]:
            assert 0.0 < x["actor/rollout_staleness_mean"] < 1.0, k
    straight_final = tmp_path / "straight" / "checkpoints" / "final"
    assert optimizer_steps(straight_final) == {2.0 * ITERATIONS}

    # killed as the reward starts iteration 2: the checkpoint after 1 holds iteration 2 generated with its cut responses'
    # carry-over in the dock (continued only in the pass for 3) and 3 with its prompts
    monkeypatch.setenv("FAKE_KILL_AFTER_ROWS", str(2 * ROWS_PER_ITERATION))
    with pytest.raises(WorkerFailed) as err:
        driver.train(inflight_config(tiny_model_dir, tmp_path, "cut", "algorithm.scorer=fake_scorers:FakeKillingScorer", *partial))
    assert err.value.member == "reward-0"
    cut = tmp_path / "cut"
    state = json.loads((checkpoint_dir(cut, 2) / "driver_state.json").read_text())
    assert (state["open_iterations"], state["generated_through"], state["partial_tokens"]) == ([2, 3], 2, 5)
    assert state["reports"]["2"]["rollout"]["rollout/partial_cut"] == rows[2]["rollout/partial_cut"] > 0

    driver.train(inflight_config(tiny_model_dir, tmp_path, "cut", "algorithm.scorer=fake_scorers:FakeHashScorer",
                                 "run.resume=latest", *partial))
    same_rows(read_rows(cut), rows)
    resumed = AutoModelForCausalLM.from_pretrained(cut / "checkpoints" / "final").state_dict()
    straight = AutoModelForCausalLM.from_pretrained(straight_final).state_dict()
    for name, p in straight.items():
        torch.testing.assert_close(resumed[name], p, rtol=1e-5, atol=1e-6, msg=name)
    assert optimizer_steps(cut / "checkpoints" / "final") == {2.0 * ITERATIONS}
