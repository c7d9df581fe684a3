"""Checkpoint retention, ``trainer.keep_checkpoints`` (dockrl.checkpoint.pruning.prune_checkpoints, called by the driver)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from dock.conftest import s3_server  # noqa: F401 - fixture: moto's S3 server in a process of its own
from test_resume import FAKES, Interrupt, read_rows, same_rows, tiny_run

from dockrl import driver
from dockrl.checkpoint.pruning import prune_checkpoints
from dockrl.checkpoint.resume import (
    STATE_FILE,
    checkpoint_dir,
    dock_snapshot_uri,
    final_dir,
    latest_checkpoint,
    prepare_checkpoint,
    write_driver_state,
    write_final_state,
)
from dockrl.checkpoint.resume_point import find_resume
from dockrl.config import ConfigError, load_config


def config(tmp_path: Path, *extra: str):
    return load_config(None, [f"run.output_dir={tmp_path / 'run'}", "trainer.iterations=8", "trainer.save_every=1", *extra])


def complete(cfg, next_iteration: int, dock_uri: str | None = None) -> Path:
    """A complete checkpoint (weights stand-in, driver state written last) after iteration ``next_iteration - 1``."""
    ckpt = prepare_checkpoint(checkpoint_dir(cfg.run.output_dir, next_iteration))
    (ckpt / "model.safetensors").write_bytes(b"weights")
    write_driver_state(ckpt, cfg, next_iteration=next_iteration, dock_uri=dock_uri or str(ckpt / "dock"),
                       open_iteration=next_iteration, summary={}, prompts="p")
    return ckpt


def iter_names(run: str | Path) -> list[str]:
    return sorted(p.name for p in (Path(run) / "checkpoints").iterdir())


def test_a_negative_keep_checkpoints_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"^trainer.keep_checkpoints: got -1; expected an integer >= 0 \(0: keep all\)$"):
        load_config(None, ["trainer.keep_checkpoints=-1"])
    assert load_config(None, []).trainer.keep_checkpoints == 0  # the default keeps every checkpoint, as before


def test_pruning_keeps_the_newest_complete_ones_final_and_what_a_stage_still_writes(tmp_path, caplog):
    cfg = config(tmp_path)
    run = cfg.run.output_dir
    for k in range(1, 6):
        complete(cfg, k)
    writing = prepare_checkpoint(checkpoint_dir(run, 6))  # the actor writes the next one: incomplete, not touched
    (writing / "model.safetensors").write_bytes(b"half")
    final = prepare_checkpoint(final_dir(run))
    write_final_state(final, cfg, summary={}, prompts="p")  # a run continued from final: older than nothing here, kept
    assert prune_checkpoints(run, 0, checkpoint_dir(run, 5)) == []  # 0: keep all
    assert iter_names(run) == ["final", *(f"iter_{k:06d}" for k in range(1, 7))]

    with caplog.at_level(logging.INFO, logger="dockrl.checkpoint.pruning"):
        pruned = prune_checkpoints(run, 2, checkpoint_dir(run, 5))
    assert pruned == [checkpoint_dir(run, k) for k in (1, 2, 3)]
    assert iter_names(run) == ["final", "iter_000004", "iter_000005", "iter_000006"]
    assert (writing / "model.safetensors").read_bytes() == b"half" and not (writing / STATE_FILE).exists()
    lines = [r.getMessage() for r in caplog.records if "removed" in r.getMessage()]
    assert lines == [f"checkpoint {checkpoint_dir(run, k)} removed: trainer.keep_checkpoints=2 keeps the newest" for k in (1, 2, 3)]

    # after the final checkpoint: the newest 2 intermediate ones stay besides it
    complete(cfg, 6)
    assert prune_checkpoints(run, 2, final) == [checkpoint_dir(run, 4)]
    assert iter_names(run) == ["final", "iter_000005", "iter_000006"]
    with pytest.raises(AssertionError, match="is not complete"):
        prune_checkpoints(run, 2, prepare_checkpoint(checkpoint_dir(run, 7)))


def test_pruning_never_removes_the_checkpoint_just_written_for_a_newer_one_of_an_earlier_run(tmp_path):
    """A run resumed from iter_2 of a folder whose earlier run went on to iter_5: completing its own
    iter_3 prunes only older ones, never iter_3 for the stale iter_4 and iter_5 (the run overwrites
    them when it gets there)."""
    cfg = config(tmp_path)
    run = cfg.run.output_dir
    for k in range(1, 6):
        complete(cfg, k)
    assert prune_checkpoints(run, 1, checkpoint_dir(run, 3)) == [checkpoint_dir(run, 1), checkpoint_dir(run, 2)]
    assert iter_names(run) == ["iter_000003", "iter_000004", "iter_000005"]


def test_a_removal_cut_short_is_finished_by_the_next_prune(tmp_path):
    cfg = config(tmp_path)
    run = cfg.run.output_dir
    for k in (1, 2):
        complete(cfg, k)
    left = checkpoint_dir(run, 1).rename(Path(run) / "checkpoints" / ".pruning-iter_000001")  # stopped after the rename
    assert latest_checkpoint(run) == checkpoint_dir(run, 2)  # not a checkpoint any more
    prune_checkpoints(run, 2, checkpoint_dir(run, 2))
    assert not left.exists() and iter_names(run) == ["iter_000002"]


@pytest.mark.slow  # a moto server start and a few S3 requests
def test_a_pruned_checkpoint_takes_its_dock_snapshot_on_the_s3_store_with_it(tmp_path, s3_server, monkeypatch):  # noqa: F811
    import pyarrow as pa
    import pyarrow.fs as pafs

    from dockrl.dock.snapshot import write_snapshot

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    fs = pafs.S3FileSystem(endpoint_override=f"http://{s3_server.endpoint}", scheme="http", region="us-east-1", allow_bucket_creation=True)
    fs.create_dir("rl-runs")
    cfg = config(tmp_path, "dock.mode=distributed", "dock.warehouse=s3", f"dock.endpoint=http://{s3_server.endpoint}",
                 "dock.bucket=rl-runs", "dock.prefix=team", "dock.region=us-east-1")
    run = cfg.run.output_dir
    for k in (1, 2, 3):
        uri = dock_snapshot_uri(cfg, checkpoint_dir(run, k), "r1")
        assert uri.startswith(f"s3://rl-runs/team/r1/checkpoints/iter_{k:06d}/dock?")  # outside the run folder
        write_snapshot(uri, {"kind": "test"}, {"rows": pa.table({"x": [k]})})
        complete(cfg, k, dock_uri=uri)

    def snapshots() -> list[str]:
        found = fs.get_file_info(pafs.FileSelector("rl-runs/team/r1/checkpoints", recursive=True))
        return sorted({i.path.split("/")[4] for i in found if i.path.endswith("meta.json")})

    assert snapshots() == ["iter_000001", "iter_000002", "iter_000003"]
    prune_checkpoints(run, 1, checkpoint_dir(run, 3))
    assert snapshots() == ["iter_000003"] and iter_names(run) == ["iter_000003"]
    assert not fs.get_file_info(pafs.FileSelector("rl-runs/team/r1/checkpoints/iter_000001", allow_not_found=True, recursive=True))


@pytest.mark.slow  # two short in-process runs of the tiny model, five iterations each
def test_an_inprocess_run_keeps_the_newest_two_checkpoints_and_resumes_from_the_newest(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """save_every=1 over 5 iterations with keep_checkpoints=2: iter_3, iter_4 and final are left.
    A run cut in iteration 2 resumes from iter_2 (latest) to the same metrics as the uninterrupted
    one, and prunes iter_2, the checkpoint it resumed from, once its own iter_4 is complete."""
    monkeypatch.syspath_prepend(str(FAKES))
    keep = ("trainer.iterations=5", "trainer.keep_checkpoints=2")
    driver.train(tiny_run(tiny_model_dir, tmp_path, "straight", *keep))
    straight = tmp_path / "straight"
    assert iter_names(straight) == ["final", "iter_000003", "iter_000004"]
    assert json.loads((final_dir(straight) / STATE_FILE).read_text())["next_iteration"] == 5

    def stop_in_iteration_2(it: int, metrics: dict) -> None:
        if it == 2:  # its metrics line is written, the checkpoint after iteration 1 (iter_2) is complete
            raise Interrupt

    with pytest.raises(Interrupt):
        driver.train(tiny_run(tiny_model_dir, tmp_path, "cut", *keep), on_iteration=stop_in_iteration_2)
    cut = tmp_path / "cut"
    assert iter_names(cut) == ["iter_000001", "iter_000002"]
    resumed = tiny_run(tiny_model_dir, tmp_path, "cut", *keep, "run.resume=latest")
    assert find_resume(resumed, None).checkpoint == checkpoint_dir(cut, 2).resolve()
    with caplog.at_level(logging.INFO):
        driver.train(resumed)
    assert f"resuming at iteration 2 from {checkpoint_dir(cut, 2).resolve()}" in caplog.text
    removed = [r.getMessage().split()[1] for r in caplog.records if r.getMessage().endswith("keeps the newest")]
    assert removed == [str(checkpoint_dir(cut, 1)), str(checkpoint_dir(cut, 2))]
    assert iter_names(cut) == ["final", "iter_000003", "iter_000004"]
    assert [x["iteration"] for x in read_rows(cut)] == [0, 1, 2, 3, 4]
    same_rows(read_rows(cut), read_rows(straight))
