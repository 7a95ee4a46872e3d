"""Reward functions that misbehave on purpose, for the survival tests (``kind = "python"``).

Referenced by import path, e.g. ``target = "tests.e2e.fault_rewards:broken"``. Each scores
like the digits recipe's regex (1.0 when the response starts with a digit) unless it decides
to fail. ``broken`` decides from the response text and the answer alone, so a test can
recompute offline, from the bus log, which samples must have failed and how.
"""

from __future__ import annotations

import math
import os
import threading
import time
import zlib
from typing import Any, Literal

Verdict = Literal["ok", "raise", "nan", "hang"]

# Out of 1000 (response, answer) pairs, hashed: how many raise, return NaN, or hang.
RAISE_PER_MILLE = 25
NAN_PER_MILLE = 25
HANG_PER_MILLE = 15


def digit(response: str, sample: dict[str, Any]) -> float:
    """The digits recipe's reward: does the response start with a digit?"""
    return 1.0 if response[:1].isdigit() else 0.0


def verdict(response: str, answer: str) -> Verdict:
    """How ``broken`` treats this response (a pure function of its inputs)."""
    roll = zlib.crc32(f"{answer}\x00{response}".encode()) % 1000
    if roll < RAISE_PER_MILLE:
        return "raise"
    if roll < RAISE_PER_MILLE + NAN_PER_MILLE:
        return "nan"
    if roll < RAISE_PER_MILLE + NAN_PER_MILLE + HANG_PER_MILLE:
        return "hang"
    return "ok"


def broken(response: str, sample: dict[str, Any], *, hang_s: float = 2.0) -> float:
    """Raises for some samples, returns NaN for others, and hangs for ``hang_s`` for a few
    (configure a ``timeout`` below ``hang_s``)."""
    how = verdict(response, str(sample.get("answer", "")))
    if how == "raise":
        raise ValueError(f"deliberately broken reward for response {response!r}")
    if how == "nan":
        return math.nan
    if how == "hang":
        time.sleep(hang_s)  # the fault under test: a call that overruns its timeout
    return digit(response, sample)


_calls = 0
_calls_lock = threading.Lock()


def poison_once(
    response: str, sample: dict[str, Any], *, marker: str, after: int = 64, value: float = 1e30
) -> float:
    """Scores like ``digit``, except that one call — the first from the ``after``-th on, once
    per run: ``marker`` is created exclusively and records the response — returns the huge
    but finite ``value``. Its group's advantages then overflow the gradient norm."""
    global _calls
    with _calls_lock:
        _calls += 1
        due = _calls >= after
    if due:
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(response)
            return value
    return digit(response, sample)
