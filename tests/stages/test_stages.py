"""The stage table (``dockrl/stages/table.py``): its rows against the dock schema and the config, and a
toy stage added by one row and its loop that runs in a real in-process run."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from types import SimpleNamespace

import pyarrow as pa
import pytest

from dockrl import driver
from dockrl.config import load_config
from dockrl.dock import GRPO_SCHEMA, Dock
from dockrl.dock.schema import Column
from dockrl.process.env import SINGLE_MACHINE_ENV
from dockrl.stages import inprocess
from dockrl.stages import table as stages
from dockrl.stages.inprocess import InProcessContext, InProcessParts
from dockrl.stages.loop import Report
from dockrl.stages.table import STAGES, Stage, checkpoint_reports, iteration_reports, load, process_rows, stage, stage_processes


def test_rows_name_real_columns_and_loops():
    assert len({row.name for row in STAGES}) == len(STAGES)
    columns = {c.name for c in GRPO_SCHEMA.columns}
    for row in STAGES:
        assert set(row.claims) <= columns and set(row.writes + row.sampling_writes) <= columns, row.name
        for path in (row.process, row.inprocess):
            assert not path or callable(load(path)), (row.name, path)
    # the rights of the stages' tokens (dockrl.launch.distributed.stage_rights): every consumer is a row's, every
    # column a stage produces is written by exactly one row, the one of its producer
    assert sorted(c for row in STAGES for c in row.consumers) == sorted(GRPO_SCHEMA.consumers)
    for column in GRPO_SCHEMA.columns:
        writers = [row for row in STAGES if column.name in row.writes]
        if column.producer == "driver":
            assert writers == [], column.name
        else:
            assert len(writers) == 1 and column.producer.startswith(writers[0].consumers[0]), (column.name, writers)
    assert [row.name for row in STAGES if row.sampling_writes] == ["advantage"]
    assert [(r.name, r.inside) for r in STAGES if r.kind == "in-process"] == [("advantage", "reward")]
    assert [r.name for r in process_rows("hybrid")] == ["hybrid", "rollout", "actor"]
    assert [r.name for r in process_rows("reward")] == ["reward", "advantage"]
    with pytest.raises(KeyError, match="'length'.*expected one of"):
        stage("length")


@pytest.mark.parametrize("hybrid", [False, True])
def test_processes_and_reports_follow_the_config(hybrid):
    cfg = load_config(None, ["critic.enable=true", "algorithm.adv_estimator=gae", "algorithm.kl_loss_coef=0.01"])
    # the table reads trainer.hybrid only of the trainer; a valid hybrid config needs the megatron engine and vLLM
    cfg = SimpleNamespace(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)} | {"trainer": SimpleNamespace(hybrid=hybrid)})
    first = ["hybrid"] if hybrid else ["rollout"]
    assert stage_processes(cfg) == [*first, "reward", "reference", "critic", *([] if hybrid else ["actor"])]
    sync = [] if hybrid else [Report.WEIGHT_SYNC]
    assert iteration_reports(cfg) == [Report.ROLLOUT, Report.REWARD, Report.REFERENCE, Report.CRITIC, Report.ACTOR, *sync]
    assert checkpoint_reports(cfg) == [Report.CHECKPOINT, Report.CRITIC_CHECKPOINT]


# The toy stage: everything a new stage needs beyond this test is one row and its loop.
class LengthWorker:
    """Writes each response's length into ``response_length``; reports their mean."""

    def run_iteration(self, dock: Dock) -> dict[str, float]:
        start, lengths = time.perf_counter(), []
        while claim := dock.claim("length", ["response_ids"], 8):
            batch = [len(ids) for ids in claim.batch.column("response_ids").to_pylist()]
            dock.put(claim.rows, {"response_length": batch}, ack=claim)
            lengths += batch
        return {"length/mean": sum(lengths) / len(lengths), "timing_s/length": time.perf_counter() - start}


def length_parts(ctx: InProcessContext) -> InProcessParts:
    return InProcessParts(sample=[LengthWorker()])


LENGTH = Stage(name="length", kind="process", claims=("response_ids",), writes=("response_length",),
               reports=("length",), inprocess=f"{__name__}:length_parts")


@pytest.mark.slow  # one short run of the tiny model
def test_a_toy_stage_is_one_row_and_its_loop(tiny_model_dir, tmp_path, monkeypatch):
    # the schema is the dock's versioned contract: the test-only column lives here, not in dockrl/dock/schema.py
    schema = dataclasses.replace(GRPO_SCHEMA, columns=(*GRPO_SCHEMA.columns, Column(
        name="response_length", type=pa.int32(), producer="length", doc="tokens of the response")),
        consumers=(*GRPO_SCHEMA.consumers, "length"))
    monkeypatch.setattr(inprocess, "GRPO_SCHEMA", schema)
    after_reward = [row.name for row in STAGES].index("reward") + 1
    monkeypatch.setattr(stages, "STAGES", (*STAGES[:after_reward], LENGTH, *STAGES[after_reward:]))
    cfg = load_config(None, [
        f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={tmp_path / 'cache'}",
        "run.progress=false", "trainer.iterations=2", "trainer.global_batch=2", "trainer.mini_batch=2", "trainer.micro_batch=4",
        "rollout.n=4", "rollout.max_response_length=8", "rollout.dtype=float32", "trainer.autocast_bf16=false",
        "trainer.eval_before=false", "trainer.eval_after=false", "data.generate_train=8", "data.generate_test=4", "data.eval_size=4",
    ])
    assert "length" in stage_processes(cfg) and iteration_reports(cfg)[:3] == [Report.ROLLOUT, Report.REWARD, "length"]
    for name in SINGLE_MACHINE_ENV:  # as a machine with a network might have them: the run's process groups keep to this machine
        monkeypatch.setenv(name, "eth0" if name.endswith("IFNAME") else "10.1.2.3")
    driver.train(cfg)
    assert {name: os.environ[name] for name in SINGLE_MACHINE_ENV} == SINGLE_MACHINE_ENV
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    for r in rows:  # the stage read every response the rollout wrote
        assert r["length/mean"] == pytest.approx(r["rollout/response_length_mean"]) and r["timing_s/length"] > 0
