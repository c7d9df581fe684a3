"""The experiment trackers (``run.trackers``): the registry, the guard that keeps their failures from training,
and real runs of the tiny model logging to a real ``mlflow server`` (SQLite store, local artifact folder) started
here, to W&B offline (read back from its own transaction log), and to a server killed mid-run."""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import subprocess
import sys
import time
import typing
import urllib.request
from pathlib import Path

import pytest

from dockrl import driver
from dockrl.config import ConfigError, load_config, load_config_text
from dockrl.config.trackers import TRACKERS, TrackerName
from dockrl.process.source import commit_label
from dockrl.rollouts.keep import config_hash
from dockrl.run.trackers import RunInfo, TrackerSet

# ---- the registry and the config ----


def test_the_literal_is_the_registry():
    assert typing.get_args(TrackerName) == tuple(TRACKERS)
    for name, entry in TRACKERS.items():
        assert callable(entry.load()), name


def test_run_trackers_is_checked_at_load():
    assert load_config(None, []).run.trackers == ("tensorboard",)
    assert load_config(None, ["run.trackers=tensorboard,mlflow"]).run.trackers == ("tensorboard", "mlflow")
    assert load_config_text("run:\n  trackers: []\n", "a file").run.trackers == ()
    with pytest.raises(ConfigError, match=r"run.trackers\[1\]: got 'mlfow'; expected one of 'tensorboard', 'mlflow', 'wandb'"):
        load_config(None, ["run.trackers=tensorboard,mlfow"])
    with pytest.raises(ConfigError, match="run.trackers: got .*expected each tracker at most once"):
        load_config(None, ["run.trackers=wandb,wandb"])
    with pytest.raises(ConfigError, match="run.wandb_mode: got 'local'"):
        load_config(None, ["run.wandb_mode=local"])


def test_mlflow_without_a_tracking_uri_fails_before_the_run_naming_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match=r"run.trackers: got 'mlflow'; needs the tracking server's URI in \$MLFLOW_TRACKING_URI"):
        TrackerSet.open(("mlflow",), RunInfo(run_dir=tmp_path))


# ---- the guard, with a fake tracker ----


class FakeTracker:
    """Fake: keeps what it is given; raises while ``down``."""

    def __init__(self):
        self.down, self.started, self.logged, self.files, self.finished = False, 0, [], [], None

    def _answer(self):
        if self.down:
            raise ConnectionError("server gone")

    def start(self):
        self._answer()
        self.started += 1

    def log(self, iteration, metrics):
        self._answer()
        self.logged.append((iteration, dict(metrics)))

    def log_artifacts(self, paths):
        self._answer()
        self.files += list(paths)

    def finish(self, summary, failed):
        self._answer()
        self.finished = (dict(summary), failed)


def test_a_failing_tracker_is_counted_warned_once_retried_with_backoff_and_sent_what_it_missed(caplog):
    now = [0.0]
    fake, healthy = FakeTracker(), FakeTracker()
    trackers = TrackerSet({"fake": fake, "healthy": healthy}, clock=lambda: now[0], retry_first_s=5, retry_max_s=20)
    trackers.log(0, {"reward/mean": 0.0})
    fake.down = True
    with caplog.at_level(logging.WARNING, logger="dockrl.run.trackers.guard"):
        for it in range(1, 8):  # one iteration a second: tries at 1 (fails), 6 (fails), 16 (within the loop: none)
            now[0] = float(it)
            trackers.log(it, {"reward/mean": float(it)})
    assert trackers.counters() == {"tracker/fake/failures": 2}
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "tracker fake failed at iteration 1 (ConnectionError: server gone); training goes on" in warning.getMessage()
    assert [i for i, _ in fake.logged] == [0] and [i for i, _ in healthy.logged] == list(range(8))
    fake.down, now[0] = False, 16.0  # back, and the backoff (5, then 10 s) has passed
    trackers.log(8, {"reward/mean": 8.0})
    assert [i for i, _ in fake.logged] == list(range(9)) and fake.started == 1  # every iteration, in order, once
    assert trackers.finish({"run/seconds": 3.0}, [Path("metrics.png")]) == {"tracker/fake/failures": 2, "tracker/fake/unsent": 0}
    assert fake.finished == ({"run/seconds": 3.0}, False) and fake.files == [Path("metrics.png")]


