"""Tests of dock snapshots: round trips, atomic replacement, restore checks, sharded and on S3."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pytest

from dockrl.config import DockConfig
from dockrl.dock import GRPO_SCHEMA, Dock, DockError, Schema, open_dock
from dockrl.dock.client.dock_client import DockClient
from dockrl.dock.flight.shards import start_local_shards
from dockrl.dock.shard.controller import ShardController
from dockrl.dock.snapshot import join_uri

TOKEN = "snap-token"
COLUMNS = ["prompt_ids", "rollout_log_prob", "rm_score", "correct"]


def fill(dock) -> None:
    """Rows 0..7 in groups of 2: prompts everywhere, log-probs with odd floats, scores on rows 0..5."""
    rng = np.random.default_rng(1)
    dock.put(range(8), {"prompt_ids": [[r, r + 1][: 1 + r % 2] for r in range(8)]})
    logp = [(rng.standard_normal(r % 4) * 10).astype(np.float32) for r in range(8)]
    logp[3][:2] = [np.nan, -0.0]
    dock.put(range(8), {"rollout_log_prob": pa.array(logp, type=pa.list_(pa.float32()))})
    dock.put([5, 4, 3, 2, 1, 0], {"rm_score": [0.5 * r for r in [5, 4, 3, 2, 1, 0]], "correct": [r % 2 == 0 for r in [5, 4, 3, 2, 1, 0]]})


def state_of(dock, rows=range(8)) -> dict[str, list]:
    out = {}
    for c in COLUMNS:
        written = [r for r in rows if _has(dock, c, r)]
        out[c] = (written, dock.get([c], written).column(0).to_pylist() if written else [])
    return out


def _has(dock, column: str, row: int) -> bool:
    try:
        dock.get([column], [row])
        return True
    except DockError:
        return False


def advance(dock) -> dict[str, list[int]]:
    """Take each consumer to another point; return the rows each must get again after a restore.

    advantage: two groups acked; reward: 4 rows leased, its outputs (rm_score, correct) are
    written on rows 0..5, so those count finished; reference: 3 rows leased, one finished.
    """
    done = dock.claim("advantage", ["rm_score"], 4, whole_groups=True)
    dock.put(done.rows, {"advantages": [[0.0]] * 4})
    dock.ack(done)
    reward = dock.claim("reward", ["prompt_ids"], 4)
    reference = dock.claim("reference", ["prompt_ids"], 3)
    dock.put(reference.rows[:1], {"ref_log_prob": [[0.25]]})
    return {
        "advantage": sorted(set(range(6)) - set(done.rows)),  # rows 6, 7 lack rm_score
        "reward": [r for r in range(8) if r not in reward.rows or r >= 6],
        "reference": [r for r in range(8) if r != reference.rows[0]],
    }


def check_continues(dock, left: dict[str, list[int]]) -> None:
    """The restored dock hands each consumer exactly the rows it had not finished."""
    assert dock.claim("advantage", ["rm_score"], 2, whole_groups=True, timeout_s=0.2).rows == left["advantage"]
    assert dock.claim("reward", ["prompt_ids"], 8, timeout_s=0.2).rows == left["reward"]
    assert dock.claim("reference", ["prompt_ids"], 8, timeout_s=0.2).rows == left["reference"]


def test_round_trip_restores_cells_bits_and_returns_unacked_leases(tmp_path):
    dock = open_dock(DockConfig(timeout_s=2.0), GRPO_SCHEMA, run="test")
    dock.open_iteration(7, 8, 2)
    fill(dock)
    left = advance(dock)
    assert left == {"advantage": [4, 5], "reward": [4, 5, 6, 7], "reference": [1, 2, 3, 4, 5, 6, 7]}
    uri = str(tmp_path / "snap")
    dock.snapshot(uri)
    before = state_of(dock)
    fresh = open_dock(DockConfig(timeout_s=2.0), GRPO_SCHEMA, run="test")
    fresh.restore(uri)
    assert fresh.num_rows == 8 and fresh.group_size == 2
    assert same(state_of(fresh), before)
    bits = fresh.get(["rollout_log_prob"], [3]).column(0).values.to_numpy(zero_copy_only=False).view(np.uint32)
    want = dock.get(["rollout_log_prob"], [3]).column(0).values.to_numpy(zero_copy_only=False).view(np.uint32)
    np.testing.assert_array_equal(bits, want)  # NaN and -0.0 bit-exact
    check_continues(fresh, left)
    assert fresh.stats()["dock/rows_returned"] == 2  # reference's rows 1, 2
    with pytest.raises(DockError, match="'rm_score' is already written for rows \\[5\\]"):
        fresh.put([5], {"rm_score": [1.0]})
    fresh.put([6, 7], {"rm_score": [1.0, 2.0]})  # the restored iteration carries on
    dock.close(), fresh.close()


def same(a: dict, b: dict) -> bool:
    """Equal cell by cell, NaN equal to NaN."""
    return json.dumps(a) == json.dumps(b)


def test_snapshot_without_an_open_iteration_restores_none(tmp_path):
    uri = str(tmp_path / "empty")
    ShardController(GRPO_SCHEMA).snapshot(uri)
    fresh = ShardController(GRPO_SCHEMA)
    fresh.restore(uri)
    with pytest.raises(DockError, match="no iteration is open"):
        fresh.missing("reward", ["prompt_ids"])
    fresh.open_iteration(0, 2, 2)


def test_a_new_snapshot_replaces_the_old_one_and_its_files(tmp_path):
    dock = ShardController(GRPO_SCHEMA)
    dock.open_iteration(0, 4, 2)
    uri = tmp_path / "snap"
    dock.snapshot(str(uri))
    first_id = json.loads((uri / "meta.json").read_text())["id"]
    dock.put([0], {"prompt_ids": [[3]]})
    dock.snapshot(f"file://{uri}")
    meta = json.loads((uri / "meta.json").read_text())
    assert meta["id"] != first_id and sorted(p.name for p in uri.iterdir()) == sorted(["meta.json", meta["id"]])
    fresh = ShardController(GRPO_SCHEMA)
    fresh.restore(str(uri))
    assert fresh.get(["prompt_ids"], [0]).column(0).to_pylist() == [[3]]


def test_a_snapshot_cut_short_is_never_read_as_complete(tmp_path, monkeypatch):
    dock = ShardController(GRPO_SCHEMA)
    dock.open_iteration(0, 4, 2)
    dock.put([1], {"prompt_ids": [[1]]})
    uri = str(tmp_path / "snap")
    dock.snapshot(uri)
    dock.put([2], {"prompt_ids": [[2]]})
    calls = []
    real = pa.ipc.new_file

    def dies_on_the_second_table(*args, **kw):  # state, then payload.prompt_ids
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return real(*args, **kw)

    monkeypatch.setattr(pa.ipc, "new_file", dies_on_the_second_table)
    with pytest.raises(DockError, match="disk full"):
        dock.snapshot(uri)
    calls.clear()
    with pytest.raises(DockError, match="disk full"):
        dock.snapshot(str(tmp_path / "never"))
    monkeypatch.undo()
    fresh = ShardController(GRPO_SCHEMA)
    fresh.restore(uri)  # the earlier, complete snapshot
    assert fresh.get(["prompt_ids"], [1]).column(0).to_pylist() == [[1]]
    with pytest.raises(DockError, match=r"not yet written for rows \[2\]"):
        fresh.get(["prompt_ids"], [2])
    with pytest.raises(DockError, match="no complete snapshot at"):
        ShardController(GRPO_SCHEMA).restore(str(tmp_path / "never"))


def test_restore_refuses_what_it_cannot_load(tmp_path):
    dock = ShardController(GRPO_SCHEMA)
    dock.open_iteration(0, 4, 2)
    uri = tmp_path / "snap"
    dock.snapshot(str(uri), extra={"layout": {"shard": 0}})
    with pytest.raises(DockError, match="iteration 0 is open here; close it first"):
        dock.restore(str(uri))
    with pytest.raises(DockError, match=r"taken with \{'layout': \{'shard': 0\}\}; expected \{'layout': \{'shard': 1\}\}"):
        ShardController(GRPO_SCHEMA).restore(str(uri), extra={"layout": {"shard": 1}})
    other = Schema(version=GRPO_SCHEMA.version + 1, columns=GRPO_SCHEMA.columns, consumers=GRPO_SCHEMA.consumers)
    with pytest.raises(DockError, match=f"snapshot has schema v{GRPO_SCHEMA.version} .* this dock has v{GRPO_SCHEMA.version + 1}"):
        ShardController(other).restore(str(uri))
    meta = json.loads((uri / "meta.json").read_text())
    (uri / "meta.json").write_text(json.dumps(meta | {"version": 99}))
    with pytest.raises(DockError, match="version 99; this dock reads 'dockrl.dock.snapshot' version 1"):
        ShardController(GRPO_SCHEMA).restore(str(uri))
    with pytest.raises(DockError, match="cannot open 'relative/dir'"):
        dock.snapshot("relative/dir")


def test_join_uri_keeps_the_query():
    assert join_uri("s3://b/p?endpoint_override=x&scheme=http", "id/shard-00001") == "s3://b/p/id/shard-00001?endpoint_override=x&scheme=http"
    assert join_uri("snap/", "a") == "snap/a"


# --- sharded ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_docks() -> Iterator[tuple[list[str], list[str]]]:
    """Two independent sets of 3 shards: the run that snapshots and the fresh one that restores."""
    servers, first = start_local_shards(3, GRPO_SCHEMA, token=TOKEN, timeout_s=2.0)
    more, second = start_local_shards(3, GRPO_SCHEMA, token=TOKEN, timeout_s=2.0)
    yield first, second
    for server in servers + more:
        server.close()


def connect(locations: list[str]) -> DockClient:
    return DockClient(locations, GRPO_SCHEMA, token=TOKEN, timeout_s=2.0, rpc_timeout_s=10.0, first_shard=0)


def snapshot_and_restore(old: Dock, new: Dock, uri: str) -> None:
    """Snapshot ``old`` mid-iteration, restore into ``new`` (3 shards each): the same cells and bits, and it carries on."""
    try:
        old.open_iteration(4, 8, 2)  # shards own rows 0..1, 2..5, 6..7
        fill(old)
        left = advance(old)
        before = state_of(old)
        old.snapshot(uri)
        with pytest.raises(DockError, match="iteration 4 is open on dock shard 0"):
            old.restore(uri)
        new.restore(uri)
        assert new.num_rows == 8 and same(state_of(new), before)
        check_continues(new, left)
    finally:
        for dock in (old, new):
            dock.close_iteration()
            dock.close()


def local_dock(shards: int = 3, **kw) -> Dock:
    """The in-process dock of ``dock.mode=inprocess`` (``open_dock``)."""
    return open_dock(DockConfig(timeout_s=2.0, shards=shards, **kw), GRPO_SCHEMA, run="test")


def test_sharded_snapshot_restores_into_fresh_shards(two_docks, tmp_path):
    first, second = two_docks
    uri = str(tmp_path / "dock")
    snapshot_and_restore(connect(first), connect(second), uri)
    with pytest.raises(DockError, match="dock.shards=3; this dock has dock.mode=distributed, dock.shards=2: resume with dock.shards=3"):
        connect(second[:2]).restore(uri)
    files = sorted(p.relative_to(tmp_path / "dock").as_posix() for p in (tmp_path / "dock").rglob("meta.json"))
    assert len(files) == 4 and files[-1] == "meta.json"  # one per shard under the snapshot id, the top one last


def test_shard_refuses_a_snapshot_of_another_layout(two_docks, tmp_path):
    first, second = two_docks
    old = connect(first)
    old.open_iteration(0, 8, 2)
    uri = str(tmp_path / "dock")
    old.snapshot(uri)
    old.close_iteration()
    meta = json.loads((tmp_path / "dock" / "meta.json").read_text())
    swapped = DockClient([second[1], second[0], second[2]], GRPO_SCHEMA, token=TOKEN)
    with pytest.raises(DockError, match="snapshot was taken with"):
        swapped.core.action(0, "restore", {"uri": join_uri(uri, meta["shards"][1]), "layout": {"shard": 0}})
    swapped.close()


@pytest.fixture
def s3_uri(s3_server, monkeypatch) -> Iterator[str]:
    """A bucket on the local moto S3 server (the same S3 API pyarrow speaks to MinIO)."""
    import pyarrow.fs as pafs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    query = f"endpoint_override=http://{s3_server.endpoint}&scheme=http&region=us-east-1"
    fs = pafs.S3FileSystem(endpoint_override=f"http://{s3_server.endpoint}", scheme="http", region="us-east-1",
                           allow_bucket_creation=True)
    fs.create_dir("dock-snapshots")
    yield f"s3://dock-snapshots/run-1?{query}"


@pytest.mark.slow  # a moto server start and ~100 S3 requests: 5-25 s on 2 loaded cores
def test_sharded_snapshot_on_s3(two_docks, s3_uri):
    first, second = two_docks
    snapshot_and_restore(connect(first), connect(second), s3_uri)


@pytest.mark.parametrize("taken_in", ["inprocess", "distributed"])
def test_a_snapshot_taken_in_one_dock_mode_restores_in_the_other(two_docks, tmp_path, taken_in):
    """One snapshot format: in-process shards and Flight shards restore each other's, bit for bit."""
    flight_dock, local = connect(two_docks[0]), local_dock(3)
    old, new = (local, flight_dock) if taken_in == "inprocess" else (flight_dock, local)
    uri = str(tmp_path / "dock")
    snapshot_and_restore(old, new, uri)
    other = "inprocess" if taken_in == "distributed" else "distributed"
    fewer = local_dock(2) if other == "inprocess" else connect(two_docks[1][:2])
    with pytest.raises(DockError, match=rf"dock.mode={taken_in}, dock.shards=3; this dock has dock.mode={other}, dock.shards=2: "
                                        "resume with dock.shards=3"):
        fewer.restore(uri)
    fewer.close()


