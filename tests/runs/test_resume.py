"""Checkpoints with dock snapshots and resumed runs (dockrl/checkpoint/resume.py), in-process mode end to end."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dockrl import driver
from dockrl.checkpoint.optimizer_state import load_optimizer, optimizer_file, save_optimizer
from dockrl.checkpoint.resume import (
    STATE_FILE,
    checkpoint_dir,
    checkpoint_due,
    dock_snapshot_places,
    dock_snapshot_uri,
    final_dir,
    latest_checkpoint,
    prepare_checkpoint,
    write_driver_state,
    write_final_state,
)
from dockrl.checkpoint.resume_point import check_resume_prompts, find_resume, prompts_fingerprint
from dockrl.config import ConfigError, load_config
from dockrl.dock import GRPO_SCHEMA
from dockrl.dock.roles import AccessDenied, ShardAccess
from dockrl.engines.micro_batching import adamw
from dockrl.process.seeding import iteration_seed
from dockrl.run.metrics import MetricsWriter

FAKES = Path(__file__).parents[1]  # fake_scorers.py
VARYING = ("timing_s/", "perf/", "dock/", "memory/", "weight_sync/seconds", "rollouts/wait_s")
"""Metrics that depend on the clock or count a process's traffic: not compared between runs."""


def config(tmp_path, *extra: str):
    return load_config(None, [f"run.output_dir={tmp_path / 'run'}", "trainer.iterations=5", "trainer.save_every=2", *extra])


def complete(cfg, next_iteration: int, **changes) -> Path:
    ckpt = checkpoint_dir(cfg.run.output_dir, next_iteration)
    ckpt.mkdir(parents=True)
    write_driver_state(ckpt, cfg, next_iteration=next_iteration, dock_uri=str(ckpt / "dock"), open_iteration=next_iteration,
                       summary={"eval/accuracy_before": 0.5}, prompts="p")
    if changes:
        doc = json.loads((ckpt / STATE_FILE).read_text()) | changes
        (ckpt / STATE_FILE).write_text(json.dumps(doc))
    return ckpt


@pytest.mark.parametrize("saved", [{"fused": None}, {"fused": None, "foreach": True}, {"fused": True}],
                         ids=["before-fused", "foreach", "fused"])
