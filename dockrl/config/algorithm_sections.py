"""The run configuration's algorithm sections: ``algorithm`` (with DAPO's ``filter_groups`` and
``overlong_buffer``) and ``reward_model``; frozen, keyword-only dataclasses, one docstring per field.

Their rules are in ``dockrl.config.algorithm_rules``; ``Config`` (``dockrl.config.rules``) holds one of each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from dockrl.config.estimators import ESTIMATORS, AdvEstimator


@dataclass(frozen=True, kw_only=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling (arXiv 2503.14476 §3.2; verl's ``algorithm.filter_groups``): train
    only on groups whose responses are not all equal in ``metric``, sampling further rounds of
    prompts until ``trainer.global_batch`` such groups are found (docs/algorithms.md)."""

    enable: bool = False
    """Filter the groups and refill from the next prompts; the trained batch stays exactly
    ``trainer.global_batch`` groups."""
    metric: Literal["acc", "score"] = "acc"
    """What must differ within a kept group: ``acc``, the ``correct`` column (DAPO's choice);
    ``score``, the reward ``rm_score`` (after the overlong shaping)."""
    max_num_gen_batches: int = 3
    """Rollout rounds per iteration, the first included, each of ``trainer.global_batch`` prompts
    (verl's name). At least 1: verl's 0 (no limit) is refused, so an iteration always ends."""
    on_exhausted: Literal["error", "fill"] = "error"
    """When the rounds are used up with fewer kept groups than ``trainer.global_batch``:
    ``error`` fails the run naming these fields (verl's behaviour); ``fill`` trains on what it
    has, the kept groups topped up with the first filtered ones to the configured size (they
    carry no group-relative signal)."""

    @property
    def rounds(self) -> int:
        """Rollout rounds an iteration holds rows for: ``max_num_gen_batches`` when enabled, else 1."""
        return self.max_num_gen_batches if self.enable else 1


