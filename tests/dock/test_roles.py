"""Tokens scoped by role: a shard process started as the launcher starts it (the driver's token and
one token per stage process, each with its rights from the stage table) lets a stage claim and put
its own columns only, and only the driver finish, drop, restore or snapshot, and snapshots only to
the run's places."""

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

from dockrl.config import load_config
from dockrl.dock import GRPO_SCHEMA
from dockrl.dock.client.dock_client import DockClient
from dockrl.dock.flight.server import DockShardServer
from dockrl.dock.roles import DRIVER, DRIVER_ACTIONS, AccessDenied, ShardAccess, StageRights
from dockrl.launch.distributed import stage_rights
from dockrl.process.env import DRIVER_TOKEN_ENV, stage_token_env

DRIVER_TOKEN = "driver-token"
TOKENS = {"rollout": "rollout-token", "reward": "reward-token"}
DENIED = "is the driver's; a stage's token may not call it"
SAMPLING = load_config(None, ["algorithm.filter_groups.enable=true"])


@pytest.fixture
def shard_process(tmp_path) -> Iterator[tuple[str, Path]]:
    """A dock shard in a process of its own, as the launcher starts it: the driver's token, the rollout's and
    the reward's with their rights (``stage_rights``), the run folder as its one place."""
    run, cfg = tmp_path / "run", load_config(None, [])
    env = {**os.environ, DRIVER_TOKEN_ENV: DRIVER_TOKEN, **{stage_token_env(s): t for s, t in TOKENS.items()}}
    rights = [arg for s in TOKENS for arg in ("--stage-rights", stage_rights(cfg, s).to_arg(stage_token_env(s)))]
    cmd = [sys.executable, "-m", "dockrl", "dock-shard", "--host", "127.0.0.1", "--port", "0", "--token-env", DRIVER_TOKEN_ENV,
           *rights, "--snapshot-place", str(run)]
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


def test_each_stage_token_claims_and_puts_its_own_columns_only(shard_process):
    location, _ = shard_process
    driver, rollout, reward = client(location, DRIVER_TOKEN), client(location, TOKENS["rollout"]), client(location, TOKENS["reward"])
    try:
        driver.open_iteration(0, 4, 2)
        driver.put(range(4), {"prompt_ids": [[1, 2]] * 4, "ground_truth": ["1"] * 4})
        # the rollout (it runs model code) may not act as the reward, nor read or write what comes after it
        with pytest.raises(flight.FlightUnauthorizedError, match="may not act as consumer 'reward'"):
            rollout.claim("reward", ["prompt_ids"], 4)
        claim = rollout.claim("rollout", ["prompt_ids"], 4, whole_groups=True)
        assert claim.rows == [0, 1, 2, 3]
        for columns in ({"rm_score": [9.0] * 4}, {"advantages": [[9.0]] * 4}, {"response_ids": [[3]] * 4, "correct": [True] * 4},
                        {"ground_truth": ["2"] * 4}):
            with pytest.raises(flight.FlightUnauthorizedError, match=r"rollout stage's token may not put columns \['"):
                rollout.put(claim.rows, columns)
        rollout.put(claim.rows, {"response_ids": [[3]] * 4, "truncated": [False] * 4, "rollout_log_prob": [[-0.5]] * 4}, ack=claim)
        # the reward: its own consumer and columns, none of the rollout's
        scored = reward.claim("reward", ["response_ids", "ground_truth"], 4)
        assert scored.rows == [0, 1, 2, 3]
        with pytest.raises(flight.FlightUnauthorizedError, match=r"reward stage's token may not put columns \['response_ids'\]"):
            reward.put(scored.rows, {"response_ids": [[4]] * 4})
        reward.put(scored.rows, {"rm_score": [1.0] * 4, "correct": [True] * 4}, ack=scored)
        with pytest.raises(flight.FlightUnauthorizedError, match=r"rollout stage's token may not read columns \['rm_score'\]"):
            rollout.get(["rm_score"], [0])
        with pytest.raises(flight.FlightUnauthorizedError, match=r"may not read columns \['rm_score'\]"):
            raw_action(location, TOKENS["rollout"], "claim", {"iteration": 0, "consumer": "rollout", "columns": ["rm_score"], "count": 4,
                                                              "at_least": 0, "whole_groups": False, "timeout_s": 1.0})
        advantages = reward.claim("advantage", ["rm_score", "response_ids"], 4, whole_groups=True)  # in the reward's process
        reward.put(advantages.rows, {"advantages": [[0.5]] * 4, "returns": [[0.5]] * 4}, ack=advantages)
        cells = driver.get(["rm_score", "advantages"], [0])
        assert (cells.column("rm_score").to_pylist(), cells.column("advantages").to_pylist()) == ([1.0], [[0.5]])
    finally:
        for c in (rollout, reward, driver):
            c.close()


def refuse_drivers_verbs(location: str, token: str, run: Path) -> None:
    stage = client(location, token)
    try:
        for call in (stage.finish, lambda: stage.drop([0]), lambda: stage.snapshot(str(run / "checkpoints" / "dock")),
                     lambda: raw_action(location, token, "restore", {"uri": str(run), "layout": None}),
                     lambda: stage.open_iteration(1, 4, 2)):
            with pytest.raises(flight.FlightUnauthorizedError, match=DENIED):
                call()
    finally:
        stage.close()


