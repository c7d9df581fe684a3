"""The algorithm's rules: its ranges and the combinations it can run (``algorithm``, DAPO's
``filter_groups`` and ``overlong_buffer``, ``reward_model``), and the refusal of a switched-off
section's settings. ``check_rules`` (``dockrl.config.rules``) calls them with the sections they read.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dockrl.config.algorithm_sections import AlgorithmConfig, RewardModelConfig
from dockrl.config.errors import fail
from dockrl.config.estimators import ESTIMATORS, estimator_names
from dockrl.config.run_sections import DockConfig
from dockrl.config.sections import CriticConfig, RolloutConfig


def _refuse_settings_when_off(where: str, section: Any, unset: Any, switch: str = "") -> None:
    """A section whose ``enable`` (``switch``, default ``where.enable``) is false ignores its other
    fields: any of them set (not its default, nested sections included) is refused naming it, as
    the critic's settings are."""
    switch = switch or f"{where}.enable"
    for f in dataclasses.fields(section):
        value, default = getattr(section, f.name), getattr(unset, f.name)
        if dataclasses.is_dataclass(value):
            _refuse_settings_when_off(f"{where}.{f.name}", value, default, switch)
        elif f.name != "enable" and value != default:
            raise fail(f"{where}.{f.name}", value, f"is set but {switch} is false: enable it or leave the field unset")


def check_reward_model(m: RewardModelConfig) -> None:
    if not m.enable:
        _refuse_settings_when_off("reward_model", m, type(m)())
        return
    if not m.model.path.strip():
        raise fail("reward_model.model.path", m.model.path, "reward_model.enable=true needs the folder of a "
                    "sequence-classification reward model (or reward_model.enable=false)")
    if m.micro_batch_size < 1:
        raise fail("reward_model.micro_batch_size", m.micro_batch_size, "expected a positive integer")
    for where, x in (("reward_model.model_weight", m.model_weight), ("reward_model.rule_weight", m.rule_weight)):
        if not math.isfinite(x):
            raise fail(where, x, "expected a finite number")
    if m.model_weight == 0:
        raise fail("reward_model.model_weight", m.model_weight, "the reward model would run for nothing: "
                    "give it a weight, or set reward_model.enable=false")


def check_algorithm(a: AlgorithmConfig, critic: CriticConfig) -> None:
    """The algorithm's ranges and the combinations it can run; each error names the fields and the fix."""
    if not (0 <= a.clip_ratio_low < 1):
        raise fail("algorithm.clip_ratio_low", a.clip_ratio_low, "expected 0 <= clip_ratio_low < 1")
    if not (a.clip_ratio_c == 0 or 1 < a.clip_ratio_c < math.inf):
        raise fail("algorithm.clip_ratio_c", a.clip_ratio_c, "expected 0 (no dual-clip) or a finite bound > 1 (verl: 3.0)")
    if not (a.tis_cap == 0 or 1 <= a.tis_cap < math.inf):  # a cap below 1 would scale every token's loss down
        raise fail("algorithm.tis_cap", a.tis_cap, "expected 0 (no truncated importance sampling) or a finite cap >= 1 (verl: 2.0)")
    _check_rollout_correction(a)
    if a.ratio_level == "sequence" and a.loss_agg_mode != "seq-mean-token-mean":
        raise fail("algorithm.loss_agg_mode", a.loss_agg_mode, "algorithm.ratio_level='sequence' (GSPO) averages each "
                    "sequence's token losses, then the sequences (arXiv 2507.18071, eq. 5): set "
                    "algorithm.loss_agg_mode='seq-mean-token-mean', or algorithm.ratio_level='token'")
    for where, x in {"algorithm.gamma": a.gamma, "algorithm.lam": a.lam}.items():
        if not (0 <= x <= 1):
            raise fail(where, x, "expected a number from 0 to 1")
    estimator = ESTIMATORS[a.adv_estimator]
    if estimator.needs_values and not critic.enable:  # PPO's values come from the critic stage
        what = "GAE" if a.adv_estimator == "gae" else f"algorithm.adv_estimator={a.adv_estimator!r}"
        raise fail("algorithm.adv_estimator", a.adv_estimator, f"{what} needs the critic's values: set critic.enable=true, "
                   f"or use {estimator_names(needs_values=False)}")
    if a.adv_estimator == "dr_grpo" and a.loss_agg_mode != "seq-mean-token-sum-norm":
        raise fail("algorithm.loss_agg_mode", a.loss_agg_mode, "algorithm.adv_estimator='dr_grpo' pairs its unnormalized "
                    "advantages with the constant normalizer: set algorithm.loss_agg_mode='seq-mean-token-sum-norm' (or use "
                    "adv_estimator='grpo' with norm_adv_by_std_in_grpo=false for the advantages alone)")
    if not a.norm_adv_by_std_in_grpo and a.adv_estimator != "grpo":
        raise fail("algorithm.norm_adv_by_std_in_grpo", a.norm_adv_by_std_in_grpo,
                    f"applies to adv_estimator='grpo' only (got algorithm.adv_estimator={a.adv_estimator!r}): remove it")
    if a.kl_in_reward_coef > 0 and not estimator.token_rewards:
        raise fail("algorithm.kl_in_reward_coef", a.kl_in_reward_coef, f"algorithm.adv_estimator={a.adv_estimator!r} scores "
                    "whole responses and has no per-token rewards to subtract a KL penalty from: use algorithm.kl_loss_coef "
                   f"(KL in the loss, as GRPO), or adv_estimator {estimator_names(token_rewards=True)}")


