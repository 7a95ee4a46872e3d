"""Staleness 0 is strictly on-policy: a cluster run equals the synchronous loop, bit for bit."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
from safetensors.torch import load_file

from relax import cluster
from relax.bus._service import KILL_AT_ENV
from relax.cluster import Layout
from relax.config import ClusterConfig, load_config
from relax.roles._common import STALL_AT_ENV, connect_bus
from relax.roles._dataset import DatasetRole
from relax.sync import run_sync
from tests.actors.helpers import restarted, running_pid
from tests.e2e.audit import (
    bus_ops,
    captured_logs,
    check_exactly_once,
    hang_explained,
    read_logs,
    replay_samples_bus,
)
from tests.polling import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "digits" / "cluster.toml"
STEPS = 10


def steps(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def final_weights(run_dir: Path) -> dict:
    return load_file(run_dir / "checkpoints" / f"step-{STEPS:08d}" / "model.safetensors")


# Both cores at work in each phase (the layout bench/vs_trl.py times at staleness 0): two
# rollout processes generate half a step each, then a trainer process steps on two threads.
TWO_CORES = (
    "rollout.replicas=2",
    'rollout.placement="process"',
    "rollout.threads=1",
    'trainer.placement="process"',
    "trainer.threads=2",
)


# Each rollout scores its own samples: no reward role, the same rewards.
SCORED_IN_ROLLOUT = "reward.in_rollout=true"


# Replica rollout-1 paused once for 0.5 s between leasing prompts and asking for their
# admission (ten times a generation round): the other replica must not get later prompts
# admitted for the step meanwhile (it did, before replicas took turns at staleness 0).
HELD_UP = "after_lease@rollout-1=0.5"


@pytest.mark.parametrize(
    ("rollout_batch", "layout", "stall"),
    [
        (4, (), None),  # one generation call per step
        (2, (), None),  # two
        (2, TWO_CORES, None),
        (2, TWO_CORES, HELD_UP),
        (2, (*TWO_CORES, SCORED_IN_ROLLOUT), None),
    ],
    ids=[
        "one-call",
        "two-calls",
        "two-rollout-processes",
        "one-replica-held-up",
        "scored-in-rollout",
    ],
)
async def test_staleness_0_equals_a_synchronous_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    rollout_batch: int,
    layout: tuple[str, ...],
    stall: str | None,
) -> None:
    if stall:
        monkeypatch.setenv(STALL_AT_ENV, stall)
    if layout:
        monkeypatch.setattr(DatasetRole, "run", _prompts_once_both_replicas_connect)
    overrides = [
        "staleness=0",
        f"trainer.steps={STEPS}",
        f"checkpoint.every_steps={STEPS}",
        f"rollout.batch_size={rollout_batch}",
        *layout,
    ]
    cfg = load_config(RECIPE, overrides=overrides)
    await cluster.run(cfg, tmp_path / "cluster")
    generated = tmp_path / "cluster" / "record" / "generations"
    lines = {f.stem: f.read_text().splitlines() for f in generated.glob("rollout-*.jsonl")}
    calls = {name: len(calls) for name, calls in lines.items()}
    # Every prompt generated once (a replica that leased before the dataset had put a full
    # batch generates a call of fewer prompts: count prompts, not calls).
    prompts = [
        uid for calls in lines.values() for line in calls for uid in json.loads(line)["uids"]
    ]
    assert sorted(prompts) == sorted(set(prompts)) and len(prompts) == STEPS * 4
    if layout:  # the replicas started together and shared the work
        assert len(calls) == 2 and min(calls.values()) > 0, calls
    if stall:  # and the stall happened
        assert (tmp_path / "cluster" / f"stalled-at-{stall.split('=')[0]}").exists()
    monkeypatch.delenv(STALL_AT_ENV, raising=False)
    await run_sync(cfg, tmp_path / "sync")
    assert_same_run(tmp_path / "cluster", tmp_path / "sync")


_dataset_run = DatasetRole.run


async def _prompts_once_both_replicas_connect(self: DatasetRole) -> None:
    """The dataset role (in this process), holding its prompts until both rollout replicas
    have connected to the prompts bus: the two processes start at once, but a loaded machine
    finishes their imports seconds apart, and a 10-step run then ended before the second one
    served (CI: 20 calls on rollout-0, none on rollout-1)."""
    async with await connect_bus(self.prompts_url, self.cfg, "dataset-probe") as probe:

        async def both_connected() -> bool:  # sessions: this probe and the two replicas
            return (await probe.statistics())["transport"]["clients"] >= 3

        await wait_until(both_connected, 120, "both rollout replicas on the prompts bus")
    await _dataset_run(self)


def assert_same_run(cluster_run: Path, sync_run: Path) -> None:
    ours, reference = steps(cluster_run), steps(sync_run)
    assert len(ours) == len(reference) == STEPS
    keys = ("step", "applied", "reward_mean", "loss", "grad_norm", "tokens")
    for a, b in zip(ours, reference, strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
        assert a["oldest_row_version"] == a["newest_row_version"] == a["step"] - 1
    # Rewards moved (the comparison is not between two runs that learned nothing).
    assert len({s["reward_mean"] for s in ours}) > 1
    a, b = final_weights(cluster_run), final_weights(sync_run)
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a)


FLAKY = (
    '[{name="digit", kind="python", target="tests.e2e.contract_rewards:fails_for_some_prompts"}]'
)
# Staleness 0, two prompts per generation call, and that reward.
FLAKY_AT_0 = (
    "staleness=0",
    f"trainer.steps={STEPS}",
    f"checkpoint.every_steps={STEPS}",
    "rollout.batch_size=2",
    f"reward.functions={FLAKY}",
)


@pytest.mark.parametrize(
    "layout",
    [(), TWO_CORES, (SCORED_IN_ROLLOUT,)],
    ids=["one-rollout", "two-rollout-processes", "scored-in-rollout"],
)
async def test_staleness_0_with_groups_dropped_equals_a_synchronous_run(
    tmp_path: Path, layout: tuple[str, ...]
) -> None:
    # A reward that fails for some prompts: the cluster drops their groups and, like the
    # synchronous loop, fills the step with the next prompts, generated on the same weights.
    overrides = [*FLAKY_AT_0, *layout]
    cfg = load_config(RECIPE, overrides=overrides)
    if SCORED_IN_ROLLOUT in layout:  # the rollout drops the failed groups in its puts
        assert cluster.sample_tasks(cfg) == ["train"]
        tree = cluster.build_tree(cfg, cluster.prepare(cfg, tmp_path / "tree"))
        assert not [c for c in tree.child_ids() if c.startswith("reward")]
    await cluster.run(cfg, tmp_path / "cluster")
    generated = tmp_path / "cluster" / "record" / "generations"
    calls = sum(len(f.read_text().splitlines()) for f in generated.glob("rollout-*.jsonl"))
    assert calls > STEPS * 4 // 2  # some groups were dropped and made up for
    # Liveness: the room a dropped group leaves is admitted at once. (It waited for the
    # rollout's 5 s admission retry before: ~5 s per dropped group.) Step 1's take also
    # waits for the rollout processes to start.
    assert max(s["take_time_s"] for s in steps(tmp_path / "cluster")[1:]) < 2.5
    await run_sync(cfg, tmp_path / "sync")
    assert_same_run(tmp_path / "cluster", tmp_path / "sync")


async def test_a_different_seed_gives_a_different_run(tmp_path: Path) -> None:
    # The identity above is not an artefact of ignoring the seed.
    base = ["staleness=0", "trainer.steps=3"]
    await run_sync(load_config(RECIPE, overrides=base), tmp_path / "a")
    await run_sync(load_config(RECIPE, overrides=[*base, "rollout.seed=1"]), tmp_path / "b")
    rewards = [[s["reward_mean"] for s in steps(tmp_path / r)] for r in ("a", "b")]
    assert rewards[0] != rewards[1]


@pytest.mark.parametrize(
    ("kill", "bus"),
    [("after_lease_rollout@5", "prompts"), ("after_lease_train@4", "samples")],
    ids=["prompts-bus", "samples-bus"],
)
async def test_staleness_0_with_a_bus_killed_before_answering_a_take_equals_a_synchronous_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill: str, bus: str
) -> None:
    # The bus SIGKILLs itself once, with a take's lease logged and its reply not sent. The
    # client sends the take again to the restarted bus, which gives it the same lease back.
    # Before, the retry got a second lease once the first had expired: prompts out of order
    # (this run differed from --sync at step 3), and the trainer held up for the lease
    # timeout (60 s; the run took 77 s against 19 s).
    monkeypatch.setenv(KILL_AT_ENV, kill)
    overrides = [
        "staleness=0",
        f"trainer.steps={STEPS}",
        f"checkpoint.every_steps={STEPS}",
        "rollout.batch_size=2",
        'bus.transport="ipc"',  # the buses in their own processes: SIGKILLable
        *TWO_CORES,
    ]
    cfg = load_config(RECIPE, overrides=overrides)
    await cluster.run(cfg, tmp_path / "cluster")
    assert (tmp_path / "cluster" / bus / f"killed-at-{kill.split('@')[0]}").exists()
    ops = bus_ops(tmp_path / "cluster", bus)
    assert [op for op in ops if op["op"] == "expire"] == []  # no lease stranded, none expired
    assert max(s["take_time_s"] for s in steps(tmp_path / "cluster")[1:]) < 15
    monkeypatch.delenv(KILL_AT_ENV)
    await run_sync(cfg, tmp_path / "sync")
    assert_same_run(tmp_path / "cluster", tmp_path / "sync")


@pytest.mark.timeout(300)
async def test_staleness_0_with_roles_sigkilled_holding_leases_equals_a_synchronous_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rollout-1 is held right after leasing prompts (with the turn), the trainer right after
    # taking its 4th batch: each is SIGKILLed there, holding a lease that would last 10
    # minutes. A restarted role takes back what its name held as it connects, so the run goes
    # on at once (before, it waited for the leases to expire, and the prompts came back out of
    # order), and it is still the synchronous run, bit for bit.
    holds = ("after_lease@rollout-1", "after_take@trainer#4")
    monkeypatch.setenv(STALL_AT_ENV, ",".join(f"{hold}=600" for hold in holds))
    overrides = [
        "staleness=0",
        f"trainer.steps={STEPS}",
        "checkpoint.every_steps=1",  # the restarted trainer goes on from step 3's checkpoint
        "rollout.batch_size=2",
        "bus.lease_timeout=600",
        # Two kills can land within the default period (1 restart in 5 s).
        "supervisor.intensity=10",
        "supervisor.period=300",
        *TWO_CORES,
    ]
    cfg = load_config(RECIPE, overrides=overrides)
    layout = cluster.prepare(cfg, tmp_path / "cluster")
    run_dir = layout.run_dir
    with captured_logs(tmp_path / "run.log") as log_file, hang_explained(log_file):
        await _kill_at_holds(cfg, layout, holds)
    # Each dead lease came back by its successor's reclaim, none by expiry.
    for bus in ("prompts", "samples"):
        ended = [op for op in bus_ops(run_dir, bus) if op["op"] == "expire"]
        assert ended and all(op.get("reason") == "reclaimed" for op in ended), (bus, ended)
    logs = read_logs(log_file)
    assert [e["client"] for e in logs.events("took back what a dead incarnation held")] == [
        "rollout-1-prompts",
        "rollout-1-weights",  # its receiver left the weight plane: no join timeout waited
        "trainer",
    ]
    assert logs.events("weight transfer failed; receivers read this version from the bus") == []
    assert max(s["take_time_s"] for s in steps(run_dir)) < 60
    monkeypatch.delenv(STALL_AT_ENV)
    await run_sync(cfg, tmp_path / "sync")
    assert_same_run(run_dir, tmp_path / "sync")


@pytest.mark.timeout(300)
async def test_staleness_0_scored_in_rollout_with_a_rollout_sigkilled_after_its_put_equals_a_synchronous_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each rollout scores its own samples, and a reward fails for some prompts. Rollout-1 is
    # held right after its second put (scored rows on the bus, failed groups dropped in the
    # same request) and SIGKILLed before it acks its prompts: its successor takes them back,
    # generates and scores them again, and the bus ignores that second put. Still the
    # synchronous run, bit for bit, with nothing trained twice. Rollout-0 is held (not
    # killed) after its third put, so the run cannot end before the successor is back and
    # working (without it, rollout-0 finished the run alone while the successor started).
    hold = "after_put@rollout-1#2"
    monkeypatch.setenv(STALL_AT_ENV, f"{hold}=600,after_put@rollout-0#3=600")
    overrides = [*FLAKY_AT_0, "bus.lease_timeout=600", *TWO_CORES, SCORED_IN_ROLLOUT]
    cfg = load_config(RECIPE, overrides=overrides)
    layout = cluster.prepare(cfg, tmp_path / "cluster")
    run_dir = layout.run_dir
    with captured_logs(tmp_path / "run.log") as log_file, hang_explained(log_file):
        await _kill_at_holds(cfg, layout, (hold,))
    assert (run_dir / "stalled-at-after_put@rollout-0").exists()  # the successor finished
    ops = bus_ops(run_dir, "samples")
    assert sum(op["n"] for op in ops if op.get("name") == "duplicate_puts") > 0
    assert [op for op in ops if op["op"] == "drop" and op["reason"] == "reward_failed"]
    ledger = replay_samples_bus(run_dir)
    check_exactly_once(ledger)
    monkeypatch.delenv(STALL_AT_ENV)
    await run_sync(cfg, tmp_path / "sync")
    assert_same_run(run_dir, tmp_path / "sync")


async def _kill_at_holds(cfg: ClusterConfig, layout: Layout, holds: tuple[str, ...]) -> None:
    """Run the cluster, SIGKILL each child held at its stall point, in order; wait the end."""
    run_dir = layout.run_dir
    async with cluster.build_tree(cfg, layout) as tree:
        finished = asyncio.create_task(tree.wait())
        for hold in holds:
            child = hold.split("@")[1].split("#")[0]
            held = run_dir / f"stalled-at-{hold.split('#')[0]}"
            await wait_until(held.exists, timeout=120, what=f"{child} held at {hold}")
            pid = await running_pid(tree, child, timeout=60)
            os.kill(pid, signal.SIGKILL)
            await restarted(tree, child, pid, timeout=60)
        await asyncio.wait_for(finished, 150)  # a lease left to expire: 600 s
