"""Tests of GSM8K strict extraction, numeric matching and the timed RewardScorer (hand-written expectations)."""

from __future__ import annotations

import time

import pytest

from dockrl.rewards import RewardScorer, answers_match, extract_final_answer, is_correct, score_response


def fake_hang(response: str, ground_truth: str) -> float:
    """Verifier that hangs forever on responses containing 'HANG'; otherwise returns 1.0 if correct."""
    if "HANG" in response:
        while True:
            time.sleep(1.0)
    return 1.0 if is_correct(response, ground_truth) else 0.0


def fake_raise(response: str, ground_truth: str) -> float:
    """Verifier that raises on responses containing 'BOOM'; otherwise returns 1.0 if correct."""
    if "BOOM" in response:
        raise RuntimeError("verifier exploded")
    return 1.0 if is_correct(response, ground_truth) else 0.0


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("Adding up gives 42.\n#### 42", "42"),
        ("#### 1,234", "1234"),
        ("#### 1,234,567 dollars", "1234567"),
        ("#### -17", "-17"),
        ("#### -1,000", "-1000"),
        ("#### 3.75", "3.75"),
        ("#### 3/4", "3/4"),
        ("#### $18", "18"),
        ("#### $1,250.50", "1250.50"),
        ("#### -$5", "-5"),
        ("#### $-5", "-5"),
        ("#### 42 apples.", "42"),
        ("#### 42.", "42"),
        ("####42", "42"),
        ("####\n\n   7\n", "7"),
        ("First guess #### 10, but wait.\nActually #### 12", "12"),
        ("#### 0", "0"),
    ],
)
def test_extract_final_answer(response: str, expected: str) -> None:
    assert extract_final_answer(response) == expected


@pytest.mark.parametrize(
    "response",
    [
        "The answer is 42.",
        "",
        "####",
        "#### ",
        "#### forty-two",
        "#### 12\nthen #### none",  # the LAST '####' has no number
        "### 42",
    ],
)
def test_extract_final_answer_none(response: str) -> None:
    assert extract_final_answer(response) is None


@pytest.mark.parametrize(
    ("predicted", "truth"),
    [("0.5", "1/2"), ("1234", "1,234"), ("-3", "-3.0"), ("3/4", "0.75"), ("72", "72"), ("$18", "18"), ("1000000", "1,000,000"), (" 5 ", "5")],
)
def test_answers_match_equal(predicted: str, truth: str) -> None:
    assert answers_match(predicted, truth)
    assert answers_match(truth, predicted)


@pytest.mark.parametrize(
    ("predicted", "truth"),
    [("12", "21"), ("-3", "3"), ("0.5", "0.25"), ("3/4", "4/3"), ("", "5"), ("junk", "5"), ("5", ""), ("1/0", "5"), ("101", "100")],
)
def test_answers_match_not_equal(predicted: str, truth: str) -> None:
    assert not answers_match(predicted, truth)


# The verifier's rule for typographic and ambiguous answers (docs/rewards.md shows this table):
# (what follows '####', the extracted number or None, why)
TYPOGRAPHY = [
    ("\u22125", "-5", "Unicode minus sign U+2212"),
    ("\uff0d7", "-7", "full-width hyphen-minus"),
    ("\u00a042", "42", "no-break space before the number"),
    ("\u200942", "42", "thin space before the number"),
    ("1\u2009234", "1234", "thin space between digit groups: thousands (SI style)"),
    ("1\u202f234\u202f567", "1234567", "narrow no-break spaces between digit groups"),
    ("1\u00a0000", "1000", "no-break space between digit groups"),
    ("\uff14\uff12", "42", "full-width digits"),
    ("\u0664\u0662", "42", "Arabic-Indic digits"),
    ("\uff04\uff11\uff10", "10", "full-width dollar and digits"),
    ("1,234", "1234", "thousands commas in groups of three"),
    ("1,234.5", "1234.5", "thousands commas and a decimal part"),
    ("1,2", None, "decimal comma or a list: ambiguous"),
    ("1,23", None, "comma group of two digits: ambiguous"),
    ("1,2345", None, "comma group of four digits: ambiguous"),
    ("12,34,567", None, "lakh grouping: ambiguous"),
    ("1\u200923", None, "typographic space before a group of two digits: ambiguous"),
    ("1.2.3", None, "two decimal points: ambiguous"),
    ("1e3", "1000", "exponent: expanded"),
    ("2.5E-2", "0.025", "negative exponent, capital E"),
    ("1e999", None, "exponent beyond 100"),
    ("\\frac{3}{4}", "3/4", "LaTeX fraction"),
    ("$\\dfrac{12}{5}$", "12/5", "LaTeX display fraction in math mode"),
    ("-\\frac{1}{2}", "-1/2", "negative LaTeX fraction"),
    ("\\frac{-1}{2}", "-1/2", "negative numerator"),
    ("\\frac34", None, "LaTeX fraction without braces: not a number"),
]


@pytest.mark.parametrize(("after", "expected", "why"), TYPOGRAPHY, ids=[row[2] for row in TYPOGRAPHY])
def test_typographic_and_ambiguous_answers(after: str, expected: str | None, why: str) -> None:
    assert extract_final_answer(f"So it is.\n#### {after}") == expected
    reward = score_response(f"#### {after}", expected or "0")
    assert reward == (pytest.approx(1.1) if expected is not None else 0.0)  # ambiguous: not even the format reward


