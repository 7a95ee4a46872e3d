"""The bus shapes: every op kind has exactly one handler in the bus table's dispatch table,
each applies, and an op of an unknown kind is refused."""

from __future__ import annotations

import pytest

from relax.bus import BusTable
from relax.errors import BusError
from relax.schema import OP_KINDS, NewRow, Op


def test_every_op_kind_has_one_handler() -> None:
    assert sorted(BusTable.OP_HANDLERS) == sorted(OP_KINDS)
    assert len(set(OP_KINDS)) == len(OP_KINDS)


def rows(group: str, n: int) -> list[NewRow]:
    return [
        {"uid": f"{group}/{i}", "group": group, "group_size": n, "version": 0, "columns": {}}
        for i in range(n)
    ]


def test_each_kind_of_op_applies_through_the_table() -> None:
    table = BusTable(tasks=("train",), staleness=1, batch_size=2, capacity=8)
    ops: list[Op] = [
        {"op": "admit", "group": "g", "rows": 2, "version": 0, "deadline": 10.0},
        {"op": "put", "rows": rows("g", 2)},
        {"op": "columns", "uid": "g/0", "columns": {"response_ids": [1, 2]}},
        {"op": "lease", "id": 1, "task": "train", "holder": "h", "deadline": 5.0,
         "items": [["g/0", 1], ["g/1", 1]], "take_id": "t-0", "turn": True},
        {"op": "end_turn", "task": "train", "lease": 1},
        {"op": "release", "task": "train", "items": [["g/1", 1]]},
        {"op": "ack", "task": "train", "items": [["g/0", 1]]},
        {"op": "expire", "id": 1},
        {"op": "lease", "id": 2, "task": "train", "holder": "h", "deadline": 5.0,
         "items": [["g/1", 2]]},
        {"op": "expire", "id": 2, "reason": "reclaimed"},
        {"op": "count", "name": "duplicate_puts", "n": 2},
        {"op": "version", "version": 1},
        {"op": "admit", "group": "h", "rows": 1, "version": 1, "deadline": 10.0},
        {"op": "unadmit", "group": "h"},
        {"op": "drop", "uids": ["g/1"], "groups": ["g"], "reason": "stale"},
        {"op": "staleness", "staleness": 2},
        {"op": "commit", "version": 3, "publish": "p", "set_version": True, "task": None,
         "items": [], "ignored": 1, "drop": None},
    ]  # fmt: skip
    assert {op["op"] for op in ops} == set(OP_KINDS) - {"state"}
    for seq, op in enumerate(ops):
        table.apply(op, seq)
    assert table.rows == {} and table.leases == {} and table.admissions == {}
    assert table.turns == {} and table.lease_of_take == {"t-0": 1}  # pruned with later leases
    assert table.version == 3 and table.weights_version == 3 and table.publishes == {3: "p"}
    assert table.staleness == 2  # changed live (`relax set staleness`)
    counters = table.counters
    assert counters["put"] == 2 and counters["trained"] == 1 and counters["dropped_stale"] == 1
    assert counters["released"] == 1 and counters["expired_admissions"] == 1
    assert counters["expired_leases"] == 0 and counters["reclaimed_leases"] == 1
    assert counters["duplicate_puts"] == 2 and counters["ignored_acks"] == 1
    # A state op (compaction) rebuilds the bookkeeping on a fresh table.
    replica = BusTable(tasks=("train",), staleness=1, batch_size=2, capacity=8)
    replica.apply(table.state_op(), len(ops))
    assert replica.statistics() == table.statistics()
    assert replica.staleness == 2


def test_an_unknown_op_is_refused() -> None:
    table = BusTable()
    with pytest.raises(BusError, match="unknown op 'teleport'"):
        table.apply({"op": "teleport"})  # type: ignore[typeddict-item]


def test_statistics_carry_the_staleness_in_its_wire_form() -> None:
    assert BusTable(staleness=2).statistics()["staleness"] == 2
    assert BusTable(staleness="inf").statistics()["staleness"] == "inf"
