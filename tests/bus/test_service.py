"""The bus service through its client: puts, takes, leases, waiting, weights, recovery."""

from __future__ import annotations

import asyncio
import itertools
import math
from dataclasses import replace

import pytest
import torch

from relax.actors import ChildSpec, Supervisor
from relax.bus import BusClient, BusService, SegmentLog
from relax.bus._journal import KeyJournal
from relax.errors import AuthFailed, BusError, MessageTooLarge
from relax.transport import loads
from tests.polling import wait_until

pytestmark = pytest.mark.anyio
_names = itertools.count()


def rows(group: str, n: int = 1, version: int = 0, **columns) -> list[dict]:
    return [
        {
            "uid": f"{group}/{i}",
            "group": group,
            "group_size": n,
            "version": version,
            "columns": dict(columns),
        }
        for i in range(n)
    ]


async def start_bus(tmp_path=None, *, url: str | None = None, **kwargs) -> tuple[Supervisor, str]:
    url = url or f"inproc://bus-{next(_names)}"
    kwargs.setdefault("tasks", ["reward", "train"])
    if tmp_path is not None:
        kwargs.setdefault("run_dir", str(tmp_path))
    sup = Supervisor([ChildSpec("bus", BusService, kwargs={"url": url, **kwargs})])
    await sup.__aenter__()
    return sup, await sup.ref("bus").call("address")


async def test_rows_flow_through_two_tasks_and_finish(tmp_path) -> None:
    sup, url = await start_bus(tmp_path)
    try:
        async with await BusClient.connect(url) as bus:
            assert await bus.put(rows("g", 2, response_ids=torch.arange(4))) == 2
            async with bus.take("reward", batch_size=8, columns=["response_ids"]) as batch:
                assert len(batch) == 2 and torch.equal(
                    batch.rows[0]["columns"]["response_ids"], torch.arange(4)
                )
                for row in batch.rows:
                    await bus.add_columns(row["uid"], {"reward": 1.0})
            async with bus.take(
                "train", batch_size=8, columns=["reward"], whole_groups=True
            ) as batch:
                assert sorted(r["uid"] for r in batch.rows) == ["g/0", "g/1"]
            stats = await bus.statistics()
            assert stats["rows"] == 0 and stats["counters"]["trained"] == 2
    finally:
        await sup.__aexit__(None, None, None)


async def test_a_block_that_raises_gives_its_rows_back(tmp_path) -> None:
    sup, url = await start_bus(tmp_path)
    try:
        async with await BusClient.connect(url) as bus:
            await bus.put(rows("g"))
            with pytest.raises(RuntimeError):
                async with bus.take("train", batch_size=1):
                    raise RuntimeError("trainer step failed")
            batch = await bus.take_batch("train", batch_size=1, wait=0)
            assert batch.rows[0]["attempt"] == 2  # leased again, as a new attempt
    finally:
        await sup.__aexit__(None, None, None)


async def test_take_waits_for_rows_and_put_waits_for_room(tmp_path) -> None:
    sup, url = await start_bus(tmp_path, capacity=2, tasks=["train"])
    try:
        async with await BusClient.connect(url) as bus:
            waiting = asyncio.create_task(bus.take_batch("train", batch_size=1, wait=10))
            await bus.put(rows("a"))
            batch = await asyncio.wait_for(waiting, 10)
            assert [r["uid"] for r in batch.rows] == ["a/0"]
            await bus.put(rows("b"))
            blocked = asyncio.create_task(bus.put(rows("c"), wait=10))  # full: a (leased) and b
            done, _ = await asyncio.wait({blocked}, timeout=0.2)
            assert not done, "a put into a full bus must wait"
            await bus.ack(batch)  # a finishes: room for c
            assert await asyncio.wait_for(blocked, 10) == 1
    finally:
        await sup.__aexit__(None, None, None)


