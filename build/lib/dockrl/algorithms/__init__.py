"""Advantages and losses of GRPO: small pure tensor functions."""

from dockrl.algorithms.advantages import grpo_advantages
from dockrl.algorithms.losses import aggregate_loss, entropy_from_logits, kl_k3, policy_loss

__all__ = ["aggregate_loss", "entropy_from_logits", "grpo_advantages", "kl_k3", "policy_loss"]
