"""Rollout replicas added and removed in a running cluster: the digits recipe starts with one
rollout process, `relax scale rollout 3` adds two (each loads the current weights before it
takes a prompt, then joins the weight plane), and scaling back to one drains them (the round
in flight is put and its prompts acked, no lease left to expire) and takes them out of the
weight plane at once. Nothing is lost or trained twice: the samples bus log and the trainer's
ledger as the fault tests audit them, and every prompt of the prompts bus acked at most once
and none vanished."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from relax import cluster
from relax.config import load_config
from relax.control import control_request
from tests.e2e import audit
from tests.e2e.audit import applied_steps, check_stopped_run, read_metrics, replay_samples_bus
from tests.polling import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "digits" / "cluster.toml"
LEASE = 8.0


async def test_rollouts_scaled_up_then_drained_down_mid_run_lose_nothing(tmp_path: Path) -> None:
    # Many steps: the run is stopped once the checks are done, not left to finish first.
    overrides = [
        "trainer.steps=100000",
        'rollout.placement="process"',
        # Short enough that a prompt lease a removed replica left behind would expire while
        # the run goes on (and show in the audit), long enough that no healthy round's does.
        f"bus.lease_timeout={LEASE}",
        # The group, re-formed at each change (on one machine "auto" would read the file).
        'weights.local_file="off"',
    ]
    cfg = load_config(RECIPE, overrides=overrides)
    layout = cluster.prepare(cfg, tmp_path / "run")
    tree = cluster.build_tree(cfg, layout)
    control = cluster.control_server(cfg, layout, tree)
    try:
        async with control.serving(), tree:  # the tree stops (trainer last step saved) on exit
            finished = asyncio.create_task(tree.wait())
            try:
                await _scale_up_and_down(tree, finished, layout.run_dir)
            finally:
                finished.cancel()
    finally:
        layout.release()
    _audit(layout.run_dir, cfg.trainer.global_batch_size)


async def _status(run_dir: Path) -> dict[str, Any]:
    return await control_request(run_dir, {"op": "status", "history": 1})


async def _stats(tree: Any, child: str) -> dict[str, Any]:
    try:
        return await tree.ref(child).call("statistics", timeout=10)
    except Exception:  # not started yet
        return {}


async def _scale_up_and_down(tree: Any, finished: asyncio.Task, run_dir: Path) -> None:
    def at_step(n: int) -> bool:
        return audit.at_step(finished, run_dir, n)

    await wait_until(lambda: at_step(5), timeout=240, what="5 steps")
    version = (await _status(run_dir))["trainer"]["version"]
    cli = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "relax.cli", "scale", "rollout", "3", "--run-dir", str(run_dir),
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(cli.communicate(), 300)
    assert cli.returncode == 0, err.decode()
    assert out.decode().splitlines() == [
        "added rollout-1",
        "added rollout-2",
        "rollout: 1 -> 3 replicas",
    ]

    async def serving(child: str) -> bool:
        at_step(0)
        stats = await _stats(tree, child)
        plane = stats.get("weight_plane") or {}
        return stats.get("requests", 0) > 0 and plane.get("via_group", 0) >= 1

    for child in ("rollout-1", "rollout-2"):
        await wait_until(lambda c=child: serving(c), timeout=240, what=f"{child} serving")
        stats = await _stats(tree, child)
        # It held the trainer's weights of the moment it was added before it served at all.
        assert stats["start_version"] >= version, (child, stats["start_version"], version)
    assert {"rollout-0-", "rollout-1-", "rollout-2-"} == _plane_rollouts(await _status(run_dir))

    at_down = len(applied_steps(run_dir))
    reply = await control_request(
        run_dir, {"op": "scale", "role": "rollout", "replicas": 1}, timeout=300
    )
    assert reply["drained"] == {"rollout-2": True, "rollout-1": True}, reply
    assert (reply["before"], reply["replicas"], reply["added"]) == (3, 1, [])
    status = await _status(run_dir)
    rollouts = [c["id"] for c in status["tree"]["children"] if c["id"].startswith("rollout")]
    assert rollouts == ["rollout-0"]
    assert _plane_rollouts(status) == {"rollout-0-"}  # they left the plane on their way out
    with pytest.raises(ValueError, match="between 1 and"):
        await control_request(run_dir, {"op": "scale", "role": "rollout", "replicas": 0})
    with pytest.raises(ValueError, match="what can be scaled live: rollout"):
        await control_request(run_dir, {"op": "scale", "role": "trainer", "replicas": 2})
    # The trainer goes on with the one left, for longer than a lease: a prompt the removed
    # ones had leased and not acked would have expired by the end.
    down_at = time.time()

    async def a_lease_later() -> bool:
        at_step(0)
        steps = applied_steps(run_dir)
        return len(steps) >= at_down + 10 and steps[-1]["time"] > down_at + LEASE + 1

    await wait_until(a_lease_later, timeout=240, what="a lease's time of steps after")


def _plane_rollouts(status: dict[str, Any]) -> set[str]:
    """The weight plane's members, by replica (``rollout-<i>-``)."""
    members = status["bus"]["samples"]["weights"]["members"]
    return {m[: m.index("-", len("rollout-")) + 1] for m in members}


def _audit(run_dir: Path, batch: int) -> None:
    steps = check_stopped_run(run_dir)
    records = read_metrics(run_dir)
    skipped = [r for r in records if not r["applied"]]
    assert len(replay_samples_bus(run_dir).trained) == batch * (steps + len(skipped))
    # Prompts: each acked by a rollout at most once, none vanished, and the drain left no
    # lease to expire (a replica stopped mid-round would have: its prompts come back late).
    prompts = replay_samples_bus(run_dir, bus="prompts")
    twice = {uid: n for uid, n in prompts.acked("rollout").items() if n != 1}
    assert not twice, twice
    assert all(n == 1 for n in prompts.puts.values())
    done = set(prompts.acked("rollout")) | prompts.pending | set(prompts.dropped)
    assert not set(prompts.rows) - done, sorted(set(prompts.rows) - done)[:5]
    assert prompts.counters["expired_leases"] == 0, prompts.summary()