async def test_admission_holds_producers_until_the_trainer_moves(tmp_path) -> None:
    sup, url = await start_bus(tmp_path, tasks=["train"], staleness=0, batch_size=2)
    try:
        async with await BusClient.connect(url) as bus:
            assert await bus.admit("g0", 2, version=0) == "ok"
            assert await bus.admit("g1", 2, version=0, wait=0.1) == "ahead"
            pending = asyncio.create_task(bus.admit("g1", 2, version=1, wait=10))
            await bus.put(rows("g0", 2))
            async with bus.take("train", batch_size=2, min_rows=2):
                pass
            await bus.set_trainer_version(1)
            assert await asyncio.wait_for(pending, 10) == "ok"
            assert await bus.admit("g2", 2, version=0) == "behind"
    finally:
        await sup.__aexit__(None, None, None)


async def test_admit_many_admits_in_order_up_to_the_first_refusal(tmp_path) -> None:
    sup, url = await start_bus(tmp_path, tasks=["train"], staleness=0, batch_size=4, capacity=8)
    try:
        async with await BusClient.connect(url) as bus:
            reply = await bus.admit_many(["g0", "g1", "g2"], 2, version=0)
            assert reply == {"verdicts": ["ok", "ok", "ahead"], "staleness": 0}
            verdicts = (await bus.admit_many(["g1", "g2"], 2, version=0))["verdicts"]
            assert verdicts == ["ok", "ahead"]  # g1's admission retried: still ok
            assert (await bus.statistics())["admitted_rows"] == 4  # g2 was not admitted
            await bus.put(rows("g0", 2) + rows("g1", 2))
            async with bus.take("train", batch_size=4, min_rows=4):
                pass
            await bus.set_trainer_version(1)
            assert (await bus.admit_many(["g2", "g3"], 2, version=0))["verdicts"] == ["behind"]
            await bus.set_staleness("inf")  # a live change: the next reply says so
            reply = await bus.admit_many(["g2", "g3"], 2, version=1)
            assert reply == {"verdicts": ["ok", "ok"], "staleness": "inf"}
            with pytest.raises(BusError, match="list of group ids"):
                await bus.admit_many([], 2, version=1)
    finally:
        await sup.__aexit__(None, None, None)


async def test_admit_many_waits_for_room_only_for_its_first_group(tmp_path) -> None:
    sup, url = await start_bus(tmp_path, tasks=["train"], staleness="inf", capacity=2)
    try:
        async with await BusClient.connect(url) as bus:
            assert (await bus.admit_many(["a"], 2, version=0))["verdicts"] == ["ok"]
            assert (await bus.admit_many(["b"], 2, version=0, wait=0))["verdicts"] == ["full"]
            pending = asyncio.create_task(bus.admit_many(["b", "c"], 2, version=0, wait=10))
            done, _ = await asyncio.wait({pending}, timeout=0.2)
            assert not done, "a full bus must hold the first group's admission"
            await bus.put(rows("a", 2))
            async with bus.take("train", batch_size=2):
                pass  # a finishes: room for b, none for c behind it
            assert (await asyncio.wait_for(pending, 10))["verdicts"] == ["ok", "full"]
    finally:
        await sup.__aexit__(None, None, None)


async def test_admit_many_ahead_waits_for_a_dropped_group_or_the_trainer(tmp_path) -> None:
    sup, url = await start_bus(tmp_path, tasks=["reward", "train"], staleness=0, batch_size=4)
    try:
        async with await BusClient.connect(url) as bus:
            assert (await bus.admit_many(["g0", "g1"], 2, version=0))["verdicts"] == ["ok", "ok"]
            pending = asyncio.create_task(bus.admit_many(["g2"], 2, version=0, wait=10))
            done, _ = await asyncio.wait({pending}, timeout=0.2)
            assert not done, "version 0 is full: g2 must wait"
            await bus.put(rows("g0", 2) + rows("g1", 2))
            batch = await bus.take_batch("reward", batch_size=4, wait=0)
            failed = [r for r in batch.rows if r["group"] == "g1"]
            await bus.release(replace(batch, rows=failed), drop="reward_failed")
            # g1's reward failed: its group is gone, and version 0 has room for g2 again.
            assert (await asyncio.wait_for(pending, 10))["verdicts"] == ["ok"]
            pending = asyncio.create_task(bus.admit_many(["g3"], 2, version=0, wait=10))
            done, _ = await asyncio.wait({pending}, timeout=0.2)
            assert not done
            await bus.set_trainer_version(1)  # the trainer moved on: sync weights, at once
            assert (await asyncio.wait_for(pending, 10))["verdicts"] == ["behind"]
    finally:
        await sup.__aexit__(None, None, None)