def test_no_stage_token_calls_the_drivers_verbs(shard_process):
    location, run = shard_process
    driver = client(location, DRIVER_TOKEN)
    try:
        driver.open_iteration(0, 4, 2)
        for token in TOKENS.values():
            refuse_drivers_verbs(location, token, run)
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
        driver.close()


def access(cfg=None) -> ShardAccess:
    cfg = cfg or load_config(None, [])
    return ShardAccess(DRIVER_TOKEN, GRPO_SCHEMA, tuple((TOKENS[s], stage_rights(cfg, s)) for s in TOKENS))


def test_a_wrong_token_has_no_role():
    assert [access().role(f"Bearer {t}") for t in (DRIVER_TOKEN, *TOKENS.values(), "other", "")] == [DRIVER, "rollout", "reward", None, None]
    assert ShardAccess(DRIVER_TOKEN, GRPO_SCHEMA).role(f"Bearer {TOKENS['rollout']}") is None  # one token: the driver's only


def test_with_dynamic_sampling_the_advantage_stage_alone_may_drop_and_release_rounds():
    sampling = access(SAMPLING)
    sampling.check_action("reward", "drop", {"iteration": 0, "rows": [1]})
    sampling.check("reward", writes=["released", "advantages"])
    for action in sorted(DRIVER_ACTIONS - {"drop"}):
        with pytest.raises(AccessDenied, match=DENIED):
            sampling.check_action("reward", action, {"uri": "/x"})
    with pytest.raises(AccessDenied, match=DENIED):
        sampling.check_action("rollout", "drop", {"iteration": 0, "rows": [1]})
    with pytest.raises(AccessDenied, match=r"may not put columns \['prompt_ids'\]"):
        sampling.check_action("reward", "commit", {"objects": {"prompt_ids": {}, "released": {}}})
    with pytest.raises(AccessDenied, match=r"rollout stage's token may not put columns \['released'\]"):
        sampling.check("rollout", writes=["released"])
    with pytest.raises(AccessDenied, match=DENIED):  # without dynamic sampling no stage drops
        access().check_action("reward", "drop", {"iteration": 0, "rows": [1]})


def test_a_commit_and_its_ack_are_checked_as_a_put():
    rights = access()
    rights.check_action("reward", "commit", {"objects": {"rm_score": {}}, "ack": {"consumer": "reward", "lease": "l"}})
    with pytest.raises(AccessDenied, match="may not act as consumer 'actor'"):
        rights.check_action("reward", "commit", {"objects": {"rm_score": {}}, "ack": {"consumer": "actor", "lease": "l"}})
    with pytest.raises(AccessDenied, match=r"may not read columns \['advantages'\]"):
        rights.check_action("rollout", "locate", {"columns": ["advantages"], "rows": [0]})


def test_stage_rights_travel_as_an_argument_and_bad_ones_are_named():
    rights = stage_rights(SAMPLING, "reward")
    assert StageRights.from_arg(rights.to_arg("ENV")) == ("ENV", rights)
    for bad, field in (("[]", "exactly the fields"), (rights.to_arg("ENV").replace('"drop": true', '"drop": 1'), "'drop' must be a bool"),
                       ("{", "not JSON")):
        with pytest.raises(ValueError, match=field):
            StageRights.from_arg(bad)
    unknown = StageRights(stage="rollout", consumers=frozenset({"rollout"}), reads=frozenset({"scores"}), writes=frozenset())
    with pytest.raises(ValueError, match=r"name \['scores'\], which schema v\d+ has neither"):
        ShardAccess(DRIVER_TOKEN, GRPO_SCHEMA, (("t", unknown),))


def test_s3_places_need_the_same_bucket_prefix_and_endpoint(tmp_path):
    place = "s3://dockrl/runs/r1?endpoint_override=minio%3A9000&scheme=http"
    places = ShardAccess(DRIVER_TOKEN, GRPO_SCHEMA, snapshot_places=(place,))
    places.check_place("s3://dockrl/runs/r1/checkpoints/iter_1/dock?endpoint_override=minio%3A9000&scheme=http")
    for uri in ("s3://dockrl/runs/r1/dock?endpoint_override=evil%3A9000&scheme=http",  # another endpoint
                "s3://other/runs/r1/dock?endpoint_override=minio%3A9000&scheme=http",  # another bucket
                "s3://dockrl/runs/r10/dock?endpoint_override=minio%3A9000&scheme=http",  # a sibling prefix
                "s3://dockrl/runs/r1/../r2/dock?endpoint_override=minio%3A9000&scheme=http", str(tmp_path / "run")):
        with pytest.raises(AccessDenied, match="outside the run's places"):
            places.check_place(uri)


def test_stage_tokens_without_the_drivers_are_refused():
    with pytest.raises(ValueError, match="stage tokens need the driver's token too"):
        DockShardServer(GRPO_SCHEMA, stages=(("t", stage_rights(load_config(None, []), "rollout")),))
