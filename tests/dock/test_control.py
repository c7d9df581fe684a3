"""The dock's control channel: iteration announcements, stage reports, finish — in-process and over Flight."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from dockrl.config import DockConfig
from dockrl.dock import GRPO_SCHEMA, Dock, DockError, DockTimeoutError, open_dock
from dockrl.dock.client.dock_client import DockClient
from dockrl.dock.flight.shards import start_local_shards

TOKEN = "control-token"


@pytest.fixture(params=["inprocess", "inprocess-2shards", "2shards"])
def dock(request: pytest.FixtureRequest) -> Iterator[Dock]:
    """A fresh dock per test (control state lives for a dock's lifetime)."""
    if request.param.startswith("inprocess"):
        local = open_dock(DockConfig(timeout_s=5.0, shards=2 if "2shards" in request.param else 1), GRPO_SCHEMA, run="test")
        yield local
        local.close()
        return
    servers, locations = start_local_shards(2, GRPO_SCHEMA, token=TOKEN)
    client = DockClient(locations, GRPO_SCHEMA, token=TOKEN, timeout_s=5.0, rpc_timeout_s=10.0)
    yield client
    client.close()
    for server in servers:
        server.close()


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    """Run ``fn`` in a thread; the dict gets ``value``/``error`` and ``at`` (monotonic end time)."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e
        out["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_wait_iteration_returns_the_open_iteration_newer_than_after(dock):
    dock.open_iteration(0, 4, 2)
    assert dock.wait_iteration(-1) == 0
    with pytest.raises(DockTimeoutError, match=r"after=0.*no iteration after 0 was opened \(open now: 0\)"):
        dock.wait_iteration(0, timeout_s=0.2)
    dock.close_iteration()
    with pytest.raises(DockTimeoutError, match="open now: None"):
        dock.wait_iteration(0, timeout_s=0.1)
    dock.open_iteration(1, 4, 2)
    assert dock.wait_iteration(0) == 1


def test_wait_iteration_wakes_when_the_iteration_opens(dock):
    thread, out = in_thread(dock.wait_iteration, 4, timeout_s=10.0)
    time.sleep(0.3)
    assert thread.is_alive()  # blocked: nothing newer than 4 is open
    opened = time.monotonic()
    dock.open_iteration(5, 4, 2)
    thread.join(5)
    assert out.get("value") == 5
    assert out["at"] - opened < 1.0  # woken by the open, not by a poll interval or the timeout


def test_finish_ends_the_stage_loops(dock):
    waiting, out = in_thread(dock.wait_iteration, 0, timeout_s=10.0)
    time.sleep(0.2)
    finished = time.monotonic()
    dock.finish()
    waiting.join(5)
    assert "value" in out and out["value"] is None and out["at"] - finished < 1.0
    assert dock.wait_iteration(7) is None  # later calls return at once
    dock.open_iteration(8, 2, 2)  # an iteration still open after finish() is still handed out
    assert dock.wait_iteration(7) == 8


def test_wait_reports_blocks_until_every_stage_reported(dock):
    dock.report(3, "rollout", {"rollout/response_length_mean": 12, "timing_s/rollout": 0.5})
    thread, out = in_thread(dock.wait_reports, 3, ["rollout", "actor"], timeout_s=10.0)
    time.sleep(0.3)
    assert thread.is_alive()
    reported = time.monotonic()
    dock.report(3, "actor", {"actor/loss": -0.25})
    thread.join(5)
    assert out["value"] == {"rollout": {"rollout/response_length_mean": 12.0, "timing_s/rollout": 0.5}, "actor": {"actor/loss": -0.25}}
    assert out["at"] - reported < 1.0
    assert dock.wait_reports(3, ["actor"]) == {"actor": {"actor/loss": -0.25}}  # a subset, at once


def test_wait_reports_timeout_names_the_missing_stages(dock):
    dock.report(0, "reward", {"reward/mean": 0.1})
    start = time.monotonic()
    with pytest.raises(DockTimeoutError, match=r"stages \['rollout', 'actor'\] have not reported iteration 0 \(reported: \['reward'\]\)"):
        dock.wait_reports(0, ["rollout", "reward", "actor"], timeout_s=0.3)
    assert 0.3 <= time.monotonic() - start < 3.0


def test_reports_are_per_iteration_and_pseudo_iterations_work(dock):
    dock.report(-1, "rollout", {"eval/accuracy": 0.25})
    dock.report(0, "rollout", {"reward/mean": float("nan")})
    assert dock.wait_reports(-1, ["rollout"]) == {"rollout": {"eval/accuracy": 0.25}}
    assert math.isnan(dock.wait_reports(0, ["rollout"])["rollout"]["reward/mean"])
    with pytest.raises(DockTimeoutError, match="have not reported iteration 1"):
        dock.wait_reports(1, ["rollout"], timeout_s=0.05)


def test_bad_reports_are_refused(dock):
    dock.report(0, "reward", {"reward/mean": 1.0})
    with pytest.raises(DockError, match="stage 'reward' already reported iteration 0"):
        dock.report(0, "reward", {"reward/mean": 2.0})
    with pytest.raises(DockError, match="metric 'reward/mean' is 'high'"):
        dock.report(1, "reward", {"reward/mean": "high"})
    with pytest.raises(DockError, match="metric 'ok' is True"):
        dock.report(1, "reward", {"ok": True})
    with pytest.raises(DockError, match="stage must be a non-empty string"):
        dock.report(1, "", {})
    with pytest.raises(DockError, match="at least one stage"):
        dock.wait_reports(1, [])
    assert dock.wait_reports(0, ["reward"]) == {"reward": {"reward/mean": 1.0}}  # the first report stands


def test_shard_without_rows_still_announces_the_iteration():
    servers, locations = start_local_shards(2, GRPO_SCHEMA)
    try:
        with DockClient(locations, GRPO_SCHEMA, timeout_s=5.0) as client:
            client.open_iteration(0, 2, 2)  # one group: shard 0 (the control shard) owns no row
            assert client.wait_iteration(-1) == 0
            client.close_iteration()
            with pytest.raises(DockTimeoutError):
                client.wait_iteration(-1, timeout_s=0.1)
    finally:
        for server in servers:
            server.close()


def test_closing_the_shard_fails_blocked_waits():
    servers, locations = start_local_shards(1, GRPO_SCHEMA)
    client = DockClient(locations, GRPO_SCHEMA, timeout_s=30.0)
    waiting, out = in_thread(client.wait_reports, 0, ["actor"])
    time.sleep(0.3)
    start = time.monotonic()
    servers[0].close()  # returns once the blocked call has answered
    waiting.join(5)
    assert time.monotonic() - start < 5.0
    assert isinstance(out.get("error"), DockError) and "shutting down" in str(out["error"])
    client.close()


def test_an_iteration_is_handed_out_only_once_open_on_every_shard():
    servers, locations = start_local_shards(2, GRPO_SCHEMA)
    try:
        with DockClient(locations, GRPO_SCHEMA, timeout_s=5.0) as driver, DockClient(locations, GRPO_SCHEMA, timeout_s=5.0) as stage:
            # shard 0 (the control shard) alone opened, as midway through the driver's open_iteration
            driver.core.action(0, "open_iteration", {"iteration": 0, "num_rows": 4, "group_size": 2, "first_row": 0,
                                                 "stop_row": 2, "shard": 0, "num_shards": 2})
            with pytest.raises(DockTimeoutError):
                stage.wait_iteration(-1, timeout_s=0.2)
            driver.close_iteration()
            driver.open_iteration(0, 4, 2)
            assert stage.wait_iteration(-1) == 0 and stage.num_rows == 4  # every shard agrees on the layout
            with pytest.raises(DockError, match=r"announce\(3\): iteration 0 is open"):
                driver.core.action(0, "announce_iteration", {"iteration": 3})
    finally:
        for server in servers:
            server.close()


def test_a_shard_process_stops_at_once_on_sigterm_while_calls_block_in_it():
    cmd = [sys.executable, "-m", "dockrl.dock.flight.shards", "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(60.0, proc.kill)  # a hung shard fails the test instead of hanging it
    watchdog.start()
    try:
        location = proc.stdout.readline().strip()
        client = DockClient([location], GRPO_SCHEMA, timeout_s=60.0)
        client.open_iteration(0, 2, 2)
        claim, claim_out = in_thread(client.claim, "reward", ["response_ids"], 2)
        wait, wait_out = in_thread(client.wait_reports, 0, ["actor"])
        time.sleep(0.5)
        assert claim.is_alive() and wait.is_alive()
        start = time.monotonic()
        proc.terminate()
        proc.wait(timeout=30)
        assert time.monotonic() - start < 5.0  # not after the blocked calls' 60 s
        assert proc.returncode == 0, proc.stderr.read()
        claim.join(10)
        wait.join(10)
        assert "error" in claim_out and "error" in wait_out
        client.close()
    finally:
        watchdog.cancel()
        proc.kill()
