"""The reward-model stage as a process of a distributed run (and a pod: the same worker group)."""

from __future__ import annotations

import pytest
from test_distributed import run_overrides, workers_path  # noqa: F401 - fixture: fake scorers importable, no process left behind

from dockrl import driver
from dockrl.config import load_config
from dockrl.launch.distributed import worker_groups
from dockrl.launch.local import LocalBackend

RM = ["algorithm.kl_loss_coef=0", "algorithm.scorer=fake_scorers:FakeRandomScorer", "trainer.eval_before=false",
      "reward_model.micro_batch_size=3", "reward_model.model_weight=0.5", "reward_model.rule_weight=2.0"]


def rm_config(tiny_model_dir, tiny_reward_model_dir, tmp_path, *extra):
    return load_config(None, [*run_overrides(tiny_model_dir, tmp_path, *RM, *extra), "reward_model.enable=true",
                              f"reward_model.model.path={tiny_reward_model_dir}"])


def test_the_reward_model_is_a_worker_group_on_an_accelerator(tiny_model_dir, tiny_reward_model_dir, tmp_path):
    cfg = rm_config(tiny_model_dir, tiny_reward_model_dir, tmp_path)
    groups = worker_groups(cfg, LocalBackend("dockrl-test", state_dir=tmp_path / "state"), [5001], "127.0.0.1:29500", "secret")
    assert [g.name for g in groups] == ["dock-shard", "rollout", "reward-model", "reward", "actor"]
    rm = groups[2]
    assert rm.devices == 1 and rm.command[rm.command.index("--stage") + 1] == "reward-model"


@pytest.mark.slow
def test_two_iterations_with_the_reward_model_as_a_process(tiny_model_dir, tiny_reward_model_dir, tmp_path, workers_path):  # noqa: F811
    from e2e_checks import check_reward_model_run

    driver.train(rm_config(tiny_model_dir, tiny_reward_model_dir, tmp_path))
    check_reward_model_run(tmp_path / "run")
    assert (tmp_path / "run" / "logs" / "reward-model-0.log").is_file()
