"""Warm spares (``Process(standby=True)``): a crashed child restarts in a process started and
imported in advance. Real child processes, real SIGKILLs."""

from __future__ import annotations

import os
import signal
import time

import pytest

from relax.actors import ChildSpec, Process, Supervisor
from relax.errors import ActorDead, CallTimeout
from tests.actors.helpers import find, pid_alive
from tests.polling import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
TARGET = "tests.actors.standby_fixtures:Imported"


async def _facts(sup: Supervisor, rank: int = 0) -> dict:
    async def answer() -> dict | None:
        try:
            return await sup.ref("s").rank(rank).call("facts", timeout=5)
        except (ActorDead, CallTimeout):
            return None  # a call that raced a death waits for the restart

    return await wait_until(answer, timeout=60, what="the child to answer")


async def test_a_crashed_child_restarts_in_its_spare_with_its_module_imported() -> None:
    placement = Process(standby=True)
    spec = ChildSpec("s", TARGET, placement=placement)
    async with Supervisor([spec], intensity=5) as sup:
        seen: set[int] = set()
        for _ in range(2):  # each restart takes the spare and prepares the next
            before = await _facts(sup)
            seen.add(before["pid"])
            (spare,) = await wait_until(lambda: placement.spares(spec), 60, "a spare")
            assert spare not in seen and pid_alive(spare)
            killed_at = time.time()
            os.kill(before["pid"], signal.SIGKILL)

            old = before["pid"]
            await wait_until(lambda old=old: _restarted(sup, old), 60, "the restart")
            after = await _facts(sup)
            # The spare became the child: its module was imported before the kill, and only
            # the actor was started after it.
            assert after["pid"] == spare == find(await sup.snapshot(), "s")["pids"][0]
            assert after["imported_at"] < killed_at < after["started_at"]
            assert after["lazy_at"] < killed_at  # its warm_imports too
        last = await wait_until(lambda: placement.spares(spec), 60, "a spare")
        await sup.terminate_child("s")  # stopped on purpose: its spare goes too
        await wait_until(lambda: not pid_alive(last[0]), 10, "the spare to be stopped")
        assert placement.spares(spec) == []


async def test_a_gang_s_spares_learn_their_rank_when_they_start() -> None:
    placement = Process(standby=True)
    spec = ChildSpec("s", TARGET, placement=placement, gang=2)
    async with Supervisor([spec], intensity=5) as sup:
        old = [(await _facts(sup, r))["pid"] for r in range(2)]
        spares = await wait_until(lambda: placement.spares(spec), 60, "the gang's spares")
        os.kill(old[1], signal.SIGKILL)

        async def restarted() -> bool:
            entry = find(await sup.snapshot(), "s")
            return entry["state"] == "running" and not set(entry["pids"]) & set(old)

        await wait_until(restarted, 60, "the gang's restart")
        facts = [await _facts(sup, r) for r in range(2)]
        assert [f["pid"] for f in facts] == spares
        assert [f["rank"] for f in facts] == [[0, "0", "2"], [1, "1", "2"]]
        nxt = await wait_until(lambda: placement.spares(spec), 60, "the next spares")
    # The supervisor stopped the gang on purpose: its spares went with it.
    await wait_until(lambda: not any(pid_alive(p) for p in nxt), 10, "the spares to stop")


async def test_without_standby_a_restart_starts_cold() -> None:
    placement = Process()
    spec = ChildSpec("s", TARGET, placement=placement)
    async with Supervisor([spec], intensity=5) as sup:
        before = await _facts(sup)
        assert placement.spares(spec) == []
        killed_at = time.time()
        os.kill(before["pid"], signal.SIGKILL)
        await wait_until(lambda: _restarted(sup, before["pid"]), 60, "the restart")
        after = await _facts(sup)
        assert after["imported_at"] > killed_at and after["lazy_at"] > killed_at


async def _restarted(sup: Supervisor, old: int) -> bool:
    entry = find(await sup.snapshot(), "s")
    return entry["state"] == "running" and old not in entry["pids"]
