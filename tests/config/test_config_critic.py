"""The ``critic:`` section: its rules at load, and the stages and reports it adds to a run."""

from __future__ import annotations

import pytest

from dockrl.config import ConfigError, critic_batches, load_config
from dockrl.stages.loop import Report
from dockrl.stages.table import checkpoint_reports, iteration_reports, stage_processes

PPO = ["critic.enable=true", "algorithm.adv_estimator=gae"]


def test_the_critic_is_off_by_default_and_adds_its_stage_and_reports_when_on():
    plain = load_config()
    assert not plain.critic.enable and "critic" not in stage_processes(plain)
    assert checkpoint_reports(plain) == [Report.CHECKPOINT]
    ppo = load_config(None, PPO)
    assert stage_processes(ppo) == ["rollout", "reward", "critic", "actor"]
    assert iteration_reports(ppo) == [Report.ROLLOUT, Report.REWARD, Report.CRITIC, Report.ACTOR, Report.WEIGHT_SYNC]
    assert checkpoint_reports(ppo) == [Report.CHECKPOINT, Report.CRITIC_CHECKPOINT]
    assert critic_batches(ppo) == (ppo.trainer.mini_batch, ppo.trainer.micro_batch)  # 0: the actor's
    own = load_config(None, [*PPO, "critic.mini_batch=3", "critic.micro_batch=4"])
    assert critic_batches(own) == (3, 4)


@pytest.mark.parametrize("overrides, field", [
    (["critic.cliprange_value=0"], "critic.cliprange_value"),
    (["critic.lr=-1"], "critic.lr"),
    (["critic.ppo_epochs=0"], "critic.ppo_epochs"),
    (["critic.warmup_iterations=-1"], "critic.warmup_iterations"),
    (["critic.warmup_iterations=3", "trainer.iterations=3"], "critic.warmup_iterations"),  # the actor would never train
    (["critic.mini_batch=4"], "critic.mini_batch"),  # does not divide trainer.global_batch=6
    (["critic.micro_batch=5"], "critic.micro_batch"),  # does not divide 6 prompts × 8 samples
])
def test_bad_critic_values_name_their_field(overrides, field):
    with pytest.raises(ConfigError, match=rf"^{field}: got"):
        load_config(None, [*PPO, *overrides])


def test_critic_settings_without_the_critic_are_refused():
    with pytest.raises(ConfigError, match=r"critic.model_path: got 'some/dir'; is set but critic.enable is false"):
        load_config(None, ["critic.model_path=some/dir"])
    with pytest.raises(ConfigError, match=r"critic.warmup_iterations: got 2; .*critic.enable is false"):
        load_config(None, ["critic.warmup_iterations=2"])


def test_gae_and_the_critic_come_together():
    with pytest.raises(ConfigError, match=r"algorithm.adv_estimator: got 'gae'; GAE needs the critic's values: set critic.enable=true"):
        load_config(None, ["algorithm.adv_estimator=gae"])
    with pytest.raises(ConfigError, match=r"critic.enable: got True; the critic serves algorithm.adv_estimator='gae' only "
                                          r"\(got 'grpo', which does not use values\)"):
        load_config(None, ["critic.enable=true"])


def test_a_pipeline_run_chooses_ppo_by_its_estimator_and_the_critic_override():
    from dockrl.kubeflow.steps import resolve_overrides

    assert resolve_overrides({"adv_estimator": "gae"}, ["critic.enable=true"]) == ["algorithm.adv_estimator=gae", "critic.enable=true"]
    with pytest.raises(ConfigError, match=r"^algorithm.adv_estimator: got 'gae'; GAE needs the critic's values"):
        resolve_overrides({"adv_estimator": "gae"}, [])
