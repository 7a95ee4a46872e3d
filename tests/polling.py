"""Waiting in tests: poll a condition until it holds (never sleep a fixed time and hope), and
fail naming what was awaited."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def wait_until(
    condition: Callable[[], Awaitable[Any] | Any],
    timeout: float = 10.0,
    what: str = "condition",
    *,
    interval: float = 0.01,
) -> Any:
    """Poll ``condition`` (a plain or an async function) every ``interval`` seconds until it
    returns something truthy, and return that; fail after ``timeout`` seconds, naming
    ``what``."""
    start = time.monotonic()
    while True:
        result = condition()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return result
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def poll_until(
    condition: Callable[[], Any],
    timeout: float = 10.0,
    what: str = "condition",
    *,
    interval: float = 0.02,
) -> Any:
    """``wait_until`` for a test without an event loop (it blocks between polls)."""
    start = time.monotonic()
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
