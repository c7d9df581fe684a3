"""Rule-based rewards for GRPO: GSM8K strict answer extraction, numeric matching, timed batch scoring."""

from dockrl.rewards.math_verifier import answers_match, extract_final_answer, is_correct, score_response
from dockrl.rewards.scorer import RewardScorer

__all__ = ["RewardScorer", "answers_match", "extract_final_answer", "is_correct", "score_response"]
