"""A training run survives SIGKILLs of its roles and still learns."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
from pathlib import Path

import pytest

from relax import cluster
from relax.config import load_config
from tests.actors.helpers import find, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "digits" / "cluster.toml"


def applied_steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r["applied"]]


async def test_rollout_and_trainer_sigkilled_mid_run(tmp_path) -> None:
    overrides = [
        'rollout.placement="process"',
        'reward.placement="process"',
        'trainer.placement="process"',
        "bus.lease_timeout=5",
        "supervisor.intensity=5",
        "supervisor.period=60",
    ]
    cfg = load_config(RECIPE, overrides=overrides)
    layout = cluster.prepare(cfg, tmp_path / "run")
    async with cluster.build_tree(cfg, layout) as tree:
        finished = asyncio.create_task(tree.wait())
        for target, at_step in (("rollout-0", 5), ("trainer", 12)):
            await wait_until(
                lambda at=at_step: len(applied_steps(layout.run_dir)) >= at, timeout=120
            )
            pid = find(await tree.snapshot(), target)["pids"][0]
            os.kill(pid, signal.SIGKILL)

            async def back(target: str = target, old: int = pid) -> bool:
                entry = find(await tree.snapshot(), target)
                return entry["state"] == "running" and old not in entry["pids"]

            await wait_until(back, timeout=60, what=f"{target} restarted")
        await asyncio.wait_for(finished, 300)
        snap = await tree.snapshot()
    assert find(snap, "rollout-0")["restart_count"] == 1
    assert find(snap, "trainer")["restart_count"] == 1
    steps = applied_steps(layout.run_dir)
    assert steps[-1]["step"] == cfg.trainer.steps  # every step done, versions kept rising
    versions = [s["step"] for s in steps]
    assert all(b >= a for a, b in itertools.pairwise(versions)), versions
    last = [s["reward_mean"] for s in steps[-10:]]
    assert sum(last) / len(last) > 0.5, last  # and it still learned