def test_a_loaded_optimizer_keeps_the_engines_kernel_choice(tmp_path, saved):
    """An AdamW state saved with other ``fused``/``foreach`` flags (an older checkpoint: ``fused``
    None) loads with the moments and step of the file and the flags ``adamw`` chose for the device
    (CPU: fused), and steps as an AdamW built with those flags from the same state would."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Linear(3, 2)

    def backward(m):
        m(torch.arange(6.0).view(2, 3)).square().sum().backward()

    old = model()
    old_opt = torch.optim.AdamW(old.parameters(), lr=0.1, weight_decay=0.01, **saved)
    for _ in range(2):
        old_opt.zero_grad()
        backward(old)
        old_opt.step()
    state = old_opt.state_dict()
    assert {k: state["param_groups"][0][k] for k in saved} == saved
    torch.save(state, tmp_path / optimizer_file(0))

    new = model()
    new.load_state_dict(old.state_dict())
    engine = type("Engine", (), {})()
    engine.optimizer = adamw(new, lr=0.1, weight_decay=0.01)
    chosen = {k: engine.optimizer.param_groups[0][k] for k in ("fused", "foreach")}
    assert chosen["fused"] is True  # the device's choice: CPU has a fused kernel
    load_optimizer(engine, tmp_path)
    for group in engine.optimizer.param_groups:
        assert {k: group[k] for k in chosen} == chosen
    loaded = engine.optimizer.state_dict()["state"]
    for i, s in state["state"].items():
        torch.testing.assert_close(loaded[i]["exp_avg"], s["exp_avg"])
        assert float(loaded[i]["step"]) == float(s["step"]) == 2.0
    for m, opt in ((old, old_opt), (new, engine.optimizer)):  # one more step each: the same update
        opt.zero_grad()
        backward(m)
        opt.step()
    for a, b in zip(old.parameters(), new.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_checkpoints_fall_every_save_every_iterations_but_not_after_the_last():
    cfg = load_config(None, ["trainer.iterations=5", "trainer.save_every=2"])
    assert [it for it in range(5) if checkpoint_due(cfg.trainer, it)] == [1, 3]
    assert not any(checkpoint_due(load_config(None, ["trainer.save_every=0"]).trainer, it) for it in range(20))


def test_iteration_seeds_are_fixed_distinct_and_63_bit():
    seeds = [iteration_seed(0, it) for it in range(100)] + [iteration_seed(1, 0)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**63 for s in seeds)
    assert iteration_seed(0, 7) == iteration_seed(0, 7)
    assert prompts_fingerprint([[1, 2], [3]]) != prompts_fingerprint([[1], [2, 3]])


def test_an_optimizer_write_cut_short_leaves_no_half_written_file(tmp_path, monkeypatch):
    engine = type("Engine", (), {})()
    engine.optimizer = adamw(torch.nn.Linear(4, 4), lr=0.1, weight_decay=0.0)

    def cut_short(obj, path):  # as a SIGTERM (SystemExit from sigterm_as_exit) arriving mid-write
        Path(path).write_bytes(b"half")
        raise SystemExit(143)

    monkeypatch.setattr(torch, "save", cut_short)
    with pytest.raises(SystemExit):
        save_optimizer(engine, tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert save_optimizer(engine, tmp_path) == tmp_path / optimizer_file(0) and len(list(tmp_path.iterdir())) == 1


def test_a_checkpoints_files_and_folders_are_on_disk_before_its_marker(tmp_path, monkeypatch):
    """Durable against a node crash, not only a killed process: every file and folder of the checkpoint is
    fsync'ed, then the marker (its own file, then the folder holding the rename), in that order."""
    cfg = config(tmp_path)
    ckpt = checkpoint_dir(cfg.run.output_dir, 2)
    (ckpt / "dock" / "shard-0").mkdir(parents=True)
    for name in ("model.safetensors", "optimizer.pt", "dock/shard-0/rows.arrow"):
        (ckpt / name).write_bytes(b"x")
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), ckpt))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    write_driver_state(ckpt, cfg, next_iteration=2, dock_uri=str(ckpt / "dock"), open_iteration=2, summary={}, prompts="p")
    marker = synced.index(f"{STATE_FILE}.tmp")
    before = set(synced[:marker])
    assert {"model.safetensors", "optimizer.pt", "dock/shard-0/rows.arrow", "dock/shard-0", "dock", "."} <= before, synced
    assert synced[marker + 1:] == ["."] and (ckpt / STATE_FILE).is_file()


def test_latest_is_the_newest_complete_checkpoint(tmp_path):
    cfg = config(tmp_path, "run.resume=latest")
    assert latest_checkpoint(cfg.run.output_dir) is None
    with pytest.raises(ConfigError, match="run.resume: got 'latest'; no complete checkpoint"):
        find_resume(cfg, "p")
    complete(cfg, 2)
    checkpoint_dir(cfg.run.output_dir, 4).mkdir()  # cut short before its driver state: never resumed from
    point = find_resume(cfg, "p")
    assert point.checkpoint == checkpoint_dir(cfg.run.output_dir, 2).resolve()
    assert (point.next_iteration, point.open_iteration, point.summary) == (2, 2, {"eval/accuracy_before": 0.5})
    with pytest.raises(ConfigError, match="already holds a run"):  # run.resume unset: a fresh run, refused here
        find_resume(config(tmp_path), "p")
    explicit = config(tmp_path, f"run.resume={checkpoint_dir(cfg.run.output_dir, 2)}")
    assert find_resume(explicit, "p").next_iteration == 2
    # before the prompts are loaded: all but them checked
    assert find_resume(cfg, None).next_iteration == 2
    with pytest.raises(ConfigError, match="the training prompts='p', this run has 'q'"):
        find_resume(cfg, "q")
    check_resume_prompts(find_resume(cfg, None), "p")  # what a run checks once its prompts are loaded
    check_resume_prompts(None, "q")  # a fresh run: nothing to match
    with pytest.raises(ConfigError, match="the training prompts='p', this run has 'q'"):
        check_resume_prompts(find_resume(cfg, None), "q")
    with pytest.raises(ConfigError, match="trainer.seed=0, this run has 7"):
        find_resume(config(tmp_path, "run.resume=latest", "trainer.seed=7"), None)