def test_finish_tries_a_failing_tracker_once_more_and_counts_what_never_arrived():
    now = [0.0]
    fake = FakeTracker()
    trackers = TrackerSet({"fake": fake}, clock=lambda: now[0])
    fake.down = True
    for it in range(3):
        trackers.log(it, {"x": 1.0})  # the first fails; the others wait out the backoff
    assert trackers.finish({}, failed=True) == {"tracker/fake/failures": 2, "tracker/fake/unsent": 3}
    assert fake.finished is None and fake.logged == []


# ---- real runs ----


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """A real ``mlflow server`` on 127.0.0.1: SQLite store and artifact folder under ``root``."""

    def __init__(self, root: Path, start_timeout_s: float = 180.0):
        self.port, self.root = _free_port(), root
        root.mkdir(parents=True, exist_ok=True)
        self.log = open(root / "server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts")],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.read().strip() == b"OK":
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"mlflow server on port {self.port} did not answer /health within {start_timeout_s:.0f} s "
                                   f"(exit code {self.proc.returncode}): {(root / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)  # its own session: the server and its uvicorn worker
            self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture
def mlflow_server(tmp_path):
    server = MlflowServer(tmp_path / "mlflow")
    yield server
    server.stop()


def _cfg(tiny_model_dir, tmp_path, *overrides):
    """The cheapest real run with several iterations: the tiny model, 3 iterations of 2 prompts × 2 samples, no
    evaluation, a fake scorer (the tiny model never answers well-formed), every row kept (the rollouts page)."""
    return load_config(None, [
        f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={tmp_path / 'cache'}",
        "run.progress=false", "trainer.iterations=3", "trainer.global_batch=2", "trainer.mini_batch=2",
        "trainer.micro_batch=4", "rollout.n=2", "rollout.max_response_length=8", "rollout.dtype=float32",
        "trainer.autocast_bf16=false", "trainer.eval_before=false", "trainer.eval_after=false", "trainer.save_every=0",
        "data.generate_train=8", "data.generate_test=4", "data.eval_size=4", "algorithm.scorer=fake_scorers:FakeRandomScorer",
        *overrides,
    ])


