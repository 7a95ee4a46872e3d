"""Actors in their own OS processes: real child processes, real NNG sockets, real signals."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from relax.actors import ChildSpec, Process, Supervisor
from relax.errors import ActorDead, CallTimeout, RemoteError, StartFailed
from tests.actors.fixtures import (
    Echo,
    FailRestart,
    FinishLeavingAThread,
    StubbornStop,
    read_events,
)
from tests.actors.helpers import find, pid_alive, starts
from tests.polling import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


async def test_calls_tensors_and_errors_cross_the_process_boundary() -> None:
    async with Supervisor([ChildSpec("p", Echo, placement=Process())]) as sup:
        ref = sup.ref("p")
        assert await ref.call("pid") != os.getpid()
        assert await ref.call("add", 2, b=5) == 7
        t = torch.randn(3, 4, dtype=torch.bfloat16)
        back = await ref.call("echo", {"t": t, "xs": [1, "two", None]})
        assert torch.equal(back["t"], t) and back["xs"] == [1, "two", None]
        with pytest.raises(ValueError, match="far away") as info:
            await ref.call("boom", "far away")
        assert "Remote traceback" in "".join(getattr(info.value, "__notes__", []))
        with pytest.raises(RemoteError) as remote:
            await ref.call("custom_boom")
        assert remote.value.remote_type == "tests.actors.fixtures.CustomError"
        with pytest.raises(TypeError, match="cannot send"):
            await ref.call("echo", object())  # refused at the sender, nothing is pickled
        assert await ref.call("add", 1, 1) == 2  # still serving


async def test_tcp_transport_on_loopback() -> None:
    async with Supervisor([ChildSpec("p", Echo, placement=Process(transport="tcp"))]) as sup:
        assert await sup.ref("p").call("add", 20, 22) == 42
        assert find(await sup.snapshot(), "p")["stats"]["address"].startswith("tcp://127.0.0.1:")


async def test_a_tcp_child_dials_the_host_it_is_given() -> None:
    # What a Ray child on another node does with [cluster] host; 127.0.0.2 is loopback too.
    placement = Process(transport="tcp", host="127.0.0.2")
    async with Supervisor([ChildSpec("p", Echo, placement=placement)]) as sup:
        assert await sup.ref("p").call("add", 1, 2) == 3
        assert find(await sup.snapshot(), "p")["stats"]["address"].startswith("tcp://127.0.0.2:")


async def test_restart_under_load_200_calls_die_at_100() -> None:
    """After Ray's test_actor_restart: the call in flight fails, later calls succeed."""
    spec = ChildSpec("w", Echo, placement=Process())
    async with Supervisor([spec], intensity=3) as sup:
        ref = sup.ref("w")
        first_pid = await ref.call("pid")
        ok, dead = [], []
        for i in range(200):
            try:
                ok.append(await ref.call("work", i, die_at=100, timeout=10))
            except ActorDead:
                dead.append(i)
        assert dead == [100]
        assert ok == [2 * i for i in range(200) if i != 100]
        assert await ref.call("pid") != first_pid
        entry = find(await sup.snapshot(), "w")
        assert entry["restart_count"] == 1
        assert entry["last_crash"]["kind"] == "exit_code" and entry["last_crash"]["exit_code"] == 3


async def test_sigkill_child_is_restarted_and_answers_within_3s() -> None:
    async with Supervisor([ChildSpec("p", Echo, placement=Process())], intensity=3) as sup:
        ref = sup.ref("p")
        old = await ref.call("pid")
        killed_at = time.monotonic()
        os.kill(old, signal.SIGKILL)

        async def answers_from_new_pid() -> bool:
            try:
                return await ref.call("pid", timeout=1) != old
            except (ActorDead, CallTimeout):
                return False  # a call that raced the death; the next one waits for the restart

        await wait_until(answers_from_new_pid, timeout=10, what="restarted child to answer")
        took = time.monotonic() - killed_at
        entry = find(await sup.snapshot(), "p")
        assert took < 3.0, f"answering again took {took:.2f}s: {entry}"
        assert entry["last_crash"]["signal"] == "SIGKILL" and entry["restart_count"] == 1, entry
        assert not pid_alive(old)


async def test_sigkill_of_one_gang_member_restarts_the_whole_gang() -> None:
    spec = ChildSpec("gang", Echo, placement=Process(), gang=2)
    async with Supervisor([spec], intensity=3) as sup:
        ref = sup.ref("gang")
        assert await ref.rank(1).call("rank") == [1, 2, 1]
        old = [await ref.call("pid"), await ref.rank(1).call("pid")]
        assert old == find(await sup.snapshot(), "gang")["pids"]
        os.kill(old[1], signal.SIGKILL)

        async def both_new() -> bool:
            entry = find(await sup.snapshot(), "gang")
            return entry["state"] == "running" and not set(entry["pids"]) & set(old)

        await wait_until(both_new, what="both gang members restarted")
        new = [await ref.call("pid"), await ref.rank(1).call("pid")]
        assert not set(new) & set(old)
        assert not pid_alive(old[0]), "the surviving member must be killed with the gang"
        crash = find(await sup.snapshot(), "gang")["last_crash"]
        assert crash["member"] == 1 and crash["signal"] == "SIGKILL"


