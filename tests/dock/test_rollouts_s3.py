"""Kept rollouts in the object store (``run.rollouts_uri=s3://…``): the shards write them to the local moto S3
server with pyarrow, and every reader (``dockrl rollouts show``, the artifact's metadata) finds them from the run
folder's config."""

from __future__ import annotations

import json

import pyarrow.fs as pafs
import pytest

from dockrl import driver
from dockrl.cli import main
from dockrl.config import ConfigError, load_config
from dockrl.launch.artifacts import place_rollouts, rollouts_metadata
from dockrl.rollouts.keep import has_rows, kept_rollouts, read_rollouts

SHORT = ["run.progress=false", "trainer.iterations=2", "trainer.global_batch=2", "trainer.mini_batch=2", "trainer.micro_batch=4",
         "rollout.n=4", "rollout.max_response_length=8", "rollout.dtype=float32", "trainer.autocast_bf16=false",
         "trainer.eval_before=false", "trainer.eval_after=false", "data.generate_train=8", "data.generate_test=4", "data.eval_size=4"]


@pytest.mark.parametrize("uri, field, expected", [
    ("gs://bucket/key", "run.rollouts_uri", "expected '' \\(the run folder\\) or s3://<bucket>/<key>"),
    ("s3://bucket/key?endpoint_override=x", "run.rollouts_uri", "expected '' \\(the run folder\\) or s3://<bucket>/<key>"),
    ("s3://Bucket_1/key", "run.rollouts_uri", "bucket 'Bucket_1': expected 3-63"),
    ("s3://bucket/a/../b", "run.rollouts_uri", "key 'a/../b': expected"),
])
def test_a_bad_rollouts_uri_is_refused_naming_the_field(uri, field, expected):
    with pytest.raises(ConfigError, match=rf"^{field}: got .*{expected}"):
        load_config(None, [f"run.rollouts_uri={uri}"])


def test_keys_pyarrow_cannot_read_are_refused_naming_the_dock_field():
    with pytest.raises(ConfigError, match=r"^dock.secret_key_env: got 'MY_SECRET'; expected AWS_SECRET_ACCESS_KEY with "
                                          r"run.rollouts_uri='s3://bucket/key': the shards write the rollouts with pyarrow"):
        load_config(None, ["run.rollouts_uri=s3://bucket/key", "dock.secret_key_env=MY_SECRET"])


@pytest.mark.slow  # a moto server start and a tiny run
def test_a_run_keeps_its_rollouts_in_the_object_store_and_the_readers_find_them(s3_server, tiny_model_dir, tmp_path, monkeypatch,
                                                                                 capsys):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    run = tmp_path / "run"
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"run.output_dir={run}", f"run.cache_dir={tmp_path / 'cache'}",
                             *SHORT, "run.keep_rollouts=all", "run.rollouts_uri=s3://kept-rollouts/team/run-1",
                             f"dock.endpoint=http://{s3_server.endpoint}", "dock.region=us-east-1"])
    driver.train(cfg)

    store = pafs.S3FileSystem(endpoint_override=f"http://{s3_server.endpoint}", scheme="http", region="us-east-1")
    files = sorted(f.path for f in store.get_file_info(pafs.FileSelector("kept-rollouts/team/run-1", recursive=True)) if f.is_file)
    assert files == ["kept-rollouts/team/run-1/_meta.json", "kept-rollouts/team/run-1/iteration=0/shard-0.parquet",
                     "kept-rollouts/team/run-1/iteration=1/shard-0.parquet"]
    local = json.loads((run / "rollouts" / "_meta.json").read_text())
    assert local["uri"] == "s3://kept-rollouts/team/run-1" and not has_rows(run / "rollouts")  # the run folder names where they are
    with store.open_input_stream("kept-rollouts/team/run-1/_meta.json") as f:
        assert json.loads(f.read()) == local

    kept = kept_rollouts(run)
    table = read_rollouts(kept.rows)
    assert table.num_rows == 2 * 2 * 4 and table.column("iteration").to_pylist() == [0] * 8 + [1] * 8
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rollouts/rows"] == 16 and summary["rollouts/errors"] == 0
    capsys.readouterr()
    assert main(["rollouts", "show", str(run), "--iteration", "1", "--limit", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "(2 of 8 kept rows of iteration 1)"

    artifact = place_rollouts(run / "rollouts", tmp_path / "artifact", checkpoint=run / "checkpoints" / "final",
                              config=run / "config.yaml", move=False)
    meta = rollouts_metadata(artifact, "run-1")
    assert (meta["rows"], meta["iterations"], meta["uri"]) == (16, 2, "s3://kept-rollouts/team/run-1")
    assert meta["bytes"] == summary["rollouts/bytes"]