async def test_producers_taking_turns_wait_for_the_holder_to_end_its_turn(tmp_path) -> None:
    sup, url = await start_bus(tmp_path, tasks=["rollout"], trainer_task="rollout")
    try:
        async with (
            await BusClient.connect(url, client_id="rollout-0") as a,
            await BusClient.connect(url, client_id="rollout-1") as b,
        ):
            await a.put([r for g in ("p0", "p1", "p2") for r in rows(g)])
            first = await a.take_batch("rollout", batch_size=2, wait=0, turn=True)
            assert [r["uid"] for r in first.rows] == ["p0/0", "p1/0"]
            second = asyncio.create_task(b.take_batch("rollout", batch_size=2, wait=10, turn=True))
            done, _ = await asyncio.wait({second}, timeout=0.2)
            assert not done, "a turn-take must wait while another holder has the turn"
            assert (await b.statistics())["turns"] == {"rollout": "rollout-0"}
            # a admitted p0 only: p1 goes back, in its place, and the turn ends, in one call.
            await a.release(replace(first, rows=first.rows[1:]), end_turn=True)
            batch = await asyncio.wait_for(second, 10)
            assert [r["uid"] for r in batch.rows] == ["p1/0", "p2/0"]
            await b.release(replace(batch, rows=[]), end_turn=True)  # all admitted: only the turn
            assert (await b.statistics())["turns"] == {}
            assert (await a.take_batch("rollout", batch_size=2, wait=0, turn=True)).rows == []
    finally:
        await sup.__aexit__(None, None, None)


@pytest.mark.parametrize("scheme", ["tcp", "inproc"])
async def test_a_new_incarnation_takes_back_what_its_name_held(tmp_path, scheme) -> None:
    # A consumer dies holding a lease (and a producer the prompts' turn); the lease timeout
    # is an hour. Its successor, connecting under the same name, reclaims: the rows are
    # back now, a waiting consumer gets them, and the dead one's late ack no longer counts.
    # Another client's lease is left alone.
    url = "tcp://127.0.0.1:0" if scheme == "tcp" else None
    sup, url = await start_bus(tmp_path, url=url, lease_timeout=3600.0)
    try:
        async with (
            await BusClient.connect(url, client_id="reward-0") as dead,
            await BusClient.connect(url, client_id="reward-1") as other,
        ):
            await dead.put(rows("a", 2) + rows("b", 2) + rows("c", 2))
            held = await dead.take_batch("reward", batch_size=2, whole_groups=True, turn=True)
            kept = await other.take_batch("reward", batch_size=2, whole_groups=True)
            assert [r["group"] for r in held.rows] == ["a", "a"]
            assert [r["group"] for r in kept.rows] == ["b", "b"]
            waiting = asyncio.create_task(
                other.take_batch("reward", batch_size=4, min_rows=4, wait=30)
            )  # c alone is too few: it waits for a's rows
            async with await BusClient.connect(url, client_id="reward-0") as successor:
                assert await successor.reclaim() == {"leases": 1, "weight_members": 0}
                assert await successor.reclaim() == {"leases": 0, "weight_members": 0}
                got = await asyncio.wait_for(waiting, 10)
                assert sorted(r["uid"] for r in got.rows) == ["a/0", "a/1", "c/0", "c/1"]
                assert {r["attempt"] for r in got.rows if r["group"] == "a"} == {2}
                assert await dead.ack(held) == 0  # a new attempt holds them now
                stats = await successor.statistics()
                assert stats["counters"]["reclaimed_leases"] == 1
                assert "expired_leases" not in stats["counters"]
                assert stats["turns"] == {}  # the turn went with the lease
                assert stats["leases"] == 2  # kept's and got's
                assert await other.ack(kept) == 2
    finally:
        await sup.__aexit__(None, None, None)


