"""Rule-based GSM8K reward: strict ``#### <number>`` extraction, numeric matching, timed scoring.

Extraction follows verl's GSM8K scorer in strict mode (``verl/utils/reward_score/gsm8k.py``:
the number after the last ``####``); equivalence uses HuggingFace ``math-verify``
(``math_verify.parse``/``verify``) with an exact :class:`fractions.Fraction` fallback.
:class:`~dockrl.rewards.scorer.RewardScorer` runs each sample in a process pool so a hung
verifier costs at most ``timeout_s`` seconds and never blocks later samples.

**What counts as the number after ``####``** (docs/rewards.md has the table; each row is a test
in tests/rewards/test_math_verifier.py). The rule: normalize what a human reads as the same
number, reject what a human could read two ways.

* Typography is normalized first (``normalize_typography``): the minus sign U+2212, the small
  and full-width hyphen-minus (U+FE63, U+FF0D) become ``-``; full-width ASCII forms (``４２``,
  ``＄``, ``，``) and every other Unicode decimal digit become ASCII; a non-ASCII space (NBSP,
  thin, narrow NBSP, figure space, …) between two digits is a thousands separator (SI style,
  ``1 234``), elsewhere a space.
* A number is an optional sign and ``$`` (either order), then digits with optional thousands
  commas in groups of exactly three (``1,234,567``), an optional decimal part, an optional
  exponent (``1e3`` → ``1000``, ``2.5E-2`` → ``0.025``; |exponent| ≤ 100) or ``/denominator``
  (``3/4``); or a LaTeX fraction of integers (``\\frac{3}{4}``, ``\\dfrac``, ``\\tfrac`` → ``3/4``).
  Trailing text is allowed (``#### 42 apples.`` → ``42``).
* Ambiguous, so no number (no reward, not even the format reward): a comma or period followed
  by a digit right after the number (``1,2`` — a decimal comma or a list? —, ``1,23``,
  ``12,34,567``, ``1.2.3``, ``1,234,5``), a digit group of other than three digits after a
  typographic space (``1 23``), an exponent beyond ±100.
"""

from __future__ import annotations

import re
import threading
import unicodedata
from decimal import Decimal
from fractions import Fraction

from math_verify import parse, verify

_MINUS_SIGNS = {"\u2212": "-", "\ufe63": "-", "\uff0d": "-"}
_GROUP_SPACE = "\x00"  # stands for a typographic space while digits around it are looked at
# sign and '$' in either order, then a LaTeX fraction of integers or a decimal number
_NUMBER = re.compile(
    r"\s*(?P<s1>-?)\s*\$?\s*(?P<s2>-?)\s*(?:"
    r"\\[dt]?frac\s*\{\s*(?P<fnum>-?[0-9]+)\s*\}\s*\{\s*(?P<fden>[0-9]+)\s*\}"
    r"|(?P<mant>(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+)(?:[eE](?P<exp>[-+]?[0-9]+))?(?:/(?P<den>[0-9]+))?"
    r")"
)
_AMBIGUOUS_TAIL = re.compile(r"[,.]?[0-9]")  # right after a number: 1,2  1.2.3  12,34,567
_MAX_EXPONENT = 100
_MV_TIMEOUT_S = 5  # math-verify's own signal.alarm timeout (whole seconds), main thread only


def normalize_typography(text: str) -> str:
    """``text`` with typographic characters of numbers made ASCII (module docstring has the rule).

    Minus signs → ``-``; full-width forms and non-ASCII decimal digits → ASCII; a non-ASCII
    space between two digits → ``,`` (a thousands separator, checked like a comma), any other
    → `` ``. Never raises for ``str`` input.
    """
    out = []
    for ch in text:
        code = ord(ch)
        if ch in _MINUS_SIGNS:
            ch = _MINUS_SIGNS[ch]
        elif 0xFF01 <= code <= 0xFF5E:  # full-width ASCII forms
            ch = chr(code - 0xFEE0)
        elif not ch.isascii() and ch.isdecimal():
            ch = str(unicodedata.decimal(ch))
        elif not ch.isascii() and unicodedata.category(ch) == "Zs":
            ch = _GROUP_SPACE
        out.append(ch)
    text = re.sub(rf"(?<=[0-9]){_GROUP_SPACE}(?=[0-9])", ",", "".join(out))
    return text.replace(_GROUP_SPACE, " ")


