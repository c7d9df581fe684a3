"""Tests of the in-process transfer dock: delivery, grouping, blocking, errors and Arrow round trips.

Each test runs on the dock of ``dock.mode=inprocess`` (``open_dock``) with one and with two
shards: the same behaviour and messages, checked by the shards.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dockrl.config import DockConfig
from dockrl.dock import GRPO_SCHEMA, Claim, Dock, DockError, DockTimeoutError, open_dock

TOKENS = pa.list_(pa.int32())
LOGPROBS = pa.list_(pa.float32())
KIND: dict = {"dock": "inprocess", "opened": []}
ROW_ORDER = {  # these check the order rows come in: over two shards a claim starts at a rotating shard
    "test_claims_of_two_consumers_interleave_independently", "test_whole_groups_never_returns_a_partial_group",
    "test_claim_count_must_be_positive_without_whole_groups",
}


@pytest.fixture(autouse=True, params=["inprocess", "inprocess-2shards"])
def dock_kind(request: pytest.FixtureRequest):
    """Which dock ``make_dock`` builds in this test; closes the in-process ones afterwards."""
    if request.param == "inprocess-2shards" and request.node.originalname in ROW_ORDER:
        pytest.skip("checks the row order of one shard")
    KIND["dock"], KIND["opened"] = request.param, []
    yield request.param
    for dock in KIND["opened"]:
        dock.close()


def make_dock(num_rows: int = 8, group_size: int = 4, timeout_s: float = 5.0, *, opened: bool = True) -> Dock:
    """The dock of this test's kind, with iteration 0 open unless ``opened=False``; closed after the test."""
    dock = open_dock(DockConfig(timeout_s=timeout_s, shards=2 if "2shards" in KIND["dock"] else 1), GRPO_SCHEMA, run="test")
    KIND["opened"].append(dock)
    if opened:
        dock.open_iteration(0, num_rows, group_size)
    return dock


def prompt_cell(row: int) -> list[int]:
    """A distinct, row-identifying prompt: lets every test check which row a cell came from."""
    return [row, row + 100, row + 200][: 1 + row % 3]


def put_prompts(dock: Dock, rows) -> None:
    rows = list(rows)
    dock.put(rows, {"prompt_ids": [prompt_cell(r) for r in rows]})


def drain(dock: Dock, consumer: str, columns: list[str], count: int, **kw) -> list[Claim]:
    claims = []
    while claim := dock.claim(consumer, columns, count, **kw):
        claims.append(claim)
        assert len(claims) <= dock.num_rows, "claims never ran dry"
    return claims


# --- delivery ----------------------------------------------------------------------------


def test_each_consumer_gets_every_row_exactly_once():
    dock = make_dock(num_rows=12, group_size=4)
    put_prompts(dock, range(12))
    dock.put(range(12), {"ground_truth": [str(r) for r in range(12)]})

    reward = drain(dock, "reward", ["prompt_ids", "ground_truth"], 5)
    # "reference" claims all rows too: consumption is per consumer
    reference = drain(dock, "reference", ["prompt_ids"], 5)

    for claims in (reward, reference):
        assert [len(c) for c in claims] == [5, 5, 2]
        rows = [r for c in claims for r in c.rows]
        assert sorted(rows) == list(range(12))
        for c in claims:
            assert c.iteration == 0
            assert c.batch.num_rows == len(c.rows)
            assert c.batch.column("prompt_ids").to_pylist() == [prompt_cell(r) for r in c.rows]
    assert [g for c in reward for g in c.batch.column("ground_truth").to_pylist()] == [
        str(r) for c in reward for r in c.rows
    ]


def test_claims_of_two_consumers_interleave_independently():
    dock = make_dock(num_rows=6, group_size=2)
    put_prompts(dock, range(6))
    got = {"reward": [], "reference": []}
    for _ in range(3):
        for consumer in got:
            got[consumer] += dock.claim(consumer, ["prompt_ids"], 2).rows
    assert got == {"reward": list(range(6)), "reference": list(range(6))}


