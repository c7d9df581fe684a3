"""PPO's critic as a process of its own (``dockrl worker --stage critic``): its group, and a
distributed run cut and resumed that ends as the uninterrupted in-process run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_distributed import HYBRID, workers_path  # noqa: F401 - fixture: fake scorers importable, no process left behind
from test_distributed_resume import SAME_THREADS, VARYING, metric_close, read_rows
from test_ppo_runs import ppo_run
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from dockrl import driver
from dockrl.checkpoint.resume import checkpoint_dir, critic_dir, final_dir
from dockrl.launch.distributed import worker_groups
from dockrl.launch.local import LocalBackend
from dockrl.stages.loop import Report
from dockrl.stages.table import iteration_reports

FAKES = Path(__file__).parents[1]  # tests/fake_scorers.py


class Interrupt(Exception):
    pass


def test_the_critic_is_a_stage_group_on_an_accelerator(tiny_model_dir, tmp_path):
    cfg = ppo_run(tiny_model_dir, tmp_path, "run", "dock.mode=distributed")
    groups = worker_groups(cfg, LocalBackend("dockrl-test", state_dir=tmp_path / "state"), [5001], "127.0.0.1:29500", "secret")
    assert [g.name for g in groups] == ["dock-shard", "rollout", "reward", "critic", "actor"]
    critic = groups[3]
    assert critic.devices == 1 and critic.command[critic.command.index("--stage") + 1] == "critic"
    assert iteration_reports(cfg) == [Report.ROLLOUT, Report.REWARD, Report.CRITIC, Report.ACTOR, Report.WEIGHT_SYNC]
    hybrid = ppo_run(tiny_model_dir, tmp_path, "run", "dock.mode=distributed", *HYBRID)  # beside the hybrid actor too
    assert [g.name for g in worker_groups(hybrid, LocalBackend("dockrl-test", state_dir=tmp_path / "state"), [5001], "h:2", "t")] == [
        "dock-shard", "hybrid", "reward", "critic"]


@pytest.mark.slow  # an in-process run and two distributed runs of the tiny model
def test_a_distributed_ppo_run_cut_and_resumed_ends_as_the_in_process_run(tiny_model_dir, tmp_path, workers_path, monkeypatch):  # noqa: F811
    monkeypatch.syspath_prepend(str(FAKES))  # the in-process run's scorer; workers_path gives the processes theirs
    scorer = "algorithm.scorer=fake_scorers:FakeHashScorer"
    driver.train(ppo_run(tiny_model_dir, tmp_path, "straight", scorer, SAME_THREADS))

    def stop_in_iteration_2(it: int, metrics: dict) -> None:
        if it == 2:  # its metrics line is written, the checkpoint after iteration 1 (actor's and critic's) is complete
            raise Interrupt

    distributed = ("dock.mode=distributed", "dock.shards=2", "dock.timeout_s=120", SAME_THREADS)
    with pytest.raises(Interrupt):
        driver.train(ppo_run(tiny_model_dir, tmp_path, "cut", scorer, *distributed), on_iteration=stop_in_iteration_2)
    cut = tmp_path / "cut"
    assert (critic_dir(checkpoint_dir(cut, 2)) / "optimizer.pt").is_file()
    driver.train(ppo_run(tiny_model_dir, tmp_path, "cut", scorer, *distributed, "run.resume=latest"))
    assert "critic: iteration 2" in (cut / "logs" / "critic-0.log").read_text()

    rows, straight = read_rows(cut), read_rows(tmp_path / "straight")
    assert [x["iteration"] for x in rows] == [x["iteration"] for x in straight] == [0, 1, 2]
    for x, y in zip(rows, straight):
        keys = [k for k in y if k.startswith(("reward/", "rollout/", "actor/", "critic/")) and not k.startswith(VARYING)]
        assert len([k for k in keys if k.startswith("critic/")]) >= 7
        for k in keys:
            assert metric_close(k, x[k], y[k]), (x["iteration"], k, x[k], y[k])
    for cls, folder in ((AutoModelForCausalLM, final_dir), (AutoModelForTokenClassification, lambda r: critic_dir(final_dir(r)))):
        resumed, uncut = cls.from_pretrained(folder(cut)).state_dict(), cls.from_pretrained(folder(tmp_path / "straight")).state_dict()
        for name, p in uncut.items():
            torch.testing.assert_close(resumed[name], p, rtol=1e-5, atol=1e-6, msg=name)


def test_the_critic_runs_as_a_pod_of_the_runs_jobset_with_its_accelerator(tiny_model_dir, tmp_path, validate_jobset):
    from dockrl.launch.jobset import render_jobset
    from dockrl.launch.platform import PLATFORMS

    cfg = ppo_run(tiny_model_dir, tmp_path, "run", "dock.mode=distributed")
    groups = worker_groups(cfg, LocalBackend("dockrl-test", state_dir=tmp_path / "state"), [5001], "h:2", "t")
    [jobset] = [o for o in render_jobset(groups, run_id="3f2b1c9e-7a44-4c1e-9d0b-5e6f7a8b9c0d", namespace="team-rl",
                                         platform=PLATFORMS["gpu"]) if o["kind"] == "JobSet"]
    validate_jobset(jobset)
    jobs = {r["name"]: r["template"]["spec"]["template"]["spec"]["containers"][0] for r in jobset["spec"]["replicatedJobs"]}
    assert set(jobs) == {"dock-shard", "rollout", "reward", "critic", "actor"}
    critic = jobs["critic"]
    assert critic["resources"]["limits"] == {"nvidia.com/gpu": 1} and critic["image"] == PLATFORMS["gpu"].image
    command = [*critic.get("command", []), *critic.get("args", [])]
    assert command[command.index("--stage") + 1] == "critic"
