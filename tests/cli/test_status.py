"""`relax status`: the JSON snapshot and the live dashboard, against a real running cluster.

One cluster serves the whole module (it runs as a task in the module's event loop, the way
``tests/test_control.py`` runs one); the dashboard runs headless in the same loop under Textual's
pilot. The dashboard test stops the cluster at its end (to see the "stopped" banner), so it comes
after the JSON test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import DataTable, Static

from relax import cluster
from relax.cli._tui import StatusApp
from relax.config import parse_config
from relax.control import CONTROL_FILE, control_request
from tests.actors.helpers import find, wait_until
from tests.tiny import tiny_toml

pytestmark = pytest.mark.anyio

TOML = tiny_toml(
    "st",
    reward='placement = "process"',  # a real process to SIGKILL
    lease_timeout=5,  # a lease held by the killed reward process comes back soon
)

ROLES = {"prompts", "samples", "dataset", "reward-0", "trainer", "rollout-0"}
NO_PID = 2**22 + 1
"""Above Linux's largest pid_max: never a live process."""


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # module scope: the cluster fixture and the tests share one event loop


@pytest.fixture(scope="module")
async def run_dir(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Path]:
    """The run folder of a cluster that is up and has trained at least one step."""
    run_dir = tmp_path_factory.mktemp("status") / "run"
    running = asyncio.create_task(cluster.run(parse_config(TOML), run_dir))
    try:
        await wait_until(
            lambda: running.done() or (run_dir / CONTROL_FILE).exists(), 60, "control.json"
        )
        if running.done():
            running.result()  # it failed to start: show why
        await wait_until(lambda: _version_above(run_dir, 0), 60, "the first training step")
        yield run_dir
    finally:
        if (run_dir / CONTROL_FILE).exists():
            with contextlib.suppress(Exception):
                await control_request(run_dir, {"op": "stop"})
        await asyncio.wait_for(running, 60)


@pytest.mark.slow
async def test_status_json_against_a_running_cluster(run_dir: Path) -> None:
    first = await _status_json(run_dir)
    assert first["trainer"]["version"] >= 1
    assert {child["id"] for child in first["tree"]["children"]} >= ROLES
    assert find(first["tree"], "reward-0")["state"] == "running"
    assert first["bus"]["samples"]["counters"]["put"] > 0
    assert set(first["bus"]["samples"]["tasks"]) >= {"reward", "train"}
    assert first["metrics"] and first["paused"] is False

    version = first["trainer"]["version"]
    await wait_until(lambda: _version_above(run_dir, version), 60, "the trainer to move on")
    second = await _status_json(run_dir)
    assert second["trainer"]["version"] > version


@pytest.mark.slow
async def test_dashboard_shows_crashes_restarts_pause_and_stop(run_dir: Path) -> None:
    app = StatusApp(run_dir, interval=0.2)
    async with app.run_test(size=(150, 40)) as pilot:
        actors = app.query_one("#actors", DataTable)
        await wait_until(lambda: _rows(actors) >= ROLES, 30, "every role in the tree")
        assert _cell(actors, "trainer", "state") == "running"
        assert not app.query_one("#banner").display  # connected, nothing to report

        # A SIGKILLed process: the supervisor restarts it and the dashboard says why it died.
        reward = find((await _status(run_dir))["tree"], "reward-0")
        restarts = reward["restart_count"]
        os.kill(reward["pids"][0], signal.SIGKILL)
        await wait_until(
            lambda: "SIGKILL" in _cell(actors, "reward-0", "last crash"), 60, "the crash cause"
        )
        await wait_until(
            lambda: (
                _cell(actors, "reward-0", "restarts") == str(restarts + 1)
                and _cell(actors, "reward-0", "state") == "running"
            ),
            60,
            "the reward role to be restarted",
        )

        # `r` restarts the selected actor.
        actors.move_cursor(row=actors.get_row_index("reward-0"))
        await pilot.press("r")
        await wait_until(
            lambda: _cell(actors, "reward-0", "restarts") == str(restarts + 2), 60, "`r` to act"
        )
        assert find((await _status(run_dir))["tree"], "reward-0")["restart_count"] == restarts + 2

        # `p` pauses generation, and `p` again resumes it.
        await pilot.press("p")
        await wait_until(lambda: _paused(run_dir), 60, "the cluster to pause")
        await wait_until(lambda: "PAUSED" in _banner(app), 30, "the paused banner")
        await pilot.press("p")
        await wait_until(lambda: _not_paused(run_dir), 60, "the cluster to resume")
        await wait_until(lambda: app.paused is False and not _banner(app), 30, "banner gone")

        # The cluster stops: the dashboard says so and keeps its last status on screen.
        await control_request(run_dir, {"op": "stop"})
        await wait_until(lambda: "has stopped" in _banner(app), 60, "the stopped banner")
        assert _rows(actors) >= ROLES

        await pilot.press("q")
        await wait_until(lambda: app.return_code == 0, 30, "`q` to quit")


async def test_dashboard_waits_for_a_cluster_that_is_not_running(tmp_path: Path) -> None:
    app = StatusApp(tmp_path, interval=0.05)
    async with app.run_test() as pilot:
        await wait_until(lambda: app.polls >= 1, 30, "a first poll")
        assert "no running cluster" in _banner(app) and "relax up" in _banner(app)
        polls = app.polls
        await wait_until(lambda: app.polls > polls, 30, "it to keep retrying")
        # A control.json whose process is gone: a crashed (or killed) cluster.
        (tmp_path / CONTROL_FILE).write_text(json.dumps({"pid": NO_PID, "url": "", "token": ""}))
        await wait_until(lambda: "process died" in _banner(app), 30, "the gone banner")
        await pilot.press("p")  # no status yet: nothing to toggle, and no crash either
        await pilot.press("q")
        await wait_until(lambda: app.return_code == 0, 30, "`q` to quit")


async def test_status_json_without_a_running_cluster(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("")  # a run folder whose cluster has stopped
    code, out, err = await _relax("status", "--json", "--run-dir", str(tmp_path))
    assert code == 1 and not out
    assert f"no running cluster in {tmp_path}: start one with `relax up" in err
    (tmp_path / CONTROL_FILE).write_text(json.dumps({"pid": NO_PID, "url": "", "token": ""}))
    code, out, err = await _relax("status", "--json", "--run-dir", str(tmp_path))
    assert code == 1 and "no running cluster" in err and "stale" in err


# ---------------------------------------------------------------------- helpers


async def _relax(*args: str) -> tuple[int, str, str]:
    """Run the `relax` command line in a subprocess without blocking the event loop (the
    cluster under test runs in it)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "relax.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def _status_json(run_dir: Path) -> dict[str, Any]:
    code, out, err = await _relax("status", "--json", "--run-dir", str(run_dir))
    assert code == 0, err
    return json.loads(out)


async def _status(run_dir: Path) -> dict[str, Any]:
    return await control_request(run_dir, {"op": "status", "history": 1})


async def _version_above(run_dir: Path, floor: int) -> bool:
    return (await _status(run_dir))["trainer"]["version"] > floor


async def _paused(run_dir: Path) -> bool:
    return (await _status(run_dir))["paused"] is True


async def _not_paused(run_dir: Path) -> bool:
    return (await _status(run_dir))["paused"] is False


def _rows(table: DataTable) -> set[str]:
    return {str(key.value) for key in table.rows}


def _cell(table: DataTable, row: str, column: str) -> str:
    return str(table.get_cell(row, column)) if row in _rows(table) else ""


def _banner(app: StatusApp) -> str:
    banner = app.query_one("#banner", Static)
    return str(banner.content) if banner.display else ""