def _number_at_start(text: str, *, whole: bool) -> str | None:
    """The canonical number at the start of normalized ``text`` (all of it when ``whole``), or None."""
    match = _NUMBER.match(text)
    if match is None:
        return None
    rest = text[match.end() :]
    if (whole and rest.strip()) or _AMBIGUOUS_TAIL.match(rest):
        return None
    negative = bool(match["s1"] or match["s2"])  # any minus sign makes it negative, as before
    if match["fnum"] is not None:  # digits as text: int() refuses more than 4,300 of them (sys.int_info)
        digits = match["fnum"].lstrip("-").lstrip("0") or "0"
        negative, body = negative or (match["fnum"].startswith("-") and digits != "0"), f"{digits}/{match['fden']}"
    else:
        body = match["mant"].replace(",", "")
        if match["exp"] is not None:
            if match["den"] is not None or abs(int(match["exp"])) > _MAX_EXPONENT:
                return None
            body = format(Decimal(f"{body}e{match['exp']}"), "f")
        elif match["den"] is not None:
            body = f"{body}/{match['den']}"
    return ("-" if negative else "") + body


def extract_final_answer(response: str) -> str | None:
    """The number after the LAST ``####`` in ``response`` (GSM8K strict extraction).

    Mirrors verl's ``gsm8k.extract_solution(method="strict")``, a little more lenient about
    layout and typography (the module docstring has the rule): whitespace/newlines after
    ``####``, a leading ``$`` and trailing text are allowed; thousands separators are dropped
    (``'1,234'`` -> ``'1234'``); negatives, decimals and simple fractions (``'3/4'``) are kept
    as written; an exponent is expanded (``'1e3'`` -> ``'1000'``), a LaTeX fraction written as
    ``a/b``; ``'#### 42.'`` -> ``'42'``.

    Returns:
        The number as a string, or None when there is no ``####``, no number right after the
        last one, or an ambiguous one (``'1,2'``). Never raises for ``str`` input.
    """
    if "####" not in response:
        return None
    return _number_at_start(normalize_typography(response.rsplit("####", 1)[1]), whole=False)


def _normalize(answer: str) -> str:
    """A whole number in canonical form (typography, ``$``, thousands commas, exponent); other text stripped of spaces and ``$``."""
    text = normalize_typography(answer).strip()
    number = _number_at_start(text, whole=True)
    return number if number is not None else text.replace("$", "").strip()


def _exact(number: str) -> Fraction:
    """``a``, ``a.b`` or ``a/b`` exactly, through ``Decimal``: ``Fraction(str)`` goes through ``int(str)``, which
    refuses more than 4,300 digits, and a long right answer would score as wrong.

    Raises:
        ValueError, ArithmeticError: not such a number, or a zero denominator.
    """
    num, _, den = number.partition("/")
    value = Fraction(Decimal(num))
    return value / Fraction(Decimal(den)) if den else value


def _fraction_equal(predicted: str, ground_truth: str) -> bool:
    try:
        return _exact(predicted) == _exact(ground_truth)
    except (ValueError, ArithmeticError, TypeError):
        return False


def answers_match(predicted: str, ground_truth: str) -> bool:
    """Whether two final answers are numerically equivalent (``'0.5'`` == ``'1/2'``).

    Uses ``math_verify.verify(parse(ground_truth), parse(predicted))`` (floats compared to
    6 decimals, math-verify's default); when math-verify finds nothing to parse in either
    string, or fails, falls back to exact ``Fraction`` comparison. math-verify's
    ``signal.alarm`` timeouts are only enabled on the main thread (they cannot work
    elsewhere); off the main thread the caller must bound time (see :class:`RewardScorer`).

    Returns:
        True when equivalent; False otherwise, including for junk or non-``str`` input
        (never raises).
    """
    if not isinstance(predicted, str) or not isinstance(ground_truth, str):
        return False
    pred, gold = _normalize(predicted), _normalize(ground_truth)
    if not pred or not gold:
        return False
    if pred == gold:  # the same canonical text: equal, without parsing (a number of 100,000 digits takes math-verify seconds)
        return True
    try:
        timeout = _MV_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
        gold_parsed = parse(gold, parsing_timeout=timeout)
        pred_parsed = parse(pred, parsing_timeout=timeout)
        if gold_parsed and pred_parsed:
            return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - math-verify failures fall through to the exact check
        pass
    return _fraction_equal(pred, gold)


def is_correct(response: str, ground_truth: str) -> bool:
    """Whether the strictly extracted final answer of ``response`` matches ``ground_truth``.

    Used for evaluation accuracy. Returns False when ``response`` has no ``#### <number>``.
    """
    predicted = extract_final_answer(response)
    return predicted is not None and answers_match(predicted, ground_truth)


def score_response(response: str, ground_truth: str, *, correct_reward: float = 1.0, format_reward: float = 0.1) -> float:
    """Rule reward of one response (reward units, no scaling).

    ``correct_reward`` when the strictly extracted final answer matches ``ground_truth``, plus
    ``format_reward`` whenever the response ends its reasoning with a well-formed
    ``#### <number>`` (right or wrong). Defaults: correct 1.1, formatted but wrong 0.1, no
    ``####`` 0.0 even when the right number appears elsewhere (strict, as verl's GSM8K scorer).
    """
    predicted = extract_final_answer(response)
    if predicted is None:
        return 0.0
    return (correct_reward if answers_match(predicted, ground_truth) else 0.0) + format_reward
