"""Tokens scoped by role: a shard process started with the driver's and the stages' tokens lets a
stage claim and put its columns, and only the driver finish, drop, restore or snapshot, and
snapshots only to the run's places."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pyarrow.flight as flight
import pytest

from dockrl.dock import GRPO_SCHEMA
from dockrl.dock.client.dock_client import DockClient
from dockrl.dock.flight.server import DockShardServer
from dockrl.dock.roles import DRIVER_ACTIONS, AccessDenied, ShardAccess

DRIVER, STAGE = "driver-token", "stage-token"
DENIED = "is the driver's; a stage's token may not call it"


@pytest.fixture
def shard_process(tmp_path) -> Iterator[tuple[str, Path]]:
    """A dock shard in a process of its own, as the launcher starts it: two tokens, the run folder as its one place."""
    run = tmp_path / "run"
    env = {**os.environ, "DOCKRL_DOCK_DRIVER_TOKEN": DRIVER, "DOCKRL_DOCK_TOKEN": STAGE}
    cmd = [sys.executable, "-m", "dockrl", "dock-shard", "--host", "127.0.0.1", "--port", "0", "--token-env",
           "DOCKRL_DOCK_DRIVER_TOKEN", "--stage-token-env", "DOCKRL_DOCK_TOKEN", "--snapshot-place", str(run)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(60.0, proc.kill)  # a hung start fails the test instead of hanging it
    watchdog.start()
    try:
        location = proc.stdout.readline().strip()
        assert location.startswith("grpc://127.0.0.1:"), proc.stderr.read() if proc.poll() is not None else location
        yield location, run
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        finally:
            watchdog.cancel()


def client(location: str, token: str) -> DockClient:
    return DockClient([location], GRPO_SCHEMA, token=token, timeout_s=10.0, rpc_timeout_s=10.0)


def raw_action(location: str, token: str, name: str, body: dict) -> None:
    """Call action ``name`` on the shard directly (past the client's own checks, as an attacker would)."""
    raw = flight.connect(location)
    try:
        opts = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {token}".encode())], timeout=10.0)
        list(raw.do_action(flight.Action(name, json.dumps(body).encode()), opts))
    finally:
        raw.close()


def test_a_stage_token_claims_and_puts_its_columns_and_nothing_of_the_drivers(shard_process):
    location, run = shard_process
    driver, stage = client(location, DRIVER), client(location, STAGE)
    try:
        driver.open_iteration(0, 4, 2)
        driver.put(range(4), {"prompt_ids": [[1, 2]] * 4, "ground_truth": ["1"] * 4})
        claim = stage.claim("rollout", ["prompt_ids"], 4, whole_groups=True)
        assert claim.rows == [0, 1, 2, 3]
        stage.put(claim.rows, {"response_ids": [[3]] * 4, "truncated": [False] * 4}, ack=claim)  # its own columns
        with pytest.raises(flight.FlightUnauthorizedError, match=r"columns \['ground_truth'\] are the driver's"):
            stage.put([0], {"ground_truth": ["2"]})
        for call in (stage.finish, lambda: stage.drop([0]), lambda: stage.snapshot(str(run / "checkpoints" / "dock")),
                     lambda: raw_action(location, STAGE, "restore", {"uri": str(run), "layout": None}),
                     lambda: stage.open_iteration(1, 4, 2)):
            with pytest.raises(flight.FlightUnauthorizedError, match=DENIED):
                call()
        # the driver may; and snapshots only under the run's places
        driver.snapshot(str(run / "checkpoints" / "iter_1" / "dock"))
        assert (run / "checkpoints" / "iter_1" / "dock").is_dir()
        for outside in (str(run.parent / "elsewhere"), str(run / ".." / "elsewhere"), "s3://bucket/run/dock"):
            with pytest.raises(flight.FlightUnauthorizedError, match="outside the run's places"):
                driver.snapshot(outside)
        assert not (run.parent / "elsewhere").exists()
        driver.drop([3])
        driver.finish()
    finally:
        stage.close()
        driver.close()


def test_a_wrong_token_has_no_role():
    access = ShardAccess(DRIVER, STAGE, GRPO_SCHEMA)
    assert [access.role(f"Bearer {t}") for t in (DRIVER, STAGE, "other", "")] == ["driver", "stage", None, None]
    assert ShardAccess(DRIVER, None, GRPO_SCHEMA).role(f"Bearer {STAGE}") is None  # one token: the driver's only


def test_with_dynamic_sampling_stages_may_drop_and_release_rounds_only():
    access = ShardAccess(DRIVER, STAGE, GRPO_SCHEMA, stages_sample=True)
    access.check_action("stage", "drop", {"iteration": 0, "rows": [1]})
    access.check_columns("stage", ["released", "advantages"])
    for action in sorted(DRIVER_ACTIONS - {"drop"}):
        with pytest.raises(AccessDenied, match=DENIED):
            access.check_action("stage", action, {"uri": "/x"})
    with pytest.raises(AccessDenied, match=r"\['prompt_ids'\] are the driver's"):
        access.check_action("stage", "commit", {"objects": {"prompt_ids": {}, "released": {}}})


def test_s3_places_need_the_same_bucket_prefix_and_endpoint():
    place = "s3://dockrl/runs/r1?endpoint_override=minio%3A9000&scheme=http"
    access = ShardAccess(DRIVER, STAGE, GRPO_SCHEMA, snapshot_places=(place,))
    access.check_place("s3://dockrl/runs/r1/checkpoints/iter_1/dock?endpoint_override=minio%3A9000&scheme=http")
    for uri in ("s3://dockrl/runs/r1/dock?endpoint_override=evil%3A9000&scheme=http",  # another endpoint
                "s3://other/runs/r1/dock?endpoint_override=minio%3A9000&scheme=http",  # another bucket
                "s3://dockrl/runs/r10/dock?endpoint_override=minio%3A9000&scheme=http",  # a sibling prefix
                "s3://dockrl/runs/r1/../r2/dock?endpoint_override=minio%3A9000&scheme=http", "/tmp/run"):
        with pytest.raises(AccessDenied, match="outside the run's places"):
            access.check_place(uri)


def test_a_stage_token_without_the_drivers_is_refused():
    with pytest.raises(ValueError, match="a stage_token needs the driver's token too"):
        DockShardServer(GRPO_SCHEMA, stage_token=STAGE)