async def test_a_take_still_waiting_for_a_succeeded_client_leases_it_nothing(tmp_path) -> None:
    # A warm spare takes over a SIGKILLed role within a take's wait: the dead one's take is
    # still waiting at the bus. Rows that arrive after the successor's reclaim must not be
    # leased to it (they were, and sat out the lease timeout: a 60 s stall of the run).
    sup, url = await start_bus(tmp_path, lease_timeout=3600.0)
    try:
        async with (
            await BusClient.connect(url, client_id="reward-0") as dead,
            await BusClient.connect(url, client_id="reward-0") as successor,
        ):
            orphan = asyncio.create_task(dead.take_batch("reward", batch_size=2, wait=30))
            await wait_until(lambda: _waiting(successor), what="the take waiting at the bus")
            await successor.reclaim()
            assert (await asyncio.wait_for(orphan, 10)).rows == []  # answered with nothing
            await successor.put(rows("a", 2))
            batch = await successor.take_batch("reward", batch_size=2, wait=5)
            assert [r["uid"] for r in batch.rows] == ["a/0", "a/1"]
            assert (await successor.statistics())["leases"] == 1
    finally:
        await sup.__aexit__(None, None, None)


@pytest.mark.parametrize("many", [True, False], ids=["admit_many", "admit"])
async def test_an_admission_still_waiting_for_a_succeeded_client_admits_nothing(
    tmp_path, many: bool
) -> None:
    # A rollout SIGKILLed while its admission waits for room at the bus; its successor
    # reclaims under the same name. The dead one's wait is answered at once and admits
    # nothing: granted when room came, it held that room for a group nobody would generate.
    sup, url = await start_bus(tmp_path, tasks=["train"], staleness="inf", capacity=2)

    async def admit(client: BusClient, group: str, wait: float) -> str:
        if many:
            return (await client.admit_many([group], 2, version=0, wait=wait))["verdicts"][0]
        return await client.admit(group, 2, version=0, wait=wait)

    try:
        async with (
            await BusClient.connect(url, client_id="rollout-0") as dead,
            await BusClient.connect(url, client_id="rollout-0") as successor,
        ):
            assert await admit(dead, "a", 0) == "ok"
            orphan = asyncio.create_task(admit(dead, "b", 30))
            await wait_until(lambda: _waiting(successor), what="the admission waiting at the bus")
            await successor.reclaim()
            assert await asyncio.wait_for(orphan, 10) == "full"
            await successor.put(rows("a", 2))
            async with successor.take("train", batch_size=2):
                pass  # a finishes: room for one group
            assert (await successor.statistics())["admitted_rows"] == 0  # b was not admitted
            assert await admit(successor, "c", 0) == "ok"  # the room is the successor's
    finally:
        await sup.__aexit__(None, None, None)


async def test_a_take_given_up_before_its_answer_gets_its_rows_at_the_next_take(tmp_path) -> None:
    # The client stops waiting (cancelled, or its own timeout) while the bus still holds the
    # take; rows arrive and the bus leases them to that take, whose answer nobody reads. The
    # client's next take of the task goes under the same id and gets that lease, instead of
    # waiting for it to expire (an hour here).
    sup, url = await start_bus(tmp_path, lease_timeout=3600.0)
    try:
        async with await BusClient.connect(url, client_id="trainer") as bus:
            given_up = asyncio.create_task(bus.take_batch("reward", batch_size=2, wait=30))
            await wait_until(lambda: _waiting(bus), what="the take waiting at the bus")
            given_up.cancel()
            await bus.put(rows("a", 2))
            await wait_until(lambda: _leases(bus), what="the lease granted to the given-up take")
            batch = await bus.take_batch("reward", batch_size=2, wait=5)
            assert [r["uid"] for r in batch.rows] == ["a/0", "a/1"]
            assert {r["attempt"] for r in batch.rows} == {1}  # that very lease
            assert await bus.ack(batch) == 2
    finally:
        await sup.__aexit__(None, None, None)