@dataclass(frozen=True, kw_only=True)
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (arXiv 2503.14476 §3.4, eq. 13; verl's
    ``reward_model.overlong_buffer``): the reward of a response in the last ``len`` tokens before
    ``rollout.max_response_length`` drops linearly, by up to ``penalty_factor``
    (``dockrl.algorithms.dapo.overlong_penalty``)."""

    enable: bool = False
    """Add the length penalty to every reward."""
    len: int = 16
    """L_cache: the buffer, in tokens before ``rollout.max_response_length``, where the penalty grows."""
    penalty_factor: float = 1.0
    """The penalty at ``rollout.max_response_length`` (eq. 13's 1)."""


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """The RL algorithm: advantage estimator, policy loss, KL terms and the reward. Names follow
    verl's where it has the concept (docs/algorithms.md maps each verl name to its field here)."""

    adv_estimator: Annotated[AdvEstimator, ESTIMATORS] = "grpo"
    """Advantage estimator (``dockrl.algorithms.compute_advantages``): group-normalized (GRPO),
    leave-one-out (RLOO), batch-whitened discounted returns (REINFORCE++), GAE with a critic (PPO),
    or group-centered without the std (Dr. GRPO)."""
    norm_adv_by_std_in_grpo: bool = True
    """``grpo`` divides the group-centered rewards by the group std; false: only centered (as ``dr_grpo``)."""
    adv_eps: float = 1e-6
    """ε added to the std in the advantage denominator (``grpo``) and to the variance when whitening."""
    gamma: float = 1.0
    """Discount γ of the token-level returns (``gae``, ``reinforce_plus_plus``)."""
    lam: float = 1.0
    """λ of GAE (``gae``)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses become the mini-batch loss: mean over all tokens; mean over sequences of
    each sequence's token mean; of its token sum; or the token sum over the constant
    ``rollout.max_response_length`` (Dr. GRPO) (``dockrl.algorithms.aggregate_loss``)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio of the clipped loss: per token (PPO/GRPO) or the length-normalized
    sequence ratio (GSPO; with ``loss_agg_mode=seq-mean-token-mean``, its eq. 5)."""
    clip_ratio_low: float = 0.2
    """Lower clip ε of the ratio (1 - ε)."""
    clip_ratio_high: float = 0.28
    """Upper clip ε of the ratio (1 + ε); DAPO's clip-higher."""
    clip_ratio_c: float = 0.0
    """Dual-clip bound c > 1 of the loss of a negative-advantage token (``-c·A`` at most); 0: off
    (0 < c <= 1 is refused: the bound would cut below the clipped loss)."""
    entropy_coeff: float = 0.0
    """Coefficient of the entropy bonus subtracted from the loss; 0: off."""
    tis_cap: float = 0.0
    """Truncated importance sampling: the policy loss of each token is weighted by
    ``min(π_old/π_rollout, tis_cap)`` (rollout engine's log-probs); 0: off, else at least 1 (a cap
    below 1 would scale every token's loss down)."""
    rollout_correction: Literal["none", "mis_token", "mis_sequence", "icepop"] = "none"
    """Masked correction of the rollout–trainer mismatch, beside TIS
    (``dockrl.algorithms.rollout_correction``): with ``ρ = π_old/π_rollout`` (rollout engine's
    log-probs), ``mis_token`` masks tokens with ``ρ > rollout_ratio_high`` out of the policy loss,
    ``mis_sequence`` whole sequences whose ratio ``Π_t ρ_t`` exceeds it, ``icepop`` tokens with ``ρ``
    outside ``[rollout_ratio_low, rollout_ratio_high]``; kept tokens are weighted by their ratio.
    ``none``: off. Not with ``tis_cap`` (each weights the loss by the ratio)."""
    rollout_ratio_high: float = 2.0
    """Upper bound C of the ratio ``π_old/π_rollout`` kept by ``rollout_correction`` (IcePop's β;
    it uses 5.0); also the cap of ``actor/rollout_frac_beyond_cap`` when ``tis_cap`` is 0. At least 1."""
    rollout_ratio_low: float = 0.5
    """Lower bound α of the ratio kept by ``rollout_correction='icepop'`` (its value 0.5), in (0, 1]."""
    kl_loss_coef: float = 0.0
    """β of the KL penalty to the reference in the loss; 0: none (without ``kl_in_reward_coef`` no
    reference stage runs)."""
    kl_loss_type: Literal["low_var_kl", "kl", "abs", "mse"] = "low_var_kl"
    """KL estimator of the loss penalty: k3 (``low_var_kl``), k1 (``kl``), |k1| (``abs``), k2 (``mse``)."""
    kl_in_reward_coef: float = 0.0
    """β of the per-token KL penalty subtracted from the token rewards (``gae``,
    ``reinforce_plus_plus``); 0: none."""
    kl_penalty: Literal["kl", "abs", "mse", "low_var_kl"] = "kl"
    """KL estimator of the in-reward penalty (as ``kl_loss_type``)."""
    correct_reward: float = 1.0
    """Reward for a correct final answer."""
    format_reward: float = 0.1
    """Reward for a well-formed '#### <number>' final answer."""
    reward_timeout_s: float = 5.0
    """Per-sample verifier timeout; a timeout scores 0 and is counted."""
    scorer: str = ""
    """Custom reward scorer as ``module:Class`` (built with ``timeout_s``, ``correct_reward``,
    ``format_reward``; methods ``score``, ``counters``, ``close`` as ``RewardScorer``), run in a
    process of its own under ``reward_timeout_s`` per sample; empty: the strict GSM8K rule verifier."""
    max_bad_reward_frac: float = 0.25
    """Largest fraction of an iteration's rewards that may be bad — not a finite number, missing,
    timed out or failed (each scores 0) — before the run fails naming the scorer."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling (``algorithm.filter_groups.*``)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's overlong reward shaping (``algorithm.overlong_buffer.*``)."""
    overlong_filter: bool = False
    """DAPO's overlong filtering (§3.4): truncated responses (the ``truncated`` column) are masked
    out of the policy loss and its normalizer."""

    @property
    def uses_reference(self) -> bool:
        """Whether the run needs the reference's log-probs (a KL term in the loss or in the reward)."""
        return self.kl_loss_coef > 0 or self.kl_in_reward_coef > 0

    @property
    def corrects_rollout(self) -> bool:
        """Whether the policy loss reads the rollout engine's log-probs (TIS or a masked correction)."""
        return self.tis_cap > 0 or self.rollout_correction != "none"


@dataclass(frozen=True, kw_only=True)
class RewardModelPathConfig:
    path: str = ""
    """Local HF folder of a reward model with one label: a sequence classifier
    (``AutoModelForSequenceClassification``, e.g. ``Qwen2ForSequenceClassification``) or a value head
    per token (``…ForTokenClassification``, as verl's), read at the last token; frozen, never trained."""
    trust_remote_code: bool = False
    """Passed to ``from_pretrained``; keep off unless the model directory is yours."""


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
    """verl's ``reward_model:`` section: a learned scorer next to the rule verifier. Its stage
    (``dockrl/stages/reward_model.py``) writes ``rm_model_score``; the reward stage writes
    ``rm_score = rule_weight · rule + model_weight · model``."""

    enable: bool = False
    """Run the reward-model stage and add its score to the rule reward."""
    model: RewardModelPathConfig = field(default_factory=RewardModelPathConfig)
    """The reward model (``reward_model.model.path``)."""
    micro_batch_size: int = 8
    """Sequences per forward pass of the reward model (verl: ``micro_batch_size_per_gpu``)."""
    model_weight: float = 1.0
    """Weight of the reward model's score in ``rm_score``."""
    rule_weight: float = 1.0
    """Weight of the rule verifier's reward in ``rm_score`` (0: the reward model alone; the
    verifier still decides ``correct`` and ``reward/accuracy``)."""
