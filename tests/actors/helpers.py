"""Reading supervisor snapshots, and waiting on what they say (by polling: ``tests.polling``).

``wait_until`` is imported here too, where the tests of other areas still import it from."""

from __future__ import annotations

import os
from typing import Any

from relax.actors import Supervisor
from tests.polling import wait_until

__all__ = ["find", "pid_alive", "restarted", "running_pid", "starts", "wait_until"]


def find(snapshot: dict[str, Any], path: str) -> dict[str, Any]:
    """The snapshot entry of ``a/b`` (a child of nested supervisor ``a``)."""
    node = snapshot
    for part in path.split("/"):
        node = next(c for c in node["children"] if c["id"] == part)
    return node


async def running_pid(tree: Supervisor, path: str, timeout: float) -> int:
    """The first process of child ``path`` of ``tree``, once it runs with its processes up."""

    async def running() -> int | None:
        entry = find(await tree.snapshot(), path)
        return entry["pids"][0] if entry["state"] == "running" and entry["pids"] else None

    return await wait_until(running, timeout=timeout, what=f"{path} running")


async def restarted(
    tree: Supervisor,
    path: str,
    old_pid: int,
    timeout: float,
    *,
    states: tuple[str, ...] = ("running",),
) -> None:
    """Wait until child ``path`` of ``tree`` is in one of ``states``, its processes up, and
    ``old_pid`` not among them."""

    async def back() -> bool:
        entry = find(await tree.snapshot(), path)
        pids = entry["pids"]
        return entry["state"] in states and bool(pids) and old_pid not in pids

    await wait_until(back, timeout=timeout, what=f"{path} restarted")


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
