"""The text helpers: final-answer extraction, normalisation and number parsing."""

from __future__ import annotations

from fractions import Fraction

import pytest

from relax.rewards import extract_answer, normalize_answer, parse_last_number


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", Fraction(42)),
        ("The answer is 5.", Fraction(5)),  # a full stop ends the sentence, not a decimal
        ("3.14159", Fraction("3.14159")),
        (".5 of it", Fraction(1, 2)),
        ("x = -4", Fraction(-4)),
        ("x = \u22127", Fraction(-7)),  # typographic minus
        ("+2", Fraction(2)),
        ("10-4", Fraction(4)),  # subtraction, not a negative number
        ("1,234,567 apples", Fraction(1234567)),
        ("$1,234.50", Fraction("1234.5")),
        ("1,2,3", Fraction(3)),  # a list, not thousands groups
        ("3/4", Fraction(3, 4)),
        ("-3/4", Fraction(-3, 4)),
        ("6 / 8", Fraction(3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("\\dfrac{-1}{2}", Fraction(-1, 2)),
        ("2.5e-3", Fraction(1, 400)),
        ("\uff11\uff12", Fraction(12)),  # full-width digits
        ("first 7 then 8 finally 9", Fraction(9)),
        ("50%", Fraction(50)),
        ("1/0", None),
        ("no number here", None),
        ("", None),
    ],
)
def test_parse_last_number(text: str, expected: Fraction | None) -> None:
    assert parse_last_number(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("work... so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{3} then \\boxed{4", "3"),  # truncated last box: use the complete one
        ("steps\n#### 42\n", "42"),
        ("so the answer is: Paris.", "Paris."),
        ("Final answer = 7", "7"),
        ("just 12", "just 12"),
    ],
)
def test_extract_answer(text: str, expected: str) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("  Paris. ", "paris"),
        ("$\\text{Paris}$.", "paris"),
        ('"New   York"', "new york"),
        ("\uff21\uff22", "ab"),  # full-width letters
        ("1/2", "1/2"),  # no numeric canonicalisation
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


def test_normalize_answer_case_sensitive() -> None:
    assert normalize_answer(" Paris ", case_sensitive=True) == "Paris"
