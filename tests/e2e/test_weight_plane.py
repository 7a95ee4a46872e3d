"""The weight plane in a running cluster: the digits recipe with two rollout processes receives
every version over a gloo group (``[weights] transport = "group"``, the default); a rollout
SIGKILLed mid-run is restarted, rejoins the group at a later version and catches up, and the
run loses no sample and trains none twice (the bus log and the trainer's ledger, as the fault
tests audit it), every row within the staleness bound."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from relax import cluster
from relax.config import load_config
from tests.actors.helpers import restarted, running_pid
from tests.e2e.audit import (
    applied_steps,
    check_exactly_once,
    check_metrics,
    check_trainer_ledger,
    read_metrics,
    replay_samples_bus,
)
from tests.polling import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(600)]
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "digits" / "cluster.toml"


async def _plane(tree: Any, rollout: str, finished: asyncio.Task[Any]) -> dict[str, Any]:
    if finished.done():
        raise AssertionError("the run ended before the rollouts were seen over the group")
    try:
        stats = await tree.ref(rollout).call("statistics", timeout=10)
    except Exception:  # between incarnations
        return {}
    return stats.get("weight_plane") or {}


async def test_two_rollouts_get_every_version_over_the_group_and_a_killed_one_catches_up(
    tmp_path: Path,
) -> None:
    overrides = [
        "rollout.replicas=2",
        'rollout.placement="process"',
        'reward.placement="process"',
        'trainer.placement="process"',
        "weights.lease=3",
        # One machine: the rollouts could read the trainer's file; this test is the group's.
        'weights.local_file="off"',
        # The recipe steps in ~60 ms and a rollout process starts in seconds: enough steps
        # that the run is still going after the second rollout started, was killed and came
        # back (the waits below fail at once if it ended first).
        "trainer.steps=400",
    ]
    cfg = load_config(RECIPE, overrides=overrides)
    assert cfg.weights.transport == "group"  # the default
    steps, batch = cfg.trainer.steps, cfg.trainer.global_batch_size
    layout = cluster.prepare(cfg, tmp_path / "run")
    run_dir = layout.run_dir
    async with cluster.build_tree(cfg, layout) as tree:
        finished = asyncio.create_task(tree.wait())

        async def both_over_the_group() -> bool:
            planes = [await _plane(tree, f"rollout-{i}", finished) for i in (0, 1)]
            return all(p.get("via_group", 0) >= 2 for p in planes)

        await wait_until(both_over_the_group, timeout=180, what="both rollouts over the group")
        at_kill = len(applied_steps(run_dir))
        pid = await running_pid(tree, "rollout-1", timeout=60)
        os.kill(pid, signal.SIGKILL)
        await restarted(tree, "rollout-1", pid, timeout=120)

        async def rejoined() -> bool:
            return (await _plane(tree, "rollout-1", finished)).get("via_group", 0) >= 1

        # Its new incarnation caught up (from the bus) and then joined a re-formed group.
        await wait_until(rejoined, timeout=180, what="the restarted rollout over the group")
        survivor = await _plane(tree, "rollout-0", finished)
        assert survivor["epoch"] >= 2, survivor  # the group was formed again around it
        await asyncio.wait_for(finished, 300)
    assert len(applied_steps(run_dir)) > at_kill  # the trainer kept training

    records = read_metrics(run_dir)
    applied, _ = check_metrics(records, steps)
    for r in records:  # the bound held for every row of every step
        assert r["oldest_row_version"] >= r["trainer_version_at_take"] - cfg.staleness_bound, r
    ledger = replay_samples_bus(run_dir)
    check_exactly_once(ledger)
    skipped = [r for r in records if not r["applied"]]
    assert len(ledger.trained) == batch * (len(set(applied)) + len(skipped))
    assert ledger.versions == list(range(1, steps + 1)), ledger.versions
    assert check_trainer_ledger(run_dir, ledger)["steps"] == steps
    # Every version's bytes are in the run folder (the trainer's file), none went through RPC.
    files = sorted((run_dir / "samples" / "weights").glob("v*.safetensors"))
    assert files and files[-1].name == f"v{steps:012d}.safetensors", files
