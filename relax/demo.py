"""A demo of the supervisor tree (``relax demo``): the actor runtime on its own, no RL roles.
It is not the main job: that is ``relax up CLUSTER_TOML`` (see the README).

The tree::

    root (one_for_one)
    ├── workers (one_for_one)
    │   ├── worker-0   own OS process, squares tensors
    │   └── worker-1   own OS process, squares tensors
    └── driver         in-process, transient, significant: sends the jobs, SIGKILLs
                       worker-0 half-way, retries what died in flight, then finishes,
                       which ends the tree (auto_shutdown)

It shows what the runtime promises: the killed worker is restarted, the job that was in
flight fails with ``ActorDead`` and is retried, and every job is answered exactly once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from relax.actors import Actor, ChildSpec, Process, Restart, Supervisor
from relax.errors import ActorDead


class SquareWorker(Actor):
    """Squares a tensor; stands in for a rollout or reward worker."""

    async def square(self, job: int, values: Any) -> dict[str, Any]:
        return {"job": job, "pid": os.getpid(), "out": values * values}

    def pid(self) -> int:
        return os.getpid()


@dataclass
class DemoReport:
    jobs: int
    answered: dict[int, float] = field(default_factory=dict)
    retried: list[int] = field(default_factory=list)
    killed_pid: int | None = None
    restart_seconds: float | None = None
    tree: dict[str, Any] | None = None


class Driver(Actor):
    """Sends ``jobs`` jobs to the workers, kills one half-way, and checks every answer."""

    def __init__(self, jobs: int, report: DemoReport, supervisor: Supervisor) -> None:
        self.jobs, self.report, self.sup = jobs, report, supervisor

    async def run(self) -> None:
        import torch

        workers = [self.sup.ref(f"workers/worker-{i}") for i in range(2)]
        for job in range(self.jobs):
            if job == self.jobs // 2:
                await self._kill_worker(workers[0])
            values = torch.full((4,), float(job))
            reply = await self._send(workers[job % 2], job, values)
            if job not in self.report.answered:
                self.report.answered[job] = float(reply["out"][0])
        self.report.tree = await self.sup.snapshot()

    async def _send(self, worker: Any, job: int, values: Any, attempts: int = 3) -> Any:
        """Retry a job whose worker died with it in flight; results are deduplicated by job."""
        for attempt in range(attempts):
            try:
                return await worker.call("square", job, values, timeout=30)
            except ActorDead:
                if attempt == attempts - 1:
                    raise
                self.report.retried.append(job)
        raise AssertionError("unreachable")

    async def _kill_worker(self, worker: Any) -> None:
        pid = await worker.call("pid")
        self.log.info("demo: SIGKILL a worker", pid=pid)
        os.kill(pid, signal.SIGKILL)
        began = time.monotonic()
        while True:
            try:
                if await worker.call("pid", timeout=10) != pid:
                    break
            except ActorDead:
                continue  # the call raced the death; the next one waits for the restart
        self.report.restart_seconds = time.monotonic() - began
        self.report.killed_pid = pid


async def run_demo(jobs: int = 200) -> DemoReport:
    """Run the demo tree to completion and return what happened."""
    report = DemoReport(jobs=jobs)
    workers = ChildSpec.supervisor(
        "workers",
        [ChildSpec(f"worker-{i}", SquareWorker, placement=Process()) for i in range(2)],
        intensity=3,
    )
    root: Supervisor

    def driver() -> Driver:
        return Driver(jobs, report, root)

    children = [workers, ChildSpec("driver", driver, restart=Restart.TRANSIENT)]
    root = Supervisor(children, auto_shutdown="any_significant", significant=["driver"])
    async with root:
        await root.wait()
    return report


def main(jobs: int = 200) -> DemoReport:
    return asyncio.run(run_demo(jobs))
