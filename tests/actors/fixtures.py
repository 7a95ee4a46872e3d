"""Actors used by the runtime tests. Importable by child processes (``tests.actors.fixtures``)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

from relax.actors import Actor


def record(path: str | None, line: str) -> None:
    """Append one event line; files are shared by the test and every child process."""
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def read_events(path: str | Path) -> list[str]:
    p = Path(path)
    return p.read_text().splitlines() if p.exists() else []


class Echo(Actor):
    """Answers calls; records its lifecycle to ``events`` if given."""

    mailbox_size = 8

    def __init__(
        self, events: str | None = None, tag: str | None = None, start_delay: float = 0
    ) -> None:
        self.events, self.tag, self.start_delay = events, tag, start_delay
        self.count = 0
        self.seen: list[int] = []

    async def on_start(self) -> None:
        await asyncio.sleep(self.start_delay)
        record(self.events, f"start {self.tag or self.context.id} {os.getpid()}")

    async def on_stop(self) -> None:
        record(self.events, f"stop {self.tag or self.context.id}")

    async def on_failure(self, exc: BaseException) -> None:
        record(self.events, f"failure {self.tag or self.context.id} {type(exc).__name__}")

    async def add(self, a: int, b: int) -> int:
        return a + b

    def pid(self) -> int:
        return os.getpid()

    def rank(self) -> list[int]:
        return [self.context.rank, self.context.size, int(os.environ.get("RANK", "-1"))]

    async def echo(self, value: object) -> object:
        return value

    async def boom(self, message: str = "boom") -> None:
        raise ValueError(message)

    async def custom_boom(self) -> None:
        raise CustomError("custom")

    async def bump(self, n: int = 1) -> None:
        self.count += n

    async def get_count(self) -> int:
        return self.count

    async def sleep(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "slept"

    async def crash_cast(self) -> None:
        raise RuntimeError("cast handler crashed")

    async def work(self, i: int, die_at: int = -1) -> int:
        if i == die_at:
            os._exit(3)  # a hard death mid-call, like an OOM or a segfault
        self.seen.append(i)
        return i * 2

    def block(self, seconds: float) -> None:
        time.sleep(seconds)  # blocks the event loop: no heartbeats while it runs

    async def exit_normally(self) -> None:
        self.stop()

    def say(self, word: str) -> str | None:
        """Log ``word``; returns the log folder this process writes to."""
        self.log.warning("said", word=word)
        return os.environ.get("RELAX_LOG_DIR")

    async def say_and_die(self, word: str) -> None:
        """Log ``word``, then end at once (exit status 3), as a crash would."""
        self.log.warning("said", word=word)
        os._exit(3)


class CustomError(Exception):
    pass


class CrashOnStart(Actor):
    def __init__(self, events: str | None = None) -> None:
        self.events = events

    async def on_start(self) -> None:
        record(self.events, f"start-attempt {self.context.id}")
        raise RuntimeError("cannot start")


class Rendezvous(Actor):
    """Starts only once ``peers`` children (itself included) are starting in the same folder:
    a start group whose members start one after another never gets there."""

    def __init__(self, folder: str, peers: int, events: str | None = None) -> None:
        self.folder, self.peers, self.events = Path(folder), peers, events

    async def on_start(self) -> None:
        (self.folder / self.context.id).touch()
        deadline = time.monotonic() + 30
        while len(list(self.folder.iterdir())) < self.peers:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(list(self.folder.iterdir()))} of {self.peers} met")
            await asyncio.sleep(0.01)  # a condition polled, not a guess at how long it takes
        record(self.events, f"start {self.context.id}")

    async def on_stop(self) -> None:
        record(self.events, f"stop {self.context.id}")


class CrashSoon(Actor):
    """Starts fine, then its main loop crashes at once: a crash loop."""

    def __init__(self, events: str | None = None) -> None:
        self.events = events

    async def on_start(self) -> None:
        record(self.events, f"start {self.context.id} {os.getpid()}")

    async def run(self) -> None:
        raise RuntimeError("crash loop")


class FinishSoon(Actor):
    """Its main loop returns after ``seconds``: a normal end."""

    def __init__(self, seconds: float = 0.05, events: str | None = None) -> None:
        self.seconds, self.events = seconds, events

    async def on_start(self) -> None:
        record(self.events, f"start {self.context.id} {os.getpid()}")

    async def run(self) -> None:
        await asyncio.sleep(self.seconds)

    def pid(self) -> int:
        return os.getpid()


class FinishLeavingAThread(Actor):
    """Its main loop returns while a worker thread it started (``asyncio.to_thread``) is still
    blocked, as a thread stuck in a collective with a dead peer would be."""

    async def run(self) -> None:
        started, stuck = threading.Event(), threading.Event()

        def block() -> None:
            started.set()
            stuck.wait()  # never set

        self._left = asyncio.ensure_future(asyncio.to_thread(block))
        await asyncio.to_thread(started.wait)  # the thread is blocked before run() returns

    def pid(self) -> int:
        return os.getpid()


class StubbornStop(Actor):
    """Ignores shutdown: its on_stop never returns."""

    async def on_stop(self) -> None:
        time.sleep(3600)

    def pid(self) -> int:
        return os.getpid()


class FailRestart(Actor):
    """Starts once; every later start fails (the marker file remembers the first)."""

    def __init__(self, marker: str, events: str | None = None) -> None:
        self.marker, self.events = marker, events

    async def on_start(self) -> None:
        if os.path.exists(self.marker):
            record(self.events, f"start-failed {self.context.id}")
            raise RuntimeError("cannot start again")
        Path(self.marker).touch()
        record(self.events, f"start {self.context.id} {os.getpid()}")

    async def crash(self) -> None:
        raise RuntimeError("crash")

    def pid(self) -> int:
        return os.getpid()


class GangWorld(Actor):
    """A gang member that joins its gang's torch.distributed world in ``on_start``, as a
    trainer rank does, and answers with what the world and its environment say."""

    async def on_start(self) -> None:
        from relax.transport import init_world

        await asyncio.to_thread(init_world, self.context.rank, self.context.size)

    def pid(self) -> int:
        return os.getpid()

    def env(self) -> dict[str, str | None]:
        names = ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        names += ("RELAX_GANG_RENDEZVOUS",)
        return {name: os.environ.get(name) for name in names}

    async def gather_pids(self) -> list[int]:
        """Every member's pid, gathered over the gang's world (all members call it at once)."""
        import json

        from relax.transport import all_gather_bytes

        def gather() -> list[int]:
            return [json.loads(b) for b in all_gather_bytes(json.dumps(os.getpid()).encode())]

        return await asyncio.to_thread(gather)
