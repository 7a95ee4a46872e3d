"""The bus's plain-data shapes: a row as producers put it and consumers take it, and every
operation the bus table applies and logs.

All of them are ``TypedDict``s: they are the dicts that go over msgpack and into the bus log
unchanged (a restarted bus replays logs written before these types existed), so the types name
the keys without changing the wire. Ops are applied by ``relax.bus.BusTable`` through one
table from ``OpKind`` to handler.
"""

from __future__ import annotations

import typing
from typing import Any, Literal, NotRequired, TypedDict

from relax.schema._staleness import StalenessWire

# ---------------------------------------------------------------------------- rows


class _RowKeys(TypedDict):
    uid: str
    """Unique and stable across retries (a retried put of it is ignored)."""
    group: str
    """The prompt's id: the ``group_size`` rows of one prompt make a group."""
    version: int
    """The policy version that generated it (the oldest, when a generation spans updates)."""


class NewRow(_RowKeys, total=False):
    """A row as a producer puts it."""

    group_size: int
    """Rows the group will hold (1 when left out)."""
    columns: dict[str, Any]
    """Named columns (see ``relax.schema`` column names), each written once."""


class TakenRow(_RowKeys):
    """A row as a lease hands it out."""

    attempt: int
    """Which lease of this row this is: an ack quotes it back."""
    columns: dict[str, Any]


class TakeReply(TypedDict):
    """What a granted ``take`` answers."""

    lease: int
    task: str
    trainer_version: int
    rows: list[TakenRow]
    staleness: NotRequired[StalenessWire]
    """The bound in force when the rows were taken (the trainer's task only)."""


class AdmitManyReply(TypedDict):
    """What ``admit_many`` answers."""

    verdicts: list[str]
    """One per group, in order, up to and including the first not ``"ok"``."""
    staleness: StalenessWire
    """The bound in force now (a producer learns of a live change here)."""


# ---------------------------------------------------------------------------- operations

OpKind = Literal[
    "put",
    "columns",
    "lease",
    "ack",
    "release",
    "expire",
    "drop",
    "admit",
    "unadmit",
    "version",
    "count",
    "commit",
    "state",
    "staleness",
    "end_turn",
]
OP_KINDS: tuple[str, ...] = typing.get_args(OpKind)
"""Every kind of op the bus table applies (and its log holds)."""

Items = list[list[Any]]
"""``[uid, attempt]`` pairs (lists: that is what msgpack gives back)."""


class PutOp(TypedDict):
    op: Literal["put"]
    rows: list[NewRow]


class ColumnsOp(TypedDict):
    op: Literal["columns"]
    uid: str
    columns: dict[str, Any]


class LeaseOp(TypedDict):
    op: Literal["lease"]
    id: int
    task: str
    holder: str
    deadline: float
    items: Items
    take_id: NotRequired[str]
    """The take that asked for it: its retry (the reply lost with a killed bus) gets this lease
    again instead of a second one."""
    turn: NotRequired[bool]
    """The lease holds its task's turn (``take(..., turn=True)``) until an ``end_turn``."""


class EndTurnOp(TypedDict):
    op: Literal["end_turn"]
    task: str
    lease: int


class AckOp(TypedDict):
    op: Literal["ack"]
    task: str
    items: Items


class ReleaseOp(TypedDict):
    op: Literal["release"]
    task: str
    items: Items


class ExpireOp(TypedDict):
    op: Literal["expire"]
    id: int
    """The lease whose holder went silent, or whose holder's successor took it back."""
    reason: NotRequired[Literal["expired", "reclaimed"]]
    """Absent (older logs) or "expired": the deadline passed; "reclaimed": a new incarnation
    under the holder's name ended it (``BusClient.reclaim``)."""


class DropOp(TypedDict):
    op: Literal["drop"]
    uids: list[str]
    groups: list[str]
    """Whole groups go: rows of them that arrive later are dropped too."""
    reason: str
    """``stale``, ``oversized`` or a consumer's reason (it names the ``dropped_*`` counter)."""


class AdmitOp(TypedDict):
    op: Literal["admit"]
    group: str
    rows: int
    version: int
    deadline: float


class UnadmitOp(TypedDict):
    op: Literal["unadmit"]
    group: str
    reason: NotRequired[Literal["expired", "duplicate"]]
    """Absent (older logs) or "expired": the deadline passed; "duplicate": the group's rows
    were put again when the bus had them already."""


class VersionOp(TypedDict):
    op: Literal["version"]
    version: int


class StalenessOp(TypedDict):
    """The staleness bound changed in a running cluster (``relax set staleness``)."""

    op: Literal["staleness"]
    staleness: StalenessWire


class CountOp(TypedDict):
    op: Literal["count"]
    name: str
    n: int


class CommitOp(TypedDict):
    """A weights commit: the version, the rows it was trained on and the stale drop it caused,
    as one log record (see ``BusTable.commit_weights``)."""

    op: Literal["commit"]
    version: int
    publish: str
    set_version: bool
    task: str | None
    items: Items
    ignored: int
    drop: DropOp | None


class StateOp(TypedDict):
    """A compaction snapshot of everything but the rows themselves."""

    op: Literal["state"]
    staleness: NotRequired[StalenessWire]
    """The bound in force (logs from before live changes have none: the configured one)."""
    version: int
    weights_version: int
    publishes: list[list[Any]]
    next_lease: int
    counters: dict[str, int]
    finished: NotRequired[list[str]]
    """Logs from before the journals only: the finished uids (``relax.bus._journal`` now)."""
    dropped_groups: NotRequired[list[str]]
    """Likewise: the dropped groups."""
    admissions: list[list[Any]]
    """``[group, rows, version, deadline]`` per open admission."""


Op = (
    PutOp
    | ColumnsOp
    | LeaseOp
    | AckOp
    | ReleaseOp
    | ExpireOp
    | DropOp
    | AdmitOp
    | UnadmitOp
    | VersionOp
    | CountOp
    | CommitOp
    | StateOp
    | StalenessOp
    | EndTurnOp
)
"""One change to the bus table, as applied and logged."""