async def _leases(client: BusClient) -> bool:
    return (await client.statistics())["leases"] == 1


async def _waiting(client: BusClient) -> bool:
    # Handlers running: this statistics request, and the take.
    return (await client.statistics())["transport"]["in_flight"] >= 2


async def test_weights_round_trip_in_buckets_and_late_subscribers_get_the_current_version(
    tmp_path,
) -> None:
    sup, url = await start_bus(tmp_path)
    state = {f"layer{i}.weight": torch.randn(64, 64) for i in range(8)} | {
        "emb": torch.randn(100, 8).bfloat16()
    }
    try:
        async with await BusClient.connect(url) as trainer, await BusClient.connect(url) as rollout:
            waiting = asyncio.create_task(rollout.poll_weights(after=-1, wait=10))
            buckets = await trainer.publish_weights(1, state, bucket_bytes=40_000)
            assert buckets > 1
            version, got = await asyncio.wait_for(waiting, 10)
            assert version == 1 and list(got) == list(state)
            assert all(torch.equal(got[k], state[k]) for k in state)
            newer = {k: v + 1 for k, v in state.items()}
            await trainer.publish_weights(2, newer, bucket_bytes=40_000)
            version, got = await rollout.poll_weights(after=-1)  # a late joiner: current first
            assert version == 2 and torch.equal(got["emb"], newer["emb"])
            assert await rollout.poll_weights(after=2, wait=0.1) is None
            assert (await trainer.statistics())["trainer_version"] == 2
            with pytest.raises(BusError, match="not newer"):
                await trainer.publish_weights(2, state)
    finally:
        await sup.__aexit__(None, None, None)


@pytest.mark.parametrize("scheme", ["ipc", "inproc"])
async def test_a_restarted_bus_recovers_rows_leases_versions_and_weights(tmp_path, scheme) -> None:
    # inproc: the bus hands its objects over as they are, and a version it serves from its file
    # is in wire form; the client still gets torch tensors (an inproc evaluator crashed on it).
    url = "ipc://" + str(tmp_path / "bus.sock") if scheme == "ipc" else None
    sup, url = await start_bus(tmp_path, url=url, staleness="inf")
    try:
        async with await BusClient.connect(url) as bus:
            await bus.put(rows("a", 2) + rows("b"))
            batch = await bus.take_batch("reward", batch_size=2)
            await bus.add_columns("b/0", {"reward": 0.5})
            await bus.publish_weights(3, {"w": torch.ones(3)})
            await sup.restart_child("bus")  # stop + start: replays the log
            after = await bus.statistics()  # the same client reconnects by itself
            assert after["rows"] == 3 and after["trainer_version"] == 3 and after["leases"] == 1
            assert await bus.ack(batch) == 2  # the lease survived the restart
            version, weights = await bus.poll_weights()
            assert version == 3 and isinstance(weights["w"], torch.Tensor)
            assert torch.equal(weights["w"], torch.ones(3))
            async with bus.take("train", batch_size=8, columns=["reward"]) as got:
                assert [r["uid"] for r in got.rows] == ["b/0"]
    finally:
        await sup.__aexit__(None, None, None)


