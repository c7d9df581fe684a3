"""A retried train task (KFP's retry of the launcher, same run id) continues its run (dockrl/kubeflow/train_task.py, dockrl/kubeflow/train_retry.py).

The run folder of a pipeline run lies on the shared volume, keyed by the run id: a retry that
finds a complete checkpoint there resumes from the newest, one that finds none sets the failed
attempt's folder aside and starts fresh; with the kubernetes backend the failed attempt's JobSet
goes first. The shared volume is a folder of tmp_path here, "mounted" at the platform's
``shared_mount_path`` as in the train pod.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
from test_distributed import workers_path  # noqa: F401 - fixture: fake scorers importable, no process left behind
from test_distributed_resume import ROWS_PER_ITERATION, read_rows
from test_kubernetes_run import LAUNCHER_IP, NS, RUN, npu_platform, small_config, use_fake_cluster

from dockrl import driver
from dockrl.checkpoint.resume import STATE_FILE, checkpoint_dir, final_dir, prepare_checkpoint, write_driver_state, write_final_state
from dockrl.kubeflow import train_retry, train_task
from dockrl.kubeflow.steps import prepare_dataset
from dockrl.launch.artifacts import resolve_checkpoint
from dockrl.launch.backend import WorkerFailed
from dockrl.launch.distributed import worker_groups
from dockrl.launch.kubernetes import KubernetesBackend
from dockrl.launch.launcher_pod import OwnerPod
from dockrl.launch.platform import PLATFORMS, Platform
from dockrl.run.metrics import MetricsWriter

RUN_SETTINGS = [
    "run.progress=false", "dock.shards=2", "dock.timeout_s=120", "trainer.iterations=3", "trainer.global_batch=4",
    "trainer.mini_batch=2", "trainer.micro_batch=4", "rollout.n=4", "rollout.max_response_length=12", "rollout.dtype=float32",
    "trainer.autocast_bf16=false", "trainer.lr=1e-2", "trainer.save_every=1", "trainer.eval_before=false",
    "algorithm.kl_loss_coef=0", "data.generate_train=40", "data.generate_test=8", "data.eval_size=8", "run.num_threads=1",
]


def cpu_platform(shared: Path) -> Platform:
    """The cpu preset with its shared volume mounted at ``shared`` (the train pod's mount, on this machine)."""
    shared.mkdir(parents=True, exist_ok=True)
    return Platform.from_json(json.dumps(json.loads(PLATFORMS["cpu"].to_json()) | {"shared_mount_path": str(shared)}))


def attempt(overrides, tmp_path: Path, n: int, platform: Platform, **kw) -> tuple[dict[str, float], dict[str, float]]:
    """One attempt of the train task: a fresh pod's own artifact folders, the same run id. Returns
    (summary, the metrics it logged: the run's summary, for its KFP Metrics artifact)."""
    logged: dict[str, float] = {}
    summary = train_task.run_training(overrides, tmp_path / "ds", tmp_path / f"attempt-{n}" / "model", tmp_path / f"attempt-{n}" / "run",
                                    log_metric=logged.__setitem__, run_id=RUN, platform=platform, **kw)
    return summary, logged


@pytest.mark.slow  # two distributed runs of the tiny model (3 iterations, one cut in iteration 2): ~30-60 s on 2 cores
def test_a_retried_train_task_resumes_from_its_newest_checkpoint(tiny_model_dir, tmp_path, workers_path, monkeypatch, caplog):  # noqa: F811
    """The reward process SIGKILLs itself as iteration 2 starts; the task is run again, with the
    same run id and overrides, in a new pod: it resumes at iteration 2 from iter_2 (iter_1 was
    pruned by trainer.keep_checkpoints=1 in the distributed driver), every iteration's metrics
    appear once, and the final checkpoint is handed over."""
    overrides = [f"model.path={tiny_model_dir}", f"run.cache_dir={tmp_path / 'cache'}", *RUN_SETTINGS,
                 "algorithm.scorer=fake_scorers:FakeKillingScorer", "trainer.keep_checkpoints=1"]
    monkeypatch.setenv("FAKE_KILL_AFTER_ROWS", str(2 * ROWS_PER_ITERATION))  # counted per reward process: a resumed one scores 1 iteration
    prepare_dataset(overrides, tmp_path / "ds")
    platform = cpu_platform(tmp_path / "shared")
    shared_run = tmp_path / "shared" / "runs" / RUN

    with pytest.raises(WorkerFailed) as err:
        attempt(overrides, tmp_path, 1, platform)
    assert err.value.member == "reward-0"
    assert [x["iteration"] for x in read_rows(shared_run)] == [0, 1]
    assert sorted(p.name for p in (shared_run / "checkpoints").iterdir()) == ["iter_000002"]  # iter_1 pruned once iter_2 was complete

    with caplog.at_level(logging.INFO):
        summary, logged = attempt(overrides, tmp_path, 2, platform)
    assert f"retry of run {RUN}: resuming at iteration 2 from {checkpoint_dir(shared_run, 2)}" in caplog.text
    rows = read_rows(shared_run)
    assert [x["iteration"] for x in rows] == [0, 1, 2]
    # this attempt's metrics artifact summarizes the whole run: the failed attempt's iterations too
    assert logged["run/iterations"] == 3 and logged["reward/mean/final"] == pytest.approx(rows[2]["reward/mean"])
    assert logged["reward/mean/best"] == pytest.approx(max(x["reward/mean"] for x in rows))
    assert all(math.isfinite(x["actor/loss"]) for x in rows) and summary["run/seconds"] > 0
    state = json.loads((final_dir(shared_run) / STATE_FILE).read_text())
    assert state["next_iteration"] == 3
    assert sorted(p.name for p in (shared_run / "checkpoints").iterdir()) == ["final", "iter_000002"]
    model = tmp_path / "attempt-2" / "model"
    # the artifact names the final checkpoint on the volume (export-model and evaluate mount it): no weights in the artifact store
    assert resolve_checkpoint(model) == final_dir(shared_run) and [p.name for p in model.iterdir()] == ["dockrl-checkpoint.json"]
    assert [x["iteration"] for x in read_rows(tmp_path / "attempt-2" / "run")] == [0, 1, 2]
    assert any((shared_run / "logs" / "attempt-1").glob("reward-0*.log"))  # the failed attempt's logs are kept


def test_a_retried_train_task_without_a_checkpoint_sets_the_attempt_aside_and_starts_fresh(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """In-process (the launcher's part is the same): the first attempt stops in iteration 0, before
    any checkpoint; the retry keeps its folder as <run id>.attempt-1 and runs from iteration 0."""
    from test_resume import FAKES

    monkeypatch.syspath_prepend(str(FAKES))
    overrides = [f"model.path={tiny_model_dir}", f"run.cache_dir={tmp_path / 'cache'}", *RUN_SETTINGS, "dock.mode=inprocess",
                 "trainer.iterations=2", "algorithm.scorer=fake_scorers:FakeHashScorer"]
    prepare_dataset(overrides, tmp_path / "ds")
    platform = cpu_platform(tmp_path / "shared")
    shared_run = tmp_path / "shared" / "runs" / RUN

    def dies(iteration: int, metrics: dict) -> None:
        raise RuntimeError("the pod was evicted")

    train = driver.train
    monkeypatch.setattr(driver, "train", lambda cfg, backend=None: train(cfg, backend=backend, on_iteration=dies))
    with pytest.raises(RuntimeError, match="evicted"):
        train_task.run_training(overrides, tmp_path / "ds", tmp_path / "attempt-1" / "model", tmp_path / "attempt-1" / "run",
                              log_metric=print, run_id=RUN, platform=platform)
    monkeypatch.setattr(driver, "train", train)
    assert [x["iteration"] for x in read_rows(shared_run)] == [0] and not list(shared_run.glob("checkpoints/*"))
    (shared_run / "checkpoints" / "iter_000001").mkdir(parents=True)  # as a SIGKILL mid-write leaves one: incomplete
    with caplog.at_level(logging.INFO):
        _, logged = attempt(overrides, tmp_path, 2, platform)
    aside = shared_run.with_name(f"{RUN}.attempt-1")
    assert f"its folder (logs, metrics) is kept in {aside}, the run starts fresh" in caplog.text
    assert [x["iteration"] for x in read_rows(aside)] == [0] and not (aside / "checkpoints").exists()
    assert [x["iteration"] for x in read_rows(shared_run)] == [0, 1] and logged["run/iterations"] == 2
    assert (resolve_checkpoint(tmp_path / "attempt-2" / "model") / "config.json").is_file()


def fake_training(seen: dict, *, fail: bool = False):
    """A fake ``driver.train``: records its config, writes iteration 2 of a run resumed there (its metrics,
    as the driver's ``MetricsWriter`` does: a failed attempt's lines from iteration 2 on dropped) and a final
    checkpoint."""
    def train(cfg, *, backend=None):
        if fail:
            raise AssertionError("a finished run was trained again")
        seen["cfg"] = cfg
        out = Path(cfg.run.output_dir)
        (out / "checkpoints" / "final").mkdir(parents=True, exist_ok=True)
        (out / "checkpoints" / "final" / "config.json").write_text("{}")
        with MetricsWriter(out, resume_from=2) as writer:
            writer.log(2, {"reward/mean": 0.5})
            writer.log_summary({"run/seconds": 1.0})
        return {"run/seconds": 1.0}

    return train


def completed(cfg, run: Path, next_iteration: int) -> Path:
    ckpt = prepare_checkpoint(checkpoint_dir(run, next_iteration))
    write_driver_state(ckpt, cfg, next_iteration=next_iteration, dock_uri=str(ckpt / "dock"), open_iteration=next_iteration,
                       summary={}, prompts="p")
    return ckpt


def test_a_retry_on_kubernetes_tears_down_the_failed_attempts_jobset_then_resumes(cluster, tiny_model_dir, tmp_path, monkeypatch, caplog):
    use_fake_cluster(cluster, monkeypatch)
    platform = npu_platform(tmp_path)
    shared_run = tmp_path / "shared" / "runs" / RUN
    cfg = small_config(tiny_model_dir, shared_run, "trainer.iterations=4")
    # the failed attempt: its JobSet, Secret and running pods (its launcher died before its teardown), a complete checkpoint;
    # its launcher was a pod of its own
    old = KubernetesBackend(RUN, namespace=NS, platform=platform, core_api=cluster.core(), custom_api=cluster.custom(),
                            owner=OwnerPod(name="dockrl-grpo-abcde-train-1", uid="11111111-0000-4000-8000-0123456789ab"),
                            launcher_ip=LAUNCHER_IP)
    cluster.pods_on_create["actor"] = ({"phase": "Running"}, "")
    old.start(worker_groups(cfg, old, old.serve_ports(2), f"{LAUNCHER_IP}:29500", "token", RUN))
    left = old.remains()
    assert {x.split("/")[0] for x in left} == {"NetworkPolicy", "JobSet", "Pod"}  # its Secret goes with its launcher pod
    ckpt = completed(cfg, shared_run, 2)
    # the failed attempt's metrics: iteration 2 was cut short after the checkpoint it resumes from
    (shared_run / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i, "reward/mean": r}) + "\n"
                                                      for i, r in ((0, 0.0), (1, 0.1), (2, 0.9))))

    seen: dict = {}
    train = fake_training(seen)

    def fake_train_watching_the_cluster(cfg, *, backend=None):
        seen["at start"] = sorted({k[0] for k in cluster.objects})  # what exists when the new JobSet would be created
        return train(cfg, backend=backend)

    monkeypatch.setattr(driver, "train", fake_train_watching_the_cluster)
    prepare_dataset(["data.generate_train=12", "data.generate_test=4", "data.max_steps=2"], tmp_path / "ds")
    with caplog.at_level(logging.INFO):
        _, logged = attempt(["trainer.iterations=4"], tmp_path, 2, platform, worker_backend="kubernetes")
    assert seen["at start"] == ["Secret"]  # torn down and gone before the new attempt started anything, but the
    # failed launcher pod's Secret (garbage collection removes it with that pod; the new attempt creates its own)
    assert f"the failed attempt's workers are still there ({', '.join(left)}); tearing them down" in caplog.text
    assert seen["cfg"].run.resume == "latest" and f"retry of run {RUN}: resuming at iteration 2 from {ckpt}" in caplog.text
    # the summary of iterations 0 and 1 of the failed attempt (not its 2: the checkpoint resumes there) and 2 of this one
    assert logged == {"run/iterations": 3.0, "reward/mean/final": 0.5, "reward/mean/best": 0.5, "run/seconds": 1.0}
    assert resolve_checkpoint(tmp_path / "attempt-2" / "model") == final_dir(shared_run)


