"""Rule-based rewards for GRPO: GSM8K strict answer extraction, numeric matching, timed batch scoring."""

from dockrl.rewards.math_verifier import RewardScorer, answers_match, extract_final_answer, is_correct, score_response

__all__ = ["RewardScorer", "answers_match", "extract_final_answer", "is_correct", "score_response"]
