"""Supervision semantics with in-process children: strategies, restart types, intensity."""

from __future__ import annotations

import asyncio
import json

import pytest

from relax.actors import ChildSpec, Exit, InProc, Process, Restart, Strategy, Supervisor
from relax.errors import ActorDead, StartFailed, SupervisorGaveUp
from tests.actors.fixtures import (
    CrashOnStart,
    CrashSoon,
    Echo,
    FinishSoon,
    Rendezvous,
    read_events,
)
from tests.actors.helpers import find, starts
from tests.polling import wait_until

pytestmark = pytest.mark.anyio


def three(events: str, **extra) -> list[ChildSpec]:
    return [ChildSpec(i, Echo, kwargs={"events": events}, **extra) for i in ("a", "b", "c")]


async def crash_and_wait(sup: Supervisor, child: str) -> None:
    await sup.ref(child).cast("crash_cast")

    async def restarted() -> bool:
        entry = find(await sup.snapshot(), child)
        return entry["restart_count"] == 1 and entry["state"] == "running"

    await wait_until(restarted, what=f"{child} restarted")


@pytest.mark.parametrize(
    ("strategy", "restarted"),
    [
        (Strategy.ONE_FOR_ONE, {"b"}),
        (Strategy.REST_FOR_ONE, {"b", "c"}),
        (Strategy.ONE_FOR_ALL, {"a", "b", "c"}),
    ],
)
async def test_strategy_restarts_exactly_the_right_children(
    events_file, strategy, restarted
) -> None:
    async with Supervisor(three(events_file), strategy=strategy, intensity=5) as sup:
        await crash_and_wait(sup, "b")
        for ref in ("a", "b", "c"):
            assert await sup.ref(ref).call("add", 1, 1) == 2
        events = read_events(events_file)
        for child in ("a", "b", "c"):
            assert starts(events, child) == (2 if child in restarted else 1), (child, events)
        # Siblings are stopped in reverse start order before anyone starts again.
        stops = [e for e in events if e.startswith("stop ")]
        assert stops == [f"stop {c}" for c in ("c", "a") if c in restarted and c != "b"]
        # A restart of several children is one restart against the intensity budget.
        assert (await sup.snapshot())["restarts_in_period"] == 1
    assert read_events(events_file)[-3:] == ["stop c", "stop b", "stop a"]


async def test_children_start_in_order_and_stop_in_reverse(events_file) -> None:
    async with Supervisor(three(events_file)):
        pass
    events = [e.split()[0] + " " + e.split()[1] for e in read_events(events_file)]
    assert events == ["start a", "start b", "start c", "stop c", "stop b", "stop a"]


async def test_transient_child_that_exits_normally_is_not_restarted(events_file) -> None:
    children = [
        ChildSpec("t", FinishSoon, kwargs={"events": events_file}, restart=Restart.TRANSIENT),
        ChildSpec("e", Echo),
    ]
    async with Supervisor(children, intensity=5) as sup:

        async def settled() -> bool:
            return find(await sup.snapshot(), "t")["state"] == "stopped"

        await wait_until(settled, what="transient child to end")
        entry = find(await sup.snapshot(), "t")
        assert entry["restart_count"] == 0 and entry["last_exit"]["kind"] == "normal"
        assert starts(read_events(events_file), "t") == 1
        with pytest.raises(ActorDead):
            await sup.ref("t").call("pid")


async def test_transient_child_that_crashes_is_restarted(events_file) -> None:
    children = [ChildSpec("t", Echo, kwargs={"events": events_file}, restart="transient")]
    async with Supervisor(children, intensity=5) as sup:
        await crash_and_wait(sup, "t")
        assert starts(read_events(events_file), "t") == 2


async def test_temporary_child_is_never_restarted(events_file) -> None:
    children = [ChildSpec("tmp", Echo, kwargs={"events": events_file}, restart="temporary")]
    async with Supervisor(children, intensity=5) as sup:
        await sup.ref("tmp").cast("crash_cast")

        async def crashed() -> bool:
            return find(await sup.snapshot(), "tmp")["state"] == "crashed"

        await wait_until(crashed, what="temporary child to be marked crashed")
        with pytest.raises(ActorDead):
            await sup.ref("tmp").call("pid")
        assert starts(read_events(events_file), "tmp") == 1


