"""User reward functions the tests load by import path ("tests.rewards.fixture_fns:name")."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any


def contains_keyword(response: str, sample: dict[str, Any], keyword: str = "yes") -> float:
    """1.0 if the keyword option appears in the response."""
    return 1.0 if keyword in response else 0.0


async def async_length(response: str, sample: dict[str, Any]) -> float:
    """Async: the response length divided by the sample's "scale"."""
    await asyncio.sleep(0)
    return len(response) / sample["scale"]


def returns_bool(response: str, sample: dict[str, Any]) -> bool:
    return response == "ok"


def mutates_sample(response: str, sample: dict[str, Any]) -> float:
    sample["answer"] = "tampered"
    return 0.5


def boom(response: str, sample: dict[str, Any]) -> float:
    raise RuntimeError("verifier exploded")


async def async_boom(response: str, sample: dict[str, Any]) -> float:
    raise ValueError("async verifier exploded")


def sleeps(response: str, sample: dict[str, Any], seconds: float = 1.0) -> float:
    time.sleep(seconds)
    return 1.0


async def async_sleeps(response: str, sample: dict[str, Any], seconds: float = 30.0) -> float:
    await asyncio.sleep(seconds)
    return 1.0


async def ignores_cancellation(response: str, sample: dict[str, Any]) -> float:
    """Swallows CancelledError and keeps going: must still not hang the caller."""
    for _ in range(3):
        try:
            await asyncio.sleep(0.15)
        except asyncio.CancelledError:
            pass
    return 1.0


def returns_nan(response: str, sample: dict[str, Any]) -> float:
    return math.nan


def returns_inf(response: str, sample: dict[str, Any]) -> float:
    return -math.inf


def returns_text(response: str, sample: dict[str, Any]) -> str:
    return "1.0"


def returns_none(response: str, sample: dict[str, Any]) -> None:
    return None


class Scorer:
    """A callable object with an async __call__."""

    async def __call__(self, response: str, sample: dict[str, Any]) -> float:
        return 0.25


scorer = Scorer()
not_callable = 42