def test_claim_after_all_rows_taken_is_empty_and_immediate():
    dock = make_dock(num_rows=4, group_size=2, timeout_s=5.0)
    put_prompts(dock, range(4))
    assert len(dock.claim("reward", ["prompt_ids"], 4)) == 4
    start = time.monotonic()
    # response_ids was never written: an empty claim must not wait for it
    for columns in (["prompt_ids"], ["prompt_ids", "response_ids"]):
        empty = dock.claim("reward", columns, 4)
        assert len(empty) == 0 and not empty
        assert empty.rows == [] and empty.batch.num_rows == 0
        assert empty.batch.schema.names == columns
    assert time.monotonic() - start < 1.0
    # another consumer still gets everything
    assert dock.claim("reference", ["prompt_ids"], 4).rows == [0, 1, 2, 3]


# --- whole groups --------------------------------------------------------------------------


def test_whole_groups_never_returns_a_partial_group():
    dock = make_dock(num_rows=12, group_size=4)
    put_prompts(dock, [0, 1, 2, 4, 5, 6, 7, 9, 10])  # only group 1 (rows 4..7) is complete

    claim = dock.claim("rollout", ["prompt_ids"], 4, whole_groups=True)
    assert claim.rows == [4, 5, 6, 7]
    # without whole_groups the same readiness gives a row set that cuts groups
    assert dock.claim("reward", ["prompt_ids"], 4).rows == [0, 1, 2, 4]
    # groups 0 and 2 are incomplete: a whole-group claim waits and times out
    with pytest.raises(DockTimeoutError):
        dock.claim("rollout", ["prompt_ids"], 4, whole_groups=True, timeout_s=0.2)

    put_prompts(dock, [3])
    assert dock.claim("rollout", ["prompt_ids"], 4, whole_groups=True).rows == [0, 1, 2, 3]
    put_prompts(dock, [8, 11])
    last = dock.claim("rollout", ["prompt_ids"], 8, whole_groups=True)
    assert last.rows == [8, 9, 10, 11]  # min(count, rows left) = one group
    assert last.batch.column("prompt_ids").to_pylist() == [prompt_cell(r) for r in last.rows]
    assert len(dock.claim("rollout", ["prompt_ids"], 4, whole_groups=True)) == 0


@pytest.mark.parametrize("count", [2, 6, 0, -4])
def test_whole_groups_count_not_a_multiple_of_group_size(count):
    dock = make_dock(num_rows=8, group_size=4)
    put_prompts(dock, range(8))
    with pytest.raises(DockError, match=rf"count={count}"):
        dock.claim("rollout", ["prompt_ids"], count, whole_groups=True, timeout_s=0.1)
    # the failed claim took nothing
    assert dock.claim("rollout", ["prompt_ids"], 8, whole_groups=True).rows == list(range(8))


def test_claim_count_must_be_positive_without_whole_groups():
    dock = make_dock()
    put_prompts(dock, range(8))
    with pytest.raises(DockError, match="count=0"):
        dock.claim("reward", ["prompt_ids"], 0)
    # a count that is not a group multiple is fine without whole_groups
    assert dock.claim("reward", ["prompt_ids"], 3).rows == [0, 1, 2]


# --- blocking and timeouts ----------------------------------------------------------------


def test_claim_blocks_until_rows_are_ready():
    dock = make_dock(num_rows=4, group_size=2, timeout_s=5.0)

    def producer():
        time.sleep(0.2)
        put_prompts(dock, range(4))

    thread = threading.Thread(target=producer, daemon=True)
    start = time.monotonic()
    thread.start()
    try:
        claim = dock.claim("rollout", ["prompt_ids"], 4, whole_groups=True)
    finally:
        thread.join(5)
    elapsed = time.monotonic() - start
    assert claim.rows == [0, 1, 2, 3]
    assert claim.batch.column("prompt_ids").to_pylist() == [prompt_cell(r) for r in range(4)]
    assert 0.15 <= elapsed < 3.0
    assert dock.stats()["dock/wait_s"] >= 0.1


