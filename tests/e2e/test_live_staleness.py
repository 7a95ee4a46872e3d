"""The staleness bound changed in a running cluster: the digits recipe starts at 1, is set to 0
with `relax set staleness 0` and then to "inf" through the control endpoint, and the bound in
force at each take holds for every row of every step (the oldest row of each batch against
the bound that step's take reported), with nothing lost or trained twice."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path
from typing import Any

import pytest

from relax import cluster
from relax.config import load_config
from relax.control import control_request
from tests.e2e import audit
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
ROOT = Path(__file__).resolve().parents[2]


async def test_staleness_set_live_from_1_to_0_to_inf_holds_at_every_step(tmp_path: Path) -> None:
    overrides = [
        "trainer.steps=150",
        'rollout.placement="process"',
        'weights.overlap="on"',  # "auto" is off on CPU: the bound must hold with it too
    ]
    cfg = load_config(RECIPE, overrides=overrides)
    assert cfg.staleness == 1
    run_dir = tmp_path / "run"
    run = asyncio.create_task(cluster.run(cfg, run_dir))
    try:
        await _change_twice(run, run_dir)
    except BaseException:
        # Stop the cluster the way an operator would, so a failed check ends the test
        # instead of leaving a half-cancelled run behind.
        with contextlib.suppress(Exception):
            await control_request(run_dir, {"op": "stop"}, timeout=10)
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(run, 120)
        raise
    layout = await asyncio.wait_for(run, 300)
    _check(cfg, layout)


async def _change_twice(run: asyncio.Task, run_dir: Path) -> None:
    def at_step(n: int) -> bool:
        return audit.at_step(run, run_dir, n)

    await wait_until(lambda: at_step(10), timeout=240, what="10 steps")
    cli = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "relax.cli", "set", "staleness", "0", "--run-dir", str(run_dir),
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(cli.communicate(), 120)
    assert cli.returncode == 0, err.decode()
    assert out.decode().strip() == "staleness: 1 -> 0"
    changed_at = len(applied_steps(run_dir))
    await wait_until(lambda: at_step(changed_at + 15), timeout=240, what="15 steps at 0")
    reply = await control_request(run_dir, {"op": "set", "key": "staleness", "value": "inf"})
    assert reply == {"staleness": "inf", "before": 0}
    with pytest.raises(ValueError, match="staleness"):  # refused, nothing changed
        await control_request(run_dir, {"op": "set", "key": "staleness", "value": -2})
    status = await control_request(run_dir, {"op": "status", "history": 1})
    assert status["bus"]["samples"]["staleness"] == "inf"


def _check(cfg: Any, layout: Any) -> None:

    records = read_metrics(layout.run_dir)
    applied, _ = check_metrics(records, cfg.trainer.steps)
    bounds = [r["staleness_bound"] for r in records]
    # The bound each take reported moved 1 -> 0 -> "inf", once each, in that order.
    assert [b for i, b in enumerate(bounds) if i == 0 or bounds[i - 1] != b] == [1, 0, "inf"]
    # [weights] overlap: a step's publish went on during the next step while
    # the bound was above 0, never at 0 (where the run is the synchronous loop).
    assert not any(r["publish_overlapped"] for r in records if r["staleness_bound"] == 0)
    for bound in (1, "inf"):
        assert any(r["publish_overlapped"] for r in records if r["staleness_bound"] == bound)
    for r in records:  # every row of every batch within the bound in force at its take
        lags = {int(lag): n for lag, n in r["lag_hist"].items()}
        assert sum(lags.values()) == cfg.trainer.global_batch_size, r
        assert max(lags) == r["staleness_max"], r
        if r["staleness_bound"] != "inf":
            assert r["staleness_max"] <= r["staleness_bound"], r
    ledger = replay_samples_bus(layout.run_dir)
    check_exactly_once(ledger)
    assert check_trainer_ledger(layout.run_dir, ledger)["steps"] == cfg.trainer.steps
    # Steps taken under bounds 1, 0 and "inf" replay bit for bit from the trainer's record.
    audit.check_replays_identically(layout.run_dir, cfg.trainer.steps)
    assert len(applied) == cfg.trainer.steps
