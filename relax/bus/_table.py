"""The TransferQueue's state: a table of sample rows, leases, acks and staleness admission.

Pure, synchronous and deterministic: every change is an *op* (a small dict, one
``relax.schema`` ``TypedDict`` per kind) applied by ``apply`` through ``OP_HANDLERS``, the one
table from op kind to handler (``relax.bus._table_state``: the state and how ops change it;
this module: the decisions). Live calls decide (which rows a take leases, which rows are too
stale) and return the ops they applied; the bus service appends those ops to its log *before*
it answers, and a restarted bus rebuilds this table by applying the logged ops again. Time comes in as an
argument, never from a clock in here, so tests and replay are exact.

Rows, per the design's "Samples" contract: ``uid`` (unique, stable across retries), ``group``
(prompt id; ``group_size`` rows make a group), ``version`` (policy version that generated it —
the oldest one when a generation spans a weight update) and named columns written once each.

Per consumer task (e.g. ``reward`` and ``train`` take the same rows independently) a row is
``pending`` → ``leased`` (with an attempt number) → ``acked``. A row every task has acked is
finished: it leaves the table and its uid is remembered, so a retried put of it is ignored and
nothing is trained on twice.

Staleness (``s``): the trainer task at version ``N`` only receives rows with
``version ≥ N - s``; older rows are dropped and counted. Producers ask ``admit`` before they
generate; admission paces them so rows arrive no staler than ``s`` when consumed (AReaL's rule):
a producer holding weights ``v`` may have rows in play only while
``trained + queued + admitted + n ≤ (v + s + 1) · batch_size``, and, when the run's last
version ``end_version`` is known, ``≤ (end_version + skipped steps) · batch_size``.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from relax.bus._columns import check_columns, check_rows
from relax.bus._table_state import Item, Lease, Row, TableState, plain_value
from relax.errors import BadRow, BusError, ColumnConflict, UnknownTask  # re-exported here
from relax.schema import BusStatistics, Op, Staleness
from relax.transport import RawTensor


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, RawTensor) or isinstance(b, RawTensor):
        return plain_value(a) == plain_value(b)
    if hasattr(a, "shape") and hasattr(b, "shape"):
        import torch

        return bool(a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))
    return bool(a == b)


def _fill(
    units: list[list[Row]], batch_size: int, min_rows: int, token_budget: int | None
) -> list[Row]:
    """The rows of the oldest units (in ``units``' order) that fit ``batch_size`` rows and
    ``token_budget`` tokens, skipping a unit that does not fit to look at the ones behind it.

    Greedy first. When that falls short of ``min_rows`` (whole groups of mixed sizes: a group
    of 1 ahead of groups of 2 leaves a batch of 4 one row short forever), the earliest
    selection whose size lands in ``[min_rows, batch_size]``: a unit is taken when the units
    behind it can still complete the batch, found with reachable-sum bitsets (Python ints, one
    bit per row count), so the cost is one shift per unit.
    """
    chosen: list[Row] = []
    tokens = 0
    for unit in units:
        if len(chosen) + len(unit) > batch_size:
            continue
        unit_tokens = sum(r.tokens for r in unit)
        if token_budget is not None and tokens + unit_tokens > token_budget:
            continue
        chosen.extend(unit)
        tokens += unit_tokens
        if len(chosen) == batch_size:
            return chosen
    if len(chosen) >= min_rows or sum(len(unit) for unit in units) < min_rows:
        return chosen  # enough, or not enough rows at all: no search can help
    mask = (1 << (batch_size + 1)) - 1
    reach = [1] * (len(units) + 1)  # reach[i]: bit s set if units[i:] can add exactly s rows
    for i in range(len(units) - 1, -1, -1):
        reach[i] = (reach[i + 1] | (reach[i + 1] << len(units[i]))) & mask
    wanted = mask & ~((1 << min_rows) - 1)  # row counts in [min_rows, batch_size]
    if not reach[0] & wanted:
        return chosen  # no selection reaches min_rows: the caller waits
    picked: list[Row] = []
    tokens = 0
    for i, unit in enumerate(units):
        n = len(picked) + len(unit)
        unit_tokens = sum(r.tokens for r in unit)
        if token_budget is not None and tokens + unit_tokens > token_budget:
            continue
        if n <= batch_size and (reach[i + 1] << n) & wanted:
            picked.extend(unit)
            tokens += unit_tokens
            if len(picked) == batch_size:
                break
    return picked


class BusTable(TableState):
    """Decides what each call does, as the ops it applies. See the module docstring."""

    # ------------------------------------------------------------------ decisions

    def put(
        self,
        rows: list[dict[str, Any]],
        *,
        checked: bool = False,
        failed_groups: list[str] | tuple[str, ...] = (),
    ) -> list[Op] | None:
        """Ops that add ``rows`` (all or nothing); ``None`` when the bus is full (wait).

        The whole put is checked before any of it is applied (``BadRow``/``BadColumn`` name
        the first bad row and field; see ``relax.bus._columns``), so a refused put leaves
        nothing behind. Rows already present or already finished are skipped: a retried put
        is harmless. ``checked``: the caller ran ``check_rows`` on these rows already (a put
        waiting for room is retried, and need not be checked again each time).

        ``failed_groups``: groups of ``rows`` whose reward failed where they were scored; they
        go on the bus and are dropped whole at once (``"reward_failed"``), as the reward role
        drops them: the same counters, their admissions settled, later rows of theirs dropped.
        """
        if not checked:
            check_rows(rows)
        if not (
            isinstance(failed_groups, list | tuple)
            and set(failed_groups) <= {r["group"] for r in rows}
        ):
            raise BusError(
                f"failed_groups must be groups of the rows put, got {failed_groups!r:.80}"
            )
        fresh: dict[str, dict[str, Any]] = {}
        for r in rows:
            if r["uid"] not in self.rows and r["uid"] not in self.finished:
                fresh.setdefault(r["uid"], r)
        self._check_groups(fresh)
        if len(fresh) > self.capacity:
            raise BusError(
                f"a put of {len(fresh)} rows can never fit a bus of capacity {self.capacity}"
            )
        arriving = Counter(r["group"] for r in fresh.values())
        covered = sum(
            min(n, self.admissions[g].rows) for g, n in arriving.items() if g in self.admissions
        )
        if fresh and len(self.rows) + self.admitted_rows() - covered + len(fresh) > self.capacity:
            return None
        ops: list[Op] = []
        if len(fresh) < len(rows):
            ops.append({"op": "count", "name": "duplicate_puts", "n": len(rows) - len(fresh)})
            # A retried prompt whose group was put (and maybe trained) already: the producer
            # was admitted again, but nothing new arrives to settle that admission. Left
            # standing it holds room until it expires, and at the run's end, where admission
            # is capped, the last batch until then (the rollout killed before its prompt ack).
            settled = {r["group"] for r in rows if r["uid"] not in fresh} - set(arriving)
            ops += [
                {"op": "unadmit", "group": g, "reason": "duplicate"}
                for g in sorted(settled)
                if g in self.admissions
            ]
        if fresh:
            ops.append({"op": "put", "rows": list(fresh.values())})
        self._apply_all(ops)
        if failed_groups:  # after the put: the drop takes the rows it just added
            groups = sorted(set(failed_groups))
            uids = [u for g in groups for u in self.groups.get(g, ())]
            ops += self._apply_all(
                [{"op": "drop", "uids": uids, "groups": groups, "reason": "reward_failed"}]
            )
        return ops

    def _check_groups(self, fresh: dict[str, dict[str, Any]]) -> None:
        """Refuse rows that would make a group no whole-group take can ever complete: larger
        than a training batch, sizes that disagree, more rows than its size."""
        sizes: dict[str, int] = {}
        counts: Counter[str] = Counter()
        for uid, r in fresh.items():
            group, size = r["group"], r.get("group_size", 1)
            if size > self.batch_size:
                raise BadRow(
                    uid,
                    "group_size",
                    f"is {size}: a group of {size} rows can never fit a training batch of "
                    f"{self.batch_size} rows (the trainer takes whole groups)",
                )
            live = self.groups.get(group)
            known = sizes.get(group)
            if known is None and live:
                known = self.rows[live[0]].group_size
            if known is not None and known != size:
                raise BadRow(
                    uid, "group_size", f"is {size} but group {group!r} has group_size {known}"
                )
            sizes[group] = size
            counts[group] += 1
            if counts[group] + len(live or ()) > size:
                raise BadRow(
                    uid, "group", f"{group!r} would hold more rows than its group_size {size}"
                )

    def add_columns(self, uid: str, columns: dict[str, Any]) -> list[Op]:
        """Ops that write ``columns`` of row ``uid`` (each column once; ``BadColumn`` for a
        value that breaks the schema, nothing written)."""
        if not isinstance(uid, str):
            raise BadRow(repr(uid)[:60], "uid", "must be a string")
        row = self.rows.get(uid)
        check_columns(uid, columns, row.columns if row is not None else None)
        if row is None:
            if uid in self.finished:
                return []  # a late write to a finished row: nothing left to do
            raise BusError(f"no row {uid!r} on the bus")
        new = {}
        for name, value in columns.items():
            if name in row.columns:
                if not _same(row.columns[name], value):
                    raise ColumnConflict(f"row {uid!r}: column {name!r} was already written")
            else:
                new[name] = value
        return self._apply_all([{"op": "columns", "uid": uid, "columns": new}] if new else [])

    def take(
        self,
        task: str,
        *,
        columns: tuple[str, ...] | list[str] = (),
        batch_size: int,
        min_rows: int = 1,
        whole_groups: bool = False,
        token_budget: int | None = None,
        max_row_tokens: int | None = None,
        holder: str = "",
        lease_timeout: float = 60.0,
        now: float = 0.0,
        trainer_version: int | None = None,
        turn: bool = False,
        take_id: str | None = None,
    ) -> tuple[list[Op], Lease | None]:
        """Lease up to ``batch_size`` ready rows to ``task``; ``None`` if fewer than ``min_rows``.

        Drops (and counts) rows the trainer can no longer use: too stale, or a unit larger
        than the whole token budget or holding a row above ``max_row_tokens`` (dropped as
        "oversized"). Drops happen even when no lease is granted. ``trainer_version``: the
        trainer is already at this version (its publish still on the way, overlapped with
        this take): staleness counts from it, not from the last committed one.

        ``turn``: takes that ask for the turn get it one at a time. The lease granted holds
        the task's turn until its holder ends it (``end_turn``), the lease ends (its rows
        acked, released or expired), or the same holder takes again (restarted, say); until
        then another holder's turn-take gets nothing (it waits). Producers that lease work and
        then ask for admission take turns so that admission follows the queue's order: one
        producer held up between the two cannot see the next one's later rows admitted first.
        Turns are logged (with the lease, and ``end_turn``): a restarted bus keeps them.

        ``take_id``: the caller's id for this take. A take whose lease is logged but whose
        reply was lost (the bus killed in between) comes again with the same id, and gets
        the same lease back while it lasts: its rows are not leased to no one until the
        lease runs out, and the queue's order is kept.
        """
        if task not in self.tasks:
            raise UnknownTask(f"unknown consumer task {task!r}; the bus serves {list(self.tasks)}")
        if take_id is not None:
            granted = self.leases.get(self.lease_of_take.get(take_id, -1))
            if granted is not None and granted.task == task:
                return [], granted
        if turn and not self._turn_free(task, holder):
            return [], None
        ops: list[Op] = []
        trainer = task == self.trainer_task
        floor = (
            self.staleness.oldest_version(self.trainer_at(trainer_version))
            if trainer
            else -math.inf
        )
        units = list(self._units(task, columns, whole_groups))
        if trainer:  # oldest versions first: they are the ones about to go stale
            units.sort(key=lambda unit: min(r.version for r in unit))
        usable: list[list[Row]] = []
        for unit in units:
            if trainer and min(r.version for r in unit) < floor:
                ops.append(self._drop_op(unit, "stale"))
                continue
            too_long = max_row_tokens is not None and max(r.tokens for r in unit) > max_row_tokens
            if too_long or (
                token_budget is not None and sum(r.tokens for r in unit) > token_budget
            ):
                ops.append(self._drop_op(unit, "oversized"))
                continue
            usable.append(unit)
        chosen = _fill(usable, batch_size, max(1, min_rows), token_budget)
        self._apply_all(ops)
        if len(chosen) < max(1, min_rows):
            return ops, None
        lease_op = {
            "op": "lease",
            "id": self.next_lease,
            "task": task,
            "holder": holder,
            "deadline": now + lease_timeout,
            "items": [[r.uid, r.progress[task][1] + 1] for r in chosen],
        }
        if take_id is not None:
            lease_op["take_id"] = take_id
        if turn:
            lease_op["turn"] = True
        self._apply(lease_op)
        ops.append(lease_op)
        return ops, self.leases[lease_op["id"]]

    def statistics(self) -> BusStatistics:
        stats = super().statistics()
        # Who holds each task's turn: a producer waiting for its lease shows whom it waits on.
        stats["turns"] = {t: h for t, (lease, h) in self.turns.items() if lease in self.leases}
        return stats

    def _turn_free(self, task: str, holder: str) -> bool:
        held = self.turns.get(task)
        return held is None or held[1] == holder or held[0] not in self.leases

    def end_turn(self, task: str, lease: int) -> list[Op]:
        """Lease ``lease`` gives up ``task``'s turn (see ``take``): the op, or none if it did
        not hold it (ended already, or taken over by its holder's next take)."""
        held = self.turns.get(task)
        if held is None or held[0] != lease:
            return []
        return self._apply_all([{"op": "end_turn", "task": task, "lease": lease}])

    def trainer_at(self, hint: int | None) -> int:
        """The trainer's version for a take: the committed one, or the trainer's own when it
        is ahead (a publish overlapped with the next take)."""
        return self.version if hint is None else max(self.version, int(hint))

    def _units(self, task: str, columns: Any, whole_groups: bool) -> Any:
        """Rows (or whole groups) that ``task`` may take now, in arrival order."""
        done: set[str] = set()
        for row in list(self.rows.values()):
            if row.uid in done:
                continue
            if not whole_groups:
                if self._ready(row, task, columns):
                    yield [row]
                continue
            members = [self.rows[u] for u in self.groups.get(row.group, ()) if u in self.rows]
            done.update(r.uid for r in members)
            if len(members) == row.group_size and all(
                self._ready(r, task, columns) for r in members
            ):
                yield members

    @staticmethod
    def _ready(row: Row, task: str, columns: Any) -> bool:
        return row.progress[task][0] == "pending" and all(c in row.columns for c in columns)

    def ack(
        self, task: str, items: list[Item], *, skipped_step: bool = False
    ) -> tuple[list[Op], int]:
        """Ops that record ``task``'s acks; returns how many rows this acked for the first time.

        An ack quoting an old attempt (its lease expired and the row went to someone else) is
        ignored; acking a row twice counts once. ``skipped_step``: the trainer consumed these
        rows in a step it skipped (non-finite loss, …), so one batch went by without a new
        version — pacing must count it, or producers would wait for a version that never comes.
        """
        if task not in self.tasks:
            raise UnknownTask(f"unknown consumer task {task!r}")
        valid = []
        for uid, attempt in items:
            row = self.rows.get(uid)
            if row is None:
                continue
            state = row.progress[task]
            if state[0] != "acked" and state[1] == attempt:
                valid.append([uid, attempt])
        stale = len(items) - len(valid)
        ops: list[Op] = [{"op": "ack", "task": task, "items": valid}] if valid else []
        if stale:
            ops.append({"op": "count", "name": "ignored_acks", "n": stale})
        if skipped_step and valid and task == self.trainer_task:
            ops.append({"op": "count", "name": "skipped_steps", "n": 1})
        return self._apply_all(ops), len(valid)

    def release(self, task: str, items: list[Item], *, drop: str | None = None) -> list[Op]:
        """Give leased rows back (to be taken again), or drop them for good with a reason
        (their whole groups go: a group baseline needs every member)."""
        if task not in self.tasks:
            raise UnknownTask(f"unknown consumer task {task!r}")
        mine = []
        for uid, attempt in items:
            row = self.rows.get(uid)
            if row is not None and row.progress[task][:2] == ("leased", attempt):
                mine.append([uid, attempt])
        if not mine:
            return []
        if drop:
            return self._apply_all([self._drop_op([self.rows[u] for u, _ in mine], drop)])
        return self._apply_all([{"op": "release", "task": task, "items": mine}])

    def admit(
        self, group: str, rows: int, version: int, *, now: float, timeout: float
    ) -> tuple[list[Op], str]:
        """May a producer holding weights ``version`` start generating ``rows`` for ``group``?

        Returns ``(ops, verdict)`` with verdict ``"ok"``, ``"full"`` (wait for room),
        ``"ahead"`` (wait for the trainer: generating now would go stale, or past the run's
        end) or ``"behind"``
        (the producer's weights are too old: sync weights first).
        """
        if group in self.admissions or group in self.groups:
            return [], "ok"  # a retried admission
        if self.staleness.too_stale(version, self.version):
            return [], "behind"
        if self.room() < rows:
            return [], "full"
        in_play = self.trained + self.queued_for_trainer() + self.admitted_rows()
        skipped = self.counters["skipped_steps"]
        # Every batch the run will still consume (a skipped step consumes one too) is spoken
        # for: generating more would only be thrown away at the end.
        end = self.end_version
        if end is not None and in_play + rows > (end + skipped) * self.batch_size:
            return [], "ahead"
        if self.staleness.bounded:
            # Batches consumed so far = versions + skipped steps; a row admitted now will be
            # consumed within `staleness` of them.
            allowed = self.staleness.rows_in_play
            if in_play + rows > allowed(version + skipped, self.batch_size):
                if in_play + rows <= allowed(self.version + skipped, self.batch_size):
                    # Newer weights than the producer's would be admitted now: have it sync,
                    # rather than wait for a trainer that has already moved on.
                    return [], "behind"
                return [], "ahead"
        op = {
            "op": "admit",
            "group": group,
            "rows": rows,
            "version": version,
            "deadline": now + timeout,
        }
        return self._apply_all([op]), "ok"

    def set_staleness(self, staleness: Any) -> list[Op]:
        """Change the staleness bound of a running cluster: from the next admission on, and
        rows already queued for the trainer that the new bound makes too stale are dropped
        (``"stale"``: the dataset's accounting sees them, the trainer never trains them)."""
        bound = Staleness.parse(staleness)
        if bound == self.staleness:
            return []
        ops: list[Op] = [{"op": "staleness", "staleness": bound.wire}]
        self._apply(ops[0])
        return ops + self._drop_stale()

    def set_version(self, version: int) -> list[Op]:
        """The trainer moved to ``version``; rows that can never be trained are dropped."""
        if version <= self.version:
            return []
        ops: list[Op] = [{"op": "version", "version": version}]
        self._apply(ops[0])
        return ops + self._drop_stale()

    def _stale_rows(self) -> list[Row]:
        """The rows waiting for the trainer below the oldest version it may still take."""
        floor = self.min_version()
        return [
            r
            for r in self.rows.values()
            if r.version < floor and r.progress[self.trainer_task][0] == "pending"
        ]

    def _drop_stale(self) -> list[Op]:
        """Drop the rows ``_stale_rows`` finds (one drop op), if any."""
        stale = self._stale_rows()
        if not stale:
            return []
        op = self._drop_op(stale, "stale")
        self._apply(op)
        return [op]

    def commit_weights(
        self,
        version: int,
        publish: str,
        *,
        task: str | None = None,
        items: list[Item] | None = None,
        set_trainer_version: bool = True,
    ) -> list[Op]:
        """One step's commit as ONE op (one log record): weights ``version`` (upload
        ``publish``) becomes visible, the rows it was trained on are acked, and the trainer
        version moves (dropping rows that became too stale). A bus killed at any moment
        replays either all of it or none of it, so it can neither expose weights whose rows
        go back to the queue nor ack rows whose update is lost."""
        if version <= self.weights_version:
            raise BusError(
                f"weight version {version} is not newer than the committed {self.weights_version}"
            )
        items = items or []
        valid: list[list[Any]] = []
        if items:
            if task not in self.tasks:
                raise UnknownTask(f"unknown consumer task {task!r}")
            for uid, attempt in items:
                row = self.rows.get(uid)
                state = row.progress[task] if row is not None else ("gone", None)
                if state[0] != "acked" and state[1] == attempt:
                    valid.append([uid, attempt])
        op: Op = {
            "op": "commit",
            "version": version,
            "publish": publish,
            "set_version": set_trainer_version,
            "task": task,
            "items": valid,
            "ignored": len(items) - len(valid),
            "drop": None,
        }
        self._apply(op)
        stale = self._stale_rows()
        if stale and set_trainer_version:
            op["drop"] = self._drop_op(stale, "stale")
            self._apply(op["drop"])  # logged inside the commit: replayed in the same order
        return [op]

    def expire(self, now: float) -> list[Op]:
        """Ops that return expired leases' rows to the queue and cancel expired admissions."""
        ops: list[Op] = []
        for lease in list(self.leases.values()):
            if lease.deadline <= now:
                ops.append({"op": "expire", "id": lease.id})
        for adm in list(self.admissions.values()):
            if adm.deadline <= now:
                ops.append({"op": "unadmit", "group": adm.group})
        return self._apply_all(ops)

    def reclaim(self, holder: str) -> list[Op]:
        """End every lease ``holder`` holds, its rows back in the queue at once.

        For a new incarnation under a dead one's name (a restarted role, same client name):
        what its predecessor held would otherwise sit out the lease timeout (60 s by default:
        at staleness 0 the whole run waits for those rows). The rows keep their attempt
        numbers, so the next lease is a new attempt, exactly as after an expiry; a turn the
        lease held is free again."""
        if not holder:
            raise ValueError("reclaim needs the holder's name")
        return self._apply_all(
            [
                {"op": "expire", "id": lease.id, "reason": "reclaimed"}
                for lease in list(self.leases.values())
                if lease.holder == holder
            ]
        )

    def extend_leases(self, now: float, grace: float) -> None:
        """After a restart, give every recovered lease a fresh deadline (clocks moved on)."""
        for lease in self.leases.values():
            lease.deadline = max(lease.deadline, now + grace)
        for adm in self.admissions.values():
            adm.deadline = max(adm.deadline, now + grace)

    def _drop_op(self, rows: list[Row], reason: str) -> Op:
        # Whole groups go together, and rows of the group that arrive later are dropped too.
        groups = sorted({r.group for r in rows})
        uids = [u for g in groups for u in self.groups.get(g, ())]
        return {"op": "drop", "uids": uids, "groups": groups, "reason": reason}

    def _apply_all(self, ops: list[Op]) -> list[Op]:
        for op in ops:
            self._apply(op)
        return ops
