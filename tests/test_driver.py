"""The driver's iteration loop over fake stages, for both kinds of stage runner.

``inprocess``: a fake of ``InProcessStages`` (the stages' metrics are return values);
``processes``: the real ``ProcessStages`` over an in-process dock, with fake stages in threads
that serve the iterations and report through the dock as the stage processes do. Both fakes
claim the prompt rows the driver put, so the metrics show which prompts each iteration saw.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest

from dockrl.checkpoint.resume import checkpoint_dir, checkpoint_due, final_dir, prepare_checkpoint
from dockrl.checkpoint.resume_point import find_resume, prompts_fingerprint
from dockrl.config import load_config
from dockrl.dock import GRPO_SCHEMA, open_dock
from dockrl.driver import drive
from dockrl.launch.distributed import ProcessStages
from dockrl.run.data import Prompt
from dockrl.run.setup import RunPlan, prompt_batches
from dockrl.stages.loop import Report, final_report, serve_iterations

PROMPTS = [Prompt(index=i, question=f"q{i}", ground_truth=str(i), prompt_ids=[1, 2 + i]) for i in range(7)]
TESTS = PROMPTS[:2]


def fake_config(run_dir: Path, *extra: str):
    return load_config(None, [
        f"run.output_dir={run_dir}", "run.progress=false", "trainer.iterations=5", "trainer.save_every=2",
        "trainer.global_batch=2", "trainer.mini_batch=2", "trainer.micro_batch=2", "rollout.n=2", "algorithm.kl_loss_coef=0",
        "dock.timeout_s=10", *extra,
    ])


def fake_plan(cfg) -> RunPlan:
    """``plan_run`` without a model: the prompts above, the resume point ``run.resume`` names."""
    fingerprint = prompts_fingerprint([p.prompt_ids for p in PROMPTS])
    point = find_resume(cfg, fingerprint)
    if point:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=str(point.checkpoint)))
    return RunPlan(cfg=cfg, model_path=Path("fake-model"), train_prompts=PROMPTS, test_prompts=TESTS, fingerprint=fingerprint,
                   resume=point)


def claim_prompts(dock, iteration: int) -> dict[str, float]:
    """The fake rollout: claims every row; its metrics say which iteration and prompts it saw."""
    claim = dock.claim("rollout", ["prompt_ids", "ground_truth"], dock.num_rows, whole_groups=True)
    truths = claim.batch.column("ground_truth").to_pylist()
    dock.ack(claim)
    return {"rollout/response_length_mean": 3.0, "fake/iteration": float(iteration), "fake/rows": float(len(truths)),
            "fake/truths": float("".join(truths[:: dock.group_size]))}


def write_weights(folder: Path, iteration: int) -> None:
    """The fake actor's checkpoint: what a real one writes before the driver's state."""
    (prepare_checkpoint(folder) / "fake_weights.txt").write_text(str(iteration))


def evaluation(tag: str) -> dict[str, float]:
    return {f"eval/accuracy_{tag}": 0.25, f"eval/format_rate_{tag}": 1.0}


class FakeInProcessStages:
    """Stands in for ``InProcessStages``: every stage a function call in this process."""

    def __init__(self, plan: RunPlan) -> None:
        self.cfg, self.run = plan.cfg, "fake"
        self.dock = open_dock(plan.cfg.dock, GRPO_SCHEMA, run=self.run)

    def evaluate(self, tag):
        return evaluation(tag)

    def run_iteration(self, iteration):
        return claim_prompts(self.dock, iteration) | {"fake/reward": 1.0, "fake/actor": 1.0}

    def save_checkpoint(self, iteration, folder):
        write_weights(folder, iteration)

    def finish(self):
        write_weights(final_dir(self.cfg.run.output_dir), self.cfg.trainer.iterations - 1)

    def close(self):
        self.dock.close()


class FakeBackend:
    """What ``ProcessStages`` asks of a worker backend, for stages that are threads: ``check``
    raises the first error of a stage thread."""

    run_id, logs = "fake-run", "(fake stage threads)"

    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def check(self) -> None:
        if self.errors:
            raise self.errors[0]


def fake_stage_threads(cfg, dock, backend: FakeBackend) -> list[threading.Thread]:
    """The stage processes' protocol with fake work: rollout (evaluations, weight sync), reward, actor (checkpoints)."""
    t, timeout_s = cfg.trainer, cfg.dock.timeout_s

    def rollout():
        if t.eval_before and not cfg.run.resume:
            dock.report(0, Report.EVAL_BEFORE, evaluation("before"))
        serve_iterations(dock, Report.ROLLOUT, lambda it: claim_prompts(dock, it), timeout_s=timeout_s,
                         after_report=lambda it: dock.report(it, Report.WEIGHT_SYNC, {"timing_s/weight_sync": 0.0}))
        if t.eval_after:
            dock.report(t.iterations, Report.EVAL_AFTER, evaluation("after"))
        dock.report(t.iterations, final_report("rollout"), {})

    def reward():
        serve_iterations(dock, Report.REWARD, lambda it: {"fake/reward": 1.0}, timeout_s=timeout_s)
        dock.report(t.iterations, final_report("reward"), {})

    def actor():
        def checkpoint(it: int) -> None:
            if checkpoint_due(t, it):
                write_weights(checkpoint_dir(cfg.run.output_dir, it + 1), it)
                dock.report(it, Report.CHECKPOINT, {})

        serve_iterations(dock, Report.ACTOR, lambda it: {"fake/actor": 1.0}, timeout_s=timeout_s, after_report=checkpoint)
        write_weights(final_dir(cfg.run.output_dir), t.iterations - 1)
        dock.report(t.iterations, final_report("actor"), {})

    def guarded(body):
        def run():
            try:
                body()
            except BaseException as e:  # noqa: BLE001 - the driver's next wait raises it
                backend.errors.append(e)
        return threading.Thread(target=run, daemon=True)

    return [guarded(body) for body in (rollout, reward, actor)]


