"""The bus table's state and how each op changes it: the one place an op is applied, live or
replayed from the bus log (``relax.bus._table`` decides which ops a call makes).

Rows, leases and admissions as dataclasses; ``TableState.OP_HANDLERS`` maps each op kind
(``relax.schema.OpKind``) to its handler. Nothing here decides anything or reads a clock: given
the same ops in the same order, two tables end in the same state.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from relax.errors import BusError
from relax.schema import (
    PROMPT_IDS,
    RESPONSE_IDS,
    TOKEN_VERSIONS,
    AckOp,
    AdmitOp,
    BusStatistics,
    ColumnsOp,
    CommitOp,
    CountOp,
    DropOp,
    EndTurnOp,
    ExpireOp,
    LeaseOp,
    Op,
    PutOp,
    ReleaseOp,
    Staleness,
    StalenessOp,
    StateOp,
    TaskCounts,
    UnadmitOp,
    VersionOp,
)
from relax.transport import RawTensor

Item = tuple[str, int]  # (uid, attempt): what a lease hands out and an ack must quote back


@dataclass(eq=False)
class Row:
    uid: str
    group: str
    group_size: int
    version: int
    columns: dict[str, Any]
    tokens: int = 0
    seq: int = 0
    """Log position of the row's put (rows still live keep their log segments alive)."""
    # Per task: ("pending", attempt) | ("leased", attempt, lease_id) | ("acked", attempt)
    progress: dict[str, tuple[Any, ...]] = field(default_factory=dict)


@dataclass(eq=False)
class Lease:
    id: int
    task: str
    holder: str
    deadline: float
    items: dict[str, int]  # uid -> attempt still outstanding


@dataclass(eq=False)
class Admission:
    group: str
    rows: int
    version: int
    deadline: float


def count_tokens(columns: dict[str, Any]) -> int:
    """Tokens a row costs against a take's token budget: its prompt and response ids."""
    total = 0
    for name in (PROMPT_IDS, RESPONSE_IDS):
        value = columns.get(name)
        if value is not None and hasattr(value, "__len__"):
            total += len(value)
    return total


def plain_value(value: Any) -> Any:
    """A value the table can compare or read (the bus keeps tensors in wire form)."""
    return value.to_torch().tolist() if isinstance(value, RawTensor) else value


