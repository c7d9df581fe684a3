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
    policy_loss,
    sequence_ratio_log,
    tis_weight,
    value_loss,
)
from dockrl.algorithms.padding import right_pad

__all__ = [
    "ActorLoss", "PolicyLoss", "actor_loss", "aggregate_loss", "compute_advantages", "discounted_returns", "entropy_from_logits", "gae",
    "grpo_advantages", "kl_k3", "kl_penalty", "masked_whiten", "mixed_groups", "policy_loss",
    "reinforce_plus_plus_advantages", "right_pad", "rloo_advantages", "sequence_ratio_log", "tis_weight", "token_rewards", "value_loss",
]
