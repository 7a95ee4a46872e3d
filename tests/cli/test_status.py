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
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from textual.geometry import Region
from textual.widgets import DataTable, Static
from typer.testing import CliRunner

from relax import cluster
from relax.cli import app as relax_app
from relax.cli._tui import StatusApp
from relax.cli._tui_widgets import AskValue, Confirm
from relax.config import parse_config
from relax.control import CONTROL_FILE, control_request, read_metrics
from tests.actors.helpers import find
from tests.polling import wait_until
from tests.tiny import tiny_toml

pytestmark = pytest.mark.anyio

TOML = tiny_toml(
    "st",
    reward='placement = "process"',  # a real process to SIGKILL
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
    # The weights each rollout serves: a published version, from the bus's file here.
    served = first["rollouts"]["rollout-0"]
    assert served["version"] >= 0 and served["start_version"] >= 0, served
    assert served["version"] <= first["trainer"]["version"] + 1, served

    version = first["trainer"]["version"]
    await wait_until(lambda: _version_above(run_dir, version), 60, "the trainer to move on")
    second = await _status_json(run_dir)
    assert second["trainer"]["version"] > version


@pytest.mark.slow
async def test_status_into_a_pipe_prints_one_plain_snapshot_and_exits(run_dir: Path) -> None:
    # stdout is a pipe here: no dashboard (it would never exit), no escape codes.
    code, out, err = await _relax("status", "--run-dir", str(run_dir))
    assert code == 0, err
    assert "\x1b" not in out
    lines = out.splitlines()
    assert lines[0].startswith("cluster st · run folder ")
    assert re.search(r"^trainer version [1-9]\d* · step \d+ · reward ", out, re.M), out
    assert re.search(r"^rollouts rollout-0 v\d+$", out, re.M), out
    for role in ROLES - {"prompts", "samples"}:
        assert re.search(rf"^  {role} +running ", out, re.M), (role, out)
    assert re.search(r"^bus samples +rows \d+/\d+", out, re.M), out
    assert re.search(r"^  task train: pending \d+", out, re.M), out


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

        # `r` asks first; `n` leaves the actor alone, `y` restarts it.
        actors.move_cursor(row=actors.get_row_index("reward-0"))
        await pilot.press("r")
        await wait_until(lambda: isinstance(app.screen, Confirm), 30, "the question")
        await pilot.press("n")
        await wait_until(lambda: not isinstance(app.screen, Confirm), 30, "the answer")
        assert find((await _status(run_dir))["tree"], "reward-0")["restart_count"] == restarts + 1
        await pilot.press("r")
        await wait_until(lambda: isinstance(app.screen, Confirm), 30, "the question")
        await pilot.press("y")
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

        # `+` adds a rollout replica; `-` drains it and takes it out of the tree again.
        assert "1 rollout ·" in _trainer_panel(app)
        assert re.search(r"serving +v\d+", _trainer_panel(app)), _trainer_panel(app)
        await pilot.press("plus")
        await wait_until(
            lambda: (
                "rollout-1" in _rows(actors) and _cell(actors, "rollout-1", "state") == "running"
            ),
            120,
            "a second rollout",
        )
        await wait_until(lambda: "2 rollouts" in _trainer_panel(app), 30, "the count shown")
        await pilot.press("minus")
        await wait_until(lambda: "rollout-1" not in _rows(actors), 120, "the second one removed")
        assert [c["id"] for c in (await _status(run_dir))["tree"]["children"]][-1] == "rollout-0"
        await pilot.press("minus")  # never below one: that is what `p` is for
        assert "rollout-0" in _rows(actors) and app.op_in_flight is None

        # `s` asks for a staleness bound; a bad one is refused, a good one set.
        await pilot.press("s")
        await wait_until(lambda: isinstance(app.screen, AskValue), 30, "the question")
        await pilot.press("minus", "3", "enter")
        await wait_until(lambda: not isinstance(app.screen, AskValue), 30, "the answer")
        await pilot.press("s")
        await wait_until(lambda: isinstance(app.screen, AskValue), 30, "the question again")
        await pilot.press("3", "enter")
        await wait_until(lambda: _staleness_is(run_dir, 3), 60, "the staleness bound set")
        await wait_until(lambda: "staleness 3" in _trainer_panel(app), 30, "the bound shown")

        # The cluster stops: the dashboard says so and keeps its last status on screen.
        await control_request(run_dir, {"op": "stop"})
        await wait_until(lambda: "has stopped" in _banner(app), 60, "the stopped banner")
        assert _rows(actors) >= ROLES

        await pilot.press("q")
        await wait_until(lambda: app.return_code == 0, 30, "`q` to quit")


@pytest.mark.slow
async def test_status_of_a_stopped_cluster_says_the_run_ended(run_dir: Path) -> None:
    if (run_dir / CONTROL_FILE).exists():  # run alone (-k): stop the module's cluster here
        await control_request(run_dir, {"op": "stop"})
        await wait_until(lambda: not (run_dir / CONTROL_FILE).exists(), 60, "the stop")
    step = max(r["step"] for r in read_metrics(run_dir))
    for args in ((), ("--json",)):
        code, out, err = await asyncio.wait_for(
            _relax("status", *args, "--run-dir", str(run_dir)), 60
        )
        assert code == 1
        said = err if args else out
        assert f"the run in {run_dir} has ended (stopped at step {step}" in said, (out, err)
        assert "last mean reward" in said
        assert not out if args else "\x1b" not in out


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


def _ended_run(tmp_path: Path, steps: int, done: int, **run_info: Any) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    info = {"cluster": "c", "steps": steps, "pid": NO_PID, **run_info}
    (run / "run.json").write_text(json.dumps(info))
    rows = [{"step": i, "applied": True, "reward_mean": i / steps} for i in range(1, done + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


@pytest.mark.parametrize(
    ("done", "control", "said"),
    [
        (8, False, "finished all 8 steps; last mean reward 1.000"),
        (3, False, "stopped at step 3 of 8; last mean reward 0.375"),
        (5, True, f"its process (pid {NO_PID}) died at step 5 of 8; last mean reward 0.625"),
    ],
)
def test_status_of_an_ended_run_reports_how_it_ended_and_exits(
    tmp_path: Path, done: int, control: bool, said: str
) -> None:
    run = _ended_run(tmp_path, 8, done)
    if control:  # left behind by a process that was killed
        (run / CONTROL_FILE).write_text(json.dumps({"pid": NO_PID, "url": "", "token": ""}))
    (run / "up.log").write_text("starting\n8 steps; mean reward 0.1 -> 0.9\n\n")
    result = CliRunner().invoke(relax_app, ["status", "--run-dir", str(run)])
    assert result.exit_code == 1
    assert f"the run in {run} has ended ({said}; up.log ends: 8 steps;" in result.stdout
    assert "no running cluster" in result.stderr


def test_status_in_a_pipe_of_a_starting_cluster_does_not_wait(tmp_path: Path) -> None:
    run = _ended_run(tmp_path, 8, 0, pid=os.getpid())  # `relax up` alive, not serving yet
    # A real pipe: a subprocess, bounded so a dashboard that never exits fails the test.
    done = subprocess.run(
        [sys.executable, "-m", "relax.cli", "status", "--run-dir", str(run)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert f"the cluster (pid {os.getpid()}) is starting or stopping" in done.stdout
    assert "\x1b" not in done.stdout + done.stderr


def test_status_on_a_terminal_reports_an_ended_run_instead_of_waiting(tmp_path: Path) -> None:
    run = _ended_run(tmp_path, 8, 8)
    primary, secondary = os.openpty()  # stdout is a terminal: the dashboard's case
    try:
        done = subprocess.run(
            [sys.executable, "-m", "relax.cli", "status", "--run-dir", str(run)],
            stdin=subprocess.DEVNULL,
            stdout=secondary,
            stderr=subprocess.PIPE,
            timeout=60,  # a dashboard waiting for a cluster that will not come fails here
        )
        os.close(secondary)
        secondary = -1
        shown = b""
        while chunk := _read_pty(primary):
            shown += chunk
    finally:
        os.close(primary)
        if secondary >= 0:
            os.close(secondary)
    assert done.returncode == 1
    assert f"the run in {run} has ended (finished all 8 steps" in shown.decode()


async def test_sparklines_draw_constants_at_their_level_and_show_their_scale(
    tmp_path: Path,
) -> None:
    app = StatusApp(tmp_path, interval=60)
    async with app.run_test(size=(150, 40)) as pilot:
        for reward, full in ((1.0, True), (0.0, False), (0.5, None)):
            app._render_snapshot(_snapshot(rewards=[reward] * 20, loss=0.25))
            await pilot.pause()
            columns = _bars(app, "#reward")
            assert len(set(columns)) == 1, columns  # a constant: one level across the chart
            height = app.query_one("#reward").size.height
            level = columns[0]
            if full:
                assert level == 8 * height  # 1.0 on the 0..1 axis: full height
            elif full is False:
                assert level == 1  # 0.0: the floor, a line of ▁ (still visible)
            else:
                assert abs(level - 4 * height) <= 1
            label = str(app.query_one("#reward-label", Static).content)
            assert f"min {reward:g} · max {reward:g} · axis 0 to 1" in label, label
        # A rising reward rises on screen; the loss axis includes 0.
        app._render_snapshot(_snapshot(rewards=[i / 19 for i in range(20)], loss=0.25))
        await pilot.pause()
        columns = _bars(app, "#reward")
        assert columns == sorted(columns) and columns[0] < columns[-1]
        assert "axis 0 to 0.25" in str(app.query_one("#loss-label", Static).content)
        assert len(set(_bars(app, "#loss"))) == 1 and _bars(app, "#loss")[0] > 1


async def test_restart_key_asks_before_restarting(tmp_path: Path, monkeypatch) -> None:
    sent: list[dict[str, Any]] = []
    app = StatusApp(tmp_path, interval=60)
    monkeypatch.setattr(app, "_operate", lambda name, payload, done: sent.append(payload))
    async with app.run_test(size=(150, 40)) as pilot:
        app._render_snapshot(_snapshot(rewards=[0.5], loss=0.1))
        await pilot.pause()
        await pilot.press("r")
        await wait_until(lambda: isinstance(app.screen, Confirm), 30, "the question")
        assert "Restart [b]trainer[/b]?" in app.screen.question
        await pilot.press("escape")
        await wait_until(lambda: not isinstance(app.screen, Confirm), 30, "the answer")
        assert sent == []
        await pilot.press("r", "n")
        await pilot.pause()
        assert sent == [] and not isinstance(app.screen, Confirm)
        await pilot.press("r", "y")
        await wait_until(lambda: bool(sent), 30, "the restart request")
        assert sent == [{"op": "restart", "child": "trainer"}]


# ---------------------------------------------------------------------- helpers


def _read_pty(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # EIO: the other side is closed and everything was read
        return b""


def _snapshot(rewards: list[float], loss: float) -> dict[str, Any]:
    """A ``status`` reply of the shape the control endpoint sends (for the widget tests)."""
    metrics = [
        {"step": i + 1, "applied": True, "reward_mean": r, "loss": loss}
        for i, r in enumerate(rewards)
    ]
    child = {"id": "trainer", "state": "running", "placement": "inproc", "restart_count": 0}
    return {
        "cluster": "c",
        "tree": {"id": "root", "strategy": "one_for_one", "children": [child]},
        "trainer": {"version": len(rewards)},
        "metrics": metrics,
        "bus": {},
    }


def _bars(app: StatusApp, selector: str) -> list[int]:
    """The level (in eighths of a cell) of every drawn column of a sparkline, read off screen."""
    widget = app.query_one(selector)
    lines = [s.text for s in widget.render_lines(Region(0, 0, *widget.size))]
    levels = []
    for x in range(widget.size.width):
        column = [line[x] for line in reversed(lines)]  # bottom line first
        if set(column) == {" "}:
            continue  # padding left of the data
        levels.append(sum(8 if c == "█" else " ▁▂▃▄▅▆▇".index(c) for c in column))
    return levels


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


@pytest.mark.parametrize("args", [["status", "--json"], ["status"], ["down"]])
def test_operating_commands_start_fast_without_torch(tmp_path: Path, args: list[str]) -> None:
    """`relax status` is polled (by people and by scripts): it must not import torch or
    transformers, which took it from ~1 s to ~13 s a call (through the control endpoint's
    import of the rollout role)."""
    run = _ended_run(tmp_path, 8, 3)
    code = (
        "import sys\n"
        "from relax.cli import main\n"
        f"sys.argv = ['relax', *{args!r}, '--run-dir', {str(run)!r}]\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "print('heavy:', heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines()[-1] == "heavy: []", done.stdout + done.stderr


def test_a_ray_placed_child_shows_its_node_in_the_plain_snapshot() -> None:
    from relax.cli._status_text import plain_snapshot

    node = "1a2b3c4d" + "0" * 48
    child = {"id": "rollout-0", "state": "running", "pids": [41], "uptime_s": 3.0}
    snap: Any = {
        "tree": {
            "strategy": "one_for_one",
            "children": [
                {**child, "placement": "ray", "stats": {"node_id": node, "node_ip": "127.0.0.1"}},
                {**child, "id": "trainer", "placement": "process", "stats": {}},
            ],
        },
        "bus": {},
        "metrics": [],
    }
    text = plain_snapshot(snap)
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ")}
    ray_line, process_line = rows["rollout-0"], rows["trainer"]
    assert "ray @ 127.0.0.1 node 1a2b3c4d " in ray_line and node not in ray_line
    assert "process" in process_line and "node" not in process_line


def test_a_ray_gang_shows_the_nodes_its_members_run_on() -> None:
    from relax.cli._status_text import placement_label

    def member(node: str) -> dict[str, Any]:
        return {"node_id": node * 7, "node_ip": "127.0.0.1"}

    packed = {"placement": "ray", "stats": {"members": [member("aaaa1111")] * 2}}
    assert placement_label(packed) == "ray @ 127.0.0.1 node aaaa1111"
    spread = {"placement": "ray", "stats": {"members": [member("aaaa1111"), member("bbbb2222")]}}
    assert placement_label(spread) == "ray @ 2 nodes: aaaa1111, bbbb2222"
    assert placement_label({"placement": "process", "stats": {"members": [{}, {}]}}) == "process"


def test_a_child_waiting_for_resources_says_so_in_the_plain_snapshot() -> None:
    from relax.cli._status_text import plain_snapshot

    waiting = {
        "id": "rollout-0",
        "placement": "ray",
        "state": "waiting",
        "waiting": "waiting for resources: no live Ray node has {'node-b': 0.1}",
        "pids": [],
    }
    running = {"id": "trainer", "placement": "process", "state": "running", "pids": [7]}
    snap: Any = {
        "tree": {"strategy": "one_for_one", "children": [waiting, running]},
        "bus": {},
        "metrics": [],
    }
    rows = {line.split()[0]: line for line in plain_snapshot(snap).splitlines() if line[:2] == "  "}
    assert "waiting for resources" in rows["rollout-0"]
    assert "waiting" not in rows["trainer"] and "running" in rows["trainer"]


def _trainer_panel(app: StatusApp) -> str:
    return str(app.query_one("#trainer", Static).content)


async def _staleness_is(run_dir: Path, bound: int) -> bool:
    return (await _status(run_dir))["bus"]["samples"]["staleness"] == bound
