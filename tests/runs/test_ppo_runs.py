"""PPO with a critic, in-process, end to end on the tiny model: GAE wiring, the critic's warm-up,
its checkpoint, and a cut run resumed to the uninterrupted result (critic weights and optimizer too)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_resume import Interrupt, read_rows, same_rows
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from dockrl import driver
from dockrl.config import load_config
from dockrl.checkpoint.resume import checkpoint_dir, critic_dir, final_dir

FAKES = Path(__file__).parents[1]  # fake_scorers.py


def ppo_run(tiny_model_dir, tmp_path, name: str, *extra: str):
    return load_config(None, [
        f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / name}", f"run.cache_dir={tmp_path / 'cache'}",
        "run.progress=false", "trainer.iterations=3", "trainer.global_batch=4", "trainer.mini_batch=2",
        "trainer.micro_batch=4", "rollout.n=4", "rollout.max_response_length=12", "rollout.dtype=float32",
        "trainer.autocast_bf16=false", "trainer.lr=1e-3", "trainer.save_every=1", "trainer.eval_before=false",
        "trainer.eval_after=false", "algorithm.adv_estimator=gae", "algorithm.gamma=1.0", "algorithm.lam=0.95",
        "critic.enable=true", "critic.lr=1e-3", "algorithm.scorer=fake_scorers:FakeHashScorer",
        "data.generate_train=40", "data.generate_test=8", "data.eval_size=8", *extra,
    ])


def state(folder: Path, cls=AutoModelForCausalLM) -> dict[str, torch.Tensor]:
    return cls.from_pretrained(folder).state_dict()


def check_ppo_rows(rows: list[dict], warmup: int) -> None:
    """Every iteration trains the critic; the actor only after the warm-up."""
    for x in rows:
        assert math.isfinite(x["critic/vf_loss"]) and x["critic/grad_norm"] > 0 and x["timing_s/critic_values"] > 0
        assert 0 <= x["critic/vf_clipfrac"] <= 1 and math.isfinite(x["critic/vf_explained_var"])
        if x["iteration"] < warmup:
            assert x["actor/warmup"] == 1.0 and "actor/loss" not in x
        else:
            assert math.isfinite(x["actor/loss"]) and x["actor/grad_norm"] > 0 and "actor/warmup" not in x


@pytest.mark.slow  # one short run of the tiny model
def test_ppo_warms_the_critic_up_then_trains_both(tiny_model_dir, tmp_path, monkeypatch):
    """With the KL penalty in the reward: the reference runs before the advantages, which read it."""
    monkeypatch.syspath_prepend(str(FAKES))
    driver.train(ppo_run(tiny_model_dir, tmp_path, "run", "trainer.iterations=2", "critic.warmup_iterations=1",
                         "algorithm.kl_in_reward_coef=0.05"))
    run = tmp_path / "run"
    check_ppo_rows(read_rows(run), warmup=1)
    assert all(x["timing_s/reference"] > 0 for x in read_rows(run))
    policy = state(tiny_model_dir)
    warmed = state(checkpoint_dir(run, 1))  # after iteration 0: the actor did not step
    assert all(torch.equal(warmed[n], p) for n, p in policy.items())
    assert [n for n, p in state(final_dir(run)).items() if torch.equal(p, policy[n])] == []
    # the critic started from the policy's backbone and a new head, and trained from the first iteration
    critic0, critic1 = state(critic_dir(checkpoint_dir(run, 1)), AutoModelForTokenClassification), \
        state(critic_dir(final_dir(run)), AutoModelForTokenClassification)
    assert critic0.keys() == {k for k in policy if k.startswith("model.")} | {"score.weight", "score.bias"}
    assert not any(torch.equal(critic0[n], policy[n]) for n in critic0 if n in policy)
    assert not torch.equal(critic0["score.weight"], critic1["score.weight"])
    assert (critic_dir(final_dir(run)) / "optimizer.pt").is_file()


@pytest.mark.slow  # one short run of the tiny model
def test_ppo_runs_with_one_sample_per_prompt(tiny_model_dir, tmp_path, monkeypatch):
    """GAE needs no group (verl's PPO samples once per prompt); a group of one has no spread to report."""
    monkeypatch.syspath_prepend(str(FAKES))
    driver.train(ppo_run(tiny_model_dir, tmp_path, "run", "trainer.iterations=2", "rollout.n=1", "trainer.micro_batch=2"))
    rows = read_rows(tmp_path / "run")
    check_ppo_rows(rows, warmup=0)
    assert len(rows) == 2 and all("rollout/frac_zero_std_groups" not in x for x in rows)


@pytest.mark.slow  # two short runs of the tiny model and a resumed one
def test_an_interrupted_ppo_run_resumes_to_the_uninterrupted_result(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(FAKES))
    driver.train(ppo_run(tiny_model_dir, tmp_path, "straight"))

    def stop_in_iteration_2(it: int, metrics: dict) -> None:
        if it == 2:  # its metrics line is written, the checkpoint after iteration 1 is complete
            raise Interrupt

    with pytest.raises(Interrupt):
        driver.train(ppo_run(tiny_model_dir, tmp_path, "cut"), on_iteration=stop_in_iteration_2)
    cut, straight = tmp_path / "cut", tmp_path / "straight"
    assert (critic_dir(checkpoint_dir(cut, 2)) / "optimizer.pt").is_file()
    driver.train(ppo_run(tiny_model_dir, tmp_path, "cut", "run.resume=latest"))
    rows = read_rows(cut)
    check_ppo_rows(rows, warmup=0)
    same_rows(rows, read_rows(straight))  # critic/* included
    for cls, folder in ((AutoModelForCausalLM, final_dir), (AutoModelForTokenClassification, lambda r: critic_dir(final_dir(r)))):
        resumed, uncut = state(folder(cut), cls), state(folder(straight), cls)
        assert resumed.keys() == uncut.keys()
        for name, p in uncut.items():
            torch.testing.assert_close(resumed[name], p, rtol=1e-5, atol=1e-6, msg=name)
    adam = [torch.load(critic_dir(final_dir(r)) / "optimizer.pt", weights_only=True)["state"] for r in (cut, straight)]
    assert adam[0].keys() == adam[1].keys()
    for k in adam[1]:  # the critic's AdamW moments and step count carried over the cut
        for name in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(adam[0][k][name], adam[1][k][name], rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # six iterations of the tiny model (the shared learning harness)
def test_ppo_reward_rises(tiny_model_dir, tmp_path, monkeypatch):
    """PPO (GAE with the critic, γ = λ = 1 as verl's defaults) learns the harness's reward."""
    from learning import reward_curve, rises

    curve = reward_curve(monkeypatch, tiny_model_dir, tmp_path, "algorithm.adv_estimator=gae", "critic.enable=true",
                         "critic.lr=1e-2")
    assert len(curve) == 6
    assert rises(curve), f"reward curve {[round(r, 3) for r in curve]} does not rise"
