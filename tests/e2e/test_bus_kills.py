"""A bus SIGKILLed at any point of the weights commit, or a bus killed at any moment, costs the
run one restart of that bus and nothing else, under the recipes' default supervisor settings
(one restart in five seconds).

The digits recipe runs with both buses in their own processes.
The samples bus SIGKILLs itself at a named point of the commit protocol (``RELAX_BUS_KILL_AT``,
once per run); the prompts and samples buses are also killed from outside at moments while the
run goes. Afterwards the run is audited from the bus log AND the trainer's own ledger: nothing
lost, nothing trained twice, weight versions contiguous, the run finished.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from relax import cluster
from relax.bus._service import KILL_AT_ENV
from relax.config import load_config
from tests.actors.helpers import find, wait_until
from tests.e2e.audit import (
    applied_steps,
    check_exactly_once,
    check_metrics,
    check_stopped_run,
    check_trainer_ledger,
    read_metrics,
    replay_samples_bus,
)

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "digits" / "cluster.toml"
STEPS = 8
# The buses in their own processes (SIGKILLable); the roles in this one, which keeps start-up
# short on a small machine. They reach the buses over ipc:// either way.
OVERRIDES = ['bus.transport="ipc"', f"trainer.steps={STEPS}"]


def audit(run_dir: Path, snap: dict, restarted: dict[str, int], steps: int = STEPS) -> None:
    """The supervisor restarted exactly ``restarted``; the run is whole by both records."""
    counts = {c["id"]: c["restart_count"] for c in snap["children"] if c["restart_count"]}
    assert counts == restarted, counts
    check_metrics(read_metrics(run_dir), steps)
    ledger = replay_samples_bus(run_dir)
    check_exactly_once(ledger)
    assert ledger.commits == list(range(steps + 1)), ledger.commits  # v0: the initial weights
    assert ledger.versions == list(range(1, steps + 1)), ledger.versions
    summary = check_trainer_ledger(run_dir, ledger)
    assert summary["steps"] == steps, summary


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("transport", "point"),
    [
        # The weight plane: the trainer writes the bytes itself, the bus is never mid-upload.
        *(("group", p) for p in ("before_upload", "after_weights_file", "after_commit_record")),
        *(("bus", p) for p in ("before_upload", "mid_upload", "after_weights_file")),
        ("bus", "after_commit_record"),
    ],
)
async def test_samples_bus_killed_inside_the_weights_commit(
    tmp_path, monkeypatch, transport, point
) -> None:
    # In the commit of step 3 (its rows acked with it); the bus processes inherit it.
    monkeypatch.setenv(KILL_AT_ENV, f"{point}@3")
    cfg = load_config(RECIPE, overrides=[*OVERRIDES, f'weights.transport="{transport}"'])
    assert (cfg.supervisor.intensity, cfg.supervisor.period) == (1, 5.0)  # the defaults
    layout = cluster.prepare(cfg, tmp_path / "run")
    async with cluster.build_tree(cfg, layout) as tree:
        await asyncio.wait_for(tree.wait(), 90)
        snap = await tree.snapshot()
    assert (layout.run_dir / "samples" / f"killed-at-{point}").exists()
    audit(layout.run_dir, snap, {"samples": 1})


@pytest.mark.timeout(180)
async def test_either_bus_killed_at_a_moment_of_the_run(tmp_path) -> None:
    # Never reached: the run is stopped once both buses were killed, came back and it went
    # on. (A fixed step count "long enough" raced the machine's speed: 100 steps could end
    # before the second kill.)
    steps = 100_000
    # A take whose reply died with the bus gets its lease again when its client resends it
    # (tests/e2e/test_sync.py), and one whose client gave up first (its wait ran out while
    # the bus was down) at the client's next take of the task under the same id
    # (tests/bus/test_service.py). The short lease bounds what neither covers.
    overrides = [*OVERRIDES, f"trainer.steps={steps}", "bus.lease_timeout=10"]
    cfg = load_config(RECIPE, overrides=overrides)
    layout = cluster.prepare(cfg, tmp_path / "run")
    run_dir = layout.run_dir
    async with cluster.build_tree(cfg, layout) as tree:  # stopped gracefully on exit
        finished = asyncio.create_task(tree.wait())
        await wait_until(lambda: len(applied_steps(run_dir)) >= 3, 60, "3 steps")
        for target in ("samples", "prompts"):

            async def running(target: str = target) -> bool:
                entry = find(await tree.snapshot(), target)
                return entry["state"] == "running" and bool(entry["pids"])

            await wait_until(running, 30, f"{target} running")
            assert not finished.done()
            pid = find(await tree.snapshot(), target)["pids"][0]
            os.kill(pid, signal.SIGKILL)

            async def back(target: str = target, old: int = pid) -> bool:
                entry = find(await tree.snapshot(), target)
                return entry["state"] == "running" and old not in entry["pids"]

            await wait_until(back, 30, f"{target} restarted")
            await asyncio.sleep(5.5)  # the next kill falls outside this one's 5 s window
        done = len(applied_steps(run_dir))
        await wait_until(lambda: len(applied_steps(run_dir)) >= done + 3, 120, "steps after")
        assert not finished.done()
        snap = await tree.snapshot()
    counts = {c["id"]: c["restart_count"] for c in snap["children"] if c["restart_count"]}
    assert counts == {"prompts": 1, "samples": 1}, counts
    assert check_stopped_run(run_dir) >= done + 3