def read_wandb_history(run_file: Path) -> tuple[list[dict], dict]:
    """The history rows (``_step`` and the values) and the config of a W&B run's transaction log (``run-<id>.wandb``):
    W&B's record format (LevelDB's log: 32 KiB blocks of records with a 7-byte header, after a 7-byte file header
    ``:W&B``, magic 0xBEE1, version 0), each record a ``wandb_internal_pb2.Record`` of W&B's own schema."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{run_file} is no W&B transaction log"
    records, chunk, offset = [], b"", 7
    while offset + 7 <= len(data):
        left_in_block = 32768 - offset % 32768
        if left_in_block < 7:  # a block's tail too short for a header is padding
            offset += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        if kind == 0 and length == 0:
            break
        chunk += data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    rows, config = [], {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item}
            rows.append({"_step": record.history.step.num} | row)
        elif kind in ("run", "config"):  # the config comes with the run record, and its updates after
            updates = record.run.config.update if kind == "run" else record.config.update
            config |= {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in updates}
    return rows, config


@pytest.mark.slow
def test_a_run_logs_every_iteration_config_lineage_and_report_to_mlflow_and_wandb_offline(
        tiny_model_dir, tmp_path, mlflow_server, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    monkeypatch.setenv("WANDB_MODE", "offline")  # and no network: nothing is sent anywhere
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("DOCKRL_IMAGE", "registry.example.com/dockrl-cpu:0.1.0")
    cfg = _cfg(tiny_model_dir, tmp_path, "run.trackers=tensorboard,mlflow,wandb", "run.wandb_mode=offline",
               "run.tracker_project=trackers-test", "run.keep_rollouts=all")
    summary = driver.train(cfg)
    run = tmp_path / "run"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [0, 1, 2] and not any(k.startswith("tracker/") for x in lines for k in x)
    assert not any(k.startswith("tracker/") for k in summary)  # no tracker failed
    ids = json.loads((run / "trackers.json").read_text())

    client = MlflowClient(mlflow_server.uri)
    [experiment] = [e for e in client.search_experiments() if e.name == "trackers-test"]
    [mlrun] = client.search_runs([experiment.experiment_id])
    assert mlrun.info.run_id == ids["mlflow"] and mlrun.info.status == "FINISHED" and mlrun.info.run_name == "run"
    for key in ("reward/mean", "actor/loss", "timing_s/iteration"):
        history = client.get_metric_history(mlrun.info.run_id, key)
        assert sorted((m.step, m.value) for m in history) == [(x["iteration"], pytest.approx(x[key])) for x in lines], key
    params, tags = mlrun.data.params, mlrun.data.tags
    assert params["trainer.iterations"] == "3" and params["rollout.n"] == "2" and params["run.trackers"] == str(cfg.run.trackers)
    assert tags["dockrl.config_sha256"] == config_hash(cfg) and tags["dockrl.resumed_from"] == ""
    assert tags["dockrl.image"] == "registry.example.com/dockrl-cpu:0.1.0" and tags["dockrl.commit"] == commit_label()
    artifacts = {a.path: a.file_size for a in client.list_artifacts(mlrun.info.run_id)}
    assert {"config.yaml", "metrics.png", "metrics.html", "rollouts.html"} <= artifacts.keys()
    assert all(artifacts[name] > 0 for name in ("metrics.png", "metrics.html", "rollouts.html"))
    curves = Path(client.download_artifacts(mlrun.info.run_id, "metrics.html", str(tmp_path / "down")))
    assert "3 iteration(s)" in curves.read_text()

    [run_file] = (run / "wandb").glob(f"offline-run-*-{ids['wandb']}/run-{ids['wandb']}.wandb")
    rows, config = read_wandb_history(run_file)
    assert [r["_step"] for r in rows] == [0, 1, 2]
    assert [r["reward/mean"] for r in rows] == [pytest.approx(x["reward/mean"]) for x in lines]
    assert config["trainer"]["iterations"] == 3
    assert config["lineage"]["config_sha256"] == config_hash(cfg)
    assert any((run / "tensorboard").iterdir())


@pytest.mark.slow
def test_a_tracking_server_killed_mid_run_does_not_fail_training_and_is_counted_and_reported(
        tiny_model_dir, tmp_path, mlflow_server, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # a refused connection fails at once: the test stays short
    cfg = _cfg(tiny_model_dir, tmp_path, "run.trackers=mlflow")

    def kill_after_first(iteration, _metrics):
        if iteration == 0:
            mlflow_server.stop()

    with caplog.at_level(logging.WARNING, logger="dockrl.run.trackers.guard"):
        summary = driver.train(cfg, on_iteration=kill_after_first)
    run = tmp_path / "run"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [0, 1, 2]  # trained to the end
    assert "tracker/mlflow/failures" not in lines[0] and lines[1]["tracker/mlflow/failures"] == 1
    assert summary["tracker/mlflow/failures"] >= 2  # iteration 1's attempt and the end's
    assert summary["tracker/mlflow/unsent"] == 2  # iterations 1 and 2 never reached it
    assert json.loads((run / "summary.json").read_text())["tracker/mlflow/failures"] == summary["tracker/mlflow/failures"]
    [warning] = [r.getMessage() for r in caplog.records if r.name == "dockrl.run.trackers.guard" and r.levelno == logging.WARNING]
    assert warning.startswith("tracker mlflow failed at iteration 1 (") and "training goes on" in warning
