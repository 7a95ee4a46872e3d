"""The digits recipe on a multi-node Ray cluster simulated on this machine: a head, ``node-a``
and ``node-b`` (raylets of their own, each with its custom resource, all on 127.0.0.1),
started once for the module and torn down after it. The buses and the supervisor tree run in
this process (the head); the roles run in Ray actors' child processes on the nodes their
``[<role>.ray]`` names, and survive SIGKILLs, a lost node and a gang member's death with the
same audit as the process placement's fault test: zero samples lost, zero trained twice.

Skipped when ray is not installed, unless ``RELAX_REQUIRE_RAY=1`` (CI), where a missing ray
fails instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from relax import cluster
from relax.actors import RAY_INSTALL_HINT
from relax.config import load_config
from tests.actors.helpers import find, pid_alive, restarted, running_pid
from tests.e2e.audit import (
    applied_steps,
    check_exactly_once,
    check_metrics,
    check_trainer_ledger,
    read_metrics,
    replay_samples_bus,
)
from tests.optional import require
from tests.polling import wait_until
from tests.ray_nodes import add_node, loopback_cluster

# Whole runs with Ray actors starting (and restarting) beside CI's other worker: over the
# suite's 120 s default on a loaded machine; the waits inside have their own deadlines.
pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(600)]
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "digits" / "cluster.toml"

require("ray", "RELAX_REQUIRE_RAY", RAY_INSTALL_HINT, whole_module=True)

# Enough steps that the run is still going when a restarted role is back.
AUDITED = ["supervisor.intensity=10", "supervisor.period=300"]


@pytest.fixture(scope="module")
def nodes() -> Any:
    with loopback_cluster(
        1,
        node_a={"num_cpus": 2, "resources": {"node-a": 1}},
        node_b={"num_cpus": 2, "resources": {"node-b": 1}},
    ) as simulated:
        yield simulated


def _pinned(role: str, node: str, cpus: float) -> list[str]:
    """Overrides that put ``role`` on Ray, on the node with custom resource ``node``. A start
    (a Ray worker, then a child importing torch, DeepSpeed for a trainer gang) gets 3 minutes:
    CI's two test workers share two cores."""
    return [
        f'{role}.placement="ray"',
        f"{role}.ray.num_cpus={cpus}",
        f'{role}.ray.resources={{"{node}"=0.01}}',
        f"{role}.ray.start_timeout=180",
        f"{role}.threads=1",
    ]


async def _entry(tree: Any, child: str) -> dict[str, Any]:
    return find(await tree.snapshot(), child)


def _audit(run_dir: Path, steps: int, trainer_kills: int) -> str:
    """Zero samples lost, zero trained twice — by the bus's log and by the trainer's ledger."""
    records = read_metrics(run_dir)
    applied, redone = check_metrics(records, steps)
    assert redone <= trainer_kills, (redone, applied)
    skipped = [r for r in records if not r["applied"]]
    ledger = replay_samples_bus(run_dir)
    check_exactly_once(ledger)
    batch = int(records[0]["rows"])
    assert len(ledger.trained) == batch * (len(set(applied)) + len(skipped))
    assert ledger.versions == list(range(1, steps + 1)), ledger.versions
    assert check_trainer_ledger(run_dir, ledger)["steps"] == steps
    return ledger.summary()


async def test_roles_pinned_to_nodes_learn_and_survive_sigkills(nodes, tmp_path: Path) -> None:
    """Rollout on node-a, reward and trainer on node-b, the buses on the head: every actor
    reports its node; a SIGKILLed rollout and trainer are restarted by our supervisor with
    the cause shown; nothing is lost or trained twice; and the run learns as on one machine."""
    steps = 60
    cfg = load_config(
        RECIPE,
        overrides=[
            *_pinned("rollout", "node-a", 1),
            *_pinned("reward", "node-b", 0.5),
            *_pinned("trainer", "node-b", 1),
            *AUDITED,
            f"trainer.steps={steps}",
        ],
    )
    layout = cluster.prepare(cfg, tmp_path / "run")
    run_dir = layout.run_dir
    async with cluster.build_tree(cfg, layout) as tree:
        finished = asyncio.create_task(tree.wait())
        await wait_until(lambda: len(applied_steps(run_dir)) >= 3, timeout=120, what="3 steps")
        where = {c: (await _entry(tree, c))["stats"] for c in ("rollout-0", "reward-0", "trainer")}
        assert where["rollout-0"]["node_id"] == nodes.node_a.node_id, where
        assert where["reward-0"]["node_id"] == nodes.node_b.node_id, where
        assert where["trainer"]["node_id"] == nodes.node_b.node_id, where
        for stats in where.values():
            assert stats["node_ip"] == "127.0.0.1" and stats["ray_actor_id"], stats
        assert (await _entry(tree, "samples"))["placement"] != "ray"  # the bus on the head

        for child, at in (("rollout-0", 5), ("trainer", 12)):
            await wait_until(
                lambda at=at: len(applied_steps(run_dir)) >= at, timeout=120, what=f"{at} steps"
            )
            pid = await running_pid(tree, child, timeout=60)
            os.kill(pid, signal.SIGKILL)
            await restarted(tree, child, pid, timeout=90)
            entry = await _entry(tree, child)
            crash = entry["last_crash"]
            assert crash["kind"] == "signal" and crash["signal"] == "SIGKILL", crash
            assert entry["restart_count"] == 1 and entry["stats"]["ray_actor_id"]
            assert entry["stats"]["ray_actor_id"] != where[child]["ray_actor_id"]
        await asyncio.wait_for(finished, 300)

    summary = _audit(run_dir, steps, trainer_kills=1)
    last = [s["reward_mean"] for s in applied_steps(run_dir)[-10:]]
    print(f"\nbus: {summary}; last rewards {last}")
    assert sum(last) / len(last) > 0.5, last  # it learned, as the recipe does on one machine