class TableState:
    """All sample rows and the bookkeeping around them, changed only by applying ops."""

    def __init__(
        self,
        *,
        tasks: tuple[str, ...] = ("train",),
        trainer_task: str = "train",
        capacity: int = 1024,
        staleness: Staleness | int | float | str = 1,
        batch_size: int = 16,
        dedup_window: int = 1_000_000,
        end_version: int | None = None,
    ) -> None:
        if trainer_task not in tasks:
            raise ValueError(f"trainer task {trainer_task!r} must be one of the tasks {tasks}")
        self.tasks = tuple(tasks)
        self.trainer_task = trainer_task
        self.capacity = capacity
        self.staleness = Staleness.parse(staleness)
        self.batch_size = batch_size
        self.dedup_window = dedup_window
        # The version the trainer stops at ([trainer] steps): nothing is admitted that no step
        # would train. Without it an unbounded run ("inf") generated until the bus was full,
        # and threw all of it away at the end.
        self.end_version = end_version
        self.rows: OrderedDict[str, Row] = OrderedDict()
        self._trained_on_bus = 0  # rows the trainer acked that another task still holds
        self.groups: dict[str, list[str]] = {}
        self.leases: dict[int, Lease] = {}
        self.admissions: dict[str, Admission] = {}
        self.finished: OrderedDict[str, None] = OrderedDict()  # recently finished uids
        self.dropped_groups: OrderedDict[str, None] = OrderedDict()
        # With a log (``journaling``): the uids and groups remembered since the last
        # compaction, which the bus appends to its journals (``relax.bus._journal``).
        self.journaling = False
        self._unjournaled: tuple[list[str], list[str]] = ([], [])
        self.version = 0  # the trainer's policy version N
        self.weights_version = -1  # the newest weights version the log committed
        self.publishes: dict[int, str] = {}  # recent weights version -> its publish id
        self.next_lease = 1
        self.counters: Counter[str] = Counter()
        # Per task, the lease (id, holder) holding the task's turn (``take(turn=True)``).
        self.turns: dict[str, tuple[int, str]] = {}
        # A take's id -> the lease it was granted: the same take retried (its reply lost with
        # a killed bus) gets that lease again. Entries of ended leases are pruned in bulk.
        self.lease_of_take: dict[str, int] = {}

    # ------------------------------------------------------------------ derived state

    @property
    def trained(self) -> int:
        return self.counters["trained"]

    def min_version(self) -> float:
        """Oldest row version the trainer may still receive."""
        return self.staleness.oldest_version(self.version)

    def admitted_rows(self) -> int:
        return sum(a.rows for a in self.admissions.values())

    def queued_for_trainer(self) -> int:
        """Rows on the bus the trainer has not acked. A row it trained on may stay a while
        (until another task, the critic say, acks it too); it is counted in ``trained``
        already, and counting it again would pace producers on rows consumed twice."""
        return len(self.rows) - self._trained_on_bus

    def room(self) -> int:
        """Rows that can still be put or admitted before the bus is full."""
        return self.capacity - len(self.rows) - self.admitted_rows()

    def mark_seq(self, ops: list[Op], seq: int) -> None:
        """Remember the log position of the put records among ``ops`` (see ``oldest_live_seq``)."""
        for op in ops:
            if op["op"] == "put":
                for r in op["rows"]:
                    if r["uid"] in self.rows:
                        self.rows[r["uid"]].seq = seq

    # ------------------------------------------------------------------ applying ops

    def apply(self, op: Op, seq: int = 0) -> None:
        """Apply one logged op (replay after a restart); ``seq`` is its log position."""
        self._apply(op)
        if op["op"] == "commit" and op.get("drop"):
            self._apply(op["drop"])  # the stale drop decided inside the commit
        self.mark_seq([op], seq)

    def _apply(self, op: Op) -> None:
        handler = self.OP_HANDLERS.get(op["op"])
        if handler is None:
            raise BusError(f"unknown op {op['op']!r} in the bus log")
        handler(self, op)

    def _apply_put(self, op: PutOp) -> None:
        for r in op["rows"]:
            self._insert(r)

    def _apply_columns(self, op: ColumnsOp) -> None:
        row = self.rows.get(op["uid"])
        if row is not None:
            row.columns.update(op["columns"])
            row.tokens = count_tokens(row.columns)

    def _apply_lease(self, op: LeaseOp) -> None:
        items = {}
        for uid, attempt in op["items"]:
            row = self.rows.get(uid)
            if row is not None:
                row.progress[op["task"]] = ("leased", attempt, op["id"])
                items[uid] = attempt
        self.leases[op["id"]] = Lease(op["id"], op["task"], op["holder"], op["deadline"], items)
        self.next_lease = max(self.next_lease, op["id"] + 1)
        self.counters["leases"] += 1
        if op.get("turn"):
            self.turns[op["task"]] = (op["id"], op["holder"])
        if "take_id" in op:
            if len(self.lease_of_take) > 2 * len(self.leases) + 64:
                self.lease_of_take = {
                    t: lease for t, lease in self.lease_of_take.items() if lease in self.leases
                }
            self.lease_of_take[op["take_id"]] = op["id"]

    def _apply_end_turn(self, op: EndTurnOp) -> None:
        if self.turns.get(op["task"], (None,))[0] == op["lease"]:
            del self.turns[op["task"]]

    def _apply_ack(self, op: AckOp) -> None:
        for uid, attempt in op["items"]:
            self._ack_one(op["task"], uid, attempt)

    def _apply_release(self, op: ReleaseOp) -> None:
        for uid, attempt in op["items"]:
            row = self.rows.get(uid)
            if row is not None:
                self._settle_lease(op["task"], uid)
                row.progress[op["task"]] = ("pending", attempt)
        self.counters["released"] += len(op["items"])

    def _apply_expire(self, op: ExpireOp) -> None:
        lease = self.leases.pop(op["id"], None)
        if lease is None:
            return
        for uid, attempt in lease.items.items():
            row = self.rows.get(uid)
            if row is not None and row.progress[lease.task] == ("leased", attempt, lease.id):
                row.progress[lease.task] = ("pending", attempt)
        self.counters[f"{op.get('reason', 'expired')}_leases"] += 1

    def _apply_drop(self, op: DropOp) -> None:
        for uid in op["uids"]:
            self._remove(uid, finished=True)
        for group in op.get("groups", ()):
            self._drop_group(group)
            self.admissions.pop(group, None)
        self.counters[f"dropped_{op['reason']}"] += len(op["uids"])

    def _apply_admit(self, op: AdmitOp) -> None:
        self.admissions[op["group"]] = Admission(
            op["group"], op["rows"], op["version"], op["deadline"]
        )
        self.counters["admitted"] += op["rows"]

    def _apply_unadmit(self, op: UnadmitOp) -> None:
        if self.admissions.pop(op["group"], None) is not None:
            # Expired (its producer died), or settled by a put of rows the bus already had.
            reason = op.get("reason", "expired")
            self.counters[f"{reason}_admissions"] += 1

    def _apply_version(self, op: VersionOp) -> None:
        self.version = max(self.version, op["version"])

    def _apply_count(self, op: CountOp) -> None:
        self.counters[op["name"]] += op["n"]

    def _apply_commit(self, op: CommitOp) -> None:
        # See commit_weights; replay applies the op's "drop" after this.
        for uid, attempt in op["items"]:
            self._ack_one(op["task"], uid, attempt)
        if op["ignored"]:
            self.counters["ignored_acks"] += op["ignored"]
        self.weights_version = max(self.weights_version, op["version"])
        self.publishes[op["version"]] = op["publish"]
        for old in sorted(self.publishes)[:-16]:  # a retry only ever quotes a recent one
            del self.publishes[old]
        if op["set_version"]:
            self.version = max(self.version, op["version"])
        self.counters["weight_commits"] += 1

    def _apply_staleness(self, op: StalenessOp) -> None:
        self.staleness = Staleness.parse(op["staleness"])

    def _apply_state(self, op: StateOp) -> None:
        if "staleness" in op:  # changed while running: the compacted log keeps the change
            self.staleness = Staleness.parse(op["staleness"])
        self.version = max(self.version, op["version"])
        self.weights_version = max(self.weights_version, op.get("weights_version", -1))
        self.publishes.update({int(v): p for v, p in op.get("publishes", ())})
        self.next_lease = max(self.next_lease, op["next_lease"])
        self.counters = Counter(op["counters"])
        # A state record from before the journals carries the whole memory; journaled at the
        # next compaction, since the next state record will not.
        for uid in op.get("finished", ()):
            self._finish(uid)
            if uid in self.rows:
                self._remove(uid, finished=False)
        for group in op.get("dropped_groups", ()):
            self._drop_group(group)
        self.admissions = {g: Admission(g, n, v, d) for g, n, v, d in op["admissions"]}

    OP_HANDLERS: ClassVar[Mapping[str, Callable[[TableState, Any], None]]] = {
        "put": _apply_put,
        "columns": _apply_columns,
        "lease": _apply_lease,
        "ack": _apply_ack,
        "release": _apply_release,
        "expire": _apply_expire,
        "drop": _apply_drop,
        "admit": _apply_admit,
        "unadmit": _apply_unadmit,
        "version": _apply_version,
        "count": _apply_count,
        "commit": _apply_commit,
        "state": _apply_state,
        "staleness": _apply_staleness,
        "end_turn": _apply_end_turn,
    }
    """How each kind of op (``relax.schema.OpKind``) changes the table: the one place an op
    is applied, live or replayed from the log."""

    def _insert(self, r: dict[str, Any]) -> None:
        if r["uid"] in self.rows or r["uid"] in self.finished:
            return
        if r["group"] in self.dropped_groups:  # the rest of its group was dropped already
            self._finish(r["uid"])
            self.counters["dropped_with_group"] += 1
            return
        columns = dict(r.get("columns") or {})
        version = int(r["version"])
        per_token = plain_value(columns.get(TOKEN_VERSIONS))
        if per_token is not None and len(per_token):
            # A generation that spanned a weight update is as stale as its oldest token.
            version = min(version, int(min(per_token)))
        row = Row(
            uid=r["uid"],
            group=r["group"],
            group_size=int(r.get("group_size", 1)),
            version=version,
            columns=columns,
            tokens=count_tokens(columns),
            progress={t: ("pending", 0) for t in self.tasks},
        )
        self.rows[row.uid] = row
        self.groups.setdefault(row.group, []).append(row.uid)
        admission = self.admissions.get(row.group)
        if admission is not None:  # the admitted work is arriving
            admission.rows -= 1
            if admission.rows <= 0:
                del self.admissions[row.group]
        self.counters["put"] += 1

    def _ack_one(self, task: str, uid: str, attempt: int) -> None:
        row = self.rows.get(uid)
        if row is None or row.progress[task][0] == "acked":
            return
        self._settle_lease(task, uid)
        row.progress[task] = ("acked", attempt)
        self.counters[f"acked_{task}"] += 1
        if task == self.trainer_task:
            self.counters["trained"] += 1
            self._trained_on_bus += 1  # until _remove takes the row off the bus
        if all(state[0] == "acked" for state in row.progress.values()):
            self._remove(uid, finished=True)

    def _settle_lease(self, task: str, uid: str) -> None:
        state = self.rows[uid].progress[task]
        if state[0] == "leased":
            lease = self.leases.get(state[2])
            if lease is not None:
                lease.items.pop(uid, None)
                if not lease.items:
                    del self.leases[lease.id]

    def _remove(self, uid: str, *, finished: bool) -> None:
        row = self.rows.pop(uid, None)
        if row is None:
            return
        if row.progress[self.trainer_task][0] == "acked":
            self._trained_on_bus -= 1
        for task in self.tasks:
            if row.progress[task][0] == "leased":
                lease = self.leases.get(row.progress[task][2])
                if lease is not None:
                    lease.items.pop(uid, None)
                    if not lease.items:
                        del self.leases[lease.id]
        members = self.groups.get(row.group)
        if members is not None:
            members.remove(uid)
            if not members:
                del self.groups[row.group]
        if finished:
            self._finish(uid)

    def _finish(self, uid: str) -> None:
        if self._remember(self.finished, uid) and self.journaling:
            self._unjournaled[0].append(uid)

    def _drop_group(self, group: str) -> None:
        if self._remember(self.dropped_groups, group) and self.journaling:
            self._unjournaled[1].append(group)

    def _remember(self, seen: OrderedDict[str, None], key: str) -> bool:
        """Remember ``key`` (the newest), forgetting beyond the window; whether it is new."""
        new = key not in seen
        seen[key] = None
        while len(seen) > self.dedup_window:
            seen.popitem(last=False)
        return new

    def remember_journaled(self, finished: list[str], dropped: list[str]) -> None:
        """What the journals held at a restart, oldest first (before the log is replayed)."""
        for uid in finished:
            self._remember(self.finished, uid)
        for group in dropped:
            self._remember(self.dropped_groups, group)

    def take_unjournaled(self) -> tuple[list[str], list[str]]:
        """The uids and groups remembered since the last call (for the journals)."""
        taken, self._unjournaled = self._unjournaled, ([], [])
        return taken

    # ------------------------------------------------------------------ compaction

    def state_op(self) -> StateOp:
        """A snapshot of everything but the rows themselves (rows keep their put records) and
        the finished uids and dropped groups (the journals keep those)."""
        return {
            "op": "state",
            "staleness": self.staleness.wire,
            "version": self.version,
            "weights_version": self.weights_version,
            "publishes": [[v, p] for v, p in sorted(self.publishes.items())],
            "next_lease": self.next_lease,
            "counters": dict(self.counters),
            "admissions": [
                [a.group, a.rows, a.version, a.deadline] for a in self.admissions.values()
            ],
        }

    def oldest_live_seq(self) -> int | None:
        """Log position of the oldest row still in the table (segments before it may go)."""
        return min((r.seq for r in self.rows.values()), default=None)

    # ------------------------------------------------------------------ statistics

    def statistics(self) -> BusStatistics:
        by_task: dict[str, TaskCounts] = {}
        for task in self.tasks:
            states = Counter(row.progress[task][0] for row in self.rows.values())
            by_task[task] = {
                "pending": states["pending"],
                "leased": states["leased"],
                "acked": states["acked"],
                "lag": states["pending"] + states["leased"],
            }
        versions = Counter(row.version for row in self.rows.values())
        return {
            "rows": len(self.rows),
            "capacity": self.capacity,
            "groups": len(self.groups),
            "leases": len(self.leases),
            "admitted_rows": self.admitted_rows(),
            "trainer_version": self.version,
            "staleness": self.staleness.wire,
            "tasks": by_task,
            "versions_in_flight": {str(v): n for v, n in sorted(versions.items())},
            "counters": dict(self.counters),
        }