def test_a_finished_run_continues_from_final_and_refuses_nothing_left(tmp_path):
    """``final`` resumes at ``trainer.iterations``: it wins over the periodic checkpoints it follows,
    loses to those of a continuation, and a resume with nothing left to run is refused."""
    cfg = config(tmp_path, "trainer.iterations=4")
    complete(cfg, 2)
    final = prepare_checkpoint(final_dir(cfg.run.output_dir))
    write_final_state(final, cfg, summary={"eval/accuracy_before": 0.5}, prompts="p")
    assert latest_checkpoint(cfg.run.output_dir) == final
    more = find_resume(config(tmp_path, "trainer.iterations=6", "run.resume=latest"), "p")
    assert (more.checkpoint, more.next_iteration, more.open_iteration, more.dock_uri) == (final.resolve(), 4, None, "")
    for iterations in (4, 3):
        with pytest.raises(ConfigError, match=rf"finished all its 4 iterations .*nothing is left to run with "
                                              rf"trainer.iterations={iterations}: pass trainer.iterations=N with N > 4"):
            find_resume(config(tmp_path, f"trainer.iterations={iterations}", "run.resume=latest"), "p")
    complete(cfg, 5)  # the continuation's own checkpoint after iteration 4
    assert latest_checkpoint(cfg.run.output_dir) == checkpoint_dir(cfg.run.output_dir, 5)
    prepare_checkpoint(final)  # the continuation overwrites final: incomplete until its state is written again
    assert not (final / STATE_FILE).exists()


def test_a_fresh_run_refuses_a_folder_with_another_run(tmp_path):
    cfg = config(tmp_path)
    assert find_resume(cfg, "p") is None  # an empty (or missing) folder
    (Path(cfg.run.output_dir) / "checkpoints").mkdir(parents=True)
    assert find_resume(cfg, "p") is None  # a run stopped before its first complete checkpoint: nothing to resume, set aside
    complete(cfg, 2)
    with pytest.raises(ConfigError, match=r"already holds a run \(checkpoints\).*run.resume=latest.*another run.output_dir"):
        find_resume(cfg, "p")


def test_resume_refuses_what_would_lose_or_repeat_rows(tmp_path):
    cfg = config(tmp_path)
    ckpt = complete(cfg, 2)
    cases = [
        (config(tmp_path, f"run.resume={tmp_path / 'nowhere'}"), "p", "expected 'latest' or an existing checkpoint folder"),
        (config(tmp_path, f"run.resume={tmp_path}"), "p", "is not a complete checkpoint"),
        (config(tmp_path, f"run.resume={ckpt}", "trainer.seed=3"), "p", r"trainer.seed=0, this run has 3"),
        (config(tmp_path, f"run.resume={ckpt}", "trainer.global_batch=12", "trainer.mini_batch=12"), "p", "trainer.global_batch"),
        (config(tmp_path, f"run.resume={ckpt}", "rollout.n=4"), "p", "rollout.n"),
        (config(tmp_path, f"run.resume={ckpt}"), "other", "the training prompts"),
        (config(tmp_path, f"run.resume={ckpt}", "trainer.iterations=2"), "p", "trainer.iterations: got 2; .* resumes at iteration 2"),
        (config(tmp_path, f"run.resume={ckpt}", "trainer.engine=megatron"), "p", "optimizer state of a 'hf' actor, .* 'megatron tp=1 pp=1 dp=1'"),
    ]
    for cfg_, prompts, message in cases:
        with pytest.raises(ConfigError, match=message):
            find_resume(cfg_, prompts)
    inflight = ("dock.mode=distributed", "dock.max_inflight=2")
    other = tmp_path / "partial"
    partial = complete(config(other, *inflight, "rollout.partial_tokens=8"), 4)  # iteration 4 open, its rows maybe cut
    with pytest.raises(ConfigError, match="rollout.partial_tokens: got 0; .* written with rollout.partial_tokens=8"):
        find_resume(config(other, *inflight, f"run.resume={partial}"), "p")
    complete(cfg, 3, version=99)
    with pytest.raises(ConfigError, match="checkpoint version 99"):
        find_resume(config(tmp_path, "run.resume=latest"), "p")


