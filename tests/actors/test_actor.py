"""The actor surface in one process: call, cast, errors, backpressure, death."""

from __future__ import annotations

import asyncio

import pytest

from relax.actors import Actor, ActorContext
from relax.actors._cell import Cell
from relax.errors import ActorDead, CallTimeout, StartFailed
from tests.actors.fixtures import CrashOnStart, Echo, read_events
from tests.polling import wait_until

pytestmark = pytest.mark.anyio


async def start(actor: Actor, actor_id: str = "a") -> Cell:
    cell = Cell(actor, ActorContext(id=actor_id))
    await cell.start()
    return cell


async def test_call_returns_and_cast_is_handled_in_order() -> None:
    cell = await start(Echo())
    assert await cell.call("add", (2, 3), {}, 1.0) == 5
    for _ in range(5):
        await cell.cast("bump", (2,), {})
    assert await cell.call("get_count", (), {}, 1.0) == 10  # casts ran before this call
    await cell.shutdown(1.0)


async def test_handler_exception_goes_to_the_caller_and_the_actor_lives() -> None:
    cell = await start(Echo())
    with pytest.raises(ValueError, match="nope"):
        await cell.call("boom", ("nope",), {}, 1.0)
    assert await cell.call("add", (1, 1), {}, 1.0) == 2
    assert cell.statistics()["failed"] == 1
    await cell.shutdown(1.0)


async def test_unknown_private_and_lifecycle_names_are_not_handlers() -> None:
    cell = await start(Echo())
    for name in ("nope", "_private", "on_start", "stop", "run"):
        with pytest.raises(AttributeError):
            await cell.call(name, (), {}, 1.0)
    await cell.shutdown(1.0)


async def test_cast_that_raises_crashes_the_actor_and_runs_on_failure(events_file) -> None:
    cell = await start(Echo(events_file))
    await cell.cast("crash_cast", (), {})
    exit_ = await cell.done
    assert exit_.kind == "exception" and exit_.error_type == "RuntimeError"
    assert "cast handler crashed" in (exit_.traceback or "")
    assert read_events(events_file)[-1] == "failure a RuntimeError"


class CrashOnDemand(Echo):
    """Its main loop crashes when the test says so, whatever the mailbox is doing."""

    def __init__(self) -> None:
        super().__init__()
        self.trigger = asyncio.Event()

    async def run(self) -> None:
        await self.trigger.wait()
        raise RuntimeError("main loop crashed")


async def test_every_pending_call_fails_with_actor_dead_when_the_actor_dies() -> None:
    actor = CrashOnDemand()
    cell = await start(actor)
    # One call in flight (sleeping) and more queued behind it in the mailbox.
    calls = [asyncio.create_task(cell.call("sleep", (30,), {}, None)) for _ in range(4)]
    await wait_until(
        lambda: cell.statistics()["in_flight"] == 1 and cell.statistics()["queued"] == 3
    )
    actor.trigger.set()
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5)
    assert all(isinstance(r, ActorDead) for r in results), results
    with pytest.raises(ActorDead):
        await cell.call("add", (1, 2), {}, 1.0)


async def test_call_timeout_then_the_actor_still_serves() -> None:
    cell = await start(Echo())
    with pytest.raises(CallTimeout):
        await cell.call("sleep", (0.5,), {}, 0.05)
    assert await cell.call("add", (1, 2), {}, 2.0) == 3
    await cell.shutdown(1.0)


async def test_mailbox_is_bounded_senders_wait_for_space() -> None:
    cell = await start(Echo())  # mailbox_size = 8
    blocker = asyncio.create_task(cell.call("sleep", (0.3,), {}, None))
    await wait_until(lambda: cell.statistics()["in_flight"] == 1)
    for _ in range(8):
        await cell.cast("bump", (), {})
    assert cell.statistics()["queued"] == 8
    ninth = asyncio.create_task(cell.cast("bump", (), {}))
    await asyncio.sleep(0.05)
    assert not ninth.done(), "a full mailbox must make the sender wait"
    await blocker
    await asyncio.wait_for(ninth, 2)
    assert await cell.call("get_count", (), {}, 2.0) == 9
    await cell.shutdown(1.0)


async def test_sender_waiting_on_a_full_mailbox_gets_actor_dead_when_it_dies() -> None:
    cell = await start(Echo())
    in_flight = asyncio.create_task(cell.call("sleep", (30,), {}, None))
    await wait_until(lambda: cell.statistics()["in_flight"] == 1)
    for _ in range(8):
        await cell.cast("bump", (), {})
    waiting = asyncio.create_task(cell.cast("bump", (), {}))
    await asyncio.sleep(0.01)
    await cell.shutdown(0)  # brutal
    with pytest.raises(ActorDead):
        await asyncio.wait_for(waiting, 2)
    with pytest.raises(ActorDead):
        await in_flight


async def test_on_start_failure_is_start_failed_with_the_cause() -> None:
    cell = Cell(CrashOnStart(), ActorContext(id="c"))
    with pytest.raises(StartFailed) as info:
        await cell.start()
    assert "cannot start" in str(info.value)
    assert (await cell.done).kind == "start"


async def test_stop_from_inside_is_a_normal_exit(events_file) -> None:
    cell = await start(Echo(events_file))
    await cell.call("exit_normally", (), {}, 1.0)
    exit_ = await asyncio.wait_for(cell.done, 2)
    assert exit_.kind == "normal" and exit_.normal
    assert read_events(events_file)[-1] == "stop a"


class Concurrent(Actor):
    max_concurrency = 4

    def __init__(self) -> None:
        self.running = 0
        self.peak = 0

    async def work(self) -> int:
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(0.05)
        self.running -= 1
        return self.peak


async def test_max_concurrency_lets_handlers_overlap() -> None:
    actor = Concurrent()
    cell = await start(actor)
    await asyncio.gather(*(cell.call("work", (), {}, 2.0) for _ in range(8)))
    assert actor.peak == 4
    await cell.shutdown(1.0)


async def test_sequential_actor_handles_one_message_at_a_time() -> None:
    class Sequential(Concurrent):
        max_concurrency = 1

    actor = Sequential()
    cell = await start(actor)
    await asyncio.gather(*(cell.call("work", (), {}, 5.0) for _ in range(4)))
    assert actor.peak == 1
    await cell.shutdown(1.0)


async def test_shutdown_timeout_cancels_a_stuck_on_stop() -> None:
    class SlowStop(Actor):
        async def on_stop(self) -> None:
            await asyncio.sleep(3600)

    cell = await start(SlowStop())
    exit_ = await asyncio.wait_for(cell.shutdown(0.1), 3)
    assert exit_.kind == "shutdown"
