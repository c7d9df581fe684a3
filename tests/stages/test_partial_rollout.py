"""Partial rollout (``rollout.partial_tokens``): a response cut at the per-pass budget is kept in the
dock as carry-over and finished in the rollout's next pass with the weights synced since; the
other stages see every row once, complete; a dock snapshot between the passes resumes exactly."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from dockrl.config import RolloutConfig
from dockrl.dock import GRPO_SCHEMA, DockError
from dockrl.dock.client.dock_client import DockClient
from dockrl.dock.shard.transport import LocalTransport, local_shards
from dockrl.engines.hf.rollout import HFRolloutEngine
from dockrl.engines.rollout_engine import Sample
from dockrl.stages.rollout import RolloutWorker

GROUP, GROUPS, BUDGET, MAX_LEN = 2, 4, 3, 8
ROWS = GROUP * GROUPS
EOS = 99


def target_length(prompt: list[int]) -> int:
    """The response length the fake policy ends at (EOS included): 1 … 8 tokens over the rows."""
    iteration, row = prompt
    return 1 + (3 * row + iteration) % MAX_LEN


class FakePolicyEngine:
    """Fake rollout engine: the response to prompt ``[iteration, row]`` is ``target_length`` tokens,
    ``0, 1, …`` then EOS, continued where the context (prompt + tokens so far) left off; each
    token's log-prob is ``-version``, the weights it was generated with (``load_weights`` bumps it)."""

    def __init__(self) -> None:
        self.version, self.calls = 0, []

    def generate(self, prompts, *, max_new_tokens, temperature=1.0, top_p=1.0, greedy=False, batch_size=64):
        self.calls.append(max_new_tokens)
        out = []
        for context in prompts:
            prompt, so_far = context[:2], len(context) - 2
            left = target_length(prompt) - so_far
            tokens = [*range(so_far, so_far + left - 1), EOS][:max_new_tokens]
            out.append(Sample(tokens, [-float(self.version)] * len(tokens), truncated=EOS not in tokens))
        return out

    def load_weights(self, named_tensors) -> int:
        self.version += 1
        return 0


@pytest.fixture
def shards() -> Iterator[list]:
    services = local_shards(2, GRPO_SCHEMA, timeout_s=5.0)
    yield [LocalTransport(s) for s in services]
    for s in services:
        s.close()


def connect(shards: list, **kw) -> DockClient:
    return DockClient(shards, GRPO_SCHEMA, timeout_s=5.0, rpc_timeout_s=10.0, **kw)


def open_filled(driver: DockClient, iteration: int) -> None:
    driver.open_iteration(iteration, ROWS, GROUP)
    driver.put(range(ROWS), {"prompt_ids": [[iteration, r] for r in range(ROWS)]}, iteration=iteration)


def worker(engine, max_age: int = 2) -> RolloutWorker:
    return RolloutWorker(engine, RolloutConfig(n=GROUP, max_response_length=MAX_LEN, partial_tokens=BUDGET, partial_max_age=max_age,
                                               batch_size=4))


def rollout_pass(stage: DockClient, rollout: RolloutWorker, iteration: int, *, last: bool = False) -> dict[str, float]:
    assert stage.wait_iteration(iteration - 1) == iteration
    return rollout.run_pass(stage, iteration, last=last)


def train_rows(client: DockClient, iteration: int) -> dict[int, tuple[list[int], list[float]]]:
    """What a downstream stage (the actor) claims of ``iteration``: every row's response and log-probs, by row."""
    assert client.wait_iteration(iteration - 1) == iteration
    got: dict[int, tuple[list[int], list[float]]] = {}
    while claim := client.claim("actor", ["response_ids", "rollout_log_prob", "weight_version"], 3, timeout_s=5.0):
        for row, ids, lp, versions in zip(claim.rows, *(claim.batch.column(k).to_pylist() for k in range(3))):
            assert row not in got, f"row {row} of iteration {iteration} handed out twice"
            # the fake's log-prob of a token is -(the weights' version): each segment's weight_version is its pass's
            assert versions == [-x for x in lp], f"row {row} of iteration {iteration}: weight versions {versions}, log-probs {lp}"
            got[row] = (ids, lp)
        client.ack(claim)
    return got