async def test_a_put_drops_the_groups_its_producer_failed_to_score_and_a_restart_keeps_it(
    tmp_path,
) -> None:
    """A rollout scoring its own samples (``[reward] in_rollout``) puts them scored, naming
    the groups whose reward failed: the bus drops those in the same request and logs it, so
    a restarted bus neither serves them nor forgets the drop."""
    sup, url = await start_bus(tmp_path, tasks=["train"], staleness="inf")
    try:
        async with await BusClient.connect(url) as bus:
            put = rows("good", 2, reward=1.0) + rows("bad", 2)
            assert await bus.put(put, failed_groups=["bad"]) == 4
            for stats in (await bus.statistics(), None):
                if stats is None:
                    await sup.restart_child("bus")  # stop + start: replays the log
                    stats = await bus.statistics()
                assert stats["rows"] == 2 and stats["counters"]["dropped_reward_failed"] == 2
            await bus.put(rows("bad", 2)[1:])  # the failed group put again (a retry): not served
            async with bus.take("train", batch_size=8, columns=["reward"]) as batch:
                assert sorted(r["uid"] for r in batch.rows) == ["good/0", "good/1"]
            with pytest.raises(BusError, match="groups of the rows put"):
                await bus.put(rows("other"), failed_groups=["good"])
    finally:
        await sup.__aexit__(None, None, None)


async def test_wrong_secret_can_neither_put_nor_take(tmp_path) -> None:
    secret = "s" * 32
    sup, url = await start_bus(tmp_path, url="tcp://127.0.0.1:0", secret=secret)
    try:
        async with await BusClient.connect(url, secret=secret) as bus:
            await bus.put(rows("a"))
        with pytest.raises(AuthFailed):
            intruder = await BusClient.connect(url, secret="x" * 32, connect_timeout=3)
            try:
                await intruder.put(rows("evil"))
            finally:
                await intruder.aclose()
        with pytest.raises(AuthFailed):
            intruder = await BusClient.connect(url, secret="x" * 32, connect_timeout=3)
            try:
                await intruder.take_batch("train", batch_size=1)
            finally:
                await intruder.aclose()
        async with await BusClient.connect(url, secret=secret) as bus:
            stats = await bus.statistics()
            assert stats["rows"] == 1  # nothing the intruder sent reached the bus
    finally:
        await sup.__aexit__(None, None, None)


async def test_oversized_messages_are_refused_at_the_sender(tmp_path) -> None:
    from relax.transport import Limits

    sup, url = await start_bus(
        tmp_path, url="tcp://127.0.0.1:0", frame_bytes=1 << 16, max_message_bytes=1 << 20
    )
    try:
        limits = Limits(frame_bytes=1 << 16, max_message_bytes=1 << 20)
        async with await BusClient.connect(url, limits=limits) as bus:
            with pytest.raises(MessageTooLarge):
                await bus.put(rows("big", blob=torch.zeros(1 << 19)))  # 2 MB of float32
            assert await bus.put(rows("ok", blob=torch.zeros(1 << 16))) == 1  # 256 KB: chunked
    finally:
        await sup.__aexit__(None, None, None)


async def test_garbage_on_the_socket_does_not_kill_the_bus(tmp_path) -> None:
    import pynng

    sup, url = await start_bus(tmp_path, url="tcp://127.0.0.1:0")
    try:
        with pynng.Req0(recv_max_size=0, recv_timeout=2000) as raw:
            raw.dial(url, block=True)
            for junk in (b"", b"\x00" * 7, b"RLX1garbage", bytes(range(256)) * 10):
                await raw.asend(junk)
                await raw.arecv()  # the server answers junk with an error frame, and lives
        async with await BusClient.connect(url) as bus:
            assert await bus.put(rows("after-junk")) == 1
            assert (await bus.statistics())["transport"]["bad_frames"] >= 4
        assert find_state(await sup.snapshot()) == "running"
    finally:
        await sup.__aexit__(None, None, None)


def find_state(snapshot: dict) -> str:
    return snapshot["children"][0]["state"]