async def test_temporary_sibling_is_not_restarted_by_one_for_all(events_file) -> None:
    children = [
        ChildSpec("tmp", Echo, kwargs={"events": events_file}, restart="temporary"),
        ChildSpec("p", Echo, kwargs={"events": events_file}),
    ]
    async with Supervisor(children, strategy="one_for_all", intensity=5) as sup:
        await crash_and_wait(sup, "p")
        assert find(await sup.snapshot(), "tmp")["state"] == "stopped"
        assert starts(read_events(events_file), "tmp") == 1


async def test_crash_loop_escalates_and_the_whole_tree_stops_in_reverse(events_file) -> None:
    sub = ChildSpec.supervisor(
        "sub",
        [
            ChildSpec("c", Echo, kwargs={"events": events_file}),
            ChildSpec("d", CrashSoon, kwargs={"events": events_file}),
        ],
        intensity=2,
        period=30,
    )
    children = [
        ChildSpec("a", Echo, kwargs={"events": events_file}),
        ChildSpec("b", Echo, kwargs={"events": events_file}),
        sub,
    ]
    async with Supervisor(children, intensity=0, period=30) as root:
        with pytest.raises(SupervisorGaveUp, match="root"):
            await root.wait()
        snap = await root.snapshot()
    events = read_events(events_file)
    assert starts(events, "d") == 3  # the first start and two restarts, then the budget is spent
    assert [e for e in events if e.startswith("stop")] == ["stop c", "stop b", "stop a"]
    assert "gave up" in snap["gave_up"]
    assert find(snap, "sub")["last_crash"]["error_type"] == "SupervisorGaveUp"


async def test_initial_start_failure_stops_started_children_in_reverse(events_file) -> None:
    children = [*three(events_file), ChildSpec("x", CrashOnStart, kwargs={"events": events_file})]
    with pytest.raises(StartFailed, match="'x' failed to start"):
        async with Supervisor(children):
            pass
    stops = [e for e in read_events(events_file) if e.startswith("stop")]
    assert stops == ["stop c", "stop b", "stop a"]


async def test_a_start_group_starts_at_once_in_processes(events_file, tmp_path) -> None:
    # Three replicas that each start only when all three are starting: one after another
    # (the order without a start group) the first would wait for the others for ever.
    folder = tmp_path / "met"
    folder.mkdir()
    replicas = [
        ChildSpec(
            f"r-{i}",
            Rendezvous,
            kwargs={"folder": str(folder), "peers": 3, "events": events_file},
            placement=Process(),
            start_group="r",
        )
        for i in range(3)
    ]
    children = [ChildSpec("a", Echo, kwargs={"events": events_file}), *replicas]
    children.append(ChildSpec("z", Echo, kwargs={"events": events_file}))
    async with Supervisor(children) as sup:
        assert {c["id"]: c["state"] for c in (await sup.snapshot())["children"]} == {
            c.id: "running" for c in children
        }
    events = [" ".join(e.split()[:2]) for e in read_events(events_file)]
    # The group is one step of the start order, and the stop order is the list reversed.
    assert events[0] == "start a" and events[4] == "start z"
    assert sorted(events[1:4]) == ["start r-0", "start r-1", "start r-2"]
    assert events[5:] == ["stop z", "stop r-2", "stop r-1", "stop r-0", "stop a"]


async def test_a_start_group_with_a_member_that_fails_stops_the_rest(events_file) -> None:
    def member(i: int, cls: type) -> ChildSpec:
        return ChildSpec(f"g-{i}", cls, kwargs={"events": events_file}, start_group="g")

    children = [ChildSpec("a", Echo, kwargs={"events": events_file})]
    children += [member(0, Echo), member(1, CrashOnStart), member(2, Echo)]
    children.append(ChildSpec("z", Echo, kwargs={"events": events_file}))
    with pytest.raises(StartFailed, match="'g-1' failed to start"):
        async with Supervisor(children):
            pass
    events = read_events(events_file)
    assert not any(e.startswith("start z") for e in events)  # nothing after the group starts
    assert [e for e in events if e.startswith("stop")] == ["stop g-2", "stop g-0", "stop a"]