def expected(iteration: int, row: int, first: int, budget: int = BUDGET, passes: int = 2) -> tuple[list[int], list[float]]:
    """The complete response of a row and its log-probs: ``budget`` tokens a pass, each pass's under
    its weights (``first``, ``first + 1``, …), all the rest in the row's ``passes``-th pass."""
    n = target_length([iteration, row])
    return [*range(n - 1), EOS], [-float(first + min(t // budget, passes - 1)) for t in range(n)]


def test_cut_responses_finish_in_the_next_pass_with_its_weights_and_every_row_is_trained_once(shards):
    driver, stage, actor = connect(shards, max_inflight=2), connect(shards), connect(shards)
    engine = FakePolicyEngine()
    rollout = worker(engine)
    try:
        open_filled(driver, 0)
        open_filled(driver, 1)
        first = rollout_pass(stage, rollout, 0)
        cut0 = [r for r in range(ROWS) if target_length([0, r]) > BUDGET]
        assert rollout.pending == {0: cut0} and first["rollout/partial_cut"] == len(cut0) > 0
        assert (first["rollout/responses"], first["rollout/partial_continued"], first["rollout/response_passes_max"]) == \
            (ROWS - len(cut0), 0, 1)
        with pytest.raises(DockError, match="not yet written"):  # a cut row has no response for any other stage yet
            driver.get(["response_ids"], cut0[:1], iteration=0)
        assert engine.calls == [BUDGET] * len(engine.calls)
        sampled = sum(min(target_length([0, r]), BUDGET) for r in range(ROWS))  # cut ones included
        assert first["rollout/tokens_generated"] == sampled
        assert first["perf/rollout_tokens_per_s"] == pytest.approx(sampled / first["timing_s/rollout"])

        engine.load_weights([])  # the update synced between the passes
        second = rollout_pass(stage, rollout, 1)
        assert (second["rollout/partial_continued"], second["rollout/response_passes_max"]) == (len(cut0), 2)
        assert MAX_LEN - BUDGET in engine.calls  # continued with the rest of max_response_length
        assert train_rows(actor, 0) == {r: expected(0, r, 0) for r in range(ROWS)}  # each row once, complete
        driver.close_iteration(0)

        open_filled(driver, 2)
        engine.load_weights([])
        third = rollout_pass(stage, rollout, 2, last=True)  # the last pass has no budget: nothing left over
        assert third["rollout/partial_cut"] == 0 and rollout.pending == {}
        assert train_rows(actor, 1) == {r: expected(1, r, 1) for r in range(ROWS)}
        assert train_rows(actor, 2) == {r: expected(2, r, 2, passes=1) for r in range(ROWS)}
        # the staleness bound: a response spans at most two passes, so its tokens come from at most two
        # consecutive weights (its iteration's pass's and the next one's), as `expected` spells out
    finally:
        driver.close_iteration()
        for c in (stage, actor, driver):
            c.close()


def test_a_snapshot_between_the_passes_resumes_the_cut_responses_exactly(shards, tmp_path):
    driver, stage = connect(shards, max_inflight=2), connect(shards)
    engine = FakePolicyEngine()
    rollout = worker(engine)
    try:
        open_filled(driver, 0)
        open_filled(driver, 1)
        rollout_pass(stage, rollout, 0)
        driver.snapshot(str(tmp_path / "snap"))
        driver.close_iteration()
        driver.restore(str(tmp_path / "snap"))  # what a resumed run's driver does before any stage starts
        for it in (0, 1):
            driver.announce(it)
        resumed = worker(engine)
        resumed.pending = {0: None}  # a resumed rollout reads the cut rows from the dock
        engine.load_weights([])
        metrics = rollout_pass(stage, resumed, 1)
        assert metrics["rollout/partial_continued"] == sum(target_length([0, r]) > BUDGET for r in range(ROWS))
        cells = driver.get(["response_ids", "rollout_log_prob"], range(ROWS), iteration=0)
        assert list(zip(*(cells.column(k).to_pylist() for k in range(2)))) == [expected(0, r, 0) for r in range(ROWS)]
    finally:
        driver.close_iteration()
        stage.close()
        driver.close()


def test_a_response_spans_at_most_max_age_passes_each_under_its_weights(shards):
    driver, stage, actor = connect(shards, max_inflight=3), connect(shards), connect(shards)
    engine = FakePolicyEngine()
    rollout = worker(engine, max_age=3)
    try:
        for it in (0, 1, 2):
            open_filled(driver, it)
        passes = []
        for it in (0, 1, 2):
            passes.append(rollout_pass(stage, rollout, it))
            engine.load_weights([])
        assert [p["rollout/response_passes_max"] for p in passes] == [1, 2, 3]
        longest = [r for r in range(ROWS) if target_length([0, r]) > 2 * BUDGET]  # cut twice: continued in its third pass
        assert longest and passes[1]["rollout/partial_held"] >= len(longest)
        assert train_rows(actor, 0) == {r: expected(0, r, 0, passes=3) for r in range(ROWS)}
        driver.close_iteration(0)
        open_filled(driver, 3)
        last = rollout_pass(stage, rollout, 3, last=True)
        assert last["rollout/partial_held"] == 0 and rollout.pending == {}
        assert train_rows(actor, 1) == {r: expected(1, r, 1, passes=3) for r in range(ROWS)}
        assert train_rows(actor, 2) == {r: expected(2, r, 2, passes=2) for r in range(ROWS)}  # the last pass ends it
        assert train_rows(actor, 3) == {r: expected(3, r, 3, passes=1) for r in range(ROWS)}
    finally:
        driver.close_iteration()
        for c in (stage, actor, driver):
            c.close()


def test_only_a_rewritable_column_takes_a_second_put_and_a_snapshot_holds_the_last(shards, tmp_path):
    driver = connect(shards)
    try:
        open_filled(driver, 0)
        driver.put([1, 2], {"partial_ids": [[1], [2]], "rollout_cut": [True, True]})
        driver.put([2], {"partial_ids": [[2, 3]], "rollout_cut": [False]})
        with pytest.raises(DockError, match="already written"):
            driver.put([2], {"prompt_ids": [[9]]})
        driver.snapshot(str(tmp_path / "snap"))
        driver.close_iteration()
        driver.restore(str(tmp_path / "snap"))
        cells = driver.get(["partial_ids", "rollout_cut"], [1, 2], iteration=0)
        assert cells.to_pylist() == [{"partial_ids": [1], "rollout_cut": True}, {"partial_ids": [2, 3], "rollout_cut": False}]
        with pytest.raises(DockError, match=r"claims on rewritable columns \['partial_ids'\]"):  # a rewrite would not reach it
            driver.claim("actor", ["prompt_ids", "partial_ids"], 2, timeout_s=1.0)
    finally:
        driver.close_iteration()
        driver.close()


def test_a_run_resumed_after_its_last_pass_reads_no_cut_rows_there(shards):
    """The run's last pass has no budget; a checkpoint that holds it open is resumed with more
    iterations: the resumed rollout reads ``rollout_cut`` of that iteration (every row false) and
    goes on, instead of failing on a cell never written."""
    driver, stage = connect(shards, max_inflight=2), connect(shards)
    engine = FakePolicyEngine()
    try:
        open_filled(driver, 0)
        open_filled(driver, 1)
        rollout_pass(stage, worker(engine), 0, last=True)  # the old run's last pass
        resumed = worker(engine)
        resumed.pending = {0: None}  # what run_rollout sets for the open iterations it generated
        metrics = rollout_pass(stage, resumed, 1)
        assert metrics["rollout/partial_continued"] == 0
        assert driver.get(["rollout_cut"], range(ROWS), iteration=0).column(0).to_pylist() == [False] * ROWS
    finally:
        driver.close_iteration()
        driver.close_iteration()
        stage.close()
        driver.close()


def test_continuing_a_cut_generation_equals_generating_it_in_one_pass(tiny_model_dir):
    engine = HFRolloutEngine(tiny_model_dir, dtype="float32")
    prompts = [[5, 17, 23, 42], [7, 11]]
    whole = engine.generate(prompts, max_new_tokens=9, greedy=True)
    cut = engine.generate(prompts, max_new_tokens=4, greedy=True)
    rest = engine.generate([p + c.response_ids for p, c in zip(prompts, cut)], max_new_tokens=5, greedy=True)
    for w, c, r in zip(whole, cut, rest):
        assert c.truncated and len(c.response_ids) == 4, "the tiny model ended a response within the budget"
        assert c.response_ids + r.response_ids == w.response_ids
        torch.testing.assert_close(torch.tensor(c.log_probs + r.log_probs), torch.tensor(w.log_probs), rtol=1e-4, atol=1e-4)
