"""The weight plane: versions reach receivers over a gloo group, verified, switched on commit;
the bus carries the announcement and the commit, and serves the publisher's file to the rest."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from relax.bus import BusClient, WeightStore
from relax.bus._plane import PlaneOptions, WeightPublisher, WeightSubscriber, bucket_digest
from tests.bus.fixtures import tcp_bus
from tests.bus.weight_plane_peer import spawn_peer
from tests.polling import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
# The group's own tests: receivers that could read the bus's file (they can: one machine) are
# kept on the group; ``test_receivers_that_can_read_the_bus_s_file`` tests the file path.
FAST = PlaneOptions(
    bucket_bytes=1 << 20, timeout=20.0, stall_timeout=2.0, lease=2.0, local_file=False
)


def state_dict(seed: int, mb: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {f"layer.{i}": torch.randn(256, 1024, generator=g) for i in range(mb)}
    state["embed"] = torch.randn(333, 7, generator=g).bfloat16()  # odd byte count
    state["steps"] = torch.arange(10, dtype=torch.int64)
    return state


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
async def bus(tmp_path):
    async with tcp_bus(str(tmp_path)) as url:
        yield url


async def members(client: BusClient, lease: float = FAST.lease) -> list[str]:
    return list(await client._call({"op": "w_members", "lease": lease}))


def test_the_digest_sees_a_flipped_byte_and_swapped_tensors() -> None:
    a, b = torch.randn(100), torch.randn(7, dtype=torch.float64)
    base = bucket_digest([a, b])
    assert base == bucket_digest([a.clone(), b.clone()])
    flipped = a.clone()
    flipped.view(torch.uint8)[123] ^= 1
    assert bucket_digest([flipped, b]) != base
    assert bucket_digest([b, a]) != base
    odd = torch.arange(5, dtype=torch.uint8)  # tail bytes only
    assert bucket_digest([odd]) != bucket_digest([odd.flip(0)])


async def test_versions_reach_two_receivers_over_the_group_and_a_joiner_through_the_bus(
    bus,
) -> None:
    async with (
        await BusClient.connect(bus) as trainer_bus,
        await BusClient.connect(bus) as bus_a,
        await BusClient.connect(bus) as bus_b,
        await BusClient.connect(bus) as bus_c,
    ):
        pub = WeightPublisher(trainer_bus, FAST)
        a = WeightSubscriber(bus_a, "a", FAST)
        b = WeightSubscriber(bus_b, "b", FAST)
        try:
            waits = [asyncio.create_task(s.next(-1, wait=60)) for s in (a, b)]
            await wait_until(lambda: _members_are(trainer_bus, ["a", "b"]), what="both polling")
            first = state_dict(1)
            assert await pub.publish(1, first) == 2
            for got in await asyncio.gather(*waits):
                assert got is not None and got[0] == 1 and same(got[1], first)
            assert a.statistics()["via_group"] == b.statistics()["via_group"] == 1
            weights = (await trainer_bus.statistics())["weights"]
            assert weights["buckets_in"] == weights["buckets_out"] == 0  # no bytes through RPC

            # A joiner gets the current version from the bus (the publisher's file) first.
            c = WeightSubscriber(bus_c, "c", FAST)
            joined = await c.next(-1, wait=10)
            assert joined is not None and joined[0] == 1 and same(joined[1], first)
            assert c.statistics()["via_bus"] == 1

            # The next version forms a group of three: a new epoch, every one over it.
            waits = [asyncio.create_task(s.next(1, wait=60)) for s in (a, b, c)]
            await wait_until(lambda: _members_are(trainer_bus, ["a", "b", "c"]), what="three")
            second = state_dict(2)
            assert await pub.publish(2, second) == 3
            for got in await asyncio.gather(*waits):
                assert got is not None and got[0] == 2 and same(got[1], second)
            assert pub.statistics()["epochs"] == 2
            assert [s.statistics()["epoch"] for s in (a, b, c)] == [2, 2, 2]
            # What the bus serves for version 2 is the publisher's file, bit-identical.
            again = await WeightSubscriber(bus_c, "reader", FAST)._fetch(
                {"version": 2, "buckets": len(pub_layout(second)), "meta": {"names": None}}
            )
            assert again is not None and same(again[1], second)
        finally:
            for s in (a, b):
                await s.aclose()
            await pub.aclose()


def pub_layout(state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    from relax.bus._client import _buckets

    return _buckets(state, FAST.bucket_bytes)


async def _members_are(client: BusClient, expected: list[str], lease: float = FAST.lease) -> bool:
    return await members(client, lease) == expected


async def test_a_corrupted_bucket_is_detected_and_the_version_comes_from_the_bus(bus) -> None:
    async with (
        await BusClient.connect(bus) as trainer_bus,
        await BusClient.connect(bus) as bus_a,
    ):
        pub = WeightPublisher(trainer_bus, FAST)
        a = WeightSubscriber(bus_a, "a", FAST)
        opened = a._open

        async def open_corrupting(info):  # type: ignore[no-untyped-def]
            group = await opened(info)
            receive = group.broadcast_bucket

            async def flipped(tensors, **kwargs):  # type: ignore[no-untyped-def]
                out = await receive(tensors, **kwargs)
                if group.statistics()["operations"] == 2:  # one byte of the second bucket
                    out[0].view(-1).view(torch.uint8)[17] ^= 0x40
                return out

            group.broadcast_bucket = flipped
            return group

        a._open = open_corrupting  # type: ignore[method-assign]
        try:
            wait = asyncio.create_task(a.next(-1, wait=60))
            await wait_until(lambda: _members_are(trainer_bus, ["a"]), what="a polling")
            state = state_dict(3)
            await pub.publish(1, state)
            got = await wait
            assert got is not None and got[0] == 1 and same(got[1], state)  # never the flip
            stats = a.statistics()
            assert stats["corrupt"] == 1 and stats["via_group"] == 0 and stats["via_bus"] == 1
            assert "checksums" in stats["last_failure"]
            # The group itself is fine: the next version arrives over it.
            wait = asyncio.create_task(a.next(1, wait=60))
            await pub.publish(2, state_dict(4))
            got = await wait
            assert got is not None and same(got[1], state_dict(4))
            assert a.statistics()["via_group"] == 1
        finally:
            await a.aclose()
            await pub.aclose()


async def test_a_receiver_sigkilled_mid_transfer_fails_that_transfer_and_the_rest_go_on(
    bus,
) -> None:
    """200 MB to two receivers; one (its own process) is SIGKILLed mid-transfer: the publish
    returns within the stall timeout, the other receiver gets the version, the next version
    goes over a group without the dead one, and a restarted receiver catches up."""
    big = replace(FAST, bucket_bytes=16 << 20)

    async def spawn(member: str) -> asyncio.subprocess.Process:
        return await spawn_peer(bus, member, big.lease, "group", "sum")

    victim = await spawn("victim")
    async with (
        await BusClient.connect(bus) as trainer_bus,
        await BusClient.connect(bus) as bus_a,
    ):
        pub = WeightPublisher(trainer_bus, big)
        a = WeightSubscriber(bus_a, "a", big)
        try:
            wait = asyncio.create_task(a.next(-1, wait=120))
            await wait_until(
                lambda: _members_are(trainer_bus, ["a", "victim"]), timeout=60, what="both"
            )
            state = state_dict(5, mb=200)
            publishing = asyncio.create_task(pub.publish(1, state))
            line = await asyncio.wait_for(victim.stdout.readline(), 120)  # type: ignore[union-attr]
            assert line.startswith(b"bucket 1"), line  # it holds one bucket of 13
            victim.send_signal(signal.SIGKILL)
            started = asyncio.get_running_loop().time()
            assert await publishing == 0  # not over the group: it broke
            assert asyncio.get_running_loop().time() - started < big.timeout
            assert pub.statistics()["group_failures"] == 1
            got = await wait
            assert got is not None and got[0] == 1 and same(got[1], state)
            await victim.wait()

            # The dead one's lease runs out: the next group is a and a restarted receiver.
            restarted = await spawn("victim-2")
            line = await asyncio.wait_for(restarted.stdout.readline(), 120)  # type: ignore[union-attr]
            assert json.loads(line)["version"] == 1  # caught up from the bus first
            wait = asyncio.create_task(a.next(1, wait=120))
            await wait_until(
                lambda: _members_are(trainer_bus, ["a", "victim-2"]), timeout=60, what="rejoin"
            )
            second = state_dict(6)
            assert await pub.publish(2, second) == 2
            got = await wait
            assert got is not None and same(got[1], second)
            while not (line := await restarted.stdout.readline()).startswith(b"{"):  # type: ignore[union-attr]
                pass
            got_line = json.loads(line)
            assert got_line["version"] == 2
            assert got_line["sum"] == float(sum(t.double().sum() for t in second.values()))
            restarted.kill()
            await restarted.wait()
        finally:
            await a.aclose()
            await pub.aclose()


async def test_a_receiver_that_died_idle_costs_one_join_timeout_and_is_left_out_after(
    bus,
) -> None:
    """SIGKILLed between versions, inside its lease: the next group waits for it only
    ``join_timeout``, that version reaches the live receiver from the bus, and the version
    after forms the group without the dead one."""
    opts = replace(FAST, join_timeout=2.0, lease=30.0)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = ["-m", "tests.bus.weight_plane_peer", bus, "idle", str(opts.lease), "group"]
    victim = await asyncio.create_subprocess_exec(
        sys.executable, *args, cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE
    )
    async with (
        await BusClient.connect(bus) as trainer_bus,
        await BusClient.connect(bus) as bus_a,
    ):
        pub = WeightPublisher(trainer_bus, opts)
        a = WeightSubscriber(bus_a, "a", opts)
        try:
            wait = asyncio.create_task(a.next(-1, wait=60))
            await wait_until(
                lambda: _members_are(trainer_bus, ["a", "idle"], opts.lease), what="both"
            )
            victim.send_signal(signal.SIGKILL)  # idle: no transfer in flight
            await victim.wait()
            started = asyncio.get_running_loop().time()
            assert await pub.publish(1, state_dict(7)) == 0  # its lease (30 s) still runs
            assert asyncio.get_running_loop().time() - started < opts.join_timeout + 3
            got = await wait
            assert got is not None and same(got[1], state_dict(7))
            assert a.statistics()["via_bus"] == 1
            wait = asyncio.create_task(a.next(1, wait=60))
            assert await pub.publish(2, state_dict(8)) == 1  # a group of the live one only
            got = await wait
            assert got is not None and same(got[1], state_dict(8))
            assert pub.statistics()["members"] == ["a"]
        finally:
            await a.aclose()
            await pub.aclose()


@contextlib.asynccontextmanager
async def a_and_stopping_b(
    bus: str, opts: PlaneOptions, *, b_member: str = "b", b_client: str | None = None
) -> AsyncIterator[tuple[BusClient, WeightPublisher, WeightSubscriber, WeightSubscriber, Any]]:
    """A publisher and receivers ``a`` and ``b`` (member ``b_member``, its client named
    ``b_client``), both counted as members, ``b`` stopping (its wait cancelled: it will join
    nothing; its poll goes on waiting at the bus a while). Yields ``(trainer's client,
    publisher, a, b, a's wait for its first version)``."""
    async with (
        await BusClient.connect(bus) as trainer_bus,
        await BusClient.connect(bus) as bus_a,
        await BusClient.connect(bus, client_id=b_client) as bus_b,
    ):
        pub = WeightPublisher(trainer_bus, opts)
        a = WeightSubscriber(bus_a, "a", opts)
        b = WeightSubscriber(bus_b, b_member, opts, poll_wait=3.0)
        try:
            wait_a = asyncio.create_task(a.next(-1, wait=60))
            wait_b = asyncio.create_task(b.next(-1, wait=60))
            both = sorted(["a", b_member])
            await wait_until(
                lambda: _members_are(trainer_bus, both, opts.lease), what="both polling"
            )
            wait_b.cancel()
            yield trainer_bus, pub, a, b, wait_a
        finally:
            await a.aclose()
            await b.aclose()
            await pub.aclose()


async def test_a_receiver_that_leaves_is_out_of_the_next_group_at_once(bus) -> None:
    """A rollout stopped on purpose (drained, scaled away) leaves: the next version's group
    is formed without it, with no join timeout waited — even though a poll of its was still
    waiting at the bus when it left (that poll must not make it a member again)."""
    opts = replace(FAST, join_timeout=20.0, lease=60.0)
    async with a_and_stopping_b(bus, opts) as (trainer_bus, pub, a, b, wait_a):
        await b.leave()
        assert await members(trainer_bus, opts.lease) == ["a"]
        started = asyncio.get_running_loop().time()
        assert await pub.publish(1, state_dict(3)) == 1  # a group of a alone
        assert asyncio.get_running_loop().time() - started < 10  # no join timeout (20 s)
        got = await wait_a
        assert got is not None and same(got[1], state_dict(3))
        assert a.statistics()["via_group"] == 1
        # b's abandoned poll (pending_after -1) ended when version 1 was announced, well
        # before a had it committed: it did not make b a member again.
        assert await members(trainer_bus, opts.lease) == ["a"]


async def test_a_dead_receiver_whose_successor_reconnects_is_out_of_the_next_group_at_once(
    bus,
) -> None:
    """A rollout SIGKILLed between versions never says it leaves: its lease (60 s) still
    counts it in, and the next group would wait ``join_timeout`` for it. Its restarted self
    reconnects under the same client name and reclaims: the dead receiver is out at once."""
    opts = replace(FAST, join_timeout=20.0, lease=60.0)
    dead = {"b_member": "rollout-1-0-old", "b_client": "rollout-1-weights"}
    async with a_and_stopping_b(bus, opts, **dead) as (trainer_bus, pub, a, _, wait_a):
        async with await BusClient.connect(bus, client_id="rollout-1-weights") as successor:
            assert await successor.reclaim() == {"leases": 0, "weight_members": 1}
        assert await members(trainer_bus, opts.lease) == ["a"]
        started = asyncio.get_running_loop().time()
        assert await pub.publish(1, state_dict(4)) == 1  # a group of a alone
        assert asyncio.get_running_loop().time() - started < 10  # join timeout: 20 s
        got = await wait_a
        assert got is not None and same(got[1], state_dict(4))
        assert a.statistics()["via_group"] == 1


async def test_a_receiver_that_leaves_while_the_group_forms_does_not_hold_the_publish(
    bus,
) -> None:
    """A rollout stopped on purpose just after a publish counted it in: the publisher stops
    waiting for it at once (not the join timeout, which outlasted the trainer's own stop and
    got it killed before its last commit), the version commits, and the receiver that did
    join learns the group was abandoned and reads the version from the bus."""
    opts = replace(FAST, join_timeout=20.0, lease=60.0)
    async with a_and_stopping_b(bus, opts) as (_, pub, a, b, wait_a):
        started = asyncio.get_running_loop().time()
        publishing = asyncio.create_task(pub.publish(1, state_dict(5)))
        await wait_until(lambda: a.statistics()["epoch"] == 1, what="a joining the group")
        await b.leave()
        assert await publishing == 0  # nobody got it over the group
        assert asyncio.get_running_loop().time() - started < 5  # join timeout: 20 s
        assert pub.statistics()["group_failures"] == 1
        assert "left the plane" in pub.statistics()["last_failure"]
        got = await asyncio.wait_for(wait_a, 5)
        assert got is not None and got[0] == 1 and same(got[1], state_dict(5))
        assert a.statistics()["via_bus"] == 1


async def test_a_publisher_that_abandons_the_group_commits_at_once_through_the_bus(bus) -> None:
    """A trainer asked to stop mid-publish: the rollouts stop first, and one that has not
    left yet would hold the group (up to its join timeout) past the trainer's shutdown
    timeout, losing the commit of a step it had trained and recorded. ``abandon`` ends the
    transfer at once; this version and every later one commit through the bus."""
    opts = replace(FAST, join_timeout=20.0, lease=60.0)
    async with a_and_stopping_b(bus, opts) as (_, pub, a, _b, wait_a):
        started = asyncio.get_running_loop().time()
        publishing = asyncio.create_task(pub.publish(1, state_dict(6)))
        await wait_until(lambda: a.statistics()["epoch"] == 1, what="a joining the group")
        pub.abandon()  # b never joins, and has not left
        assert await publishing == 0
        assert asyncio.get_running_loop().time() - started < 10  # join timeout: 20 s
        assert pub.statistics()["last_failure"] == "abandoned: the publisher is stopping"
        got = await asyncio.wait_for(wait_a, 10)
        assert got is not None and got[0] == 1 and same(got[1], state_dict(6))
        wait_a = asyncio.create_task(a.next(1, wait=60))
        assert await pub.publish(2, state_dict(7)) == 0  # no group any more
        got = await asyncio.wait_for(wait_a, 10)
        assert got is not None and same(got[1], state_dict(7))
        assert pub.statistics()["epochs"] == 1 and a.statistics()["via_bus"] == 2


async def test_receivers_that_can_read_the_bus_s_file_read_it_verified_and_leave_the_group(
    bus, tmp_path
) -> None:
    """On one machine a receiver reads each committed version from the bus's file (checked
    bucket by bucket against the publisher's checksums) and the group carries bytes only to
    the receivers that cannot; a file that is not there, or not the same bytes, costs only
    the fast path."""
    local = replace(FAST, local_file=True)
    async with (
        await BusClient.connect(bus) as trainer_bus,
        await BusClient.connect(bus) as bus_a,
        await BusClient.connect(bus) as bus_b,
        await BusClient.connect(bus) as bus_c,
    ):
        pub = WeightPublisher(trainer_bus, local)
        a = WeightSubscriber(bus_a, "a", local)
        b = WeightSubscriber(bus_b, "b", FAST)  # never reads files: stays on the group
        try:
            assert await pub.publish(1, state_dict(1)) == 0  # nobody polls yet
            got = await a.next(-1, wait=30)  # a joiner: v1 from the file, verified
            assert got is not None and got[0] == 1 and same(got[1], state_dict(1))
            assert a.statistics()["via_file"] == 1 and a.statistics()["via_bus"] == 0
            wait_a = asyncio.create_task(a.next(1, wait=60))
            wait_b = asyncio.create_task(b.next(1, wait=60))
            await wait_until(
                lambda: _members_are(trainer_bus, ["b"]), what="b alone needing the group"
            )
            stats = (await trainer_bus.statistics())["weights"]
            assert stats["members"] == ["a", "b"] and stats["local_members"] == ["a"]
            assert await pub.publish(2, state_dict(2)) == 1  # over the group: b only
            for got in await asyncio.gather(wait_a, wait_b):
                assert got is not None and got[0] == 2 and same(got[1], state_dict(2))
            assert a.statistics()["via_file"] == 2 and a.statistics()["via_group"] == 0
            assert b.statistics()["via_group"] == 1
            assert pub.statistics()["members"] == ["b"]

            # Not readable here (another machine): the bus sends it, and a rejoins the group.
            head = await bus_a._call({"op": "w_poll", "after": 1, "wait": 0})
            assert Path(head["file"]).is_file()
            assert await a._from_file({**head, "file": str(tmp_path / "elsewhere")}) is None
            assert a._local is False
            # Not the same bytes (a foreign or damaged file): refused, bucket named.
            foreign = flipped_copy(head["file"], tmp_path / "foreign.safetensors")
            assert await a._from_file({**head, "file": str(foreign)}) is None
            assert await a._from_file(head) is not None and a._local is True

            # A receiver that was in the group when it started checks one bucket of the file
            # after its first version, and is left out of the group from the next one on.
            c = WeightSubscriber(bus_c, "c", local)
            waits = [asyncio.create_task(r.next(2, wait=60)) for r in (b, c)]
            await wait_until(lambda: _members_are(trainer_bus, ["b", "c"]), what="c joining")
            assert await pub.publish(3, state_dict(3)) == 2
            for got in await asyncio.gather(*waits):
                assert got is not None and same(got[1], state_dict(3))
            assert c.statistics()["via_group"] == 1 and c._local is True
            waits = [asyncio.create_task(r.next(3, wait=60)) for r in (b, c)]
            await wait_until(lambda: _members_are(trainer_bus, ["b"]), what="c off the group")
            assert await pub.publish(4, state_dict(4)) == 1
            for got in await asyncio.gather(*waits):
                assert got is not None and same(got[1], state_dict(4))
            assert c.statistics()["via_file"] == 1
            await c.aclose()
        finally:
            await a.aclose()
            await b.aclose()
            await pub.aclose()


def flipped_copy(path: str, to: Path) -> Path:
    """A copy of the file at ``path`` with one byte of its last tensor flipped."""
    to.write_bytes(Path(path).read_bytes())
    with to.open("r+b") as f:
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    return to


@contextlib.asynccontextmanager
async def publishing_to_files(bus: str) -> AsyncIterator[Any]:
    """``publish(version)``: a small version, with nobody polling (it goes to the bus's file
    only), within 10 s."""
    async with await BusClient.connect(bus) as trainer_bus:
        pub = WeightPublisher(trainer_bus, replace(FAST, local_file=True))

        async def publish(version: int) -> None:
            await asyncio.wait_for(pub.publish(version, state_dict(version, mb=1)), 10)

        try:
            yield publish
        finally:
            await pub.aclose()


def weight_files(run_dir: Path) -> list[int]:
    """The versions whose files the bus in ``run_dir`` holds."""
    return [int(p.stem[1:]) for p in sorted(Path(run_dir, "weights").glob("v*.safetensors"))]


async def test_old_versions_files_are_deleted_after_the_commit_not_during_it(
    bus, tmp_path, monkeypatch
) -> None:
    """Deleting a version file frees its page cache (about 30 ms per GB): the bus does it after
    the commit's reply, one deletion at a time, so no publish waits for it — here deletions
    are held until three versions are out — and only the newest two files stay."""
    held, calls = threading.Event(), []
    prune = WeightStore.prune_files

    def held_prune(store: WeightStore) -> None:  # runs on a thread: blocking is what we test
        calls.append(store.current)
        assert held.wait(30)
        prune(store)

    monkeypatch.setattr(WeightStore, "prune_files", held_prune)
    try:
        async with publishing_to_files(bus) as publish:
            for version in (1, 2, 3):
                await publish(version)
            await wait_until(lambda: calls, what="a deletion to start")
            assert weight_files(tmp_path) == [1, 2, 3]  # none deleted yet
            held.set()
            await wait_until(lambda: weight_files(tmp_path) == [2, 3], what="v1 deleted")
    finally:
        held.set()


async def test_a_deletion_that_fails_is_caught_up_by_the_next(bus, tmp_path, monkeypatch) -> None:
    """An old weight file that cannot be deleted (a permission, a busy file system) costs disk
    until the next commit deletes it; publishing goes on."""
    failures = iter([PermissionError("read-only for a moment")])
    prune = WeightStore.prune_files

    def flaky_prune(store: WeightStore) -> None:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        prune(store)

    monkeypatch.setattr(WeightStore, "prune_files", flaky_prune)
    async with publishing_to_files(bus) as publish:
        for version in (1, 2, 3, 4):
            await publish(version)
        await wait_until(lambda: weight_files(tmp_path) == [3, 4], what="v1 and v2 deleted")


async def test_a_publish_of_the_version_a_receiver_holds_does_not_wait_for_it(bus) -> None:
    """The trainer's first publish is of the weights every rollout starts from (version 0,
    which they hold already): a receiver polling then is in its group and takes part, so the
    publish does not wait out ``join_timeout`` for it (CI saw a run stall there)."""
    opts = replace(FAST, join_timeout=20.0, lease=30.0)
    async with (
        await BusClient.connect(bus) as trainer_bus,
        await BusClient.connect(bus) as bus_a,
    ):
        pub = WeightPublisher(trainer_bus, opts)
        a = WeightSubscriber(bus_a, "a", opts)
        try:
            wait = asyncio.create_task(a.next(0, wait=60))  # it holds version 0
            await wait_until(lambda: _members_are(trainer_bus, ["a"], opts.lease), what="a")
            started = asyncio.get_running_loop().time()
            assert await pub.publish(0, state_dict(0)) == 1  # over the group, with a
            assert asyncio.get_running_loop().time() - started < 10  # no join timeout (20 s)
            assert not wait.done()  # version 0 is not news to it
            assert await pub.publish(1, state_dict(1)) == 1
            got = await wait
            assert got is not None and got[0] == 1 and same(got[1], state_dict(1))
            assert a.statistics()["via_group"] == 1
        finally:
            await a.aclose()
            await pub.aclose()
