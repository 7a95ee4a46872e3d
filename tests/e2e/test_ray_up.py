"""The digits recipe with its rollout on ``placement = "ray"`` and ``[cluster.ray] address =
"local"``: ``relax.cluster`` starts a private Ray instance on 127.0.0.1 for the run, the
rollout runs in a Ray actor's child process, and the run trains as it does on one machine.

Skipped when ray is not installed, unless ``RELAX_REQUIRE_RAY=1`` (CI), where a missing ray
fails instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from relax import cluster
from relax.actors import RAY_INSTALL_HINT
from relax.config import load_config
from relax.control import control_request
from relax.errors import RelaxError
from tests.actors.helpers import find, wait_until
from tests.e2e.audit import check_stopped_run
from tests.optional import require

# Whole runs with Ray actors starting (and restarting) beside CI's other worker: over the
# suite's 120 s default on a loaded machine; the waits inside have their own deadlines.
pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(600)]
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "digits" / "cluster.toml"

require("ray", "RELAX_REQUIRE_RAY", RAY_INSTALL_HINT, whole_module=True)

STEPS = 6


async def test_digits_recipe_runs_with_its_rollout_on_ray(tmp_path: Path) -> None:
    import ray

    assert not ray.is_initialized()
    cfg = load_config(
        RECIPE,
        overrides=[
            'rollout.placement="ray"',
            "rollout.ray.num_cpus=1",
            'cluster.ray.address="local"',
            "cluster.ray.num_cpus=2",
            f"trainer.steps={STEPS}",
            'weights.local_file="off"',  # the group, not the file the rollout could read
        ],
    )
    run_dir = tmp_path / "run"
    run = asyncio.create_task(cluster.run(cfg, run_dir))

    async def rollout_on_its_node() -> dict[str, Any] | None:
        if run.done():
            run.result()  # raises what the run raised; a finished run is too late to look
            raise AssertionError("the run ended before its rollout showed up in the status")
        try:
            status = await control_request(run_dir, {"op": "status", "history": 1}, timeout=5)
        except RelaxError:
            return None  # not serving yet
        entry = find(status["tree"], "rollout-0")
        running = entry["state"] == "running" and (entry["stats"] or {}).get("node_id")
        return entry if running else None

    entry = await wait_until(rollout_on_its_node, timeout=120, what="the rollout on Ray")
    # The status (what `relax status --json` prints) names the Ray node and actor hosting it.
    assert entry["placement"] == "ray", entry
    assert entry["stats"]["node_id"] in {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert entry["stats"]["node_ip"] == "127.0.0.1" and entry["stats"]["ray_actor_id"]
    layout = await run
    assert not ray.is_initialized()  # the private instance was stopped with the run
    rows = [
        json.loads(line) for line in (layout.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if r["applied"]] == list(range(1, STEPS + 1))
    # The Ray-placed rollout picked up the trainer's published weights, within the bound.
    assert max(r["newest_row_version"] for r in rows) > 0, rows
    for r in rows:
        assert r["oldest_row_version"] >= r["trainer_version_at_take"] - cfg.staleness_bound, r
    # Those weights came over the weight plane's gloo group (the default), not the bus: the
    # Ray-placed rollout's own log (relayed from its node) says it joined the group.
    events = [json.loads(line) for line in (layout.run_dir / "logs" / "rollout-0.jsonl").open()]
    joined = [e for e in events if e["event"] == "joined the weight group"]
    assert joined and joined[0]["backend"] == "gloo" and joined[0]["size"] == 2, joined
    assert not [e for e in events if e["event"].startswith("weight transfer failed")]


async def test_every_role_on_ray_runs_from_one_command(tmp_path: Path) -> None:
    """README-style: `relax up examples/digits_ray/cluster.toml` alone — every role on Ray in
    a private instance the run starts and stops — trains the recipe, and every role reports
    the Ray node and actor hosting it."""
    recipe = RECIPE.parents[1] / "digits_ray" / "cluster.toml"
    run_dir = tmp_path / "run"
    up = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "relax.cli",
        "up",
        str(recipe),
        "--run-dir",
        str(run_dir),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        roles = ("dataset", "rollout-0", "reward-0", "trainer")

        async def all_on_ray() -> list[dict[str, Any]] | None:
            if up.returncode is not None:
                raise AssertionError("relax up ended before its roles showed up in the status")
            try:
                status = await control_request(run_dir, {"op": "status", "history": 1}, timeout=5)
            except RelaxError:
                return None  # not serving yet
            entries = [find(status["tree"], role) for role in roles]
            placed = all(
                e["state"] == "running" and (e["stats"] or {}).get("node_id") for e in entries
            )
            return entries if placed else None

        entries = await wait_until(all_on_ray, timeout=180, what="every role running on Ray")
        for entry in entries:
            assert entry["placement"] == "ray" and entry["stats"]["ray_actor_id"], entry
        out, err = await asyncio.wait_for(up.communicate(), 300)
    finally:
        if up.returncode is None:
            up.kill()
            await up.wait()
    assert up.returncode == 0, err.decode()[-3000:]
    assert "40 steps (0 skipped)" in out.decode(), out.decode()[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r["reward_mean"] for r in rows if r["applied"]][-10:]
    assert sum(last) / len(last) > 0.5, last  # it learned, as the digits recipe does


async def test_two_ray_placed_rollouts_get_the_versions_over_one_group(tmp_path: Path) -> None:
    """Two rollout replicas, each a Ray actor's child process: both receive the trainer's
    versions over one gloo group of three (the trainer and both), and the run loses and
    repeats nothing."""
    cfg = load_config(
        RECIPE,
        overrides=[
            'rollout.placement="ray"',
            "rollout.replicas=2",
            "rollout.ray.num_cpus=1",
            'cluster.ray.address="local"',
            "cluster.ray.num_cpus=2",
            "trainer.steps=100000",  # stopped once both are seen over the group
            'weights.local_file="off"',  # the group, not the file they could read
        ],
    )
    run_dir = tmp_path / "run"
    run = asyncio.create_task(cluster.run(cfg, run_dir))

    def joined_three(child: str) -> list[dict[str, Any]]:
        """The rollout's own log lines (relayed from its Ray node) of a group of three."""
        path = run_dir / "logs" / f"{child}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        events = [json.loads(line) for line in lines if line.endswith("}")]
        return [e for e in events if e["event"] == "joined the weight group" and e["size"] == 3]

    async def both_in_one_group() -> list[dict[str, Any]] | None:
        if run.done():
            run.result()
            raise AssertionError("the run ended before both rollouts were seen over the group")
        if not all(joined_three(f"rollout-{i}") for i in (0, 1)):
            return None
        try:
            status = await control_request(run_dir, {"op": "status", "history": 1}, timeout=5)
        except RelaxError:
            return None
        return [find(status["tree"], f"rollout-{i}") for i in (0, 1)]

    try:
        entries = await wait_until(both_in_one_group, timeout=240, what="both in one group")
        # A few versions more over that group before the run is stopped.
        at = (await control_request(run_dir, {"op": "status", "history": 1}))["trainer"]
        await wait_until(
            lambda: _version_above(run_dir, at["version"] + 5), timeout=120, what="5 versions"
        )
    finally:
        with contextlib.suppress(Exception):
            await control_request(run_dir, {"op": "stop"}, timeout=30)
    layout = await asyncio.wait_for(run, 180)
    for entry in entries:
        assert entry["placement"] == "ray" and entry["stats"]["ray_actor_id"], entry
    joined = [joined_three(f"rollout-{i}")[0] for i in (0, 1)]
    assert {e["rank"] for e in joined} == {1, 2} and {e["backend"] for e in joined} == {"gloo"}
    assert len({e["epoch"] for e in joined}) == 1  # the same group
    assert entries[0]["pids"] != entries[1]["pids"]
    check_stopped_run(layout.run_dir)


async def _version_above(run_dir: Path, version: int) -> bool:
    status = await control_request(run_dir, {"op": "status", "history": 1}, timeout=5)
    return status["trainer"]["version"] > version
