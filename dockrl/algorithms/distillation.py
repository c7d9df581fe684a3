"""On-policy distillation: the per-token reverse-KL advantage of a student against a frozen teacher.

The student samples ``y ~ π_S``; the teacher scores every sampled token. The reverse KL
``KL(π_S ‖ π_T) = E_{y~π_S}[log π_S(y_t) - log π_T(y_t)]`` is minimised by policy gradient with the
per-token advantage ``log π_T(y_t) - log π_S(y_t)`` (its single-sample estimate, negated): GKD
(Agarwal et al., 2024, arXiv 2306.13649, §3: on-policy data, the reverse KL) and Thinking
Machines' "On-Policy Distillation" (Lu et al., 2025), which uses it as the advantage of every token
with no discount, the student's log-probs those of the sampler.
"""

from __future__ import annotations

import torch


def reverse_kl_advantages(teacher_log_prob: torch.Tensor, student_log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``A_t = log π_T(y_t) - log π_S(y_t)``, per token; its negated mean is the reverse-KL estimate (k1).

    Args:
        teacher_log_prob: ``(B, T)`` log-probs of the sampled tokens under the teacher, nats.
        student_log_prob: ``(B, T)`` log-probs of the same tokens under the student that sampled them, nats.
        mask: ``(B, T)`` response mask (1 on the response's sampled tokens).

    Returns:
        ``(B, T)`` float32 advantages, 0 where the mask is 0.

    Raises:
        ValueError: the three shapes differ.
    """
    if not teacher_log_prob.shape == student_log_prob.shape == mask.shape:
        raise ValueError(f"reverse_kl_advantages: shapes differ: teacher {tuple(teacher_log_prob.shape)}, "
                         f"student {tuple(student_log_prob.shape)}, mask {tuple(mask.shape)}")
    return (teacher_log_prob.float() - student_log_prob.float()) * mask.float()


def distillation_advantages(
    task_advantages: torch.Tensor, teacher_log_prob: torch.Tensor, student_log_prob: torch.Tensor, mask: torch.Tensor,
    *, coef: float, reward_weight: float,
) -> torch.Tensor:
    """The task reward's advantages combined with the teacher's:
    ``A_t = reward_weight · A^task_t + coef · (log π_T(y_t) - log π_S(y_t))``
    (``reward_weight = 0``: distillation alone, as Thinking Machines' recipe; else the reverse KL is a
    dense per-token term beside the task's outcome advantage).

    Args:
        task_advantages: ``(B, T)`` the estimator's advantages (``compute_advantages``).
        teacher_log_prob, student_log_prob, mask: as ``reverse_kl_advantages``.
        coef: λ, weight of the reverse-KL advantage.
        reward_weight: weight of the task advantages.

    Returns:
        ``(B, T)`` float32 advantages, 0 where the mask is 0.
    """
    kl_adv = reverse_kl_advantages(teacher_log_prob, student_log_prob, mask)
    return (reward_weight * task_advantages.float() * mask.float() + coef * kl_adv).float()