async def test_ref_waits_through_a_restart_and_reaches_nested_children(events_file) -> None:
    spec = ChildSpec("w", Echo, kwargs={"events": events_file, "start_delay": 0.3})
    sub = ChildSpec.supervisor("sub", [spec], intensity=5)
    async with Supervisor([sub], intensity=5) as root:
        ref = root.ref("sub/w")
        assert await ref.call("add", 2, 2) == 4
        await ref.cast("crash_cast")

        async def restarting() -> bool:
            return find(await root.snapshot(), "sub/w")["state"] == "starting"

        await wait_until(restarting, what="the restart to begin")
        # The call is made while the child is down: it waits for the new incarnation.
        assert await ref.call("add", 3, 3, timeout=5) == 6
        assert starts(read_events(events_file), "w") == 2


async def test_snapshot_is_json_ready_and_shows_the_crash_cause(events_file) -> None:
    sub = ChildSpec.supervisor("sub", [ChildSpec("w", Echo)], strategy="rest_for_one", intensity=5)
    async with Supervisor([ChildSpec("a", Echo), sub], intensity=5) as root:
        await root.ref("sub/w").cast("crash_cast")

        async def restarted() -> bool:
            return find(await root.snapshot(), "sub/w")["restart_count"] == 1

        await wait_until(restarted, what="nested child restart")
        snap = json.loads(json.dumps(await root.snapshot()))
    entry = find(snap, "sub/w")
    assert entry["last_crash"]["kind"] == "exception"
    assert "cast handler crashed" in entry["last_crash"]["traceback"]
    assert (
        find(snap, "sub")["kind"] == "supervisor"
        and find(snap, "sub")["strategy"] == "rest_for_one"
    )
    assert entry["state"] == "running" and entry["uptime_s"] is not None


async def test_operator_restart_and_terminate(events_file) -> None:
    async with Supervisor(three(events_file)) as sup:
        await sup.restart_child("b")
        assert starts(read_events(events_file), "b") == 2
        assert (await sup.snapshot())["restarts_in_period"] == 0  # operator restarts are free
        await sup.terminate_child("c")
        with pytest.raises(ActorDead):
            await sup.ref("c").call("pid")


async def test_children_added_and_deleted_while_running(events_file) -> None:
    async with Supervisor(three(events_file), intensity=5) as sup:
        await sup.start_child(ChildSpec("d", Echo, kwargs={"events": events_file}))
        assert sup.child_ids() == ["a", "b", "c", "d"]
        assert await sup.ref("d").call("add", 2, 3) == 5
        assert find(await sup.snapshot(), "d")["state"] == "running"
        with pytest.raises(ValueError, match="already has a child 'd'"):
            await sup.start_child(ChildSpec("d", Echo))
        # An added child is supervised like the others: a crash is restarted in place.
        await crash_and_wait(sup, "d")
        assert starts(read_events(events_file), "d") == 2

        # Deleted: stopped, gone from the tree; its refs fail instead of waiting.
        ref = sup.ref("d")
        await sup.delete_child("d")
        assert "stop d" in read_events(events_file)
        assert sup.child_ids() == ["a", "b", "c"]
        assert [c["id"] for c in (await sup.snapshot())["children"]] == ["a", "b", "c"]
        with pytest.raises(ActorDead):
            await ref.call("pid", timeout=5)
        with pytest.raises(KeyError):
            sup.ref("d")
        # Its id can be used again.
        await sup.start_child(ChildSpec("d", Echo, kwargs={"events": events_file}))
        assert await sup.ref("d").call("add", 1, 1) == 2
    # The added child stops first, like the last child of the spec list.
    assert read_events(events_file)[-4:] == ["stop d", "stop c", "stop b", "stop a"]


async def test_a_child_that_fails_to_start_is_not_added() -> None:
    async with Supervisor([ChildSpec("a", Echo)]) as sup:
        with pytest.raises(StartFailed):
            await sup.start_child(ChildSpec("bad", CrashOnStart))
        assert sup.child_ids() == ["a"]
        assert await sup.ref("a").call("add", 1, 2) == 3


async def test_the_exit_of_a_deleted_child_is_no_crash(events_file) -> None:
    async with Supervisor([ChildSpec("a", Echo, kwargs={"events": events_file})]) as sup:
        await sup.start_child(ChildSpec("d", Echo, kwargs={"events": events_file}))
        await sup.delete_child("d")
        # Its crash reported after the delete (it was queued when the delete took the lock):
        sup._events.put_nowait(("d", 1, Exit("exception", "late")))
        sup._events.put_nowait(("d", 1, None))  # or its wait for resources ended
        assert await sup.ref("a").call("add", 1, 1) == 2
        await wait_until(lambda: sup._events.empty(), what="the late events handled")
        snap = await sup.snapshot()
        assert snap["gave_up"] is None and snap["restarts_in_period"] == 0
        assert sup.child_ids() == ["a"] and starts(read_events(events_file), "d") == 1