async def test_a_lost_node_s_rollout_is_placed_again_or_waits_for_one(
    nodes, tmp_path: Path
) -> None:
    """The rollout needs ``roam``, which one node has: removing that node mid-run re-places it
    on another node with ``roam``; removing that one too leaves it waiting for resources (not
    counted against restart intensity) until a node with ``roam`` joins; the run completes
    with nothing lost or trained twice."""
    steps = 40
    cfg = load_config(
        RECIPE,
        overrides=[*_pinned("rollout", "roam", 1), *AUDITED, f"trainer.steps={steps}"],
    )
    first = add_node(nodes, num_cpus=1, resources={"roam": 1})
    layout = cluster.prepare(cfg, tmp_path / "run")
    run_dir = layout.run_dir
    async with cluster.build_tree(cfg, layout) as tree:
        finished = asyncio.create_task(tree.wait())
        await wait_until(lambda: len(applied_steps(run_dir)) >= 3, timeout=120, what="3 steps")
        assert (await _entry(tree, "rollout-0"))["stats"]["node_id"] == first.node_id
        second = add_node(nodes, num_cpus=1, resources={"roam": 1})
        old = await running_pid(tree, "rollout-0", timeout=60)
        nodes.remove_node(first)
        await restarted(tree, "rollout-0", old, timeout=90)
        entry = await _entry(tree, "rollout-0")
        assert (entry["last_crash"] or {}).get("kind") == "node_lost", json.dumps(entry)
        assert entry["stats"]["node_id"] == second.node_id
        await wait_until(lambda: not pid_alive(old), timeout=30, what="the lost node's child gone")

        before = len(applied_steps(run_dir))
        old = await running_pid(tree, "rollout-0", timeout=60)
        nodes.remove_node(second)

        async def waiting() -> dict[str, Any] | None:
            entry = await _entry(tree, "rollout-0")
            return entry if entry["state"] == "waiting" else None

        entry = await wait_until(waiting, timeout=60, what="the rollout to wait for roam")
        assert "roam" in entry["waiting"], entry
        assert not finished.done() and len(applied_steps(run_dir)) < steps
        third = add_node(nodes, num_cpus=1, resources={"roam": 1})
        await restarted(tree, "rollout-0", old, timeout=90)
        entry = await _entry(tree, "rollout-0")
        assert entry["stats"]["node_id"] == third.node_id and entry["restart_count"] == 2, entry
        assert (await tree.snapshot())["restarts_in_period"] == 2  # the two node losses only
        await asyncio.wait_for(finished, 300)
        assert len(applied_steps(run_dir)) > before
    nodes.remove_node(third)
    print(f"\nbus: {_audit(run_dir, steps, trainer_kills=0)}")


async def test_a_deepspeed_gang_in_one_placement_group_trains_and_restarts_as_a_unit(
    nodes, tmp_path: Path
) -> None:
    import ray

    steps = 8
    cfg = load_config(
        RECIPE,
        overrides=[
            'trainer.backend="deepspeed"',
            "trainer.zero_stage=2",
            "trainer.gang=2",
            "trainer.micro_batch_size=16",  # 32 rows a step: one micro-batch per rank
            *_pinned("trainer", "node-b", 1),
            *AUDITED,
            f"trainer.steps={steps}",
        ],
    )
    layout = cluster.prepare(cfg, tmp_path / "run")
    run_dir = layout.run_dir
    async with cluster.build_tree(cfg, layout) as tree:
        finished = asyncio.create_task(tree.wait())
        await wait_until(lambda: len(applied_steps(run_dir)) >= 2, timeout=180, what="2 steps")
        entry = await _entry(tree, "trainer")
        members = entry["stats"]["members"]
        assert [m["node_id"] for m in members] == [nodes.node_b.node_id] * 2  # STRICT_PACK
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        assert [(g["strategy"], len(g["bundles"])) for g in groups] == [("STRICT_PACK", 2)]
        old = entry["pids"]
        os.kill(old[1], signal.SIGKILL)

        async def both_new() -> bool:
            entry = await _entry(tree, "trainer")
            return entry["state"] == "running" and not set(entry["pids"]) & set(old)

        await wait_until(both_new, timeout=120, what="both trainer ranks restarted")
        crash = (await _entry(tree, "trainer"))["last_crash"]
        assert crash["member"] == 1 and crash["signal"] == "SIGKILL", crash
        assert not pid_alive(old[0]), "the surviving rank must be killed with the gang"
        await asyncio.wait_for(finished, 300)
    for record in read_metrics(run_dir):
        assert record["world_size"] == 2.0, "both ranks of the gang trained"
    print(f"\nbus: {_audit(run_dir, steps, trainer_kills=1)}")