def test_a_snapshot_of_another_payload_place_is_refused_naming_dock_warehouse(tmp_path):
    stored = local_dock(2, warehouse="directory", directory=str(tmp_path / "store"))
    stored.open_iteration(0, 4, 2)
    stored.put(range(4), {"prompt_ids": [[r] for r in range(4)]})
    stored.snapshot(str(tmp_path / "snap"))
    stored.close_iteration()
    stored.close()
    memory = local_dock(2)
    with pytest.raises(DockError, match="taken with dock.warehouse=directory or s3 .*; this dock has dock.warehouse=memory"):
        memory.restore(str(tmp_path / "snap"))
    memory.close()


def test_a_store_mode_snapshot_outlives_its_iterations_objects(tmp_path):
    """Objects die with their iteration: the snapshot keeps copies and restores them into the new run's store."""
    from dockrl.dock.warehouse.stores import DirectoryWarehouse

    servers, locations = start_local_shards(2, GRPO_SCHEMA, token=TOKEN, timeout_s=2.0, payload="store")
    more, fresh = start_local_shards(2, GRPO_SCHEMA, token=TOKEN, timeout_s=2.0, payload="store")
    old_store, new_store = DirectoryWarehouse(tmp_path / "store" / "run-1"), DirectoryWarehouse(tmp_path / "store" / "run-2")
    old = DockClient(locations, GRPO_SCHEMA, token=TOKEN, timeout_s=2.0, warehouse=old_store)
    new = DockClient(fresh, GRPO_SCHEMA, token=TOKEN, timeout_s=2.0, warehouse=new_store)
    try:
        old.open_iteration(3, 8, 2, announce=False)
        fill(old)
        before = state_of(old)
        uri = str(tmp_path / "snap")
        old.snapshot(uri)
        old.close_iteration()
        assert old_store.list() == []  # the iteration's objects are gone from the store
        new.restore(uri)
        assert same(state_of(new), before)
        assert sorted(new_store.list()) == sorted(json.loads((tmp_path / "snap" / "meta.json").read_text())["objects"])
        with pytest.raises(DockError, match="timed out"):
            new.wait_iteration(-1, timeout_s=0.2)  # restored, not yet announced: no stage starts on it
        new.announce(3)
        assert new.wait_iteration(-1, timeout_s=1.0) == 3
    finally:
        for dock in (old, new):
            dock.close()
        for server in servers + more:
            server.close()
