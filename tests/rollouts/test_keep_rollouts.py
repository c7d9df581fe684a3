"""Kept rollouts (``run.keep_rollouts``, docs/rollouts.md): the shards write each closed iteration's rows as a
hive-partitioned Parquet dataset in the background; ``dockrl rollouts show`` reads it back."""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from dockrl import driver
from dockrl.cli import main
from dockrl.config import ConfigError, load_config
from dockrl.dock.client.dock_client import open_dock
from dockrl.dock.schema import GRPO_SCHEMA
from dockrl.dock.shard.kept_rollouts import META_KEY, SCHEMA_VERSION, KeepSpec, kept, kept_columns
from dockrl.rollouts.keep import read_rollouts
from dockrl.run.metrics import read_metrics

SHORT = ["run.progress=false", "trainer.iterations=2", "trainer.global_batch=2", "trainer.mini_batch=2", "trainer.micro_batch=4",
         "rollout.n=4", "rollout.max_response_length=8", "rollout.dtype=float32", "trainer.autocast_bf16=false",
         "trainer.eval_before=false", "trainer.eval_after=false", "data.generate_train=8", "data.generate_test=4", "data.eval_size=4"]
COLUMNS = [f.name for f in kept_columns(GRPO_SCHEMA)]


def fill(dock, iteration: int, rows: int = 16, n: int = 4, *, responses: int | None = None) -> None:
    """Open ``iteration`` and write prompts, and responses and rewards for the first ``responses`` rows (default all)."""
    dock.open_iteration(iteration, rows, n)
    dock.put(range(rows), {"prompt_ids": [[1, 2, r] for r in range(rows)], "ground_truth": ["4"] * rows}, iteration=iteration)
    m = rows if responses is None else responses
    dock.put(range(m), {"response_ids": [[7] * (r % 5 + 1) for r in range(m)], "truncated": [False] * m,
                        "rollout_log_prob": [[-0.5] * (r % 5 + 1) for r in range(m)]}, iteration=iteration)
    dock.put(range(m // 2), {"rm_score": [float(r) for r in range(m // 2)], "correct": [r % 2 == 0 for r in range(m // 2)]},
             iteration=iteration)


def test_keep_rollouts_values_and_their_errors():
    for value, kept_as in [("off", False), ("all", "all"), ("'0.25'", "0.25"), ("0.5", 0.5), ("true", True)]:
        assert load_config(None, [f"run.keep_rollouts={value}"]).run.keep_rollouts == kept_as
    for value in ["0", "1", "1.5", "-0.1", "some", "nan"]:
        with pytest.raises(ConfigError, match=r"^run.keep_rollouts: got .*; expected 'off', 'all' or a fraction"):
            load_config(None, [f"run.keep_rollouts={value}"])


def test_the_shards_write_their_rows_of_a_closed_iteration_as_parquet(tmp_path):
    cfg = load_config(None, ["dock.shards=2"])
    dock = open_dock(cfg.dock, GRPO_SCHEMA, run="t")
    root = tmp_path / "rollouts"
    try:
        fill(dock, 0, responses=12)  # rows 12..15 never sampled: not kept
        dock.close_iteration(0, keep=KeepSpec(uri=str(root), weight_version=0, meta={"config_sha256": "abc"}))
        fill(dock, 1)
        dock.close_iteration(1, keep=KeepSpec(uri=str(root), weight_version=1))
        counters = dock.flush_rollouts()
    finally:
        dock.close()
    assert counters["rollouts/rows"] == 12 + 16 and counters["rollouts/files"] == 4 and counters["rollouts/errors"] == 0
    assert counters["rollouts/bytes"] == sum(p.stat().st_size for p in root.rglob("*.parquet"))
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == [
        "iteration=0", "iteration=0/shard-0.parquet", "iteration=0/shard-1.parquet", "iteration=1", "iteration=1/shard-0.parquet",
        "iteration=1/shard-1.parquet"]
    dataset = ds.dataset(root, format="parquet", partitioning="hive")  # the iteration partition merges with the column
    assert dataset.schema.names == COLUMNS
    first = dataset.to_table(filter=ds.field("iteration") == 0).sort_by("row").to_pydict()
    assert first["row"] == list(range(12)) and first["shard"] == [0] * 8 + [1] * 4
    assert first["response_length"] == [r % 5 + 1 for r in range(12)] and first["prompt_length"] == [3] * 12
    assert first["rm_score"] == [float(r) for r in range(6)] + [None] * 6  # a cell not written is null
    assert first["advantages"] == [None] * 12 and first["weight_version"] == [0] * 12
    meta = json.loads(pq.read_schema(root / "iteration=0" / "shard-1.parquet").metadata[META_KEY])
    assert meta == {"config_sha256": "abc", "schema_version": SCHEMA_VERSION, "dock_schema_version": GRPO_SCHEMA.version,
                    "iteration": 0, "shard": 1, "fraction": 1.0}


def test_a_fraction_keeps_a_deterministic_sample_of_the_rows(tmp_path):
    rows = np.arange(4000)
    sample = kept(3, rows, 0.25, seed=7)
    assert 0.2 < sample.mean() < 0.3 and np.array_equal(sample, kept(3, rows, 0.25, seed=7))
    assert not np.array_equal(sample, kept(4, rows, 0.25, seed=7)) and not np.array_equal(sample, kept(3, rows, 0.25, seed=8))
    written = []
    for attempt in range(2):  # the same rows in two runs, whatever the shards
        cfg = load_config(None, [f"dock.shards={1 + attempt}"])
        dock = open_dock(cfg.dock, GRPO_SCHEMA, run="t")
        try:
            fill(dock, 0, rows=64)
            dock.close_iteration(0, keep=KeepSpec(uri=str(tmp_path / str(attempt)), fraction=0.5, seed=1))
            dock.flush_rollouts()
        finally:
            dock.close()
        written.append(read_rollouts(tmp_path / str(attempt), 0).column("row").to_pylist())
    assert written[0] == written[1] == np.flatnonzero(kept(0, np.arange(64), 0.5, seed=1)).tolist()
    assert 16 < len(written[0]) < 48


def test_a_write_that_fails_is_counted_and_never_fails_the_close(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    dock = open_dock(load_config().dock, GRPO_SCHEMA, run="t")
    try:
        fill(dock, 0)
        start = time.perf_counter()
        dock.close_iteration(0, keep=KeepSpec(uri=str(blocker / "rollouts")))
        assert time.perf_counter() - start < 5
        counters = dock.flush_rollouts()
        fill(dock, 1)  # the dock goes on
        dock.close_iteration(1)
    finally:
        dock.close()
    assert counters["rollouts/errors"] == 1 and counters["rollouts/rows"] == 0


def check_run(run, iterations: int, rows: int) -> None:
    table = read_rollouts(run / "rollouts")
    assert table.num_rows == iterations * rows  # every row trained: iterations × global_batch × rollout.n
    assert table.schema.names == COLUMNS
    assert table.column("iteration").to_pylist() == [i for i in range(iterations) for _ in range(rows)]
    assert table.column("weight_version").to_pylist() == table.column("iteration").to_pylist()  # on-policy
    assert table.column("advantages").null_count == 0 and table.column("rm_score").null_count == 0
    meta = json.loads((run / "rollouts" / "_meta.json").read_text())
    assert meta["schema_version"] == SCHEMA_VERSION and meta["resumed_from"] is None and len(meta["config_sha256"]) == 64
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rollouts/rows"] == iterations * rows and summary["rollouts/errors"] == 0
    assert summary["rollouts/bytes"] == sum(p.stat().st_size for p in (run / "rollouts").rglob("*.parquet"))


def test_a_run_keeps_every_row_it_trained_and_rollouts_show_prints_them(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"run.output_dir={run}", f"run.cache_dir={tmp_path / 'cache'}",
                             *SHORT, "run.keep_rollouts=all"])
    driver.train(cfg)
    check_run(run, 2, 2 * 4)
    capsys.readouterr()
    assert main(["rollouts", "show", str(run), "--iteration", "1", "--limit", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:6] == ["iteration", "row", "weights", "reward", "correct", "length"]
    assert [line.split()[:3] for line in lines[1:4]] == [["1", str(r), "1"] for r in range(3)]
    assert lines[-1] == "(3 of 8 kept rows of iteration 1)"
    assert main(["rollouts", "show", str(tmp_path), "--iteration", "0"]) == 2  # no kept rollouts there
    capsys.readouterr()
    assert main(["rollouts", "show", str(run), "--iteration", "7"]) == 2  # an iteration the run did not keep
    assert capsys.readouterr().err.strip() == (f"dockrl rollouts show: iteration 7 has no kept rows in {run / 'rollouts'}; "
                                               "the kept iterations are 0, 1")


def test_a_run_given_relative_paths_is_read_and_resumed_from_another_folder(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """``config.yaml`` records the run's paths absolute: ``rollouts show`` and a resume work from any working folder."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copytree(tiny_model_dir, here / "model")
    monkeypatch.chdir(here)
    driver.train(load_config(None, ["model.path=model", "run.output_dir=run", "run.cache_dir=cache", *SHORT, "run.keep_rollouts=all"]))
    recorded = load_config(here / "run" / "config.yaml")
    assert (recorded.model.path, recorded.run.output_dir, recorded.run.cache_dir) == (
        str((here / "model").resolve()), str((here / "run").resolve()), str((here / "cache").resolve()))
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["rollouts", "show", "../here/run", "--iteration", "1"]) == 0, capsys.readouterr().err
    assert main(["train", "--config", "../here/run/config.yaml", "run.resume=latest", "trainer.iterations=3"]) == 0, capsys.readouterr().err
    assert [row["iteration"] for row in read_metrics(here / "run" / "metrics.jsonl")] == [0, 1, 2]
    assert list(elsewhere.iterdir()) == []  # nothing of the run went to the working folder


def test_keep_rollouts_needs_the_payload_in_the_shards(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"^run.keep_rollouts: got 'all'; needs dock.warehouse=memory"):  # a rule of the config
        load_config(None, [f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'run'}", "run.keep_rollouts=all",
                           "dock.warehouse=directory", f"dock.directory={tmp_path / 'store'}"])
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_distributed_run_keeps_its_rows_through_the_flight_shards(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"run.output_dir={run}", f"run.cache_dir={tmp_path / 'cache'}",
                             *SHORT, "trainer.global_batch=4", "dock.mode=distributed", "dock.shards=2", "dock.timeout_s=120",
                             "run.keep_rollouts=all"])
    driver.train(cfg)
    check_run(run, 2, 4 * 4)
    assert sorted(p.name for p in (run / "rollouts" / "iteration=1").iterdir()) == ["shard-0.parquet", "shard-1.parquet"]