def test_blocked_claim_fails_when_the_iteration_is_closed():
    dock = make_dock(num_rows=4, group_size=2, timeout_s=5.0)
    errors: list[BaseException] = []

    def consumer():
        try:
            dock.claim("reward", ["prompt_ids"], 2)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)

    thread = threading.Thread(target=consumer, daemon=True)
    start = time.monotonic()
    thread.start()
    time.sleep(0.1)
    dock.close_iteration()
    thread.join(3)
    assert not thread.is_alive()
    assert time.monotonic() - start < 3.0
    assert len(errors) == 1 and isinstance(errors[0], DockError)
    assert not isinstance(errors[0], DockTimeoutError)
    assert "no iteration" in str(errors[0])


@pytest.mark.parametrize("per_call", [True, False], ids=["timeout_arg", "dock_default"])
def test_claim_timeout_names_missing_columns_and_consumer(per_call):
    dock = make_dock(num_rows=4, group_size=2, timeout_s=5.0 if per_call else 0.3)
    put_prompts(dock, range(4))
    kw = {"timeout_s": 0.3} if per_call else {}
    start = time.monotonic()
    with pytest.raises(DockTimeoutError) as info:
        dock.claim("reward", ["prompt_ids", "response_ids"], 2, **kw)
    elapsed = time.monotonic() - start
    assert 0.25 <= elapsed < 3.0  # the 0.3 s timeout, plus scheduling on a loaded machine
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, DockError)
    msg = str(info.value)
    assert "'reward'" in msg
    missing = msg.split("missing")[-1]
    assert "'response_ids': " in missing and "prompt_ids" not in missing  # 4 rows, or 2 on each of two shards
    # the failed claim consumed nothing
    dock.put(range(4), {"response_ids": [[r] for r in range(4)]})
    assert dock.claim("reward", ["prompt_ids", "response_ids"], 4).rows == [0, 1, 2, 3]


def test_infinite_timeout_waits_instead_of_crashing():
    dock = make_dock(num_rows=2, group_size=2, timeout_s=math.inf)
    thread = threading.Thread(target=lambda: (time.sleep(0.1), put_prompts(dock, range(2))), daemon=True)
    thread.start()
    try:
        claim = dock.claim("rollout", ["prompt_ids"], 2)
    finally:
        thread.join(5)
    assert claim.rows == [0, 1]


# --- bad input -------------------------------------------------------------------------------