def fake_process_stages(plan: RunPlan) -> ProcessStages:
    dock, backend = open_dock(plan.cfg.dock, GRPO_SCHEMA, run=FakeBackend.run_id), FakeBackend()
    threads = fake_stage_threads(plan.cfg, dock, backend)
    for thread in threads:
        thread.start()

    def stop():
        dock.finish()
        for thread in threads:
            thread.join(timeout=10)
        assert not any(thread.is_alive() for thread in threads), "a fake stage thread did not end"
        dock.close()

    return ProcessStages(plan.cfg, dock, backend, test_prompts=len(plan.test_prompts), stop=stop)


RUNNERS = {"inprocess": FakeInProcessStages, "processes": fake_process_stages}


def run(kind: str, cfg, on_iteration=None) -> dict[str, float]:
    plan = fake_plan(cfg)
    runner = RUNNERS[kind](plan)
    try:
        return drive(plan, runner, on_iteration=on_iteration)
    finally:
        runner.close()


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def expected_truths(cfg) -> list[float]:
    return [float("".join(p.ground_truth for p in batch)) for batch in prompt_batches(PROMPTS, cfg.trainer)]


@pytest.fixture(params=sorted(RUNNERS))
def kind(request):
    return request.param


def test_iterations_run_in_order_each_with_its_prompts_then_the_summary(kind, tmp_path):
    cfg = fake_config(tmp_path / "run")
    seen: list[int] = []
    summary = run(kind, cfg, on_iteration=lambda it, metrics: seen.append(it))
    lines = metrics_of(tmp_path / "run")
    assert seen == [x["iteration"] for x in lines] == [0, 1, 2, 3, 4]
    assert [x["fake/iteration"] for x in lines] == [0, 1, 2, 3, 4]  # the stages worked on the iteration the driver opened
    assert [x["fake/truths"] for x in lines] == expected_truths(cfg)  # with its batch of prompts
    assert all(x["fake/rows"] == 4 and x["fake/reward"] == x["fake/actor"] == 1.0 for x in lines)  # global_batch × n rows
    assert all(x["timing_s/iteration"] > 0 and "dock/bytes_put" in x for x in lines)
    assert {"eval/accuracy_before", "eval/accuracy_after", "run/seconds"} <= summary.keys()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["eval/accuracy_after"] == 0.25


def test_checkpoints_follow_save_every_and_final_completes_the_run(kind, tmp_path):
    run(kind, fake_config(tmp_path / "run"))  # 5 iterations, save_every=2: after iterations 1 and 3, then final
    folders = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert folders == ["final", "iter_000002", "iter_000004"]
    for name, next_iteration, written_after in (("iter_000002", 2, 1), ("iter_000004", 4, 3), ("final", 5, 4)):
        folder = tmp_path / "run" / "checkpoints" / name
        state = json.loads((folder / "driver_state.json").read_text())
        assert state["next_iteration"] == next_iteration and (folder / "fake_weights.txt").read_text() == str(written_after)
        assert state["open_iteration"] == (None if name == "final" else next_iteration)
        assert state["summary"]["eval/accuracy_before"] == 0.25
        assert (folder / "dock").is_dir() == (name != "final")  # the dock with the next iteration's prompts


def test_a_resumed_run_goes_on_at_its_checkpoint_and_logs_every_iteration_once(kind, tmp_path):
    run(kind, fake_config(tmp_path / "straight"))

    class Cut(Exception):
        pass

    def cut_after_3(it, metrics):
        if it == 3:  # logged, but its checkpoint (iter_000004) never written
            raise Cut

    with pytest.raises(Cut):
        run(kind, fake_config(tmp_path / "cut"), on_iteration=cut_after_3)
    assert [x["iteration"] for x in metrics_of(tmp_path / "cut")] == [0, 1, 2, 3]

    seen: list[int] = []
    summary = run(kind, fake_config(tmp_path / "cut", "run.resume=latest"), on_iteration=lambda it, m: seen.append(it))
    assert seen == [2, 3, 4]  # from iter_000002's next iteration: the restored dock held its prompts
    straight, resumed = metrics_of(tmp_path / "straight"), metrics_of(tmp_path / "cut")
    assert [x["iteration"] for x in resumed] == [0, 1, 2, 3, 4]  # the cut run's 2 and 3 replaced, each index once
    keys = ("iteration", "fake/iteration", "fake/truths", "fake/rows")
    assert [{k: x[k] for k in keys} for x in resumed] == [{k: x[k] for k in keys} for x in straight]
    assert "eval/accuracy_before" in summary  # carried over from the checkpoint, not evaluated again