def test_dock_snapshots_go_to_the_run_folder_or_the_runs_s3_store(tmp_path):
    ckpt = checkpoint_dir(tmp_path / "run", 4)
    assert dock_snapshot_uri(config(tmp_path), ckpt, "r1") == str((ckpt / "dock").resolve())
    s3 = config(tmp_path, "dock.warehouse=s3", "dock.endpoint=http://minio:9000", "dock.bucket=rl-runs", "dock.prefix=team/dock",
                "dock.mode=distributed")
    assert dock_snapshot_uri(s3, ckpt, "r1") == "s3://rl-runs/team/dock/r1/checkpoints/iter_000004/dock?endpoint_override=minio:9000&scheme=http"
    custom = config(tmp_path, "dock.warehouse=s3", "dock.endpoint=minio:9000", "dock.access_key_env=MY_KEY", "dock.mode=distributed")
    assert dock_snapshot_uri(custom, ckpt, "r1").startswith("/")  # pyarrow reads AWS_* only: kept local
    inprocess = config(tmp_path, "dock.warehouse=s3", "dock.endpoint=minio:9000")
    assert dock_snapshot_uri(inprocess, ckpt, "r1").startswith("/")  # its dock lives in memory, no store
    # the shards take snapshots there and nowhere else (dockrl.dock.roles): every uri lies under the run's places
    for cfg in (config(tmp_path), s3, custom):
        assert cfg.run.output_dir == str(tmp_path / "run")
        access = ShardAccess("d", GRPO_SCHEMA, snapshot_places=dock_snapshot_places(cfg, "r1"))
        access.check_place(dock_snapshot_uri(cfg, ckpt, "r1"))
        with pytest.raises(AccessDenied):
            access.check_place(dock_snapshot_uri(cfg, checkpoint_dir(tmp_path / "other", 4), "r2"))
    resumed = dock_snapshot_places(s3, "r2", restore=dock_snapshot_uri(s3, ckpt, "r1"))  # a resume reads the old run's
    ShardAccess("d", GRPO_SCHEMA, snapshot_places=resumed).check_place(dock_snapshot_uri(s3, ckpt, "r1"))


def test_a_resumed_writer_keeps_the_iterations_before_the_checkpoint(tmp_path):
    with MetricsWriter(tmp_path) as w:
        for it in range(4):
            w.log(it, {"x": it})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 4, "x"')  # a line cut short by a kill
    with MetricsWriter(tmp_path, resume_from=2) as w:
        w.log(2, {"x": 20})
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(x["iteration"], x["x"]) for x in lines] == [(0, 0), (1, 1), (2, 20)]


class Interrupt(Exception):
    pass


def tiny_run(tiny_model_dir, tmp_path, name: str, *extra: str):
    return load_config(None, [
        f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / name}", f"run.cache_dir={tmp_path / 'cache'}",
        "run.progress=false", "trainer.iterations=3", "trainer.global_batch=4", "trainer.mini_batch=2",
        "trainer.micro_batch=4", "rollout.n=4", "rollout.max_response_length=12", "rollout.dtype=float32",
        "trainer.autocast_bf16=false", "trainer.lr=1e-2", "trainer.save_every=1", "algorithm.kl_loss_coef=0.05",
        "algorithm.scorer=fake_scorers:FakeHashScorer", "trainer.eval_before=false",
        "data.generate_train=40", "data.generate_test=8", "data.eval_size=8", *extra,
    ])


def same_rows(a: list[dict], b: list[dict]) -> None:
    """Equal iteration indexes; every metric but the clock's and the traffic counters' equal to fp32 rounding."""
    assert [x["iteration"] for x in a] == [x["iteration"] for x in b]
    for x, y in zip(a, b):
        keys = sorted(k for k in x if not k.startswith(VARYING))
        assert keys == sorted(k for k in y if not k.startswith(VARYING))
        for k in keys:
            assert math.isclose(x[k], y[k], rel_tol=1e-4, abs_tol=1e-6), (x["iteration"], k, x[k], y[k])


def read_rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tiny_model_dir, tmp_path_factory) -> Path:
    """The folder of the uninterrupted 3-iteration run (a checkpoint after every iteration) that the
    resumed runs of this module are compared with: run once, it serves them all."""
    out = tmp_path_factory.mktemp("uninterrupted")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(FAKES))
        driver.train(tiny_run(tiny_model_dir, out, "straight"))
    return out / "straight"