async def test_compaction_deletes_dead_segments_and_recovery_still_matches(tmp_path) -> None:
    kwargs = {"tasks": ["train"], "staleness": "inf", "segment_bytes": 4096, "compact_every": 50}
    sup, url = await start_bus(tmp_path, url="ipc://" + str(tmp_path / "bus.sock"), **kwargs)
    try:
        async with await BusClient.connect(url) as bus:
            for i in range(300):  # each row: put, lease, ack records
                await bus.put(rows(f"g{i}", blob=torch.full((64,), i)))
                async with bus.take("train", batch_size=1):
                    pass
            await bus.put(rows("live", blob=torch.arange(64)))
            before = await bus.statistics()
            segments = len(list((tmp_path / "bus-log").glob("*.seg")))
            await sup.restart_child("bus")
            after = await bus.statistics()
            async with bus.take("train", batch_size=8, columns=["blob"]) as batch:
                assert [r["uid"] for r in batch.rows] == ["live/0"]
                assert torch.equal(batch.rows[0]["columns"]["blob"], torch.arange(64))
            assert await bus.put(rows("g7", blob=torch.zeros(64))) == 0  # finished long ago
    finally:
        await sup.__aexit__(None, None, None)
    assert before["log"]["segments"] == segments < 10  # 900+ records, most segments deleted
    assert after["counters"]["trained"] == before["counters"]["trained"] == 300
    assert after["rows"] == 1


async def test_compactions_journal_finished_uids_instead_of_rewriting_them(tmp_path) -> None:
    """The memory of finished uids lives in a journal beside the log: each compaction's state
    record stays small however many rows finished (it used to carry the whole window, up to a
    million uids), the journal keeps the newest ``dedup_window`` of them across restarts and
    deleted segments, and a retried put of one is ignored."""
    kwargs = {
        "tasks": ["train"],
        "staleness": "inf",
        "segment_bytes": 4096,
        "compact_every": 50,
        "dedup_window": 120,
    }
    sup, url = await start_bus(tmp_path, url="ipc://" + str(tmp_path / "bus.sock"), **kwargs)
    try:
        async with await BusClient.connect(url) as bus:
            for i in range(300):
                await bus.put(rows(f"g{i}"))
                async with bus.take("train", batch_size=1):
                    pass
            await sup.restart_child("bus")
            fresh = await bus.put([r for i in range(290, 300) for r in rows(f"g{i}")])
            forgotten = await bus.put(rows("g0"))  # beyond the window: a put like any other
    finally:
        await sup.__aexit__(None, None, None)
    assert fresh == 0 and forgotten == 1
    with SegmentLog(tmp_path / "bus-log") as log:
        assert log.first_seq > 0  # compacted: the acks of g0 … are gone from the log
        states = [loads(r) for _, r in log.replay() if loads(r)["op"] == "state"]
    assert states and all("finished" not in op for op in states)
    journal = KeyJournal(tmp_path / "bus-finished", window=120)
    held = journal.load()
    journal.close()
    assert {"g299/0", "g180/0"} <= set(held) and len(held) < 300  # pruned, newest kept


async def test_a_key_journal_keeps_the_newest_window_across_reopening(tmp_path) -> None:
    journal = KeyJournal(tmp_path / "j", window=10, segment_bytes=64)  # a segment per record
    for i in range(20):
        journal.append([f"k{i}/{j}" for j in range(3)])
    assert journal.statistics() == {"records": 4, "keys": 12}  # 4 records hold 10 or more
    journal.close()
    again = KeyJournal(tmp_path / "j", window=10, segment_bytes=64)
    assert again.load() == [f"k{i}/{j}" for i in range(16, 20) for j in range(3)]
    again.close()


# ---------------------------------------------------------------------- checked at the door

SECRET = "a secret for the door tests"


def sample(uid: str, **columns) -> dict:
    cols = {"prompt_ids": [1, 2], "response_ids": [3, 4], "logprobs": [-1.0, -1.0]}
    return {"uid": uid, "group": uid, "version": 0, "columns": {**cols, **columns}}


