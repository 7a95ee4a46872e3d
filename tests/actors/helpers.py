"""Waiting on conditions (never on fixed sleeps) and reading supervisor snapshots."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def wait_until(
    condition: Callable[[], Awaitable[bool] | bool], timeout: float = 10.0, what: str = "condition"
) -> float:
    """Poll ``condition`` until true; returns the seconds it took, fails after ``timeout``."""
    start = time.monotonic()
    while True:
        result = condition()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


def find(snapshot: dict[str, Any], path: str) -> dict[str, Any]:
    """The snapshot entry of ``a/b`` (a child of nested supervisor ``a``)."""
    node = snapshot
    for part in path.split("/"):
        node = next(c for c in node["children"] if c["id"] == part)
    return node


def starts(events: list[str], actor_id: str) -> int:
    return sum(1 for e in events if e.startswith(f"start {actor_id} "))


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as dead: it no longer runs code)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