@pytest.mark.slow  # two short runs of the tiny model, and the module's uninterrupted one
def test_an_interrupted_run_resumes_to_the_uninterrupted_result(tiny_model_dir, tmp_path, monkeypatch, straight):
    monkeypatch.syspath_prepend(str(FAKES))

    def stop_in_iteration_2(it: int, metrics: dict) -> None:
        if it == 2:  # its metrics line is written, the checkpoint after iteration 1 is complete
            raise Interrupt

    with pytest.raises(Interrupt):
        driver.train(tiny_run(tiny_model_dir, tmp_path, "cut"), on_iteration=stop_in_iteration_2)
    cut = tmp_path / "cut"
    assert [x["iteration"] for x in read_rows(cut)] == [0, 1, 2]
    assert (checkpoint_dir(cut, 2) / "optimizer.pt").is_file() and (checkpoint_dir(cut, 2) / "dock" / "meta.json").is_file()
    snapshot = json.loads((checkpoint_dir(cut, 2) / "dock" / "meta.json").read_text())
    assert snapshot["layout"]["iteration"] == 2 and snapshot["shards"]  # iteration 2 open with its prompts

    driver.train(tiny_run(tiny_model_dir, tmp_path, "cut", "run.resume=latest"))
    same_rows(read_rows(cut), read_rows(straight))
    resumed = AutoModelForCausalLM.from_pretrained(cut / "checkpoints" / "final").state_dict()
    uncut = AutoModelForCausalLM.from_pretrained(straight / "checkpoints" / "final").state_dict()
    assert resumed.keys() == uncut.keys()
    for name, p in uncut.items():
        torch.testing.assert_close(resumed[name], p, rtol=1e-5, atol=1e-6, msg=name)


def optimizer_steps(checkpoint: Path) -> set[float]:
    return {float(v["step"]) for v in torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"].values()}


@pytest.mark.slow  # three short runs of the tiny model, and the module's uninterrupted one
def test_a_finished_run_continues_for_more_iterations_as_one_longer_run(tiny_model_dir, tmp_path, monkeypatch, straight):
    """2 iterations without periodic checkpoints (save_every=0), then 3 in total: iteration 2 runs
    once, from the final weights, optimizer (4 steps carried: 2 mini-batches per iteration) and
    data position, and the result is the uninterrupted 3-iteration run's (which wrote checkpoints
    on the way: writing them changes nothing of the result)."""
    monkeypatch.syspath_prepend(str(FAKES))
    driver.train(tiny_run(tiny_model_dir, tmp_path, "two", "trainer.save_every=0", "trainer.iterations=2"))
    two = tmp_path / "two"
    assert not list((two / "checkpoints").glob("iter_*")) and optimizer_steps(final_dir(two)) == {4.0}
    state = json.loads((final_dir(two) / STATE_FILE).read_text())
    assert (state["next_iteration"], state["open_iteration"], state["dock_snapshot"]) == (2, None, "")

    before = {p: p.stat().st_mtime_ns for p in [two / "summary.json", two / "config.yaml", *final_dir(two).iterdir()]}
    with pytest.raises(ConfigError, match="finished all its 2 iterations"):  # nothing left: refused, nothing touched
        driver.train(tiny_run(tiny_model_dir, tmp_path, "two", "trainer.save_every=0", "trainer.iterations=2", "run.resume=latest"))
    assert {p: p.stat().st_mtime_ns for p in before} == before

    driver.train(tiny_run(tiny_model_dir, tmp_path, "two", "trainer.save_every=0", "run.resume=latest"))
    assert [x["iteration"] for x in read_rows(two)] == [0, 1, 2]
    same_rows(read_rows(two), read_rows(straight))
    assert optimizer_steps(final_dir(two)) == optimizer_steps(final_dir(straight)) == {6.0}
    assert json.loads((final_dir(two) / STATE_FILE).read_text())["next_iteration"] == 3
    continued = AutoModelForCausalLM.from_pretrained(final_dir(two)).state_dict()
    for name, p in AutoModelForCausalLM.from_pretrained(final_dir(straight)).state_dict().items():
        torch.testing.assert_close(continued[name], p, rtol=1e-5, atol=1e-6, msg=name)

    # the run's config.yaml keeps run.resume as given: run again for one more iteration, it goes on
    # from final (found by `latest` now) instead of rewinding to the checkpoint the resume above found
    again = load_config(two / "config.yaml", ["trainer.iterations=4"])
    assert again.run.resume == "latest"
    driver.train(again)
    assert [x["iteration"] for x in read_rows(two)] == [0, 1, 2, 3]