async def test_a_refused_put_leaves_nothing_live_or_logged(tmp_path) -> None:
    """Over tcp:// with a secret: a put whose second row says version="abc" is refused as a
    whole, and neither the live table nor the log (a restarted bus) has its first row."""
    from relax.errors import BadRow
    from tests.transport.rpc_helpers import free_port

    url = f"tcp://127.0.0.1:{free_port()}"  # a fixed port: the restarted bus comes back on it
    sup, url = await start_bus(tmp_path, url=url, secret=SECRET)
    try:
        async with await BusClient.connect(url, secret=SECRET) as bus:
            with pytest.raises(BadRow, match="row 'second': version must be an integer") as e:
                await bus.put([sample("first"), {**sample("second"), "version": "abc"}])
            assert (e.value.uid, e.value.field) == ("second", "version")  # rebuilt as itself
            assert (await bus.statistics())["rows"] == 0
            await sup.restart_child("bus")
            assert (await bus.statistics())["rows"] == 0  # the log agrees
            assert await bus.put([sample("first")]) == 1
    finally:
        await sup.__aexit__(None, None, None)


async def test_poisoned_columns_are_refused_naming_uid_and_column(tmp_path) -> None:
    """The issue's repros, each refused at the door with the uid and the column."""
    from relax.errors import BadColumn

    sup, url = await start_bus(tmp_path, url="tcp://127.0.0.1:0", secret=SECRET)
    prompts, prompts_url = await start_bus(
        tmp_path / "prompts",
        url="tcp://127.0.0.1:0",
        secret=SECRET,
        tasks=["rollout"],
        trainer_task="rollout",
    )
    try:
        async with (
            await BusClient.connect(url, secret=SECRET) as bus,
            await BusClient.connect(prompts_url, secret=SECRET) as prompt_bus,
        ):
            with pytest.raises(BadColumn, match="row 's': column 'response_ids' is a str"):
                await bus.put([sample("s", response_ids="the answer is 4")])
            with pytest.raises(BadColumn, match="row 'p': column 'prompt_ids' is a str"):
                await prompt_bus.put(
                    [{"uid": "p", "group": "p", "version": 0, "columns": {"prompt_ids": "2+2?"}}]
                )
            assert await bus.put([sample("a"), sample("b"), sample("c")]) == 3
            with pytest.raises(BadColumn, match="row 'a': column 'reward' is a str"):
                await bus.add_columns("a", {"reward": "high"})
            refused = await bus.add_columns_many(
                [("a", {"reward": 1.0}), ("b", {"reward": math.nan}), ("c", {"reward": 0.5})]
            )
            assert refused[0] is None and refused[2] is None
            assert isinstance(refused[1], BadColumn) and refused[1].field == "reward"
            assert "not finite" in str(refused[1])
            async with bus.take("train", batch_size=8, columns=["reward"]) as batch:
                assert sorted(r["uid"] for r in batch.rows) == ["a", "c"]  # b waits for one
            assert (await prompt_bus.statistics())["rows"] == 0
    finally:
        await sup.__aexit__(None, None, None)
        await prompts.__aexit__(None, None, None)


async def test_the_trainer_is_not_blocked_by_a_group_that_does_not_fit(tmp_path) -> None:
    from relax.errors import BadRow

    sup, url = await start_bus(
        tmp_path, url="tcp://127.0.0.1:0", secret=SECRET, tasks=["train"], batch_size=4
    )
    try:
        async with await BusClient.connect(url, secret=SECRET) as bus:
            with pytest.raises(BadRow, match=r"group of 8 rows can never fit .* batch of 4"):
                await bus.put(rows("huge", 8))
            await bus.put(rows("single", 1))
            await bus.put(rows("pair1", 2))
            await bus.put(rows("pair2", 2))
            batch = await bus.take_batch(
                "train", batch_size=4, min_rows=4, whole_groups=True, wait=2.0
            )
            assert sorted(r["group"] for r in batch.rows) == ["pair1"] * 2 + ["pair2"] * 2
    finally:
        await sup.__aexit__(None, None, None)
