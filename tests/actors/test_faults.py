"""Fault tests that kill real processes and count what survived."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from relax.actors import ChildSpec, InProc, Process, Supervisor
from relax.errors import SupervisorGaveUp
from tests.actors.fixtures import CrashSoon, Echo, read_events
from tests.actors.helpers import pid_alive, starts
from tests.polling import poll_until

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_sigkill_of_the_supervisor_leaves_no_orphans() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.actors.tree_main"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        pids = json.loads(line)
        children = pids["children"]
        assert len(children) == 4 and all(pid_alive(p) for p in children)
        os.kill(pids["supervisor"], signal.SIGKILL)
        proc.wait(10)
        poll_until(
            lambda: not any(pid_alive(p) for p in children),
            10,
            f"the children {children} to die with their supervisor (none orphaned)",
            interval=0.05,
        )
    finally:
        proc.kill()
        proc.wait()


def test_a_loop_torn_down_under_the_tree_still_stops_every_child_in_order() -> None:
    # An exception raised out of the event loop makes asyncio.run cancel every task at once:
    # each child's watcher and reader too, while the tree's teardown waits on them. The tree
    # must still stop each child (asked, not killed) and the process end; it used to hang.
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.actors.tree_main", "--raise-on-sigusr1"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        pids = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        children = pids["children"]
        assert len(children) == 4 and all(pid_alive(p) for p in children)
        os.kill(pids["supervisor"], signal.SIGUSR1)
        _, err = proc.communicate(timeout=30)
        assert "Raised: raised by a signal handler" in err and proc.returncode == 1
        stops = [json.loads(line) for line in err.splitlines() if '"child stopped"' in line]
        assert [(s["supervisor"], s["child"]) for s in stops] == [
            ("sub", "b"),
            ("root", "sub"),
            ("root", "g"),
            ("root", "a"),
        ]
        assert {s["how"] for s in stops} == {"stopped by its supervisor"}
        assert not [p for p in children if pid_alive(p)]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.anyio
async def test_crash_loop_in_a_process_escalates_and_stops_the_tree_in_reverse(events_file) -> None:
    ev = {"events": events_file}
    sub = ChildSpec.supervisor(
        "sub",
        [
            ChildSpec("c", Echo, kwargs=ev, placement=Process()),
            ChildSpec("d", CrashSoon, kwargs=ev, placement=Process()),
        ],
        intensity=2,
        period=60,
    )
    children = [
        ChildSpec("a", Echo, kwargs=ev, placement=Process()),
        ChildSpec("b", Echo, kwargs=ev, placement=InProc()),
        sub,
    ]
    async with Supervisor(children, intensity=0, period=60) as root:
        with pytest.raises(SupervisorGaveUp):
            await root.wait()
    events = read_events(events_file)
    assert starts(events, "d") == 3
    assert [e for e in events if e.startswith("stop")] == ["stop c", "stop b", "stop a"]
    pids = [int(e.split()[2]) for e in events if e.startswith("start ")]
    assert not [p for p in pids if p != os.getpid() and pid_alive(p)]