def test_ground_truths_are_read_by_the_same_rule() -> None:
    assert answers_match("-5", "\u22125") and answers_match("1000", "1e3") and answers_match("3/4", "\\frac{3}{4}")
    assert not answers_match("12", "1,2")


def test_the_rule_table_is_documented() -> None:
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "rewards.md").read_text()
    for after, expected, why in TYPOGRAPHY:
        shown = after.encode("unicode_escape").decode().replace("\\\\", "\\")
        assert f"| `{shown}` | {'`' + expected + '`' if expected else 'none'} | {why} |" in doc, shown


def test_answers_match_never_raises_on_junk() -> None:
    for junk in ["\\frac{", "}}}{{{", "#### ####", "nan", "inf", "1/0", "\x00", "$" * 50]:
        assert answers_match(junk, "7") is False
    assert answers_match(None, "7") is False  # type: ignore[arg-type]


def test_answers_past_pythons_int_string_limit_are_compared_exactly() -> None:
    """More than 4,300 digits (``sys.int_info.str_digits_check_threshold``): ``int(str)`` refuses them."""
    big = "9" * 5000
    assert score_response(f"#### {big}", big) == pytest.approx(1.1)
    assert score_response(f"#### {big[:-1]}8", big) == pytest.approx(0.1)
    assert answers_match(f"{big}/2", f"{big[:-1]}8.5e0") is False and answers_match(f"{big}0/20", f"{big}/2")
    assert extract_final_answer("#### \\frac{-" + big + "}{3}") == f"-{big}/3"


def test_score_response_values() -> None:
    assert score_response("So 6*7.\n#### 42", "42") == pytest.approx(1.1)
    assert score_response("#### 1,234", "1234") == pytest.approx(1.1)
    assert score_response("#### 41", "42") == pytest.approx(0.1)
    assert score_response("The answer is 42.", "42") == 0.0  # right number, but not in strict format
    assert score_response("#### ", "42") == 0.0
    assert score_response("#### 42", "42", correct_reward=2.0, format_reward=0.0) == pytest.approx(2.0)
    assert is_correct("#### 0.5", "1/2") and not is_correct("0.5", "1/2")


def test_scorer_normal_batch() -> None:
    responses = ["#### 42", "#### 41", "no answer 42", "#### 1,234", "#### 3/4"] * 13  # 65 samples
    truths = ["42", "42", "42", "1234", "0.75"] * 13
    with RewardScorer(timeout_s=5.0) as scorer:
        scorer.score(["#### 1"], ["1"])  # warm up the worker
        start = time.monotonic()
        rewards = scorer.score(responses, truths)
        elapsed = time.monotonic() - start
        assert rewards == pytest.approx([1.1, 0.1, 0.0, 1.1, 1.1] * 13)
        assert scorer.counters() == {"timeouts": 0, "errors": 0, "scored": 66}
    assert elapsed < 3.0  # no sample waited for its timeout (5 s); the margin is for a loaded machine


def test_scorer_hanging_verifier_times_out_and_recovers() -> None:
    responses = ["#### 1", "HANG #### 2", "#### 3", "#### 9"]
    truths = ["1", "2", "3", "4"]
    # 2 s: a replacement worker forks and imports this module within it even on a slow, busy core
    with RewardScorer(timeout_s=2.0, verify_fn=fake_hang, num_workers=2) as scorer:
        start = time.monotonic()
        assert scorer.score(responses, truths) == [1.0, 0.0, 1.0, 0.0]
        assert time.monotonic() - start < 12.0
        assert scorer.counters() == {"timeouts": 1, "errors": 0, "scored": 3}
        assert scorer.score(["#### 5", "#### 6"], ["5", "7"]) == [1.0, 0.0]
        assert scorer.counters() == {"timeouts": 1, "errors": 0, "scored": 5}


def test_scorer_two_hangs_single_worker() -> None:
    with RewardScorer(timeout_s=2.0, verify_fn=fake_hang, num_workers=1) as scorer:
        start = time.monotonic()
        assert scorer.score(["HANG", "#### 1", "HANG", "#### 2"], ["1", "1", "2", "2"]) == [0.0, 1.0, 0.0, 1.0]
        assert time.monotonic() - start < 15.0
        assert scorer.counters()["timeouts"] == 2


def test_scorer_raising_verifier_counts_error() -> None:
    with RewardScorer(timeout_s=5.0, verify_fn=fake_raise) as scorer:
        assert scorer.score(["#### 1", "BOOM #### 2", "#### 3"], ["1", "2", "3"]) == [1.0, 0.0, 1.0]
        assert scorer.counters() == {"timeouts": 0, "errors": 1, "scored": 2}


def test_scorer_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        RewardScorer(timeout_s=0)
    with pytest.raises(ValueError):
        RewardScorer(num_workers=0)
    with RewardScorer() as scorer, pytest.raises(ValueError):
        scorer.score(["#### 1"], [])
    assert RewardScorer().score([], []) == []
