"""The bus table on its own: rows, leases, acks, admission and staleness, deterministic."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.bus._table import BusTable, ColumnConflict, UnknownTask
from relax.errors import BadColumn, BadRow, BusError


def rows(group: str, n: int, version: int = 0, **columns) -> list[dict]:
    return [
        {
            "uid": f"{group}-{i}",
            "group": group,
            "group_size": n,
            "version": version,
            "columns": dict(columns),
        }
        for i in range(n)
    ]


def table(**kw) -> BusTable:
    kw.setdefault("tasks", ("reward", "train"))
    return BusTable(**kw)


def test_put_is_idempotent_and_bounded() -> None:
    t = table(capacity=4)
    assert t.put(rows("g", 2))
    assert t.put(rows("g", 2)) == [{"op": "count", "name": "duplicate_puts", "n": 2}]
    assert len(t.rows) == 2
    assert t.put(rows("h", 3)) is None  # would exceed capacity: wait
    with pytest.raises(BusError, match="never fit"):
        t.put(rows("big", 5))


def test_tasks_take_the_same_rows_independently_and_rows_finish_when_all_acked() -> None:
    t = table()
    t.put(rows("g", 2, response_ids=[1, 2]))
    _, reward = t.take("reward", columns=("response_ids",), batch_size=8)
    assert reward is not None and sorted(reward.items) == ["g-0", "g-1"]
    _, train = t.take("train", columns=("reward",), batch_size=8)
    assert train is None  # no reward column yet
    for uid in reward.items:
        t.add_columns(uid, {"reward": 1.0})
    t.ack("reward", list(reward.items.items()))
    _, train = t.take("train", columns=("reward",), batch_size=8)
    assert train is not None
    _, n = t.ack("train", list(train.items.items()))
    assert n == 2 and not t.rows and t.trained == 2
    assert t.put(rows("g", 2)) == [
        {"op": "count", "name": "duplicate_puts", "n": 2}
    ]  # finished uids


def test_columns_are_write_once() -> None:
    t = table()
    t.put(rows("g", 1))
    t.add_columns("g-0", {"x": torch.arange(3)})
    assert t.add_columns("g-0", {"x": torch.arange(3)}) == []  # identical retry: fine
    with pytest.raises(ColumnConflict):
        t.add_columns("g-0", {"x": torch.zeros(3)})


def test_expired_lease_returns_rows_and_late_ack_of_old_attempt_is_ignored() -> None:
    t = table(tasks=("train",))
    t.put(rows("g", 1))
    _, first = t.take("train", batch_size=1, lease_timeout=10, now=0)
    assert first is not None and first.items == {"g-0": 1}
    t.expire(now=11)
    _, second = t.take("train", batch_size=1, lease_timeout=10, now=11)
    assert second is not None and second.items == {"g-0": 2}
    _, n = t.ack("train", [("g-0", 1)])  # the first holder wakes up late
    assert n == 0 and t.counters["ignored_acks"] == 1
    _, n = t.ack("train", [("g-0", 2)])
    assert n == 1 and t.trained == 1
    _, n = t.ack("train", [("g-0", 2)])  # acked twice counts once
    assert n == 0 and t.trained == 1


def test_turn_takes_are_granted_one_at_a_time() -> None:
    t = table(tasks=("rollout",), trainer_task="rollout")
    for name in ("p0", "p1", "p2", "p3"):
        t.put(rows(name, 1))
    _, a = t.take("rollout", batch_size=1, holder="a", turn=True)
    assert a is not None and list(a.items) == ["p0-0"]
    assert t.take("rollout", batch_size=1, holder="b", turn=True) == ([], None)  # a's turn
    _, plain = t.take("rollout", batch_size=1, holder="c")  # takes without turns never wait
    assert plain is not None and list(plain.items) == ["p1-0"]
    # The holder taking again (a restarted holder, say) carries the turn on to the new lease.
    _, a2 = t.take("rollout", batch_size=1, holder="a", turn=True)
    assert a2 is not None and list(a2.items) == ["p2-0"]
    assert not t.end_turn("rollout", a.id)  # that lease's turn was carried on
    assert t.take("rollout", batch_size=1, holder="b", turn=True) == ([], None)
    assert t.end_turn("rollout", a2.id)
    _, b = t.take("rollout", batch_size=1, holder="b", turn=True)
    assert b is not None and list(b.items) == ["p3-0"]


def test_a_turn_ends_with_its_lease() -> None:
    t = table(tasks=("rollout",), trainer_task="rollout")
    for name in ("p0", "p1", "p2"):
        t.put(rows(name, 1))
    _, a = t.take("rollout", batch_size=1, holder="a", turn=True, lease_timeout=10, now=0)
    assert t.take("rollout", batch_size=1, holder="b", turn=True, now=1) == ([], None)
    t.release("rollout", list(a.items.items()))  # released: the lease, and the turn, end
    _, b = t.take("rollout", batch_size=1, holder="b", turn=True, lease_timeout=10, now=2)
    assert b is not None and list(b.items) == ["p0-0"]  # released rows keep their place
    t.expire(now=13)  # b went silent: its lease expires, and its turn with it
    _, a = t.take("rollout", batch_size=2, holder="a", turn=True, now=13)
    assert a is not None and list(a.items) == ["p0-0", "p1-0"]


def replayed(t: BusTable, ops: list) -> BusTable:
    """A fresh table that applied ``ops``: what a restarted bus rebuilds from its log."""
    fresh = table(tasks=t.tasks, trainer_task=t.trainer_task)
    for seq, op in enumerate(ops):
        fresh.apply(op, seq)
    return fresh


def test_a_take_retried_with_its_id_gets_its_lease_again_on_a_restarted_bus() -> None:
    t = table(tasks=("train",))
    log = list(t.put(rows("g", 2)) or []) + list(t.put(rows("h", 2)) or [])
    ops, first = t.take("train", batch_size=2, holder="a", take_id="a-0")
    log += ops
    # The bus is killed before its reply: the restarted one rebuilds from the log, and the
    # client's retry (same request, same take id) gets the same lease, logging nothing new.
    again = replayed(t, log)
    ops, retried = again.take("train", batch_size=2, holder="a", take_id="a-0")
    assert ops == [] and retried is not None
    assert (retried.id, retried.items) == (first.id, first.items) == (1, {"g-0": 1, "g-1": 1})
    # Another take (another id) gets the next rows; so does this id once its lease has ended.
    _, other = again.take("train", batch_size=2, holder="a", take_id="a-1")
    assert other is not None and list(other.items) == ["h-0", "h-1"]
    again.release("train", list(retried.items.items()))
    _, anew = again.take("train", batch_size=2, holder="a", take_id="a-0")
    assert anew is not None and anew.id != first.id and anew.items == {"g-0": 2, "g-1": 2}


def test_turns_are_logged_and_a_restarted_bus_keeps_them() -> None:
    t = table(tasks=("rollout",), trainer_task="rollout")
    log = []
    for name in ("p0", "p1"):
        log += t.put(rows(name, 1)) or []
    ops, a = t.take("rollout", batch_size=1, holder="a", turn=True)
    log += ops
    again = replayed(t, log)
    assert again.turns == {"rollout": (a.id, "a")}
    assert again.take("rollout", batch_size=1, holder="b", turn=True) == ([], None)  # a's turn
    log += t.end_turn("rollout", a.id)
    again = replayed(t, log)
    assert again.turns == {}
    _, b = again.take("rollout", batch_size=1, holder="b", turn=True)
    assert b is not None and list(b.items) == ["p1-0"]


def test_a_reclaim_ends_the_holders_leases_and_replays() -> None:
    t = table(tasks=("train", "reward"))
    log = []
    for name in ("g", "h", "k"):
        log += t.put(rows(name, 1)) or []
    log += t.take("train", batch_size=1, holder="a", turn=True)[0]
    log += t.take("train", batch_size=1, holder="b")[0]
    log += t.take("reward", batch_size=1, holder="a")[0]
    reclaimed = t.reclaim("a")
    log += reclaimed
    # Both of a's leases (two tasks) end; b's stays; nothing else is touched.
    assert [op["reason"] for op in reclaimed] == ["reclaimed", "reclaimed"]
    assert [lease.holder for lease in t.leases.values()] == ["b"]
    assert t.turns == {"train": (1, "a")} and t._turn_free("train", "b")  # its lease ended
    assert t.counters["reclaimed_leases"] == 2 and t.counters["expired_leases"] == 0
    assert t.rows["g-0"].progress == {"train": ("pending", 1), "reward": ("pending", 1)}
    assert t.reclaim("a") == []
    again = replayed(t, log)  # a restarted bus rebuilds the same
    assert again.statistics() == t.statistics() and list(again.leases) == list(t.leases)
    # The next lease is a new attempt: an ack quoting the dead holder's would not count.
    _, lease = again.take("train", batch_size=1, holder="a2")
    assert lease is not None and lease.items == {"g-0": 2}
    with pytest.raises(ValueError, match="holder"):
        t.reclaim("")


def test_whole_groups_only_and_token_budget() -> None:
    t = table(tasks=("train",))
    t.put(rows("a", 2, response_ids=[1] * 10)[:1])  # half a group
    t.put(rows("b", 2, response_ids=[1] * 10))
    _, lease = t.take("train", batch_size=8, whole_groups=True)
    assert lease is not None and sorted(lease.items) == ["b-0", "b-1"]
    t2 = table(tasks=("train",))
    t2.put(rows("x", 1, response_ids=[1] * 30))
    t2.put(rows("y", 1, response_ids=[1] * 5))
    _, lease = t2.take("train", batch_size=8, token_budget=20)
    assert lease is not None and list(lease.items) == ["y-0"]
    assert (
        t2.counters["dropped_oversized"] == 1
    )  # larger than the whole budget: rejected, not stuck


def test_a_group_with_a_sample_over_max_row_tokens_is_dropped_as_oversized() -> None:
    t = table(tasks=("train",))
    big = rows("big", 2, response_ids=[1] * 5)
    big[1]["columns"]["response_ids"] = [1] * 50  # one sample of the group is too long
    t.put(big)
    t.put(rows("ok", 2, response_ids=[1] * 5))
    _, lease = t.take("train", batch_size=8, whole_groups=True, max_row_tokens=20)
    assert lease is not None and sorted(lease.items) == ["ok-0", "ok-1"]
    assert t.counters["dropped_oversized"] == 2  # the whole group, counted
    assert "big" in t.dropped_groups


def test_trainer_never_receives_stale_rows() -> None:
    t = table(tasks=("train",), staleness=1)
    t.put(rows("old", 2, version=0))
    t.put(rows("new", 2, version=2))
    t.set_version(2)  # floor = 1: version-0 rows can never be trained
    assert t.counters["dropped_stale"] == 2
    _, lease = t.take("train", batch_size=8)
    assert lease is not None and sorted(lease.items) == ["new-0", "new-1"]


def test_a_trainer_ahead_of_its_commit_is_judged_by_its_own_version() -> None:
    """A trainer whose publish of v3 is still on the way (overlapped) takes at version 3:
    rows stale against 3 are dropped and never leased, though the bus has committed only 2."""
    t = table(tasks=("train",), staleness=1)
    t.put(rows("v1", 2, version=1))
    t.put(rows("v2", 2, version=2))
    t.set_version(2)  # floor 1: both would do for a trainer at 2
    assert t.counters["dropped_stale"] == 0
    ops, lease = t.take("train", batch_size=8, whole_groups=True, trainer_version=3)  # floor 2
    assert lease is not None and sorted(lease.items) == ["v2-0", "v2-1"]
    assert t.counters["dropped_stale"] == 2 and ops[0]["op"] == "drop"
    assert t.trainer_at(3) == 3 and t.trainer_at(1) == 2 and t.trainer_at(None) == 2
    # A replica of the table replays the same outcome from the logged ops alone.
    replayed = table(tasks=("train",), staleness=1)
    replayed.put(rows("v1", 2, version=1))
    replayed.put(rows("v2", 2, version=2))
    replayed.set_version(2)
    for op in ops:
        replayed.apply(op)
    assert sorted(replayed.rows) == ["v2-0", "v2-1"] and replayed.leases


def test_a_live_staleness_change_admits_and_drops_by_the_new_bound_and_replays() -> None:
    t = table(tasks=("train",), staleness=2, batch_size=2, capacity=100)
    t.put(rows("v0", 2, version=0))
    t.put(rows("v2", 2, version=2))
    t.set_version(2)  # floor 0 under staleness 2: both groups may still be trained
    assert t.counters["dropped_stale"] == 0
    ops = t.set_staleness(0)  # floor 2: the version-0 rows are now too stale, dropped
    assert ops[0] == {"op": "staleness", "staleness": 0} and t.staleness == 0
    assert t.counters["dropped_stale"] == 2 and sorted(t.rows) == ["v2-0", "v2-1"]
    assert t.admit("old", 1, version=1, now=0, timeout=60)[1] == "behind"
    assert t.set_staleness(0) == []  # no change, nothing logged
    assert t.set_staleness("inf")[0] == {"op": "staleness", "staleness": "inf"}
    assert t.admit("old", 1, version=1, now=0, timeout=60)[1] == "ok"
    with pytest.raises(ValueError, match="staleness"):
        t.set_staleness(-1)
    # A restarted bus replays the change from its log, or from a compaction snapshot.
    replayed = table(tasks=("train",), staleness=2, batch_size=2, capacity=100)
    for op in [*ops, {"op": "staleness", "staleness": "inf"}]:
        replayed.apply(op)
    assert replayed.staleness == "inf"
    restored = table(tasks=("train",), staleness=2, batch_size=2, capacity=100)
    restored.apply(t.state_op())
    assert restored.staleness == "inf"


def test_dropping_a_row_drops_its_group_and_its_latecomers() -> None:
    t = table(tasks=("train",))
    t.put(rows("g", 3)[:2])
    t.take("train", batch_size=1)
    t.release("train", [("g-0", 1)], drop="reward_failed")
    assert not t.rows and t.counters["dropped_reward_failed"] == 2
    t.put(rows("g", 3)[2:])
    assert not t.rows and t.counters["dropped_with_group"] == 1


def test_a_producer_that_scored_its_rows_drops_a_failed_group_in_its_put() -> None:
    """``[reward] in_rollout``: the rollout puts its scored rows and names the groups whose
    reward failed. Those are dropped in the same put, as the reward role drops them: counted
    as ``reward_failed``, their admissions settled, their latecomers dropped; and a restarted
    bus rebuilds the same table from the logged ops."""
    t = table(tasks=("train",), staleness=0, batch_size=4, capacity=8)
    log = []
    for group in ("ok", "bad"):
        admitted, verdict = t.admit(group, 2, version=0, now=0, timeout=60)
        assert verdict == "ok"
        log += admitted
    assert t.admitted_rows() == 4
    ops = t.put(rows("ok", 2, reward=1.0) + rows("bad", 3)[:2], failed_groups=["bad"])
    assert [op["op"] for op in ops] == ["put", "drop"]
    assert sorted(t.rows) == ["ok-0", "ok-1"]
    assert t.counters["dropped_reward_failed"] == 2
    assert t.admitted_rows() == 0  # both settled: "ok" by its rows, "bad" by its drop
    same = replayed(t, log + ops)
    assert sorted(same.rows) == ["ok-0", "ok-1"] and same.counters == t.counters
    t.put(rows("bad", 3)[2:])  # the failed group's last row, late
    assert "bad-2" not in t.rows and t.counters["dropped_with_group"] == 1
    with pytest.raises(BusError, match="groups of the rows put"):
        t.put(rows("other", 1), failed_groups=["ok"])
    assert "other-0" not in t.rows  # refused whole


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_admission_paces_producers(staleness) -> None:
    t = table(tasks=("train",), staleness=staleness, batch_size=4, capacity=100)
    granted = 0
    while t.admit(f"g{granted}", 1, version=0, now=0, timeout=60)[1] == "ok":
        granted += 1
    assert granted == (staleness + 1) * 4
    assert t.admit("late", 1, version=0, now=0, timeout=60)[1] == "ahead"
    t.set_version(staleness + 1)
    assert t.admit("old-weights", 1, version=0, now=0, timeout=60)[1] == "behind"


def test_a_skipped_training_step_keeps_producers_going() -> None:
    # Strictly on-policy: one batch per version. The trainer consumes batch 0 but skips the
    # step (no new version); without counting that, producers would wait for version 1 forever.
    t = table(tasks=("train",), staleness=0, batch_size=2, capacity=100)
    for g in ("a", "b"):
        assert t.admit(g, 1, version=0, now=0, timeout=60)[1] == "ok"
        t.put(rows(g, 1))
    assert t.admit("c", 1, version=0, now=0, timeout=60)[1] == "ahead"
    _, lease = t.take("train", batch_size=2, now=0)
    assert lease is not None
    _, acked = t.ack("train", list(lease.items.items()), skipped_step=True)
    assert acked == 2 and t.counters["skipped_steps"] == 1
    assert t.admit("c", 1, version=0, now=0, timeout=60)[1] == "ok"
    assert t.admit("d", 1, version=0, now=0, timeout=60)[1] == "ok"
    assert t.admit("e", 1, version=0, now=0, timeout=60)[1] == "ahead"


def test_a_row_trained_on_but_not_yet_done_by_another_task_is_counted_once() -> None:
    # PPO at staleness 0: the trainer has acked a batch (version 1) that the critic, a second
    # task, still holds. Counted as trained and again as queued, the next batch's producers
    # were told "ahead" until the critic acked (~5 s a step, waiting for weights).
    t = table(tasks=("critic", "train"), staleness=0, batch_size=2, capacity=100)
    for g in ("a", "b"):
        assert t.admit(g, 1, version=0, now=0, timeout=60)[1] == "ok"
        t.put(rows(g, 1))
    _, critic = t.take("critic", batch_size=2, now=0)  # the critic is still on them
    _, lease = t.take("train", batch_size=2, now=0)
    assert critic is not None and lease is not None
    t.commit_weights(1, "p1", task="train", items=list(lease.items.items()))
    assert len(t.rows) == 2  # not finished: the critic has not acked
    assert t.admit("c", 1, version=1, now=0, timeout=60)[1] == "ok"
    assert t.admit("d", 1, version=1, now=0, timeout=60)[1] == "ok"
    assert t.admit("e", 1, version=1, now=0, timeout=60)[1] == "ahead"
    assert t.queued_for_trainer() == 0
    t.ack("critic", list(critic.items.items()))  # now finished: they leave the bus
    assert not t.rows and t.queued_for_trainer() == 0
    t.put(rows("c", 1))
    assert t.queued_for_trainer() == 1


def test_admission_is_bounded_by_capacity_when_fully_async() -> None:
    t = table(tasks=("train",), staleness=math.inf, capacity=3)
    verdicts = [t.admit(f"g{i}", 1, version=0, now=0, timeout=60)[1] for i in range(4)]
    assert verdicts == ["ok", "ok", "ok", "full"]
    t.expire(now=61)  # the producer died: its admissions come back
    assert t.admitted_rows() == 0


def test_a_retried_group_already_trained_does_not_hold_the_last_batch() -> None:
    """A rollout puts a group, is SIGKILLed before it acks the prompt, and its successor
    generates the prompt again: admitted again (the group left the bus when trained), its put
    is all duplicates. That admission must be settled by the put: at the run's end, where
    admission is capped, it held the last batch until it expired (CI: 80 s, the test's
    timeout)."""
    t = table(tasks=("train",), staleness=1, batch_size=2, capacity=100, end_version=2)
    log = []
    for g in ("a", "b"):
        log += t.admit(g, 1, version=0, now=0, timeout=120)[0]
        log += t.put(rows(g, 1))
    ops, lease = t.take("train", batch_size=2, now=0)
    log += ops + t.commit_weights(1, "p1", task="train", items=list(lease.items.items()))
    assert "a" not in t.groups and "a-0" in t.finished
    # The successor's retry of "a": admitted anew, put again, every row a duplicate.
    log += t.admit("a", 1, version=1, now=1, timeout=120)[0]
    assert t.admitted_rows() == 1
    put = t.put(rows("a", 1))
    assert {"op": "unadmit", "group": "a", "reason": "duplicate"} in put
    log += put
    assert t.admitted_rows() == 0 and t.counters["duplicate_admissions"] == 1
    # The last batch's two groups are admitted at once, not after the deadline.
    for g in ("c", "d"):
        ops, verdict = t.admit(g, 1, version=1, now=1, timeout=120)
        assert verdict == "ok"
        log += ops
    assert t.admit("e", 1, version=1, now=1, timeout=120)[1] == "ahead"  # past the end
    replica = table(tasks=("train",), staleness=1, batch_size=2, capacity=100, end_version=2)
    for op in log:
        replica.apply(op)
    assert replica.statistics() == t.statistics()  # the settling op replays


def test_unknown_task_is_refused() -> None:
    with pytest.raises(UnknownTask):
        table().take("nope", batch_size=1)


def test_replaying_ops_rebuilds_the_same_state() -> None:
    t = table(staleness=2, batch_size=2)
    log = []
    log += t.admit("g", 2, 0, now=0, timeout=60)[0]
    log += t.put(rows("g", 2, response_ids=[1, 2]))
    ops, _ = t.take("reward", columns=("response_ids",), batch_size=2, now=0)
    log += ops
    log += t.add_columns("g-0", {"reward": 1.0})
    log += t.ack("reward", [("g-0", 1)])[0]
    log += t.set_version(1)
    replica = table(staleness=2, batch_size=2)
    for op in log:
        replica.apply(op)
    assert replica.statistics() == t.statistics()
    assert replica.rows["g-0"].columns == t.rows["g-0"].columns
    snap = t.state_op()
    fresh = table(staleness=2, batch_size=2)
    fresh.apply(log[1])  # the put record is kept; the scalar history is in the state op
    fresh.apply(log[2])
    fresh.apply(snap)
    assert fresh.version == 1 and fresh.counters == t.counters


def test_per_token_versions_make_a_row_as_stale_as_its_oldest_token() -> None:
    t = table(tasks=("train",), staleness=1)
    t.put(
        [
            {
                "uid": "u",
                "group": "u",
                "version": 3,
                "columns": {"token_versions": torch.tensor([1, 1, 2, 3])},
            }
        ]
    )
    assert t.rows["u"].version == 1
    t.set_version(3)  # floor 2: the row started under weights 1
    assert t.counters["dropped_stale"] == 1


# ---------------------------------------------------------------------- checked at the door


def good_row(uid: str = "ok", **columns) -> dict:
    cols = {"prompt_ids": [1, 2], "response_ids": [3, 4, 5], "logprobs": [-0.5, -1.0, -2.0]}
    return {"uid": uid, "group": uid, "version": 0, "columns": {**cols, **columns}}


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"version": "abc"}, "version"),
        ({"group_size": "x"}, "group_size"),
        ({"group_size": 0}, "group_size"),
        ({"columns": [1, 2, 3]}, "columns"),  # a list where the columns should be
        ({"uid": 7}, "uid"),
        ({"group": None}, "group"),
    ],
)
def test_a_refused_put_applies_none_of_its_rows(bad, field) -> None:
    """The issue's repro: a put whose *second* row is malformed used to leave its first row in
    the live table, never logged. Now the whole put is refused and the table is unchanged."""
    t = table()
    second = {**good_row("second"), **bad}
    with pytest.raises(BadRow) as refused:
        t.put([good_row("first"), second])
    assert refused.value.field == field
    assert not t.rows and not t.groups and t.counters == {}
    assert t.put([good_row("first")])  # the good row alone goes in


@pytest.mark.parametrize(
    "columns, column, says",
    [
        ({"response_ids": "abc"}, "response_ids", "str, not a list of ints"),
        ({"prompt_ids": "what is 2+2?"}, "prompt_ids", "str, not a list of ints"),
        ({"reward": "high"}, "reward", "not a number"),
        ({"reward": math.nan}, "reward", "not finite"),
        ({"reward": -math.inf}, "reward", "not finite"),
        ({"reward": [1.0]}, "reward", "list, not a number"),
        ({"response_ids": [1, 2.5, 3]}, "response_ids", "holds a float"),
        ({"response_ids": [[1], [2], [3]]}, "response_ids", "not a number"),
        ({"logprobs": ["a", "b", "c"]}, "logprobs", "not a number"),
        ({"logprobs": [-1.0]}, "logprobs", "1 entries but response_ids has 3"),
        ({"response_ids": torch.zeros(3)}, "response_ids", "float32 tensor, not ints"),
        ({"prompt_ids": torch.zeros(2, 2, dtype=torch.long)}, "prompt_ids", "not 1-D"),
        ({"reward": torch.tensor(math.nan)}, "reward", "not finite"),
        ({"turns": 1.5}, "turns", "not an int"),
        ({"episode_end": 3}, "episode_end", "not a string"),
    ],
)
def test_columns_are_checked_at_the_put(columns, column, says) -> None:
    t = table()
    with pytest.raises(BadColumn, match=f"row 'bad': column '{column}'") as refused:
        t.put([good_row("first"), good_row("bad", **columns)])
    assert (refused.value.uid, refused.value.field) == ("bad", column)
    assert says in str(refused.value)
    assert not t.rows


def test_well_typed_and_user_columns_pass_in_every_wire_form() -> None:
    from relax.transport import dumps, loads

    tensors = {
        "prompt_ids": torch.tensor([1, 2]),
        "response_ids": torch.tensor([3, 4, 5], dtype=torch.int32),
        "logprobs": torch.tensor([-0.5, -1.0, -2.0], dtype=torch.bfloat16),
        "reward": torch.tensor(0.5),
        "loss_mask": torch.tensor([True, True, False]),
    }
    raw = loads(dumps(tensors), raw_tensors=True)  # as the bus receives them over the wire
    t = table()
    t.put([good_row("lists", reward=1, success=1.0, turns=2, answer={"any": ["thing"]})])
    t.put([{**good_row("torch"), "columns": tensors}])  # inproc:// hands tensors over as is
    t.put([{**good_row("raw"), "columns": raw}])
    t.put([good_row("mine", my_column="anything at all", scores=[[1, 2], "x"])])
    assert sorted(t.rows) == ["lists", "mine", "raw", "torch"]


def test_column_writes_are_checked_against_the_row() -> None:
    t = table()
    t.put([good_row("r")])
    with pytest.raises(BadColumn, match="'reward' is a str"):
        t.add_columns("r", {"reward": "high"})
    with pytest.raises(BadColumn, match="'ref_logprobs' has 2 entries but response_ids has 3"):
        t.add_columns("r", {"ref_logprobs": [-1.0, -1.0]})
    with pytest.raises(BadRow, match="columns is a list"):
        t.add_columns("r", [1.0])  # type: ignore[arg-type]
    assert "reward" not in t.rows["r"].columns
    assert t.add_columns("r", {"reward": 1.0, "ref_logprobs": [-1.0] * 3})


def test_a_group_that_can_never_fit_a_batch_is_refused_at_the_put() -> None:
    t = table(tasks=("train",), batch_size=4)
    with pytest.raises(BadRow, match="group of 8 rows can never fit a training batch of 4"):
        t.put(rows("huge", 8))
    assert not t.rows
    t.put(rows("g", 2))
    with pytest.raises(BadRow, match="group_size 2"):  # a size that disagrees with its group
        t.put([{**rows("g", 3)[2], "uid": "g-9"}])
    with pytest.raises(BadRow, match="more rows than its group_size"):
        t.put([{**rows("g", 2)[0], "uid": "g-extra"}])
    assert sorted(t.rows) == ["g-0", "g-1"]


def test_whole_groups_that_fit_are_found_behind_one_that_does_not() -> None:
    """The issue's repro: a batch of 4, a group of 1 first, then groups of 2. The table used to
    fill in arrival order and stop at the first group that did not fit, offering the same three
    rows forever; now it leases the two groups of 2, and the single row waits for a partner."""
    t = table(tasks=("train",), batch_size=4)
    t.put(rows("single", 1))
    t.put(rows("pair1", 2))
    t.put(rows("pair2", 2))
    _, lease = t.take("train", batch_size=4, min_rows=4, whole_groups=True)
    assert lease is not None
    assert sorted(lease.items) == ["pair1-0", "pair1-1", "pair2-0", "pair2-1"]
    t.put(rows("pair3", 2))
    t.put(rows("single2", 1))
    _, lease = t.take("train", batch_size=4, min_rows=4, whole_groups=True)
    assert lease is not None  # oldest first among what completes the batch
    assert sorted(lease.items) == ["pair3-0", "pair3-1", "single-0", "single2-0"]


def test_filling_a_batch_is_oldest_first_and_skips_what_does_not_fit() -> None:
    t = table(tasks=("train",), batch_size=4)
    for name, n in (("a", 3), ("b", 2), ("c", 2), ("d", 1)):
        t.put(rows(name, n))
    _, lease = t.take("train", batch_size=4, whole_groups=True)
    assert lease is not None and sorted(lease.items) == ["a-0", "a-1", "a-2", "d-0"]
    t2 = table(tasks=("train",), batch_size=4)
    for name, n in (("a", 3), ("b", 2), ("c", 2)):
        t2.put(rows(name, n))
    assert t2.take("train", batch_size=4, min_rows=4, whole_groups=True)[1] is not None
    t3 = table(tasks=("train",), batch_size=4)
    for name, n in (("a", 3), ("b", 3)):
        t3.put(rows(name, n))
    assert t3.take("train", batch_size=4, min_rows=4, whole_groups=True)[1] is None  # no fill


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4), max_size=8),
    batch=st.integers(1, 8),
    min_share=st.floats(0, 1),
)
def test_whole_groups_fill_a_batch_whenever_some_selection_can(sizes, batch, min_share) -> None:
    """Against brute force: a take of whole groups is granted exactly when some set of the
    waiting groups holds between ``min_rows`` and ``batch_size`` rows."""
    import itertools as it

    min_rows = max(1, round(min_share * batch))
    t = table(tasks=("train",), batch_size=8)
    for g, n in enumerate(sizes):
        t.put(rows(f"g{g}", n))
    possible = any(
        min_rows <= sum(pick) <= batch
        for k in range(len(sizes) + 1)
        for pick in it.combinations(sizes, k)
    )
    _, lease = t.take("train", batch_size=batch, min_rows=min_rows, whole_groups=True)
    assert (lease is not None) == possible
    if lease is not None:
        assert min_rows <= len(lease.items) <= batch
        leased = Counter(uid.rsplit("-", 1)[0] for uid in lease.items)
        assert all(n == sizes[int(g[1:])] for g, n in leased.items())  # whole groups only