async def test_auto_shutdown_ends_the_tree_when_a_significant_child_finishes(events_file) -> None:
    children = [
        ChildSpec("e", Echo, kwargs={"events": events_file}),
        ChildSpec("job", FinishSoon, restart="transient"),
    ]
    async with Supervisor(children, auto_shutdown="any_significant", significant=["job"]) as sup:
        exit_ = await sup.wait()
    assert exit_.kind == "normal"
    assert read_events(events_file)[-1] == "stop e"


def test_bad_specs_are_refused_early() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        Supervisor([ChildSpec("a", Echo), ChildSpec("a", Echo)])
    with pytest.raises(ValueError, match="child id"):
        ChildSpec("a b", Echo)
    with pytest.raises(ValueError, match="shutdown"):
        ChildSpec("a", Echo, shutdown=-1)
    with pytest.raises(ValueError):
        ChildSpec("a", Echo, restart="sometimes")


class ScarcePlacement(InProc):
    """In-process, but "no node can host it" until ``node_joined`` is set: the shape of a
    Ray placement whose resource is on no live node (``wait_for_resources`` and all)."""

    def __init__(self, node_joined: asyncio.Event) -> None:
        super().__init__()
        object.__setattr__(self, "node_joined", node_joined)
        object.__setattr__(self, "waits_cancelled", [])

    async def launch(self, spec):  # type: ignore[no-untyped-def]
        if not self.node_joined.is_set():
            cause = Exit("placement", "no live node has {'node-c': 1}")
            raise StartFailed(f"{spec.id}: {cause.describe()}", actor_id=spec.id, cause=cause)
        return await super().launch(spec)

    async def wait_for_resources(self, spec) -> None:  # type: ignore[no-untyped-def]
        try:
            await self.node_joined.wait()
        except asyncio.CancelledError:
            self.waits_cancelled.append(spec.id)
            raise


async def test_a_child_no_node_can_host_waits_without_burning_intensity(tmp_path) -> None:
    joined = asyncio.Event()
    events = str(tmp_path / "events.jsonl")
    children = [
        ChildSpec("scarce", Echo, kwargs={"events": events}, placement=ScarcePlacement(joined)),
        ChildSpec("b", Echo, kwargs={"events": events}),
    ]
    # intensity 0: one counted restart would stop the tree; waiting must not count.
    async with Supervisor(children, strategy=Strategy.REST_FOR_ONE, intensity=0) as sup:
        entry = find(await sup.snapshot(), "scarce")
        assert entry["state"] == "waiting" and "node-c" in entry["waiting"], entry
        assert entry["last_crash"] is None and entry["restart_count"] == 0
        assert await sup.ref("b").call("add", 1, b=2) == 3  # its sibling started anyway
        call = asyncio.create_task(sup.ref("scarce").call("add", 2, b=2, timeout=30))
        assert find(await sup.snapshot(), "scarce")["state"] == "waiting"  # the call ran meanwhile
        assert not call.done()  # a caller waits for it, as during a restart
        joined.set()
        assert await call == 4
        snap = await sup.snapshot()
        entry = find(snap, "scarce")
        assert entry["state"] == "running" and entry["waiting"] is None
        assert entry["restart_count"] == 0 and snap["restarts_in_period"] == 0
        assert sup.gave_up is None


async def test_a_waiting_child_stops_with_its_supervisor_and_on_terminate(tmp_path) -> None:
    joined = asyncio.Event()
    spec = ChildSpec("scarce", Echo, placement=ScarcePlacement(joined))
    placement = spec.placement
    async with Supervisor([spec]) as sup:
        assert find(await sup.snapshot(), "scarce")["state"] == "waiting"
        await sup.terminate_child("scarce")
        # Its wait was cancelled with it: a node that joins later starts nothing.
        await wait_until(lambda: placement.waits_cancelled == ["scarce"], what="the wait cancelled")
        joined.set()
        entry = find(await sup.snapshot(), "scarce")
        assert entry["state"] == "stopped" and entry["pids"] == []
        with pytest.raises(ActorDead):
            await sup.ref("scarce").call("add", 1, b=1)
