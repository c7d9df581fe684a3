"""Dynamic sampling (DAPO §3.2) through the dock: rounds released by the advantage stage, the trained
batch exactly ``trainer.global_batch`` groups, and an end within ``max_num_gen_batches`` rounds.

The rollout, reward and advantage stages are the real workers; only the model (``FakeEngine``: the
response names its prompt and sample), the tokenizer and the scorer are fakes, so which groups are
mixed is known. Two layouts: in-process (one dock; ``SideBySide`` as ``InProcessStages`` runs it),
and as the stage processes of ``dock.mode=distributed`` talk to a Flight shard (a client per stage;
rollout alone, reward and advantage side by side as in ``run_reward``), each stage in a thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from dockrl.config import AlgorithmConfig, DockConfig, FilterGroupsConfig, RolloutConfig
from dockrl.dock import GRPO_SCHEMA, Dock, open_dock
from dockrl.dock.client.dock_client import DockClient
from dockrl.dock.flight.shards import start_local_shards
from dockrl.driver import open_with_prompts
from dockrl.engines.rollout_engine import Sample
from dockrl.run.data import Prompt
from dockrl.stages.advantage import AdvantageWorker
from dockrl.stages.dynamic_sampling import DynamicSamplingExhausted, SideBySide, divisor_at_most
from dockrl.stages.reward import RewardWorker
from dockrl.stages.rollout import RolloutWorker

N = 2  # rollout.n
B = 3  # trainer.global_batch: groups trained per iteration, and per round
WAIT_S = 30.0  # every test ends well within this, or it failed (no pytest-timeout here: threads joined with a limit)


class FakeEngine:
    """Fake rollout engine: the response to prompt ``[g]`` is ``[g, k]`` for its k-th sample."""

    def __init__(self) -> None:
        self.generated: list[int] = []
        self.lock = threading.Lock()

    def generate(self, prompts, *, max_new_tokens, temperature=1.0, top_p=1.0, greedy=False, batch_size=64):
        out, seen = [], {}
        for p in prompts:
            k = seen[p[0]] = seen.get(p[0], -1) + 1
            out.append(Sample(response_ids=[p[0], k], log_probs=[-1.0, -1.0], truncated=False))
        with self.lock:
            self.generated += [p[0] for p in prompts[::N]]
        return out


class FakeTokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [f"{g} {k}" for g, k in ids]


class FakeMixedScorer:
    """Fake: the groups of prompts in ``mixed`` score 1.1 for sample 0 and 0 for the others; every
    other group scores 1.1 throughout (solved: all rewards equal)."""

    def __init__(self, mixed: set[int]) -> None:
        self.mixed = mixed

    def score(self, responses, ground_truths):
        out = []
        for text in responses:
            g, k = map(int, text.split())
            out.append(0.0 if g in self.mixed and k else 1.1)
        return out

    def counters(self):
        return {"timeouts": 0, "errors": 0, "scored": 0}


def prompts(rounds: int) -> list[Prompt]:
    return [Prompt(index=g, question=f"q{g}", ground_truth="1", prompt_ids=[g]) for g in range(rounds * B)]


def stages(mixed: set[int], filter_groups: FilterGroupsConfig):
    engine = FakeEngine()
    rollout = RolloutWorker(engine, RolloutConfig(n=N, batch_size=64), round_groups=B)
    reward = RewardWorker(FakeMixedScorer(mixed), FakeTokenizer(), correct_reward=1.0, round_rows=B * N)
    advantage = AdvantageWorker(AlgorithmConfig(filter_groups=filter_groups))
    return engine, rollout, reward, advantage


def run_in_threads(steps: dict[str, object]) -> dict[str, object]:
    """Each step in a thread; their results (or exceptions) once all ended, failing after WAIT_S."""
    results: dict[str, object] = {}

    def run(name, step):
        try:
            results[name] = step()
        except BaseException as e:  # noqa: BLE001 - checked by the test
            results[name] = e

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in steps.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads), f"stages still running after {WAIT_S} s: an endless loop or a stuck claim"
    return results


@pytest.fixture(params=["inprocess", "flight"])
def docks(request) -> Iterator[dict[str, Dock]]:
    """The docks of the driver and of each stage: one in-process dock, or a Flight client each."""
    if request.param == "inprocess":
        dock = open_dock(DockConfig(timeout_s=WAIT_S), GRPO_SCHEMA, run="test")
        yield dict.fromkeys(["driver", "rollout", "reward", "actor", "reference"], dock)
        dock.close()
        return
    servers, locations = start_local_shards(1, GRPO_SCHEMA, timeout_s=WAIT_S)
    clients = {name: DockClient(locations, GRPO_SCHEMA, timeout_s=WAIT_S, lease_s=5.0)
               for name in ("driver", "rollout", "reward", "actor", "reference")}
    yield clients
    for client in clients.values():
        client.close()
    for server in servers:
        server.close()


def sample(docks, mixed: set[int], filter_groups: FilterGroupsConfig):
    """One iteration: the driver opens R rounds, the stages run, the actor and reference claim."""
    rounds = filter_groups.max_num_gen_batches
    open_with_prompts(docks["driver"], 0, prompts(rounds), N, gate=B)
    engine, rollout, reward, advantage = stages(mixed, filter_groups)
    claims = {"actor": ["advantages", "response_ids"], "reference": ["prompt_ids", "response_ids", "advantages"]}
    results = run_in_threads({
        "rollout": lambda: rollout.run_iteration(docks["rollout"]),
        "reward+advantage": lambda: SideBySide([reward, advantage], timeout_s=WAIT_S).run_iteration(docks["reward"]),
        **{c: (lambda c=c, cols=cols: docks[c].claim(c, cols, B * N, whole_groups=True)) for c, cols in claims.items()},
    })
    return engine, results


def groups_of(claim) -> list[int]:
    return sorted({r // N for r in claim.rows})


def test_refill_trains_exactly_the_batch_and_drops_the_surplus(docks):
    # round 0 = groups 0-2 (1 mixed), round 1 = groups 3-5 (3 mixed: one more than needed), round 2 never sampled
    engine, results = sample(docks, {1, 3, 4, 5, 7}, FilterGroupsConfig(enable=True, max_num_gen_batches=3))
    for name, result in results.items():
        assert not isinstance(result, BaseException), f"{name}: {result!r}"
    assert sorted(engine.generated) == [0, 1, 2, 3, 4, 5]  # two rounds sampled, the third never released
    m = results["reward+advantage"]
    assert m["rollout/gen_batches"] == 2 and m["rollout/kept_groups"] == 4 and m["rollout/filled_groups"] == 0
    assert m["rollout/frac_zero_std_groups"] == pytest.approx(2 / 6)
    assert results["rollout"]["rollout/responses"] == 2 * B * N
    actor, reference = results["actor"], results["reference"]
    assert len(actor) == B * N and groups_of(actor) == [1, 3, 4]  # exactly B groups: the surplus group 5 dropped
    assert groups_of(reference) == [1, 3, 4]
    adv = actor.batch.column("advantages").to_pylist()
    assert all(a != 0 for a in adv)  # every trained group carries signal
    for dock, consumer in ((docks["actor"], "actor"), (docks["reference"], "reference")):
        assert not dock.claim(consumer, ["advantages"], N)  # nothing else is left for them


def test_all_groups_solved_ends_with_an_error_within_the_bound(docks):
    engine, results = sample(docks, set(), FilterGroupsConfig(enable=True, max_num_gen_batches=3))
    error = results["reward+advantage"]
    assert isinstance(error, DynamicSamplingExhausted)
    for field in ("max_num_gen_batches=3", "trainer.global_batch=3", "on_exhausted=fill"):
        assert field in str(error)
    assert sorted(engine.generated) == list(range(3 * B))  # exactly the bound: three rounds, not one more
    assert not isinstance(results["rollout"], BaseException)  # the other stages ended instead of waiting on
    assert len(results["actor"]) == 0 and len(results["reference"]) == 0


def test_all_groups_solved_with_fill_trains_the_configured_size(docks):
    engine, results = sample(docks, {4}, FilterGroupsConfig(enable=True, max_num_gen_batches=2, on_exhausted="fill"))
    for name, result in results.items():
        assert not isinstance(result, BaseException), f"{name}: {result!r}"
    assert sorted(engine.generated) == list(range(2 * B))
    m = results["reward+advantage"]
    assert m["rollout/gen_batches"] == 2 and m["rollout/kept_groups"] == 1 and m["rollout/filled_groups"] == 2
    assert len(results["actor"]) == B * N and groups_of(results["actor"]) == [0, 1, 4]  # mixed 4 + the first filtered


def test_one_round_is_plain_grpo_filtering(docks):
    engine, results = sample(docks, {0, 1, 2}, FilterGroupsConfig(enable=True, max_num_gen_batches=1))
    assert groups_of(results["actor"]) == [0, 1, 2] and results["reward+advantage"]["rollout/gen_batches"] == 1


@pytest.mark.parametrize(("total", "limit", "expected"), [(12, 64, 12), (12, 5, 4), (7, 3, 1), (6, 0, 1), (8, 8, 8)])
def test_divisor_at_most(total, limit, expected):
    assert divisor_at_most(total, limit) == expected


def test_side_by_side_threads_end_on_close():
    class FakeWorker:
        def run_iteration(self, dock):
            return {"fake/x": 1.0}

    together = SideBySide([FakeWorker(), FakeWorker()], timeout_s=5)
    assert together.run_iteration(object()) == {"fake/x": 1.0}  # any dock: the fakes do not touch it
    together.close()
    for thread in together.threads:
        thread.join(5)
    assert not any(t.is_alive() for t in together.threads)


def test_side_by_side_names_the_stage_still_running_at_its_timeout():
    class FakeFastWorker:
        def run_iteration(self, dock):
            return {}

    class FakeStuckWorker:
        def run_iteration(self, dock):
            time.sleep(2)
            return {}

    together = SideBySide([FakeFastWorker(), FakeStuckWorker()], timeout_s=0.2)
    with pytest.raises(TimeoutError, match=r"\['FakeStuckWorker'\] still running 0.2 s"):
        together.run_iteration(object())
    together.close()
