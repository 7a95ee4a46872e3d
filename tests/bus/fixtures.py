"""Producer and consumer actors for the bus fault tests (importable by child processes), and
a bus to test against (``tcp_bus``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

from relax.actors import Actor, ChildSpec, Supervisor
from relax.bus import BusClient, BusService


class Producer(Actor):
    """Puts rows ``r0 .. r{total-1}`` in batches. After a restart it starts over from 0:
    uids are stable across retries, so the bus ignores what it already has."""

    def __init__(self, url: str, total: int, batch: int = 100, log: str | None = None) -> None:
        self.url, self.total, self.batch, self.log_path = url, total, batch, log

    async def run(self) -> None:
        async with await BusClient.connect(self.url, client_id=f"producer-{os.getpid()}") as bus:
            for start in range(0, self.total, self.batch):
                rows = [
                    {"uid": f"r{i}", "group": f"r{i}", "version": 0, "columns": {"x": i}}
                    for i in range(start, min(start + self.batch, self.total))
                ]
                await bus.put(rows, wait=120)


class Consumer(Actor):
    """Takes and acks rows until the bus has seen ``total`` trained; logs every delivery."""

    def __init__(self, url: str, total: int, batch: int = 64, log: str | None = None) -> None:
        self.url, self.total, self.batch, self.log_path = url, total, batch, log

    async def run(self) -> None:
        async with await BusClient.connect(self.url, client_id=f"consumer-{os.getpid()}") as bus:
            while True:
                async with bus.take(
                    "train", batch_size=self.batch, wait=1.0, lease_timeout=5.0
                ) as batch:
                    if batch.rows and self.log_path:
                        with open(self.log_path, "a") as f:
                            f.write("".join(f"{r['uid']} {r['attempt']}\n" for r in batch.rows))
                if not batch.rows:
                    stats = await bus.statistics()
                    if stats["counters"].get("trained", 0) >= self.total:
                        return


@contextlib.asynccontextmanager
async def tcp_bus(run_dir: str) -> AsyncIterator[str]:
    """A persisted bus on loopback TCP in its own supervised process, up to 1 GiB a message
    (whole weight buckets); yields its address."""
    kwargs = {
        "url": "tcp://127.0.0.1:0",
        "run_dir": run_dir,
        "staleness": "inf",
        "max_message_bytes": 1 << 30,
    }
    async with Supervisor([ChildSpec("bus", BusService, kwargs=kwargs)]) as sup:
        yield await sup.ref("bus").call("address")