def _check_rollout_correction(a: AlgorithmConfig) -> None:
    """The masked corrections' bounds (``algorithm.rollout_correction``) and their refusal beside TIS."""
    if not (1 <= a.rollout_ratio_high < math.inf):  # a bound below 1 would mask on-policy tokens, whose ratio is 1
        raise fail("algorithm.rollout_ratio_high", a.rollout_ratio_high, "expected a finite bound >= 1 (the ratio of an "
                    "on-policy token is 1; MIS: 2.0, IcePop: 5.0)")
    if not (0 < a.rollout_ratio_low <= 1):
        raise fail("algorithm.rollout_ratio_low", a.rollout_ratio_low, "expected a bound in (0, 1] (IcePop: 0.5)")
    if a.rollout_correction != "icepop" and a.rollout_ratio_low != AlgorithmConfig().rollout_ratio_low:
        raise fail("algorithm.rollout_ratio_low", a.rollout_ratio_low, "is set but only algorithm.rollout_correction='icepop' "
                    f"reads it (got algorithm.rollout_correction={a.rollout_correction!r}): use 'icepop' or remove the field")
    if a.rollout_correction != "none" and a.tis_cap > 0:
        raise fail("algorithm.rollout_correction", a.rollout_correction, f"and algorithm.tis_cap={a.tis_cap} both weight each "
                    "token's loss by its ratio π_old/π_rollout: choose one (algorithm.tis_cap=0, or algorithm.rollout_correction='none')")


def check_dapo(a: AlgorithmConfig, r: RolloutConfig, dock: DockConfig, critic: CriticConfig) -> None:
    """DAPO's dynamic sampling and overlong shaping: their ranges and what they combine with."""
    f, o = a.filter_groups, a.overlong_buffer
    if f.max_num_gen_batches < 1:
        raise fail("algorithm.filter_groups.max_num_gen_batches", f.max_num_gen_batches,
                    "expected a positive integer: the rollout rounds of an iteration need a bound (verl's 0, no limit, "
                    "could sample forever on data the model always or never solves)")
    if o.enable and not 1 <= o.len <= r.max_response_length:
        raise fail("algorithm.overlong_buffer.len", o.len, f"expected 1 to rollout.max_response_length={r.max_response_length}: "
                    "the buffer lies before the maximum length")
    if not (0 <= o.penalty_factor < math.inf):
        raise fail("algorithm.overlong_buffer.penalty_factor", o.penalty_factor, "expected a finite number >= 0")
    if not o.enable:
        _refuse_settings_when_off("algorithm.overlong_buffer", o, type(o)())
    if not f.enable:
        _refuse_settings_when_off("algorithm.filter_groups", f, type(f)())
        return
    if dock.shards != 1:
        raise fail("dock.shards", dock.shards, "algorithm.filter_groups.enable needs dock.shards=1: a claim across "
                    "shards waits on one shard at a time, and the rows of a round released later may all lie on another, "
                    "which it would see only at its timeout (docs/algorithms.md)")
    if critic.enable:
        raise fail("critic.enable", critic.enable, "algorithm.filter_groups.enable: the critic's values feed the "
                    "advantages, so it would score every sampled group before dynamic sampling chose the trained ones; "
                    "DAPO trains without a critic: turn one of them off")
    if a.kl_in_reward_coef > 0:
        raise fail("algorithm.kl_in_reward_coef", a.kl_in_reward_coef, "algorithm.filter_groups.enable: the reference scores only "
                    "the groups dynamic sampling keeps, after the advantage stage chose them, so the advantages cannot "
                    "wait for its log-probs; use algorithm.kl_loss_coef (KL in the loss) or turn one of them off")