async def test_hung_event_loop_is_detected_by_heartbeat_and_restarted() -> None:
    placement = Process(heartbeat_interval=0.1, heartbeat_timeout=0.6)
    async with Supervisor([ChildSpec("h", Echo, placement=placement)], intensity=3) as sup:
        ref = sup.ref("h")
        old = await ref.call("pid")
        with pytest.raises(ActorDead):
            await ref.call("block", 60, timeout=20)  # blocks the child's loop for a minute
        assert await ref.call("pid", timeout=10) != old
        crash = find(await sup.snapshot(), "h")["last_crash"]
        assert crash["kind"] == "heartbeat" and "no heartbeat" in crash["message"]


async def test_child_ignoring_shutdown_is_killed_after_its_timeout(capfd) -> None:
    spec = ChildSpec("s", StubbornStop, placement=Process(), shutdown=0.5)
    async with Supervisor([spec]) as sup:
        pid = await sup.ref("s").call("pid")
        began = time.monotonic()
        await sup.terminate_child("s")
        took = time.monotonic() - began
        entry = find(await sup.snapshot(), "s")
    assert 0.5 <= took < 5
    assert entry["last_exit"]["kind"] == "shutdown" and entry["last_exit"]["signal"] == "SIGKILL"
    assert "its threads' stacks are in its log" in entry["last_exit"]["message"]
    assert not pid_alive(pid)
    # Before its SIGKILL it said where it hung: every thread's stack, on its stderr.
    err = capfd.readouterr().err
    assert "most recent call first" in err and "in on_stop" in err, err[-2000:]


async def test_a_child_that_finished_exits_though_a_worker_thread_is_stuck() -> None:
    # asyncio.run's teardown joins the default executor's threads: one blocked for good (a
    # collective with a dead peer) would keep a finished child alive and its supervisor
    # waiting for an exit that never comes.
    spec = ChildSpec("f", FinishLeavingAThread, placement=Process(), restart="transient")
    async with Supervisor([spec]) as sup:

        async def ended() -> bool:
            entry = find(await sup.snapshot(), "f")
            return entry["last_exit"] is not None and entry["state"] != "running"

        began = time.monotonic()
        await wait_until(ended, timeout=20, what="the finished child's exit")
        took = time.monotonic() - began
        entry = find(await sup.snapshot(), "f")
    assert entry["last_exit"]["kind"] == "normal", entry["last_exit"]
    # It left by itself, not SIGKILLed by the supervisor after its wait (about 10 s).
    assert entry["last_exit"]["signal"] is None and entry["last_exit"]["exit_code"] in (0, None)
    assert took < 5 and entry["restart_count"] == 0


async def test_process_crash_causes_are_kept(events_file) -> None:
    children = [ChildSpec("p", Echo, kwargs={"events": events_file}, placement=Process())]
    async with Supervisor(children, intensity=5) as sup:
        ref = sup.ref("p")
        await ref.cast("crash_cast")

        async def restarted() -> bool:
            return find(await sup.snapshot(), "p")["restart_count"] == 1

        await wait_until(restarted, what="restart after an exception")
        crash = find(await sup.snapshot(), "p")["last_crash"]
        assert crash["kind"] == "exception" and crash["error_type"] == "RuntimeError"
        assert "cast handler crashed" in crash["traceback"]
    assert "failure p RuntimeError" in read_events(events_file)


async def test_failed_restarts_count_against_intensity(tmp_path, events_file) -> None:
    marker = str(tmp_path / "started-once")
    spec = ChildSpec(
        "f", FailRestart, kwargs={"marker": marker, "events": events_file}, placement=Process()
    )
    async with Supervisor([spec], intensity=2, period=30) as sup:
        await sup.ref("f").cast("crash")
        with pytest.raises(Exception, match="gave up"):
            await asyncio.wait_for(sup.wait(), 20)
    events = read_events(events_file)
    assert starts(events, "f") == 1
    assert events.count("start-failed f") == 2  # two failed restarts, then the budget is spent


async def test_a_process_child_that_cannot_be_built_fails_to_start_with_the_cause() -> None:
    spec = ChildSpec("x", "tests.actors.fixtures:NoSuchActor", placement=Process())
    with pytest.raises(StartFailed, match="NoSuchActor"):
        async with Supervisor([spec]):
            pass


async def test_a_process_child_that_starts_too_slowly_is_killed() -> None:
    spec = ChildSpec("slow", Echo, kwargs={"start_delay": 30}, placement=Process(start_timeout=1))
    began = time.monotonic()
    with pytest.raises(StartFailed, match="did not start within 1"):
        async with Supervisor([spec]):
            pass
    assert time.monotonic() - began < 10


def test_process_placement_refuses_what_cannot_cross_a_process_boundary() -> None:
    with pytest.raises(ValueError, match="another process"):
        ChildSpec("l", lambda: Echo(), placement=Process())
    with pytest.raises(ValueError, match="cross a process boundary"):
        ChildSpec("o", Echo, kwargs={"events": object()}, placement=Process())
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        Process(heartbeat_interval=1, heartbeat_timeout=0.5)
