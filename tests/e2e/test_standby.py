"""``[supervisor] standby``: a SIGKILLed role restarts in its warm spare — the process that was
waiting, started and imported, before the kill — and the run loses and repeats nothing.

The digits recipe with rollout, reward and trainer in processes; each is killed once, as soon
as its spare is ready, while the run goes on. The audit is the fault tests' (the samples bus's
own log and the trainer's ledger); how long each restart took is printed, not asserted
(``bench/actors.py`` measures it).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from relax import cluster
from relax.config import load_config
from tests.actors.helpers import find, pid_alive, restarted, running_pid
from tests.e2e.audit import (
    at_step,
    check_exactly_once,
    check_metrics,
    check_no_lease_expired,
    check_trainer_ledger,
    read_metrics,
    replay_samples_bus,
)
from tests.polling import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "digits" / "cluster.toml"
ROLES = ("trainer", "rollout-0", "reward-0")


async def _spares(tree: Any, child: str) -> list[int]:
    return find(await tree.snapshot(), child)["spares"]


async def test_killed_roles_restart_in_their_warm_spares_losing_nothing(tmp_path: Path) -> None:
    overrides = [
        "supervisor.standby=true",
        *(f'{role}.placement="process"' for role in ("rollout", "reward", "trainer")),
        "supervisor.intensity=10",
        "supervisor.period=300",
        # Long enough that the run still goes after the last kill: a spare is ready a few
        # seconds after its child (re)started, the imports of a new interpreter.
        "trainer.steps=600",
    ]
    cfg = load_config(RECIPE, overrides=overrides)
    steps, batch = cfg.trainer.steps, cfg.trainer.global_batch_size
    layout = cluster.prepare(cfg, tmp_path / "run")
    run_dir = layout.run_dir
    took: dict[str, float] = {}
    async with cluster.build_tree(cfg, layout) as tree:
        finished = asyncio.create_task(tree.wait())
        await wait_until(lambda: at_step(finished, run_dir, 3), 120, "step 3")
        for role in ROLES:
            (spare,) = await wait_until(lambda r=role: _spares(tree, r), 120, f"{role}'s spare")
            assert not finished.done(), "the run ended before the kills"
            pid = await running_pid(tree, role, timeout=60)
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            await restarted(tree, role, pid, timeout=60)
            took[role] = time.monotonic() - killed
            # The spare became the role: no new interpreter was started for it.
            assert await running_pid(tree, role, timeout=60) == spare
            assert pid_alive(spare) and not pid_alive(pid)
        last = {role: await wait_until(lambda r=role: _spares(tree, r), 120) for role in ROLES}
        await asyncio.wait_for(finished, 300)
        snap = await tree.snapshot()
    for child in snap["children"]:
        expected = 1 if child["id"] in ROLES else 0
        assert child["restart_count"] == expected, child
    # A child stopped on purpose (the run's end) takes its spare along.
    for pids in last.values():
        await wait_until(lambda p=pids[0]: not pid_alive(p), 10, "the spares to be stopped")

    records = read_metrics(run_dir)
    applied, redone = check_metrics(records, steps)
    assert redone <= 1, applied  # the trainer, killed once
    ledger = replay_samples_bus(run_dir)
    check_exactly_once(ledger)
    check_no_lease_expired(run_dir, ledger)  # reclaimed, not waited out (60 s)
    skipped = sum(1 for r in records if not r["applied"])
    assert len(ledger.trained) == batch * (len(set(applied)) + skipped)
    assert check_trainer_ledger(run_dir, ledger)["steps"] == steps
    print(f"\nSIGKILL -> restarted in its spare: { {r: round(t, 3) for r, t in took.items()} }")
