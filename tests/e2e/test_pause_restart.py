"""A paused cluster whose rollout is SIGKILLed: the restarted rollout comes back paused (as the
control endpoint still reports), generates nothing, and ``resume`` starts it again."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from relax.cluster import build_tree, control_server, prepare
from relax.config import parse_config
from relax.control import control_request
from relax.runfiles import PAUSE_FILE
from tests.actors.helpers import find, wait_until
from tests.tiny import tiny_toml

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

# The default lease (60 s): the restarted rollout takes back the prompts its dead self held.
TOML = tiny_toml("pausekill", rollout='placement = "process"')


async def _puts(run_dir: Path) -> int:
    status = await control_request(run_dir, {"op": "status", "history": 1})
    return status["bus"]["samples"]["counters"].get("put", 0)


async def _rows(run_dir: Path) -> int:
    status = await control_request(run_dir, {"op": "status", "history": 1})
    return status["bus"]["samples"]["rows"]


@pytest.mark.timeout(180)
async def test_a_restarted_rollout_comes_back_paused(tmp_path: Path) -> None:
    cfg = parse_config(TOML)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / PAUSE_FILE).write_text("{}")  # left by an earlier run: not ours
    layout = prepare(cfg, tmp_path / "run")
    run_dir = layout.run_dir
    tree = build_tree(cfg, layout)
    control = control_server(cfg, layout, tree)
    async with control.serving(), tree:
        rollout = tree.ref("rollout-0")
        assert await rollout.call("paused", timeout=60) is False  # a new run starts unpaused
        await wait_until(lambda: _above(_puts(run_dir), 8), timeout=60, what="samples")

        assert (await control_request(run_dir, {"op": "pause"}))["paused"] is True
        puts = await _puts(run_dir)
        pid = find(await tree.snapshot(), "rollout-0")["pids"][0]
        os.kill(pid, signal.SIGKILL)

        async def restarted() -> bool:
            entry = find(await tree.snapshot(), "rollout-0")
            return entry["restart_count"] == 1 and entry["state"] == "running"

        await wait_until(restarted, timeout=60, what="the rollout to restart")
        # The new incarnation is paused, as the control endpoint still reports...
        assert await rollout.call("paused", timeout=60) is True
        status = await control_request(run_dir, {"op": "status", "history": 1})
        assert status["paused"] is True
        # ...and generates nothing: the trainer eats what is on the bus and runs dry, and no
        # sample has been put since the pause.
        await wait_until(
            lambda: _below(_rows(run_dir), 8), timeout=60, what="the trainer to run dry"
        )
        assert await _puts(run_dir) == puts
        assert (await rollout.call("statistics", timeout=10))["requests"] == 0

        assert (await control_request(run_dir, {"op": "resume"}))["paused"] is False
        assert not (run_dir / PAUSE_FILE).exists()
        await wait_until(lambda: _above(_puts(run_dir), puts), timeout=60, what="puts again")
        assert await rollout.call("paused", timeout=10) is False


async def _above(value, floor: int) -> bool:
    return await value > floor


async def _below(value, ceiling: int) -> bool:
    return await value < ceiling
