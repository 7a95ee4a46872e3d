"""Exactly-once under fire, after Kafka's transactions test.

A producer process puts 20,000 rows while a consumer process takes and acks them; the producer,
the consumer and the bus itself are SIGKILLed at seeded random moments and restarted by their
supervisor. At the end the bus's own log is replayed offline and must show every produced uid
acked exactly once: none lost, none acked twice, nothing dropped.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections import Counter

import pytest

from relax.actors import ChildSpec, Process, Restart, Supervisor
from relax.bus import BusClient, BusService, BusTable, SegmentLog
from relax.transport import loads
from tests.actors.helpers import find, wait_until
from tests.bus.fixtures import Consumer, Producer

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TOTAL = 20_000
KILLS = 6
SEED = 20261129


async def test_every_row_is_acked_exactly_once_through_sigkills(tmp_path) -> None:
    url = f"ipc://{tmp_path}/bus.sock"
    deliveries = tmp_path / "deliveries.log"
    bus_kwargs = {
        "url": url,
        "run_dir": str(tmp_path),
        "capacity": 4096,
        "lease_timeout": 5.0,
        "staleness": "inf",
    }
    children = [
        ChildSpec("bus", BusService, kwargs=bus_kwargs, placement=Process()),
        ChildSpec(
            "producer",
            Producer,
            kwargs={"url": url, "total": TOTAL},
            placement=Process(),
            restart=Restart.TRANSIENT,
        ),
        ChildSpec(
            "consumer",
            Consumer,
            kwargs={"url": url, "total": TOTAL, "log": str(deliveries)},
            placement=Process(),
            restart=Restart.TRANSIENT,
        ),
    ]
    rng = random.Random(SEED)
    # Seeded kill points spread over the run (by progress, so a fast machine cannot outrun
    # them); the producer is killed early, while it still has rows to put.
    points = sorted(rng.uniform(0.05, 0.9) for _ in range(KILLS))
    targets = [
        "producer",
        "producer",
        *rng.sample(["bus", "bus", "consumer", "consumer"], KILLS - 2),
    ]
    kills: Counter[str] = Counter()
    async with Supervisor(
        children,
        intensity=4 * KILLS,
        period=300,
        auto_shutdown="any_significant",
        significant=["consumer"],
    ) as sup:
        finished = asyncio.create_task(sup.wait())
        async with await BusClient.connect(url, connect_timeout=60) as probe:
            for point, target in zip(points, targets, strict=True):

                async def reached(point: float = point) -> bool:
                    stats = await probe.statistics()
                    return stats["counters"].get("trained", 0) >= point * TOTAL

                await wait_until(reached, timeout=120, what=f"{point:.0%} of the rows trained")

                async def running(target: str = target) -> bool:
                    return find(await sup.snapshot(), target)["state"] == "running"

                await wait_until(running, timeout=30, what=f"{target} running")
                pid = find(await sup.snapshot(), target)["pids"][0]
                os.kill(pid, signal.SIGKILL)
                kills[target] += 1

                async def back(target: str = target, old: int = pid) -> bool:
                    e = find(await sup.snapshot(), target)
                    return e["state"] in ("running", "stopped") and old not in e["pids"]

                await wait_until(back, timeout=30, what=f"{target} to come back")
        await asyncio.wait_for(finished, 240)

    # Audit the bus's own durable record: replay its log into a fresh table.
    table = BusTable(tasks=("train",), capacity=4096, staleness=float("inf"))
    with SegmentLog(tmp_path / "bus-log") as log:
        for seq, record in log.replay():
            table.apply(loads(record), seq)
    produced = {f"r{i}" for i in range(TOTAL)}
    delivered = Counter(line.split()[0] for line in deliveries.read_text().splitlines())
    print(
        f"\nkills: {dict(kills)} (total {sum(kills.values())}); leases expired and re-leased: "
        f"{table.counters['expired_leases']}; rows delivered more than once: "
        f"{sum(n > 1 for n in delivered.values())}; duplicate puts ignored: "
        f"{table.counters['duplicate_puts']}"
    )
    assert sum(kills.values()) == KILLS and kills["bus"] >= 1, kills
    assert table.counters["put"] == TOTAL  # every row entered exactly once, despite re-puts
    assert table.counters["trained"] == TOTAL  # and was acked exactly once
    assert set(table.finished) == produced  # none lost
    assert not table.rows and not any(k.startswith("dropped") for k in table.counters)
    assert set(delivered) == produced