def test_a_failed_attempts_pod_that_does_not_go_stops_the_retry_naming_it(cluster, tmp_path):
    backend = KubernetesBackend(RUN, namespace=NS, platform=npu_platform(tmp_path), core_api=cluster.core(), custom_api=cluster.custom())
    assert train_retry.clear_failed_attempt(backend) == []  # a first attempt: nothing to do
    cluster.objects[("Pod", NS, "stuck")] = {"apiVersion": "v1", "kind": "Pod", "status": {"phase": "Running"},
                                             "metadata": {"name": "stuck", "namespace": NS, "labels": {"dockrl.io/run": RUN}}}
    with pytest.raises(RuntimeError, match=rf"retry of run {RUN}: the failed attempt's Pod/stuck still exist 0 s after their "
                                           rf"deletion.*kubectl delete jobset,pod,secret -n {NS} -l dockrl.io/run={RUN}"):
        train_retry.clear_failed_attempt(backend, wait_s=0.0)


def test_a_retry_of_a_finished_run_hands_it_over_without_training_again(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """The failed attempt trained to the end, then failed handing over (the pod was evicted)."""
    platform = cpu_platform(tmp_path / "shared")
    shared_run = tmp_path / "shared" / "runs" / RUN
    cfg = small_config(tiny_model_dir, shared_run, "trainer.iterations=2")
    final = prepare_checkpoint(final_dir(shared_run))
    (final / "config.json").write_text("{}")
    write_final_state(final, cfg, summary={}, prompts="p")
    (shared_run / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i, "reward/mean": 1.0}) + "\n" for i in (0, 1)))
    (shared_run / "summary.json").write_text(json.dumps({"run/seconds": 12.0, "eval/accuracy_before": None}))
    monkeypatch.setattr(driver, "train", fake_training({}, fail=True))
    prepare_dataset(["data.generate_train=12", "data.generate_test=4", "data.max_steps=2"], tmp_path / "ds")
    with caplog.at_level(logging.INFO):
        summary, logged = attempt(["trainer.iterations=2"], tmp_path, 2, platform)
    assert f"retry of run {RUN}: all 2 iterations were done ({final}): handing over its final checkpoint" in caplog.text
    assert logged == {"run/iterations": 2.0, "reward/mean/final": 1.0, "reward/mean/best": 1.0, "run/seconds": 12.0}
    assert summary["run/seconds"] == 12.0 and resolve_checkpoint(tmp_path / "attempt-2" / "model") == final
    assert (final / STATE_FILE).is_file()  # kept on the shared volume: run.resume continues it with more iterations


