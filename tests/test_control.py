"""The control endpoint of a running cluster: status, restart, pause/resume, stop."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from relax import cluster
from relax.config import parse_config
from relax.control import CONTROL_FILE, ClusterNotRunning, control_request, read_metrics
from tests.actors.helpers import find, wait_until
from tests.tiny import tiny_toml

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

# The default lease (60 s): a reward role restarted holding a lease takes it back.
TOML = tiny_toml("ctl")


async def test_status_restart_pause_and_stop(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(ClusterNotRunning):
        await control_request(run_dir, {"op": "status"})
    running = asyncio.create_task(cluster.run(parse_config(TOML), run_dir))
    await wait_until(lambda: (run_dir / CONTROL_FILE).exists(), timeout=60, what="control.json")
    assert oct((run_dir / CONTROL_FILE).stat().st_mode & 0o777) == "0o600"

    async def version() -> int:
        return (await control_request(run_dir, {"op": "status"}))["trainer"]["version"]

    await wait_until(lambda: _above(version, 2), timeout=60, what="training to progress")
    status = await control_request(run_dir, {"op": "status"})
    json.dumps(status)  # JSON-ready, as `relax status --json` prints it
    assert status["cluster"] == "ctl" and status["tree"]["id"] == "ctl"
    ids = {c["id"] for c in status["tree"]["children"]}
    assert {"samples", "prompts", "dataset", "reward-0", "trainer", "rollout-0"} <= ids
    assert status["bus"]["samples"]["counters"]["put"] > 0
    assert status["metrics"] and status["metrics"][-1]["step"] >= 1

    assert await control_request(run_dir, {"op": "restart", "child": "reward-0"})
    after = await control_request(run_dir, {"op": "status"})
    assert find(after["tree"], "reward-0")["restart_count"] == 1

    # Paused: the reply comes once the round in flight is put; then nothing more is generated
    # while the trainer eats what is left on the bus, until it has too little for a step.
    assert (await control_request(run_dir, {"op": "pause"}))["paused"] is True
    puts = await _puts(run_dir)
    await wait_until(lambda: _starved(run_dir), timeout=60, what="the trainer to run dry")
    assert await _puts(run_dir) == puts
    assert (await control_request(run_dir, {"op": "resume"}))["paused"] is False
    await wait_until(lambda: _above(lambda: _puts(run_dir), puts), timeout=60, what="puts again")

    with pytest.raises(Exception, match="unknown control op"):
        await control_request(run_dir, {"op": "explode"})
    # Stopped while idle, the trainer saves its last published version on the way out.
    await control_request(run_dir, {"op": "pause"})
    await wait_until(lambda: _starved(run_dir), timeout=60, what="the trainer to run dry")
    assert await control_request(run_dir, {"op": "stop"}) == {"stopping": True}
    layout = await asyncio.wait_for(running, 60)
    assert not (run_dir / CONTROL_FILE).exists()
    records = read_metrics(layout.run_dir)
    assert len(records) < 100000  # stopped on request, not finished
    last = max(r["step"] for r in records if r["applied"])
    saved = sorted(p.name for p in (layout.run_dir / "checkpoints").iterdir())
    assert saved == [f"step-{last:08d}"]
    with pytest.raises(ClusterNotRunning):
        await control_request(run_dir, {"op": "status"})


async def _above(value, floor: int) -> bool:
    return await value() > floor


async def _puts(run_dir: Path) -> int:
    status = await control_request(run_dir, {"op": "status", "history": 1})
    return status["bus"]["samples"]["counters"]["put"]


async def _starved(run_dir: Path) -> bool:
    """Fewer rows left on the sample bus than one training step needs."""
    status = await control_request(run_dir, {"op": "status", "history": 1})
    return status["bus"]["samples"]["rows"] < 8
