"""A training run survives SIGKILLs of its roles, loses no sample, trains none twice, and learns.

The digits recipe runs with rollout, reward and trainer each in its own process. Each of them
is SIGKILLed at least once, at seeded random moments (an applied-step count, then a sub-second
delay), and restarted by the supervisor. Afterwards the samples bus's own log is replayed
offline: every row put was trained exactly once, dropped with a reason, or was still queued
when the trainer finished — none vanished, none was trained twice — and held against the
trainer's own ledger of which rows each surviving step consumed. (Bus kills, under the default
supervisor settings: ``tests/e2e/test_bus_kills.py``.)
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections import Counter
from pathlib import Path

import pytest

from relax import cluster
from relax.config import load_config
from relax.roles._common import STALL_AT_ENV
from tests.actors.helpers import restarted, running_pid
from tests.e2e.audit import (
    applied_steps,
    captured_logs,
    check_exactly_once,
    check_metrics,
    check_no_lease_expired,
    check_trainer_ledger,
    hang_explained,
    read_logs,
    read_metrics,
    replay_samples_bus,
)
from tests.polling import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "digits" / "cluster.toml"
SEED = 20261130
ROLES = ("rollout-0", "reward-0", "trainer")


@pytest.mark.timeout(300)
async def test_roles_sigkilled_mid_run_lose_nothing_and_train_nothing_twice(tmp_path) -> None:
    overrides = [
        'rollout.placement="process"',
        'reward.placement="process"',
        'trainer.placement="process"',
        "supervisor.intensity=10",
        "supervisor.period=300",
        # Twice the recipe's steps, kills in the first quarter: the run is still going at the
        # last kill even when a restarted role releases a backlog the trainer then eats at once.
        "trainer.steps=80",
    ]
    cfg = load_config(RECIPE, overrides=overrides)
    steps, batch = cfg.trainer.steps, cfg.trainer.global_batch_size
    rng = random.Random(SEED)
    targets = [*ROLES, rng.choice(ROLES)]  # each role at least once, one of them twice
    rng.shuffle(targets)
    points = sorted(rng.sample(range(3, steps // 4), len(targets)))  # applied-step counts
    delays = [rng.uniform(0.0, 0.9) for _ in targets]
    kills: Counter[str] = Counter()
    layout = cluster.prepare(cfg, tmp_path / "run")
    run_dir = layout.run_dir
    with captured_logs(tmp_path / "run.log") as log_file, hang_explained(log_file):
        async with cluster.build_tree(cfg, layout) as tree:
            finished = asyncio.create_task(tree.wait())
            for point, target, delay in zip(points, targets, delays, strict=True):
                await wait_until(
                    lambda at=point: len(applied_steps(run_dir)) >= at,
                    timeout=120,
                    what=f"{point} applied steps",
                )

                await running_pid(tree, target, timeout=60)
                await asyncio.sleep(delay)  # the kill lands at a random moment of the step
                # The child may be between incarnations right then: kill the next one.
                pid = await running_pid(tree, target, timeout=60)
                os.kill(pid, signal.SIGKILL)
                kills[target] += 1
                await restarted(tree, target, pid, timeout=60)
            await asyncio.wait_for(finished, 240)
            snap = await tree.snapshot()

    # The supervisor restarted exactly the killed children, once per kill, and knows why.
    assert set(kills) == set(ROLES) and sum(kills.values()) == len(targets), kills
    for child in snap["children"]:
        assert child["restart_count"] == kills[child["id"]], (child["id"], kills)
        if kills[child["id"]]:
            assert child["last_crash"]["kind"] == "signal", child["last_crash"]
            assert child["last_crash"]["signal"] == "SIGKILL", child["last_crash"]

    # Every restart is in the log with its cause.
    logs = read_logs(log_file)
    for target in ROLES:
        ended = logs.events("child ended", child=target)
        crashed = [e for e in ended if e["level"] == "warning" and "SIGKILL" in e["how"]]
        assert len(crashed) == kills[target], (target, ended)
        started = logs.events("child started", child=target)
        assert len(started) == kills[target] + 1, (target, started)

    # Training finished every step; versions only went forward.
    records = read_metrics(run_dir)
    applied, redone = check_metrics(records, steps)
    skipped = [r for r in records if not r["applied"]]
    # A step is redone only when the trainer died after recording it but before its weights
    # (and the ack of its rows) were committed: its update was lost, not applied twice.
    assert redone <= kills["trainer"], (redone, applied)

    # Zero samples lost, zero trained twice, by the bus's own log.
    ledger = replay_samples_bus(run_dir)
    check_exactly_once(ledger)
    check_no_lease_expired(run_dir, ledger)  # reclaimed, not waited out (60 s)
    assert len(ledger.trained) == batch * (len(set(applied)) + len(skipped)), (
        len(ledger.trained),
        len(set(applied)),
        len(skipped),
    )
    assert ledger.versions == list(range(1, steps + 1)), ledger.versions  # one per update
    # And by the trainer's own ledger: the final weights descend from steps 1..N, each on
    # rows no other surviving step used, every one of them acked by the bus.
    assert check_trainer_ledger(run_dir, ledger)["steps"] == steps
    print(
        f"\nkills (role, applied steps, delay): "
        f"{[(t, p, round(d, 2)) for t, p, d in zip(targets, points, delays, strict=True)]}; "
        f"steps redone: {redone}; skipped: {len(skipped)}; bus: {ledger.summary()}"
    )

    last = [s["reward_mean"] for s in applied_steps(run_dir)[-10:]]
    assert sum(last) / len(last) > 0.5, last  # and it still learned

    # The trainer's side replays bit for bit from its record, each restart as it happened
    # (the checkpoint it went back to, the published weights it continued from). A kill
    # before a new trainer recorded its start leaves no start: at most one per kill.
    from relax.replay import replay

    report = replay(run_dir, regenerate=True)
    assert report.identical, report.divergences[:3]
    assert report.applied == steps and 1 <= report.restarts <= kills["trainer"], report
    # And every trained row generates again as its rollout generated it (a rollout killed
    # after generating retried its prompts: the row equals one of the recorded calls).
    regen = report.regenerated
    assert regen is not None and regen.unrecorded == 0 and regen.identical == regen.rows, regen


@pytest.mark.timeout(240)
async def test_a_rollout_killed_holding_its_turn_holds_up_nothing(tmp_path, monkeypatch) -> None:
    # Staleness 0, two rollout processes: they take turns from lease to admission. Replica 1
    # is held (a test hook) right after leasing with the turn, and SIGKILLed there: the other
    # replica waits for the turn meanwhile. Its restarted self, under the same client name,
    # takes back its dead self's lease, and with it the turn (the lease would have lasted
    # 60 s): the run finishes, nothing lost, nothing trained twice.
    monkeypatch.setenv(STALL_AT_ENV, "after_lease@rollout-1=120")
    overrides = [
        "staleness=0",
        "rollout.replicas=2",
        'rollout.placement="process"',
        "trainer.steps=12",
    ]
    cfg = load_config(RECIPE, overrides=overrides)
    steps = cfg.trainer.steps
    layout = cluster.prepare(cfg, tmp_path / "run")
    run_dir = layout.run_dir
    held = run_dir / "stalled-at-after_lease@rollout-1"
    with captured_logs(tmp_path / "run.log") as log_file, hang_explained(log_file):
        async with cluster.build_tree(cfg, layout) as tree:
            finished = asyncio.create_task(tree.wait())
            await wait_until(held.exists, timeout=120, what="rollout-1 held with its turn")
            pid = await running_pid(tree, "rollout-1", timeout=60)
            os.kill(pid, signal.SIGKILL)
            await restarted(tree, "rollout-1", pid, timeout=60)
            await asyncio.wait_for(finished, 180)
            snap = await tree.snapshot()
    restarts = {c["id"]: c["restart_count"] for c in snap["children"]}
    assert restarts["rollout-1"] == 1 and restarts["rollout-0"] == 0, restarts
    check_metrics(read_metrics(run_dir), steps)
    ledger = replay_samples_bus(run_dir)
    check_exactly_once(ledger)
    assert ledger.versions == list(range(1, steps + 1)), ledger.versions
    assert check_trainer_ledger(run_dir, ledger)["steps"] == steps
