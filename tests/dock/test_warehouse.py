"""Tests of the warehouse backends: S3 (a real S3 server on 127.0.0.1) and a local directory.

Backends alone (objects, Arrow round trip, failures), then the dock over Flight with
metadata-only shards: no payload through a shard, controller bytes independent of payload size,
each object read once, and failed puts that leave nothing behind. The dock's put/claim/get
behaviour in these modes is tested with every other mode in ``test_flight.py``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from dockrl.config import ConfigError, DockConfig
from dockrl.dock import GRPO_SCHEMA, DockError
from dockrl.dock.client.dock_client import DockClient
from dockrl.dock.flight.server import DockShardServer
from dockrl.dock.flight.shards import start_local_shards
from dockrl.dock.shard.controller import ShardController
from dockrl.dock.warehouse.base import (
    Located,
    Warehouse,
    WarehouseError,
    new_key,
    read_cells,
    write_arrays,
)
from dockrl.dock.warehouse.s3 import S3Warehouse
from dockrl.dock.warehouse.stores import DirectoryWarehouse, make_warehouse

TOKEN = "warehouse-test"
TOKENS = pa.list_(pa.int32())
LOGPROBS = pa.list_(pa.float32())


@pytest.fixture(params=["s3", "directory"])
def warehouse(request: pytest.FixtureRequest, tmp_path) -> Warehouse:
    if request.param == "s3":
        return request.getfixturevalue("s3_server").warehouse()
    return DirectoryWarehouse(tmp_path / "store")


def free_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the backends alone ---------------------------------------------------------------------------


def test_objects_write_read_list_delete(warehouse):
    warehouse.write("iter-00000001/prompt_ids/a.arrow", b"first")
    warehouse.write("iter-00000001/rm_score/b.arrow", b"second")
    warehouse.write("iter-00000002/rm_score/c.arrow", b"")
    assert warehouse.read("iter-00000001/prompt_ids/a.arrow") == b"first"
    assert warehouse.read("iter-00000002/rm_score/c.arrow") == b""
    assert warehouse.list("iter-00000001/") == ["iter-00000001/prompt_ids/a.arrow", "iter-00000001/rm_score/b.arrow"]
    assert len(warehouse.list()) == 3
    warehouse.delete(["iter-00000001/prompt_ids/a.arrow", "iter-00000001/never-written.arrow"])
    assert warehouse.list() == ["iter-00000001/rm_score/b.arrow", "iter-00000002/rm_score/c.arrow"]
    with pytest.raises(WarehouseError, match="does not exist") as info:
        warehouse.read("iter-00000001/prompt_ids/a.arrow")
    store = f"http://{warehouse.endpoint} bucket 'dockrl-test'" if isinstance(warehouse, S3Warehouse) else warehouse.url
    assert store in str(info.value) and "iter-00000001/prompt_ids/a.arrow'" in str(info.value)


@pytest.mark.parametrize("key", ["../escape.arrow", "/abs.arrow", "a//b.arrow", "a/./b", "a b.arrow", ""])
def test_keys_outside_the_run_are_refused(warehouse, key):
    with pytest.raises(WarehouseError, match="invalid key"):
        warehouse.write(key, b"x")


def special_floats() -> np.ndarray:
    """float32 values whose bits a lossy path would change: NaNs with payloads, -0.0, infinities, subnormals."""
    bits = np.array([0x7FC00000, 0x7FC00001, 0xFFC12345, 0x80000000, 0x00000000, 0x7F800000, 0xFF800000, 0x00000001,
                     0x807FFFFF, 0x3F800000], dtype=np.uint32)
    return bits.view(np.float32)


def test_arrow_cells_round_trip_bit_exact(warehouse):
    rng = np.random.default_rng(0)
    specials = special_floats()
    lengths = [0, 3, 1, 10, 5, 0, 7, 2]
    tokens = [rng.integers(-(2**31), 2**31 - 1, n, dtype=np.int32) for n in lengths]
    tokens[1] = np.array([-(2**31), 2**31 - 1, 0], dtype=np.int32)
    logp = [rng.standard_normal(n).astype(np.float32) for n in lengths]
    logp[3] = specials
    scores = np.concatenate([specials[:5], rng.standard_normal(3).astype(np.float32)])
    columns = {
        "response_ids": pa.array(tokens, type=TOKENS),
        "rollout_log_prob": pa.array(logp, type=LOGPROBS),
        "rm_score": pa.array(scores, type=pa.float32()),
        "truncated": pa.array([bool(n % 2) for n in lengths], type=pa.bool_()),
    }
    # two chunks per column (rows 0-3 and 4-7), as two puts would write them
    keys = {(c, half): new_key(5, c, 4 * half) for c in columns for half in (0, 1)}
    nbytes = write_arrays(warehouse, [(keys[c, h], c, a.slice(4 * h, 4)) for c in columns for h in (0, 1) for a in [columns[c]]])
    assert nbytes > 0 and len(warehouse.list("iter-00000005/")) == 8
    order = np.array([6, 1, 3, 0, 7, 2, 5, 4])
    located = {c: Located((keys[c, 0], keys[c, 1]), order // 4, order % 4) for c in columns}
    batch, objects, read_bytes = read_cells(warehouse, GRPO_SCHEMA, list(columns), located)
    assert objects == 8 and read_bytes == nbytes  # each object read once
    assert batch.schema == GRPO_SCHEMA.arrow_schema(list(columns))
    assert batch.column("response_ids").equals(columns["response_ids"].take(pa.array(order)))
    got_logp = batch.column("rollout_log_prob")
    np.testing.assert_array_equal(got_logp.value_lengths().to_numpy(), np.array(lengths)[order])
    np.testing.assert_array_equal(
        got_logp.flatten().to_numpy().view(np.uint32), np.concatenate([logp[i] for i in order]).view(np.uint32)
    )
    np.testing.assert_array_equal(batch.column("rm_score").to_numpy().view(np.uint32), scores[order].view(np.uint32))
    assert batch.column("truncated").to_pylist() == [bool(lengths[i] % 2) for i in order]


def test_object_of_another_column_or_too_short_is_refused(warehouse):
    key = new_key(0, "rm_score", 0)
    write_arrays(warehouse, [(key, "rm_score", pa.array([1.0, 2.0], type=pa.float32()))])
    with pytest.raises(WarehouseError, match="expected one field 'advantages'"):
        read_cells(warehouse, GRPO_SCHEMA, ["advantages"], {"advantages": Located((key,), np.zeros(1, np.int64), np.zeros(1, np.int64))})
    with pytest.raises(WarehouseError, match="has no row 2 for column 'rm_score'"):
        read_cells(warehouse, GRPO_SCHEMA, ["rm_score"], {"rm_score": Located((key,), np.zeros(1, np.int64), np.full(1, 2))})
    warehouse.write("iter-00000000/rm_score/garbage.arrow", b"not arrow")
    garbage = Located(("iter-00000000/rm_score/garbage.arrow",), np.zeros(1, np.int64), np.zeros(1, np.int64))
    with pytest.raises(WarehouseError, match="not a readable Arrow IPC file"):
        read_cells(warehouse, GRPO_SCHEMA, ["rm_score"], {"rm_score": garbage})


def test_directory_writes_leave_no_temp_file_also_when_they_fail(tmp_path):
    store = DirectoryWarehouse(tmp_path / "store")
    store.write("iter-00000000/a/x.arrow", b"1")
    store.write("iter-00000000/a/x.arrow", b"22")  # replaced whole
    (tmp_path / "store" / "blocker").write_text("a file where a directory should be")
    with pytest.raises(WarehouseError, match=r"file://.*store: write 'blocker/y.arrow' failed"):
        store.write("blocker/y.arrow", b"3")
    files = sorted(p.relative_to(tmp_path / "store").as_posix() for p in (tmp_path / "store").rglob("*") if p.is_file())
    assert files == ["blocker", "iter-00000000/a/x.arrow"] and store.read("iter-00000000/a/x.arrow") == b"22"
    store.delete(["iter-00000000/a/x.arrow"])
    assert not (tmp_path / "store" / "iter-00000000").exists()  # emptied directories go too


# --- S3 failures: clear, bounded in time ----------------------------------------------------------


def test_closed_port_fails_fast_naming_endpoint_and_bucket():
    port = free_port()
    store = S3Warehouse(f"127.0.0.1:{port}", "dockrl-test", "run-a", access_key="k", secret_key="s", secure=False,
                        region="us-east-1", timeout_s=1.0, retries=2)
    start = time.monotonic()
    with pytest.raises(WarehouseError) as info:
        store.ensure_bucket()
    assert time.monotonic() - start < 5.0  # connection refused is not retried for long (backoff ≤ 0.3 s in all)
    msg = str(info.value)
    assert f"http://127.0.0.1:{port}" in msg and "bucket 'dockrl-test'" in msg and "unreachable after 3 attempt(s)" in msg


def test_silent_store_times_out_within_the_configured_bound():
    with socket.socket() as silent:  # accepts connections (kernel backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        store = S3Warehouse(f"127.0.0.1:{port}", "dockrl-test", access_key="k", secret_key="s", secure=False,
                            region="us-east-1", timeout_s=0.3, retries=1)
        start = time.monotonic()
        with pytest.raises(WarehouseError, match=r"read 'iter-00000000/x.arrow' failed: store unreachable after 2 attempt\(s\) with a 0.3 s timeout"):
            store.read("iter-00000000/x.arrow")
        elapsed = time.monotonic() - start
    assert 0.5 <= elapsed < 3.0  # 2 attempts × 0.3 s, plus backoff and scheduling


@pytest.mark.parametrize("wrong", ["secret", "access key"])
def test_wrong_credentials_are_refused_naming_the_store_and_the_variables(s3_server, wrong):
    env = {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key}
    env["AWS_SECRET_ACCESS_KEY" if wrong == "secret" else "AWS_ACCESS_KEY_ID"] = "AKIAWRONGWRONGWRONG1"
    config = DockConfig(warehouse="s3", endpoint=f"http://{s3_server.endpoint}", bucket="dockrl-test", region="us-east-1",
                        store_timeout_s=2.0, store_retries=1)
    start = time.monotonic()
    with pytest.raises(WarehouseError) as info:
        make_warehouse(config, "run-b", environ=env)
    assert time.monotonic() - start < 5.0
    msg = str(info.value)
    assert f"http://{s3_server.endpoint} bucket 'dockrl-test'" in msg and "access denied" in msg
    assert "$AWS_ACCESS_KEY_ID and $AWS_SECRET_ACCESS_KEY" in msg


def test_make_warehouse_from_the_config(s3_server, tmp_path):
    assert make_warehouse(DockConfig(), "run-c") is None
    local = make_warehouse(DockConfig(warehouse="directory", directory=str(tmp_path)), "run-c")
    assert isinstance(local, DirectoryWarehouse) and local.root == tmp_path / "run-c"
    env = {"MY_KEY": s3_server.access_key, "MY_SECRET": s3_server.secret_key, "AWS_ENDPOINT_URL": f"http://{s3_server.endpoint}"}
    config = DockConfig(warehouse="s3", bucket="dockrl-new", prefix="team/dock", access_key_env="MY_KEY",
                        secret_key_env="MY_SECRET", region="us-east-1")
    store = make_warehouse(config, "run-c", environ=env)  # endpoint from AWS_ENDPOINT_URL; the bucket is created
    assert isinstance(store, S3Warehouse) and store.url == f"s3://{s3_server.endpoint}/dockrl-new/team/dock/run-c"
    store.write("iter-00000000/x.arrow", b"x")
    assert s3_server.warehouse("dockrl-new", prefix="team/dock").list() == ["run-c/iter-00000000/x.arrow"]
    with pytest.raises(ConfigError, match="dock.secret_key_env: environment variable 'MY_SECRET' is unset"):
        make_warehouse(config, "run-c", environ={"MY_KEY": "k", "AWS_ENDPOINT_URL": "http://x:1"})
    with pytest.raises(ConfigError, match="dock.endpoint"):
        make_warehouse(config, "run-c", environ={"MY_KEY": "k", "MY_SECRET": "s"})
    with pytest.raises(ConfigError, match="run name '../x'"):
        make_warehouse(config, "../x", environ=env)


# --- the dock over Flight with metadata-only shards -----------------------------------------------


@pytest.fixture(scope="module")
def store_servers() -> Iterator[list[DockShardServer]]:
    servers, _ = start_local_shards(2, GRPO_SCHEMA, token=TOKEN, payload="store")
    yield servers
    for server in servers:
        server.close()


def dock_on(servers: list[DockShardServer], warehouse: Warehouse | None, timeout_s: float = 5.0) -> DockClient:
    return DockClient([s.location for s in servers], GRPO_SCHEMA, token=TOKEN, timeout_s=timeout_s, rpc_timeout_s=10.0,
                      warehouse=warehouse, first_shard=0)


@pytest.fixture
def dock(store_servers, warehouse) -> Iterator[DockClient]:
    client = dock_on(store_servers, warehouse)
    yield client
    client.close_iteration()
    client.close()


def round_of_traffic(servers: list[DockShardServer], warehouse: Warehouse, cell_tokens: int) -> tuple[int, int, int]:
    """Open, put 8 rows of two columns, claim them, get them, close; return (controller bytes, store bytes, shard payload bytes)."""
    client = dock_on(servers, warehouse)
    before = sum(s.controller_bytes for s in servers)
    client.open_iteration(0, 8, 2)
    client.put(range(8), {"response_ids": [[r] * cell_tokens for r in range(8)], "rm_score": [float(r) for r in range(8)]})
    claim = client.claim("actor", ["response_ids", "rm_score"], 8, whole_groups=True)
    assert claim.batch.column("response_ids").to_pylist() == [[r] * cell_tokens for r in range(8)]
    assert client.get(["rm_score"], [7, 0]).column(0).to_pylist() == [7.0, 0.0]
    payload = sum(s.dock.bytes_put + s.dock.bytes_read for s in servers)  # the open iteration's controllers
    client.close_iteration()
    controller = sum(s.controller_bytes for s in servers) - before
    store = client.store["dock/store_bytes_written"] + client.store["dock/store_bytes_read"]
    client.close()
    return controller, store, payload


def test_no_payload_through_the_shards_and_controller_bytes_independent_of_payload(store_servers, warehouse):
    small = round_of_traffic(store_servers, warehouse, cell_tokens=4)
    large = round_of_traffic(store_servers, warehouse, cell_tokens=4000)
    assert small[2] == large[2] == 0  # not one payload byte held or served by a shard
    assert large[1] > 2 * 8 * 4000 * 4 and large[1] > 20 * small[1]  # the store moved 8 × 4000 int32 each way ...
    assert large[0] == small[0] > 0  # ... the controllers exactly as many as before
    assert warehouse.list() == []  # close_iteration deleted the objects


def test_a_claim_and_a_get_read_each_object_once(dock):
    dock.open_iteration(0, 8, 2)
    dock.put(range(8), {"prompt_ids": [[r] for r in range(8)], "ground_truth": [str(r) for r in range(8)]})
    assert dock.store["dock/store_objects_written"] == 4  # 2 columns × 2 shards
    claim = dock.claim("reward", ["prompt_ids", "ground_truth"], 8)
    assert claim.rows == list(range(8)) and claim.batch.column("ground_truth").to_pylist() == [str(r) for r in range(8)]
    assert dock.store["dock/store_objects_read"] == 4
    got = dock.get(["prompt_ids"], [7, 0, 5, 2, 1])
    assert got.column(0).to_pylist() == [[7], [0], [5], [2], [1]]
    assert dock.store["dock/store_objects_read"] == 4 + 2  # one object per shard, however many rows it serves


class FakeFlakyWarehouse:
    """A real warehouse whose ``fail_on``-th write raises, as a store that drops out mid-put would."""

    def __init__(self, inner: Warehouse, fail_on: int) -> None:
        self.inner, self.url, self.fail_on, self.writes = inner, inner.url, fail_on, 0
        self._lock = threading.Lock()

    def write(self, key: str, data: bytes) -> None:
        with self._lock:
            self.writes += 1
            fail = self.writes == self.fail_on
        if fail:
            raise WarehouseError(f"object store {self.url}: write {key!r} failed (injected)")
        self.inner.write(key, data)

    def read(self, key: str) -> bytes:
        return self.inner.read(key)

    def delete(self, keys) -> None:
        self.inner.delete(keys)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)


CELLS = {"response_ids": lambda r: [r, r + 1], "rm_score": lambda r: float(r)}


def assert_nothing_written(dock: DockClient, warehouse: Warehouse, columns: list[str], rows: list[int]) -> None:
    """No readiness bit set, no object left: the same cells can still be put, and then read."""
    for column in columns:
        with pytest.raises(DockError, match=f"'{column}' not yet written"):
            dock.get([column], rows)
    assert warehouse.list() == []
    dock.put(rows, {c: [CELLS[c](r) for r in rows] for c in columns})
    assert dock.get(columns, rows).to_pylist() == [{c: CELLS[c](r) for c in columns} for r in rows]


def test_store_failing_mid_put_leaves_no_object_and_no_readiness_bit(dock):
    dock.open_iteration(0, 8, 2)
    flaky = dock_on_same(dock, FakeFlakyWarehouse(dock.warehouse, fail_on=3))
    with pytest.raises(WarehouseError, match="injected"):
        flaky.put(range(8), {c: [CELLS[c](r) for r in range(8)] for c in CELLS})
    assert flaky.warehouse.writes >= 3  # the third write failed after two had landed (a fourth may have been cancelled)
    assert_nothing_written(dock, dock.warehouse, ["response_ids", "rm_score"], list(range(8)))


def dock_on_same(dock: DockClient, warehouse: Warehouse) -> DockClient:
    return DockClient(dock.locations, GRPO_SCHEMA, token=TOKEN, timeout_s=5.0, rpc_timeout_s=10.0, warehouse=warehouse,
                      first_shard=0)


@pytest.mark.parametrize("fault", ["closed port", "wrong secret"])
def test_unusable_store_fails_the_put_in_time_and_sets_nothing(s3_server, store_servers, fault):
    good = s3_server.warehouse()
    dock = dock_on(store_servers, good)
    try:
        dock.open_iteration(0, 4, 2)
        if fault == "closed port":
            bad = S3Warehouse(f"127.0.0.1:{free_port()}", "dockrl-test", good.prefix, access_key="k", secret_key="s",
                              secure=False, region="us-east-1", timeout_s=1.0, retries=1)
        else:
            bad = S3Warehouse(s3_server.endpoint, "dockrl-test", good.prefix, access_key=s3_server.access_key,
                              secret_key="wrong-secret", secure=False, region="us-east-1", timeout_s=1.0, retries=1)
        start = time.monotonic()
        with pytest.raises(WarehouseError) as info:
            dock_on_same(dock, bad).put(range(4), {"rm_score": [CELLS["rm_score"](r) for r in range(4)]})
        assert time.monotonic() - start < 5.0
        assert "bucket 'dockrl-test'" in str(info.value) and bad.endpoint in str(info.value)
        assert_nothing_written(dock, good, ["rm_score"], list(range(4)))
    finally:
        dock.close_iteration()


def test_a_refused_commit_leaves_no_object_of_the_refused_part(dock):
    dock.open_iteration(0, 8, 2)  # shard 0 owns rows 0-3, shard 1 rows 4-7
    dock.put([6], {"rm_score": [6.0]})
    with pytest.raises(DockError, match=r"'rm_score' is already written for rows \[6\]"):
        dock.put(range(8), {"rm_score": [float(r) for r in range(8)]})
    # as in memory mode the put is atomic per shard: shard 0 took its part, shard 1 none of it
    assert dock.get(["rm_score"], [0, 3, 6]).column(0).to_pylist() == [0.0, 3.0, 6.0]
    with pytest.raises(DockError, match=r"'rm_score' not yet written for rows \[4, 5, 7\]"):
        dock.get(["rm_score"], [4, 5, 6, 7])
    assert len(dock.warehouse.list()) == 2  # the row-6 object and shard 0's part: shard 1's part was deleted


def test_client_and_shards_must_agree_on_the_payload_mode(store_servers, tmp_path):
    memory_servers, memory_locations = start_local_shards(1, GRPO_SCHEMA, token=TOKEN)
    try:
        with pytest.raises(DockError, match="payload='store' but this client has no warehouse"):
            dock_on(store_servers, None).num_rows  # noqa: B018 - the property's check raises
        store_client = DockClient(memory_locations, GRPO_SCHEMA, token=TOKEN, warehouse=DirectoryWarehouse(tmp_path))
        with pytest.raises(DockError, match="payload='memory' but this client has the warehouse file://"):
            store_client.num_rows  # noqa: B018 - the property's check raises
        # a client that skips the check (it opened the iteration itself) is refused by the shard
        raw = DockClient([s.location for s in store_servers], GRPO_SCHEMA, token=TOKEN)
        raw.open_iteration(0, 2, 2)
        with pytest.raises(DockError, match="put: dock shard at grpc://.* holds metadata only"):
            raw.put([0, 1], {"rm_score": [0.0, 1.0]})
        opts = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {TOKEN}".encode())])
        body = json.dumps({"iteration": 0, "rows": [0], "objects": {"rm_score": {"key": "k", "offsets": [0]}}}).encode()
        with pytest.raises(flight.FlightServerError, match="commit: dock shard at .* keeps payload in memory"):
            list(flight.connect(memory_locations[0]).do_action(flight.Action("commit", body), opts))
        raw.close_iteration()
    finally:
        memory_servers[0].close()



def test_commit_and_locate_on_the_in_process_dock():
    dock = ShardController(GRPO_SCHEMA, timeout_s=0.1)
    dock.open_iteration(0, 4, 2, first_row=4)  # a shard owning rows 4..7
    a, b = "iter-00000000/rm_score/a.arrow", "iter-00000000/rm_score/b.arrow"
    dock.commit([6, 4], {"rm_score": (a, [1, 0])})
    dock.commit([5], {"rm_score": (b, [0])})
    located = dock.locate(["rm_score"], [4, 5, 6])["rm_score"]
    assert located.to_json() == {"keys": [a, b], "index": [0, 1, 0], "offsets": [0, 0, 1]}
    assert Located.from_json(located.to_json()).to_json() == located.to_json()
    assert dock.take("reward", ["rm_score"], 3)[:2] == ([4, 5, 6], 1)  # committed cells are ready like put ones
    with pytest.raises(DockError, match=r"'rm_score' is already written for rows \[6\]"):
        dock.commit([6, 7], {"rm_score": ("k", [0, 1])})
    with pytest.raises(DockError, match="'rm_score' has 1 offsets for 2 rows"):
        dock.commit([7, 5], {"rm_score": ("k", [0])})
    with pytest.raises(DockError, match="'advantages' not yet written for rows \\[7\\]"):
        dock.locate(["advantages"], [7])
    with pytest.raises(DockError, match="lives in a warehouse"):
        dock.get(["rm_score"], [4])
    dock.put([4, 5], {"advantages": [[0.5], [-0.5, 0.25]]})
    with pytest.raises(DockError, match="held in the dock's memory"):
        dock.locate(["advantages"], [4])


def test_snapshot_of_committed_cells_keeps_their_object_keys(tmp_path):
    dock = ShardController(GRPO_SCHEMA, timeout_s=0.1)
    dock.open_iteration(0, 4, 2, first_row=4)
    a, b = "iter-00000000/rm_score/a.arrow", "iter-00000000/rm_score/b.arrow"
    dock.commit([6, 4], {"rm_score": (a, [1, 0])})
    dock.commit([5], {"rm_score": (b, [0])})
    dock.put([4, 5], {"advantages": [[0.5], [-0.5, 0.25]]})
    before = dock.locate(["rm_score"], [4, 5, 6])["rm_score"].to_json()
    dock.snapshot(str(tmp_path / "snap"))
    restored = ShardController(GRPO_SCHEMA, timeout_s=0.1)
    restored.restore(str(tmp_path / "snap"))
    assert restored.locate(["rm_score"], [4, 5, 6])["rm_score"].to_json() == before
    assert restored.get(["advantages"], [4, 5]).column("advantages").to_pylist() == [[0.5], [-0.5, 0.25]]
    with pytest.raises(DockError, match="'rm_score' not yet written for rows \\[7\\]"):
        restored.locate(["rm_score"], [7])
