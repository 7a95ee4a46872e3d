"""Text helpers of the answer verifiers: find the final answer, normalise it, read numbers.

All pure functions of strings, so they are easy to test on hand-made cases and cheap enough to
run inline on the event loop.
"""

from __future__ import annotations

import re
import unicodedata
from fractions import Fraction

# --------------------------------------------------------------------------- final answer

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_GSM8K = re.compile(r"####\s*(.+?)\s*$", re.MULTILINE)
_ANSWER_IS = re.compile(
    r"(?:final answer|answer)\s*(?:is|:|=)\s*:?\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE
)


def _last_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}``, with nested braces balanced; None if there is none."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
        # Unclosed (a truncated response): try an earlier, complete one.
    return None


def extract_answer(text: str) -> str:
    """The response's final answer, by the conventions RL datasets use, most explicit first.

    1. the last ``\\boxed{...}`` (MATH-style; nested braces balanced);
    2. the last ``#### X`` line (GSM8K-style);
    3. the last ``answer is X`` / ``Answer: X`` / ``final answer = X``;
    4. otherwise the whole response (synthetic tasks whose response *is* the answer).
    """
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    for pattern in (_GSM8K, _ANSWER_IS):
        matches = pattern.findall(text)
        if matches:
            return matches[-1]
    return text


# --------------------------------------------------------------------------- normalisation

_SPACES = re.compile(r"\s+")
_TEXT_WRAP = re.compile(r"^\\(?:text|mathrm|textbf)\{(.*)\}$", re.DOTALL)


def normalize_answer(text: str, *, case_sensitive: bool = False) -> str:
    """Canonical form of an answer for exact comparison.

    In order: Unicode NFKC (full-width digits, ligatures); surrounding whitespace stripped and
    inner runs of whitespace collapsed to one space; enclosing ``$...$`` and ``\\text{...}``
    removed; trailing sentence punctuation (``.``, ``!``, ``;``) and enclosing quotes removed;
    case folded unless ``case_sensitive``. Nothing else: "1/2" and "0.5" stay different (use the
    numeric verifier for that).
    """
    text = unicodedata.normalize("NFKC", text)
    text = _SPACES.sub(" ", text).strip()
    # Peel wrappers repeatedly: "$\text{Paris}$." needs three passes.
    while True:
        before = text
        text = text.rstrip(".!;").strip()
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "$\"'`":
            text = text[1:-1].strip()
        wrapped = _TEXT_WRAP.match(text)
        if wrapped:
            text = wrapped.group(1).strip()
        if text == before:
            break
    return text if case_sensitive else text.casefold()


# --------------------------------------------------------------------------- numbers

# A sign counts only when it does not follow a word character or a digit: in "10-4" the "-" is a
# subtraction and the last number is 4, in "x = -4" it is -4. U+2212 is the typographic minus.
_SIGN = r"(?:(?<![\w.)])[-\u2212+])?"
# Thousands groups need exactly three digits each ("1,234,567"); "1,2,3" is a list of three.
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+|\d+|\.\d+)(?:[eE][-+]?\d+)?"
_NUMBER = re.compile(
    r"\\d?frac\{\s*(?P<fs>" + _SIGN + r")\s*(?P<fn>" + _UNSIGNED + r")\s*\}"
    r"\{\s*(?P<fd>" + _UNSIGNED + r")\s*\}"
    r"|(?P<sign>" + _SIGN + r")(?P<num>" + _UNSIGNED + r")"
    r"(?:\s*/\s*(?P<den>" + _UNSIGNED + r")(?![\d/]))?"
)


def _to_fraction(text: str) -> Fraction:
    return Fraction(text.replace(",", ""))


def _match_value(match: re.Match[str]) -> Fraction | None:
    if match.group("fn") is not None:
        sign, num, den = match.group("fs"), match.group("fn"), match.group("fd")
    else:
        sign, num, den = match.group("sign"), match.group("num"), match.group("den")
    value = _to_fraction(num)
    if den is not None:
        denominator = _to_fraction(den)
        if denominator == 0:
            return None  # "1/0" is not a number; skip it rather than crash
        value /= denominator
    return -value if sign in ("-", "\u2212") else value


def parse_last_number(text: str) -> Fraction | None:
    """The last number written in ``text``, exactly, or None if it has none.

    Reads integers, decimals (``3.14``, ``.5``), signs (``-7``, ``\u22127``, ``+2``), thousands
    separators (``1,234,567``), scientific notation (``2.5e-3``), fractions (``3/4``, ``-3/4``)
    and LaTeX fractions (``\\frac{3}{4}``, ``\\dfrac{-1}{2}``). Full-width digits are folded by
    NFKC first. A trailing full stop ends a sentence, not a decimal ("it is 5." is 5).
    """
    text = unicodedata.normalize("NFKC", text)
    value: Fraction | None = None
    for match in _NUMBER.finditer(text):
        parsed = _match_value(match)
        if parsed is not None:
            value = parsed
    return value