def test_an_explicit_run_resume_wins_and_no_mounted_volume_keeps_the_run_in_run_dir(tiny_model_dir, tmp_path, monkeypatch):
    platform = cpu_platform(tmp_path / "shared")
    shared_run = tmp_path / "shared" / "runs" / RUN
    cfg = small_config(tiny_model_dir, shared_run, "trainer.iterations=4")
    older, _ = completed(cfg, shared_run, 1), completed(cfg, shared_run, 2)
    seen: dict = {}
    monkeypatch.setattr(driver, "train", fake_training(seen))
    prepare_dataset(["data.generate_train=12", "data.generate_test=4", "data.max_steps=2"], tmp_path / "ds")
    attempt(["trainer.iterations=4", f"run.resume={older}"], tmp_path, 2, platform)
    assert seen["cfg"].run.resume == str(older) and seen["cfg"].run.output_dir == str(shared_run)

    unmounted = Platform.from_json(json.dumps(json.loads(PLATFORMS["cpu"].to_json()) | {"shared_mount_path": str(tmp_path / "none")}))
    attempt(["trainer.iterations=4"], tmp_path, 3, unmounted)  # as before: the run folder is the run_dir artifact
    assert seen["cfg"].run.output_dir == str(tmp_path / "attempt-3" / "run") and seen["cfg"].run.resume == ""