BAD_CALLS = {
    "put unknown column": (lambda d: d.put([0], {"promptids": [[1]]}), ["'promptids'"]),
    "claim unknown column": (lambda d: d.claim("reward", ["prompt_ids", "score"], 1), ["'score'"]),
    "get unknown column": (lambda d: d.get(["score"], [0]), ["'score'"]),
    "unknown consumer": (lambda d: d.claim("judge", ["prompt_ids"], 1), ["'judge'"]),
    "put negative row": (lambda d: d.put([0, -1], {"ground_truth": ["a", "b"]}), ["-1", "out of range", "[0, 8)"]),
    "put row == num_rows": (lambda d: d.put([8], {"ground_truth": ["a"]}), ["[8]", "out of range"]),
    "get row out of range": (lambda d: d.get(["prompt_ids"], [9]), ["[9]", "out of range"]),
    "put repeated row": (lambda d: d.put([1, 2, 1], {"ground_truth": ["a", "b", "c"]}), ["repeated", "[1, 2, 1]"]),
    "wrong arrow type": (
        lambda d: d.put([0, 1], {"prompt_ids": pa.array([1, 2], type=pa.int64())}),
        ["'prompt_ids'", "int64", "list<item: int32>"],
    ),
    "values do not convert": (lambda d: d.put([0], {"rm_score": ["high"]}), ["'rm_score'", "float"]),
    "too few values": (lambda d: d.put([0, 1, 2], {"ground_truth": ["a", "b"]}), ["'ground_truth'", "2 values", "3 rows"]),
    "too many values": (
        lambda d: d.put([0], {"response_ids": pa.array([[1], [2]], type=TOKENS)}),
        ["'response_ids'", "2 values", "1 rows"],
    ),
    "record batch wrong type": (
        lambda d: d.put([0], pa.RecordBatch.from_pydict({"rm_score": pa.array([1.0], type=pa.float64())})),
        ["'rm_score'", "double"],
    ),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_raises_dock_error_naming_the_culprit(name):
    call, fragments = BAD_CALLS[name]
    dock = make_dock(num_rows=8, group_size=4, timeout_s=0.5)
    with pytest.raises(DockError) as info:
        call(dock)
    assert not isinstance(info.value, DockTimeoutError)
    for fragment in fragments:
        assert fragment in str(info.value)
    # nothing was written: every cell of the table is still free
    for column in ("prompt_ids", "ground_truth", "response_ids", "rm_score"):
        with pytest.raises(DockError, match="not yet written"):
            dock.get([column], range(8))


def test_second_put_of_a_written_cell_is_refused_and_loses_nothing():
    dock = make_dock(num_rows=4, group_size=2)
    dock.put([0, 1], {"ground_truth": ["a", "b"]})
    with pytest.raises(DockError, match=r"'ground_truth' is already written for rows \[1\]"):
        dock.put([1, 2], {"ground_truth": ["x", "y"]})
    assert dock.get(["ground_truth"], [0, 1]).column(0).to_pylist() == ["a", "b"]
    with pytest.raises(DockError, match="not yet written"):
        dock.get(["ground_truth"], [2])
    # row 2 is still writable, and the claim sees the first put's value for row 1
    dock.put([2, 3], {"ground_truth": ["c", "d"]})
    assert dock.claim("reward", ["ground_truth"], 4).batch.column(0).to_pylist() == ["a", "b", "c", "d"]


@pytest.mark.parametrize(
    "call",
    [
        lambda d: d.put([0], {"ground_truth": ["a"]}),
        lambda d: d.claim("reward", ["prompt_ids"], 1, timeout_s=0.1),
        lambda d: d.get(["prompt_ids"], [0]),
    ],
    ids=["put", "claim", "get"],
)
def test_no_open_iteration(call):
    never_opened = make_dock(timeout_s=0.1, opened=False)
    with pytest.raises(DockError, match="no iteration is open"):
        call(never_opened)
    closed = make_dock(num_rows=2, group_size=1, timeout_s=0.1)
    put_prompts(closed, range(2))
    closed.close_iteration()
    with pytest.raises(DockError, match="no iteration is open") as info:
        call(closed)
    assert not isinstance(info.value, DockTimeoutError)


def test_open_iteration_twice_then_reopen_after_close():
    dock = make_dock(num_rows=4, group_size=2)
    put_prompts(dock, range(4))
    with pytest.raises(DockError, match=r"open_iteration\(1\): iteration 0 is still open"):
        dock.open_iteration(1, 4, 2)
    assert dock.num_rows == 4  # the open iteration is untouched
    dock.close_iteration()
    dock.open_iteration(1, 6, 3)
    assert (dock.num_rows, dock.group_size) == (6, 3)
    with pytest.raises(DockError, match="not yet written"):
        dock.get(["prompt_ids"], [0])
    put_prompts(dock, range(6))
    claim = dock.claim("reward", ["prompt_ids"], 6)
    assert claim.iteration == 1 and claim.rows == list(range(6))


@pytest.mark.parametrize(("num_rows", "group_size"), [(6, 4), (0, 4), (4, 0), (-4, 2)])
def test_open_iteration_invalid_sizes(num_rows, group_size):
    dock = make_dock(timeout_s=0.1, opened=False)
    with pytest.raises(DockError, match=rf"num_rows={num_rows} .*group_size={group_size}"):
        dock.open_iteration(0, num_rows, group_size)
    dock.open_iteration(0, 8, 4)  # the failed call left no iteration open
    assert dock.num_rows == 8


@pytest.mark.parametrize(
    "bad",
    [
        {"ground_truth": [1.5, 2.5]},
        {"ground_truth": ["a"]},
        {"nope": ["a", "b"]},
        {"prompt_ids": pa.array([[1], [2]], type=pa.list_(pa.int64()))},
        "already written",
    ],
    ids=["bad values", "bad length", "unknown column", "bad arrow type", "already written"],
)
def test_put_is_atomic(bad):
    dock = make_dock(num_rows=4, group_size=2)
    good = {"response_ids": [[7], [8, 9]]}
    if bad == "already written":
        dock.put([1], {"prompt_ids": [[5]]})
        bad = {"prompt_ids": [[1], [2]]}
    with pytest.raises(DockError):
        dock.put([0, 1], {**good, **bad})
    with pytest.raises(DockError, match="'response_ids' not yet written for rows \\[0, 1\\]"):
        dock.get(["response_ids"], [0, 1])
    dock.put([0, 1], good)  # would fail if the rejected put had written it
    assert dock.get(["response_ids"], [0, 1]).column(0).to_pylist() == [[7], [8, 9]]


# --- get -----------------------------------------------------------------------------------


def test_get_returns_requested_order_and_does_not_consume():
    dock = make_dock(num_rows=6, group_size=2)
    put_prompts(dock, [4, 1])
    put_prompts(dock, [0, 5, 2, 3])  # cells spread over two chunks, out of order
    batch = dock.get(["prompt_ids"], [3, 0, 5, 1])
    assert batch.schema.names == ["prompt_ids"]
    assert batch.column(0).to_pylist() == [prompt_cell(r) for r in [3, 0, 5, 1]]
    assert dock.get(["prompt_ids"], [2]).column(0).to_pylist() == [prompt_cell(2)]
    claim = dock.claim("reward", ["prompt_ids"], 6)
    assert claim.rows == list(range(6))
    assert claim.batch.column(0).to_pylist() == [prompt_cell(r) for r in range(6)]


def test_get_raises_for_unwritten_cells():
    dock = make_dock(num_rows=4, group_size=2)
    put_prompts(dock, [0, 1])
    dock.put([0], {"response_ids": [[3]]})
    with pytest.raises(DockError, match=r"'prompt_ids' not yet written for rows \[2\]"):
        dock.get(["prompt_ids"], [1, 2])
    with pytest.raises(DockError, match=r"'response_ids' not yet written for rows \[1\]"):
        dock.get(["prompt_ids", "response_ids"], [0, 1])
    both = dock.get(["prompt_ids", "response_ids"], [0])
    assert both.to_pylist() == [{"prompt_ids": prompt_cell(0), "response_ids": [3]}]


# --- Arrow round trip ------------------------------------------------------------------------


def test_arrow_round_trip_of_token_and_log_prob_lists():
    rng = np.random.default_rng(0)
    lengths = [0, 1, 5, 3]
    response = pa.array([rng.integers(0, 2**31 - 1, n, dtype=np.int32) for n in lengths], type=TOKENS)
    logp_np = [-rng.random(n, dtype=np.float32) * np.float32(10) for n in lengths]
    logp = pa.array(logp_np, type=LOGPROBS)
    prompts = [[1, 2, 3], [4], [5, 6], [2**31 - 1, -(2**31)]]
    dock = make_dock(num_rows=4, group_size=2)
    dock.put([0, 1, 2, 3], {"prompt_ids": prompts, "response_ids": response, "rollout_log_prob": logp})
    # python floats that are exact in float32
    dock.put([3, 2, 1, 0], {"ref_log_prob": [[-0.5, -1.25], [], [-3.0], [-0.125]]})

    claim = dock.claim("actor", ["prompt_ids", "response_ids", "rollout_log_prob", "ref_log_prob"], 4)
    batch = claim.batch
    assert batch.schema.field("prompt_ids").type == TOKENS
    assert batch.schema.field("rollout_log_prob").type == LOGPROBS
    assert batch.column("prompt_ids").to_pylist() == prompts
    assert batch.column("response_ids").equals(response)
    assert batch.column("rollout_log_prob").equals(logp)
    assert batch.column("ref_log_prob").to_pylist() == [[-0.125], [-3.0], [], [-0.5, -1.25]]
    values = batch.column("rollout_log_prob").flatten().to_numpy()
    assert values.dtype == np.float32
    np.testing.assert_array_equal(values, np.concatenate(logp_np))


def test_record_batch_put():
    schema = GRPO_SCHEMA.arrow_schema(["response_ids", "truncated", "rollout_log_prob"])
    record = pa.RecordBatch.from_pydict(
        {
            "response_ids": [[11, 12], [13], [], [14, 15, 16]],
            "truncated": [False, True, False, True],
            "rollout_log_prob": [[-0.5, -0.25], [-1.0], [], [-2.0, -4.0, -8.0]],
        },
        schema=schema,
    )
    dock = make_dock(num_rows=4, group_size=2)
    rows = [2, 0, 3, 1]
    dock.put(rows, record)
    got = dock.get(["response_ids", "truncated", "rollout_log_prob"], rows)
    assert got.equals(record)
    claim = dock.claim("reward", ["truncated", "response_ids"], 4)
    assert claim.rows == [0, 1, 2, 3]
    by_row = dict(zip(rows, record.to_pylist()))
    assert claim.batch.to_pylist() == [
        {"truncated": by_row[r]["truncated"], "response_ids": by_row[r]["response_ids"]} for r in range(4)
    ]


# --- property: exactly-once delivery with whole groups ---------------------------------------

CONSUMERS = {"reward": ["prompt_ids", "response_ids"], "advantage": ["rm_score"]}
PUT_COLUMNS = {
    "prompt_ids": prompt_cell,
    "response_ids": lambda r: [r % 7] * (r % 4),
    "rm_score": lambda r: float(r),
}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_every_consumer_gets_every_row_once(data):
    g = data.draw(st.integers(1, 4), label="group_size")
    num_rows = g * data.draw(st.integers(1, 6), label="groups")
    whole = {c: data.draw(st.booleans(), label=f"whole_groups[{c}]") for c in CONSUMERS}
    dock = make_dock(num_rows=num_rows, group_size=g, timeout_s=0.5)

    written = {c: set() for c in PUT_COLUMNS}
    received = {c: [] for c in CONSUMERS}

    def available(consumer: str) -> list[int]:
        taken = set(received[consumer])
        ok = [r not in taken and all(r in written[c] for c in CONSUMERS[consumer]) for r in range(num_rows)]
        if whole[consumer]:
            ok = [all(ok[r - r % g : r - r % g + g]) for r in range(num_rows)]
        return [r for r in range(num_rows) if ok[r]]

    def check_claim(consumer: str, claim: Claim, ready: list[int], count: int) -> None:
        assert len(claim) == count
        assert set(claim.rows) <= set(ready)
        assert not set(claim.rows) & set(received[consumer])
        assert len(set(claim.rows)) == len(claim.rows)
        if whole[consumer]:
            for r in claim.rows:
                assert set(range(r - r % g, r - r % g + g)) <= set(claim.rows), f"partial group in {claim.rows}"
        for column in CONSUMERS[consumer]:
            assert claim.batch.column(column).to_pylist() == [PUT_COLUMNS[column](r) for r in claim.rows]
        received[consumer] += claim.rows

    for _ in range(data.draw(st.integers(0, 20), label="steps")):
        if data.draw(st.booleans(), label="put?"):
            open_cols = [c for c in PUT_COLUMNS if len(written[c]) < num_rows]
            if not open_cols:
                continue
            column = data.draw(st.sampled_from(open_cols), label="column")
            free = data.draw(st.permutations(sorted(set(range(num_rows)) - written[column])), label="order")
            rows = free[: data.draw(st.integers(1, len(free)), label="how many")]
            dock.put(rows, {column: [PUT_COLUMNS[column](r) for r in rows]})
            written[column] |= set(rows)
        else:
            consumer = data.draw(st.sampled_from(sorted(CONSUMERS)), label="consumer")
            ready = available(consumer)
            if not ready:
                continue
            unit = g if whole[consumer] else 1
            count = unit * data.draw(st.integers(1, len(ready) // unit), label="count")
            claim = dock.claim(consumer, CONSUMERS[consumer], count, whole_groups=whole[consumer])
            check_claim(consumer, claim, ready, count)

    for column, fn in PUT_COLUMNS.items():
        rest = sorted(set(range(num_rows)) - written[column])
        if rest:
            dock.put(rest, {column: [fn(r) for r in rest]})
            written[column] |= set(rest)
    for consumer in CONSUMERS:
        left = num_rows - len(received[consumer])
        while left:
            count, ready = min(left, g), available(consumer)
            claim = dock.claim(consumer, CONSUMERS[consumer], g, whole_groups=whole[consumer])
            check_claim(consumer, claim, ready, count)
            left -= count
        assert len(dock.claim(consumer, CONSUMERS[consumer], g, whole_groups=whole[consumer])) == 0
        assert sorted(received[consumer]) == list(range(num_rows))
