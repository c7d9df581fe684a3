"""Verdict parsers of the generative judge (``reward_model.generative.parser``): a judge's text → a score, or None.

Built-in: ``number`` (the verdict's first number) and ``label`` (the score of the first ``label=score`` label in
it); a user's parser is a ``module:function`` of the same shape, ``(verdict: str) -> float | None``, imported in the
reward-model stage's process. None means the parser cannot tell (``reward_model.generative.unparsed_score``).
"""

from __future__ import annotations

import math
import re
from typing import Callable, Sequence

from dockrl.config import ConfigError
from dockrl.process.imports import import_object

NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def parse_number(verdict: str) -> float | None:
    """The first number in ``verdict`` (``"Score: 7/10"`` → 7.0), None when it has none or it is not finite."""
    found = NUMBER.search(verdict)
    if found is None:
        return None
    value = float(found.group())
    return value if math.isfinite(value) else None


def label_parser(labels: Sequence[str]) -> Callable[[str], float | None]:
    """A parser giving the score of the label of ``labels`` (``label=score`` pairs) that occurs first in a verdict,
    as a whole word in any case (``"Incorrect."`` with ``correct=1,incorrect=0`` → 0.0); None when none occurs.
    Where two labels start at the same place (``not correct`` and ``not``) the longer wins."""
    scores = {label.strip().lower(): float(score) for label, _, score in (pair.rpartition("=") for pair in labels)}
    pattern = re.compile(r"\b(" + "|".join(re.escape(k) for k in sorted(scores, key=len, reverse=True)) + r")\b", re.IGNORECASE)

    def parse(verdict: str) -> float | None:
        found = pattern.search(verdict)
        return None if found is None else scores[found.group(1).lower()]

    return parse


def build_parser(parser: str, labels: Sequence[str] = ()) -> Callable[[str], float | None]:
    """The parser ``reward_model.generative.parser`` names.

    Raises:
        ConfigError: a ``module:function`` that does not import or is not callable (naming the field).
    """
    if parser == "number":
        return parse_number
    if parser == "label":
        return label_parser(labels)
    try:
        fn = import_object(parser)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"reward_model.generative.parser: got {parser!r}, which does not import ({e})") from None
    if not callable(fn):
        raise ConfigError(f"reward_model.generative.parser: got {parser!r}, which is no function (verdict: str) -> float | None")
    return fn
