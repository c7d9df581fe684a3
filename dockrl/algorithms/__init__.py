"""Advantage estimators and losses: small pure tensor functions (docs/algorithms.md)."""

from dockrl.algorithms.actor_loss import ActorLoss, actor_loss
from dockrl.algorithms.advantages import (
    compute_advantages,
    discounted_returns,
    gae,
    grpo_advantages,
    masked_whiten,
    reinforce_plus_plus_advantages,
    rloo_advantages,
    token_rewards,
)
from dockrl.algorithms.dapo import mixed_groups
from dockrl.algorithms.losses import (
    PolicyLoss,
    aggregate_loss,
    entropy_from_logits,
    kl_k3,
    kl_penalty,
    nll_loss,
    policy_loss,
    sequence_ratio_log,
    tis_weight,
    value_loss,
)
from dockrl.algorithms.padding import response_mask, right_pad
from dockrl.algorithms.rollout_correction import (
    Correction,
    correction_weight,
    icepop_weight,
    mis_sequence_weight,
    mis_token_weight,
    mismatch_metrics,
    token_staleness,
)

__all__ = [
    "ActorLoss", "Correction", "PolicyLoss", "actor_loss", "aggregate_loss", "compute_advantages", "correction_weight",
    "discounted_returns", "entropy_from_logits", "gae", "grpo_advantages", "icepop_weight", "kl_k3", "kl_penalty", "masked_whiten",
    "mis_sequence_weight", "mis_token_weight", "mismatch_metrics", "mixed_groups", "nll_loss", "policy_loss", "reinforce_plus_plus_advantages",
    "response_mask", "right_pad", "rloo_advantages", "sequence_ratio_log", "tis_weight", "token_rewards", "token_staleness", "value_loss",
]
