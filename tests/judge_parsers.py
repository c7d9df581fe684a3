"""A user's verdict parser for the generative judge's tests (``reward_model.generative.parser=judge_parsers:...``):
a tiny random judge writes no numbers, so the tests score its verdicts by a property every verdict has."""

from __future__ import annotations


def verdict_length(verdict: str) -> float:
    """The verdict's length in characters, divided by 10."""
    return len(verdict) / 10


def undecided(verdict: str) -> None:
    """Never tells: every verdict is unparsed."""
    return None
