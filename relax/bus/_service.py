"""The bus service: the TransferQueue as a supervised actor serving clients over RPC.

It owns a ``BusTable`` (the rows and their bookkeeping), a ``SegmentLog`` (every change,
appended before the caller hears back, so a SIGKILLed bus restarted by its supervisor comes
back with every row, lease, ack and version), the latest published weights, and an RPC server
(``inproc://``, ``ipc://`` or ``tcp://``) that any process can reach with a ``BusClient``.

Waiting happens here, not in clients: a ``take`` with nothing ready, a ``put`` into a full bus
and an ``admit`` that would run ahead of the trainer all wait (up to the caller's ``wait``) for
the table to change. That is the bus's backpressure.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax.actors import Actor
from relax.bus._columns import check_rows
from relax.bus._journal import KeyJournal
from relax.bus._log import SegmentLog
from relax.bus._table import BusTable
from relax.bus._weights import WeightStore
from relax.errors import BadRow, BusError, error_to_dict
from relax.schema import (
    AdmitManyReply,
    BusStatistics,
    Op,
    Staleness,
    StalenessWire,
    TakenRow,
    TakeReply,
)
from relax.transport import Limits, Peer, dumps, dumps_parts, loads, serve

# Log writes below this size happen inline; larger ones on the writer thread.
_INLINE_WRITE_BYTES = 64 << 10


class BusService(Actor):
    """The TransferQueue. Clients talk to it through ``relax.bus.BusClient``."""

    max_concurrency = 256  # long-polling takes must never block puts and acks

    def __init__(
        self,
        *,
        url: str,
        run_dir: str | None = None,
        tasks: list[str] | tuple[str, ...] = ("train",),
        trainer_task: str = "train",
        capacity: int = 1024,
        staleness: Staleness | StalenessWire | float = 1,
        batch_size: int = 16,
        lease_timeout: float = 60.0,
        admission_timeout: float = 120.0,
        persist: bool = True,
        segment_bytes: int = 64 << 20,
        fsync: str = "checkpoint",
        secret: str | None = None,
        frame_bytes: int = 4 << 20,
        max_message_bytes: int = 256 << 20,
        keep_weight_versions: int = 2,
        compact_every: int = 4096,
        dedup_window: int = 1_000_000,
        end_version: int | None = None,
    ) -> None:
        self.url = url
        self.run_dir = run_dir
        self._granted: Counter[str] = Counter()  # leases per task since start (a test hook)
        self.table = BusTable(
            tasks=tuple(tasks),
            trainer_task=trainer_task,
            capacity=capacity,
            staleness=Staleness.parse(staleness),
            batch_size=batch_size,
            dedup_window=dedup_window,  # finished uids remembered (a retried put is ignored)
            end_version=end_version,  # [trainer] steps: no row admitted past the run's end
        )
        self.lease_timeout = lease_timeout
        self.admission_timeout = admission_timeout
        self.persist = persist and run_dir is not None
        self.segment_bytes, self.fsync = segment_bytes, fsync
        self.secret = secret
        self.limits = Limits(frame_bytes=frame_bytes, max_message_bytes=max_message_bytes)
        self.weights = WeightStore(
            Path(run_dir, "weights") if self.persist and run_dir else None,
            keep=keep_weight_versions,
        )
        self.log_file: SegmentLog | None = None
        self.server: Any = None
        self.changed = asyncio.Condition()
        self.writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="relax-bus-log")
        self.writes_pending = 0
        self.next_seq = 0  # the log position the next record will get
        self.compact_every = compact_every  # records between compactions: keeps the log short
        self.since_compact = self.bytes_since_compact = 0
        self.journals: tuple[KeyJournal, ...] = ()  # finished uids, dropped groups
        self.stats = {"requests": 0, "recovered_records": 0}  # bytes moved: see "transport"
        # The weight plane's receivers, by the last time each polled (not logged: they poll
        # again within their lease after a bus restart).
        self.weight_members: dict[str, float] = {}
        # Reclaims so far per client name: a take or admission still waiting here for a client
        # that has since been succeeded (a reclaim under its name) is answered with nothing,
        # or it would lease rows (or room) to the dead (a warm spare takes over within a wait).
        self.reclaims: Counter[str] = Counter()
        # Each receiver's client name (its last poll's): a new incarnation under that name
        # (``reclaim``) means this receiver is dead.
        self.weight_clients: dict[str, str] = {}
        # Receivers that left (a drained rollout): a poll of theirs still in flight must not
        # make them members again. Member ids are per incarnation, so this only grows by one
        # per stopped rollout.
        self.weight_left: set[str] = set()
        self._pruning: asyncio.Future[None] | None = None  # old weight files being deleted
        # Receivers that read committed versions from this bus's folder (same machine, or a
        # shared file system): the group carries bytes only to the others.
        self.weight_local: set[str] = set()
        # member -> where it receives: {"gpu": its engine's GPU or None, "proc": its process}
        self.weight_places: dict[str, dict[str, str | None]] = {}

    # ------------------------------------------------------------------ lifecycle

    async def on_start(self) -> None:
        if self.persist:
            assert self.run_dir is not None
            directory = Path(self.run_dir, "bus-log")
            self.log_file = SegmentLog(
                directory, segment_bytes=self.segment_bytes, fsync=self.fsync
            )  # type: ignore[arg-type]
            # What finished before the last compaction first, then the log since it.
            window = self.table.dedup_window
            self.journals = tuple(
                KeyJournal(Path(self.run_dir, name), window=window, fsync=self.fsync)  # type: ignore[arg-type]
                for name in ("bus-finished", "bus-dropped")
            )
            self.table.remember_journaled(*(journal.load() for journal in self.journals))
            self.table.journaling = True
            for seq, record in self.log_file.replay():
                self.table.apply(loads(record), seq)
                self.stats["recovered_records"] += 1
            self.next_seq = self.log_file.statistics()["next_seq"]
            self.table.extend_leases(time.time(), self.lease_timeout)
            # Only weights the log committed are served; see WeightStore.recover. (A log with
            # no commit record may be from before they existed: its final files stand.)
            known = self.table.weights_version
            self.weights.recover(known, trust_final=known < 0)
            if self.stats["recovered_records"]:
                self.log.info(
                    "bus recovered",
                    records=self.stats["recovered_records"],
                    rows=len(self.table.rows),
                )
        # Tensors stay in wire form here: stored, logged and sent on without a decode copy.
        self.server = await serve(
            self.url, self.handle, secret=self.secret, limits=self.limits, raw_tensors=True
        )
        self.log.info("bus serving", url=self.server.url)

    async def run(self) -> None:
        """Expire leases and admissions whose holders went silent; compact the log."""
        while True:
            await asyncio.sleep(min(1.0, self.lease_timeout / 4))
            ops = self.table.expire(time.time())
            if ops:
                await self._commit(ops)

    async def on_stop(self) -> None:
        await self._close()

    async def on_failure(self, exc: BaseException) -> None:
        await self._close()

    async def _close(self) -> None:
        if self.server is not None:
            await self.server.aclose()
            self.server = None
        if self._pruning is not None:
            await asyncio.wait({self._pruning})
        self.writer.shutdown(wait=True)  # every accepted write lands before the log closes
        if self.log_file is not None:
            self.log_file.close()  # syncs: a clean shutdown is durable even with fsync="checkpoint"
            self.log_file = None
        for journal in self.journals:
            journal.close()
        self.journals = ()

    # ------------------------------------------------------------------ handlers (actor calls)

    def address(self) -> str:
        """The URL clients connect to (a tcp port 0 resolved to the real port)."""
        return self.server.url if self.server is not None else self.url

    async def checkpoint(self) -> None:
        """A checkpoint boundary: make the log durable on disk (fsync)."""
        if self.log_file is not None:
            await asyncio.get_running_loop().run_in_executor(self.writer, self._sync)

    def _sync(self) -> None:
        assert self.log_file is not None
        self.log_file.sync()
        for journal in self.journals:
            journal.sync()

    def statistics(self) -> BusStatistics:
        stats = self.table.statistics()
        stats["service"] = dict(self.stats)
        stats["weights"] = self.weights.statistics()
        # Who receives versions over the plane (polled within the last lease; left ones gone).
        stats["weights"]["members"] = sorted(self.weight_members)
        stats["weights"]["local_members"] = sorted(self.weight_local & set(self.weight_members))
        if self.log_file is not None:
            stats["log"] = self.log_file.statistics()
        if self.server is not None:
            stats["transport"] = self.server.statistics()
        return stats

    # ------------------------------------------------------------------ requests from clients

    async def handle(self, request: Any, peer: Peer) -> Any:
        if not isinstance(request, dict) or not isinstance(request.get("op"), str):
            raise BusError("a bus request is a dict with an 'op'")
        op = request["op"]
        handler = getattr(self, f"_op_{op}", None)
        if handler is None:
            raise BusError(f"unknown bus operation {op!r}")
        self.stats["requests"] += 1
        return await handler(request, peer)

    async def _op_put(self, req: dict[str, Any], peer: Peer) -> int:
        rows = req.get("rows")
        # The whole put is checked once, before any of it is applied or waits for room: a
        # refused put leaves nothing in the table, so the table and the log always agree.
        check_rows(rows)
        failed = req.get("failed_groups") or []
        ops = await self._wait_for(
            lambda: self.table.put(rows, checked=True, failed_groups=failed), req.get("wait")
        )
        if ops is None:
            raise BusError("the bus stayed full for the whole wait")  # the client retries
        await self._commit(ops)
        return sum(len(op["rows"]) for op in ops if op["op"] == "put")

    async def _op_columns(self, req: dict[str, Any], peer: Peer) -> None:
        await self._commit(self.table.add_columns(req["uid"], req["columns"]))

    async def _op_columns_many(
        self, req: dict[str, Any], peer: Peer
    ) -> list[dict[str, Any] | None]:
        """Many rows' columns in one request and one log record; per row, None or the error
        (a missing row, a conflicting write) as ``error_to_dict`` data, which the client
        rebuilds — the rows that worked are kept either way."""
        items = req.get("items")
        if not isinstance(items, list):
            raise BusError(
                f"columns_many carries a list of [uid, columns] items, got {items!r:.60}"
            )
        ops: list[Op] = []
        errors: list[dict[str, Any] | None] = []
        for index, item in enumerate(items):
            try:
                if not (isinstance(item, list) and len(item) == 2):
                    raise BadRow(f"#{index}", "item", "is not a [uid, columns] pair")
                ops += self.table.add_columns(item[0], item[1])
                errors.append(None)
            except BusError as exc:
                errors.append(error_to_dict(exc, with_traceback=False))
        await self._commit(ops)
        return errors

    async def _op_take(self, req: dict[str, Any], peer: Peer) -> TakeReply | None:
        columns = tuple(req.get("columns") or ())
        optional = tuple(req.get("optional") or ())
        dropped: list[Op] = []
        succeeded = self._succession(peer)

        def attempt() -> Any:
            if succeeded():
                return _SUCCEEDED  # lease nothing to the dead
            ops, lease = self.table.take(
                req["task"],
                columns=columns,
                batch_size=int(req["batch_size"]),
                min_rows=int(req.get("min_rows", 1)),
                whole_groups=bool(req.get("whole_groups", False)),
                token_budget=req.get("token_budget"),
                max_row_tokens=req.get("max_row_tokens"),
                holder=peer.id,
                lease_timeout=float(req.get("lease_timeout") or self.lease_timeout),
                now=time.time(),
                trainer_version=req.get("trainer_version"),
                turn=bool(req.get("turn")),
                take_id=req.get("take_id"),
            )
            if lease is None:
                dropped.extend(ops)
                return None
            return ops, lease

        found = await self._wait_for(attempt, req.get("wait"), commit=dropped)
        if found is None or found is _SUCCEEDED:
            return None
        ops, lease = found
        await self._commit(ops)
        if ops:  # a lease granted (not one given again to a retried take)
            self._granted[lease.task] += 1
            _kill_point(self.run_dir, f"after_lease_{lease.task}", self._granted[lease.task])
        rows: list[TakenRow] = []
        for uid, attempt_no in lease.items.items():
            row = self.table.rows[uid]
            cols = (
                row.columns
                if not columns
                else {c: row.columns[c] for c in (*columns, *optional) if c in row.columns}
            )
            rows.append(
                {
                    "uid": uid,
                    "group": row.group,
                    "version": row.version,
                    "attempt": attempt_no,
                    "columns": cols,
                }
            )
        return {
            "lease": lease.id,
            "task": lease.task,
            "trainer_version": self.table.trainer_at(req.get("trainer_version")),
            "rows": rows,
            "staleness": self.table.staleness.wire,
        }

    async def _op_ack(self, req: dict[str, Any], peer: Peer) -> int:
        ops, n = self.table.ack(
            req["task"],
            [tuple(i) for i in req["items"]],
            skipped_step=bool(req.get("skipped_step")),
        )
        await self._commit(ops)
        return n

    async def _op_release(self, req: dict[str, Any], peer: Peer) -> None:
        ops = self.table.release(
            req["task"], [tuple(i) for i in req["items"]], drop=req.get("drop")
        )
        ended = self.table.end_turn(req["task"], int(req["lease"])) if req.get("end_turn") else []
        await self._commit(ops + ended)  # one log record: the turn ends with the release
        if ended:
            async with self.changed:  # the next turn-take may go now
                self.changed.notify_all()

    def _succession(self, peer: Peer) -> Callable[[], bool]:
        """Whether ``peer``'s name has been reclaimed since this call: its client died and a
        new incarnation took the name, so a request of the dead one still waiting here (a take,
        an admission) must get nothing."""
        generation = self.reclaims[peer.id]
        return lambda: self.reclaims[peer.id] != generation

    async def _op_reclaim(self, req: dict[str, Any], peer: Peer) -> dict[str, int]:
        """The caller is a new incarnation under its name: the leases held under it end now,
        and the weight plane's receivers that polled under it leave (the next group is formed
        without them, and a transfer waiting for one stops waiting)."""
        self.reclaims[peer.id] += 1
        ops = self.table.reclaim(peer.id)
        dead = [m for m, client in self.weight_clients.items() if client == peer.id]
        for member in dead:
            self._leave_plane(member)
        await self._log(ops)
        async with self.changed:  # the rows' takers, and the dead client's takes, look again
            self.changed.notify_all()
        return {"leases": len(ops), "weight_members": len(dead)}

    async def _op_admit(self, req: dict[str, Any], peer: Peer) -> str:
        verdict = "full"
        succeeded = self._succession(peer)

        def attempt() -> Any:
            nonlocal verdict
            if succeeded():
                return []  # admit nothing for the dead: the room is its successor's
            ops, verdict = self.table.admit(
                req["group"],
                int(req["rows"]),
                int(req["version"]),
                now=time.time(),
                timeout=self.admission_timeout,
            )
            # Only "full" is worth waiting for here; "ahead" waits for the trainer's next
            # weights, which the producer's weight follower brings, so it is answered now.
            return ops if verdict != "full" else None

        ops = await self._wait_for(attempt, req.get("wait"))
        if ops:
            await self._commit(ops)
        return verdict

    async def _op_admit_many(self, req: dict[str, Any], peer: Peer) -> AdmitManyReply:
        """``admit`` for several groups in order, in one request and one log record: stops at
        the first group not admitted; answers the verdicts up to and including it, and the
        staleness bound in force. Waits while the very first group is "full" or "ahead":
        unlike ``admit``, for "ahead" too — a group dropped (a failed reward) makes room at
        the producer's version, which its weights follower would never bring, and a trainer
        that moves on turns the verdict into "behind", answered at once."""
        groups = req.get("groups")
        if not (isinstance(groups, list) and groups and all(isinstance(g, str) for g in groups)):
            raise BusError(f"admit_many carries a non-empty list of group ids, got {groups!r:.60}")
        rows, version = int(req["rows"]), int(req["version"])
        verdicts: list[str] = []
        succeeded = self._succession(peer)

        def attempt() -> Any:
            ops: list[Op] = []
            if succeeded():
                return ops  # admit nothing for the dead (verdicts: the last attempt's refusal)
            verdicts.clear()
            now = time.time()
            for group in groups:
                admitted, verdict = self.table.admit(
                    group, rows, version, now=now, timeout=self.admission_timeout
                )
                ops += admitted
                verdicts.append(verdict)
                if verdict != "ok":
                    break
            return None if verdicts in (["full"], ["ahead"]) else ops

        ops = await self._wait_for(attempt, req.get("wait"))
        if ops:
            await self._commit(ops)
        return {"verdicts": verdicts, "staleness": self.table.staleness.wire}

    async def _op_staleness(self, req: dict[str, Any], peer: Peer) -> StalenessWire:
        """Change the staleness bound (``relax set staleness``): logged, in force from the
        next admission; rows queued for the trainer that it makes too stale are dropped."""
        before = self.table.staleness.wire
        await self._commit(self.table.set_staleness(req["staleness"]))
        if self.table.staleness.wire != before:
            self.log.warning("staleness changed", before=before, after=self.table.staleness.wire)
        async with self.changed:  # waiting admissions decide again under the new bound
            self.changed.notify_all()
        return self.table.staleness.wire

    async def _op_version(self, req: dict[str, Any], peer: Peer) -> int:
        await self._commit(self.table.set_version(int(req["version"])))
        return self.table.version

    async def _op_stats(self, req: dict[str, Any], peer: Peer) -> BusStatistics:
        return self.statistics()

    # weights: begin/bucket/commit by the trainer; poll/bucket by subscribers

    async def _op_w_begin(self, req: dict[str, Any], peer: Peer) -> dict[str, Any]:
        version = int(req["version"])
        if self._already_committed(version, req.get("publish")):
            return {"already": True}  # a publish retried after its commit was logged
        _kill_point(self.run_dir, "before_upload", version)
        if version <= self.table.weights_version:
            raise BusError(
                f"weight version {version} is not newer than the current "
                f"{self.table.weights_version}"
            )
        self.weights.begin(version, req["meta"], req.get("publish"))
        began: dict[str, Any] = {"already": False}
        if req["meta"].get("store") == "file":
            staged = self.weights.staged_path(version)
            if staged is not None:  # the publisher checks the folder to know it shares it
                staged.parent.mkdir(parents=True, exist_ok=True)
            began["file"] = None if staged is None else str(staged.resolve())
        if req["meta"].get("via") == "group":
            async with self.changed:  # its receivers join the transfer before the commit
                self.changed.notify_all()
        return began

    async def _op_w_put(self, req: dict[str, Any], peer: Peer) -> None:
        version, pending = int(req["version"]), self.weights.open.get(int(req["version"]))
        if pending is not None and int(req["index"]) == min(1, len(pending["buckets"]) - 1):
            _kill_point(self.run_dir, "mid_upload", version)  # begun, not every bucket in
        self.weights.put_bucket(version, int(req["index"]), req["tensors"])

    async def _op_w_commit(self, req: dict[str, Any], peer: Peer) -> dict[str, Any]:
        """Commit weights ``version``: stage its file, log ONE record (the version, its publish
        id, the ack of the rows it was trained on, the new trainer version), then make it
        visible. A kill before the record leaves nothing the restarted bus serves (and the
        trainer's retry gets ``UploadLost``: it uploads again); a kill after it is completed by
        recovery (and the retry hears "already committed")."""
        version = int(req["version"])
        publish = str(req.get("publish") or f"anonymous-{version}")
        if self._already_committed(version, req.get("publish")):
            return {"already": True}
        entry = self.weights.seal(version, str(req.get("stored", "put")))
        try:
            # Writing the file happens on a thread; nothing serves it until it is promoted.
            await asyncio.to_thread(self.weights.stage, version, entry)
            _kill_point(self.run_dir, "after_weights_file", version)
            ack = req.get("ack") or {}
            ops = self.table.commit_weights(
                version,
                publish,
                task=ack.get("task"),
                items=[tuple(i) for i in ack.get("items", ())],
                set_trainer_version=bool(req.get("set_trainer_version", True)),
            )
            await self._log(ops)
        except Exception:
            # Not logged: its file must never be served. (Cancelled instead, the record may
            # still land from the writer thread: the staged file stays, recovery decides.)
            self.weights.discard(version)
            raise
        _kill_point(self.run_dir, "after_commit_record", version)
        self.weights.promote(version, entry, prune=False)
        async with self.changed:
            self.changed.notify_all()
        # Older versions' files go after the reply, off the publish's path: deleting a file
        # frees its page cache (about 30 ms per GB here).
        self._pruning = asyncio.ensure_future(self._prune_after(self._pruning))
        return {"already": False}

    async def _prune_after(self, previous: asyncio.Future[None] | None) -> None:
        if previous is not None:
            await asyncio.wait({previous})  # one at a time, in order
        try:
            await asyncio.to_thread(self.weights.prune_files)
        except OSError as exc:  # a file left behind costs disk, never a version: the next one
            self.log.warning("could not delete old weight files", error=str(exc))

    def _already_committed(self, version: int, publish: Any) -> bool:
        """``publish`` (the upload's id) committed ``version`` already: a retry after the bus
        logged it (the reply was lost with the bus). Another upload of a committed version is
        an error (``not newer``), not a duplicate."""
        return publish is not None and self.table.publishes.get(version) == publish

    async def _op_w_poll(self, req: dict[str, Any], peer: Peer) -> dict[str, Any] | None:
        """The newest committed version above ``after``; with ``pending_after``, also a
        version above it being published over the weight plane's group (``committed:
        False``) unless it is the publish ``pending_skip``. ``member`` names a receiver of
        the plane: polling keeps it a member (``w_members``)."""
        after = int(req.get("after", -1))
        member = req.get("member")
        pending = req.get("pending_after")

        def found() -> dict[str, Any] | None:
            latest = self.weights.latest_after(after)
            if latest is not None:
                publish = self.table.publishes.get(latest["version"])
                return {**latest, "committed": True, "publish": publish}
            if pending is None:
                return None
            return self.weights.pending_after(int(pending), req.get("pending_skip"))

        member = None if member is None or str(member) in self.weight_left else str(member)
        if member is not None:
            self.weight_members[member] = time.monotonic()
            self.weight_clients[member] = peer.id
            gpu, proc = req.get("gpu"), req.get("proc")
            self.weight_places[member] = {
                "gpu": None if gpu is None else str(gpu),
                "proc": None if proc is None else str(proc),
            }
            if req.get("local"):
                self.weight_local.add(member)
            else:
                self.weight_local.discard(member)
        try:
            return await self._wait_for(found, req.get("wait"))
        finally:
            if member is not None and member not in self.weight_left:
                self.weight_members[member] = time.monotonic()

    async def _op_w_leave(self, req: dict[str, Any], peer: Peer) -> bool:
        """A receiver leaves the weight plane now (a rollout stopping), not a lease later:
        the next version's group is formed without it."""
        return self._leave_plane(str(req["member"]))

    def _leave_plane(self, member: str) -> bool:
        """``member`` is no receiver any more (and a poll of its still in flight will not
        make it one again); whether it was one."""
        self.weight_left.add(member)
        self._forget_member(member)
        return self.weight_members.pop(member, None) is not None

    def _forget_member(self, member: str) -> None:
        self.weight_local.discard(member)
        self.weight_places.pop(member, None)
        self.weight_clients.pop(member, None)

    async def _op_w_left(self, req: dict[str, Any], peer: Peer) -> list[str]:
        """Which of ``members`` left the plane on purpose (``w_leave``): the publisher stops
        waiting for them part-way through a transfer."""
        return sorted(self.weight_left & {str(m) for m in req["members"]})

    async def _op_w_members(
        self, req: dict[str, Any], peer: Peer
    ) -> list[str] | dict[str, dict[str, str | None]]:
        """The weight plane's receivers that polled within ``lease`` seconds and need the
        bytes sent (not those reading this bus's folder), sorted; with ``places``, a map of
        each to where it receives: the GPU (UUID) its engine is on, or ``None``, and its
        process."""
        horizon = time.monotonic() - float(req.get("lease", 10.0))
        for member, seen in list(self.weight_members.items()):
            if seen < horizon:
                del self.weight_members[member]
                self._forget_member(member)
        members = sorted(set(self.weight_members) - self.weight_local)
        if req.get("places"):
            empty = {"gpu": None, "proc": None}
            return {member: self.weight_places.get(member, empty) for member in members}
        return members

    async def _op_w_get(self, req: dict[str, Any], peer: Peer) -> dict[str, Any]:
        return self.weights.get_bucket(int(req["version"]), int(req["index"]))

    # ------------------------------------------------------------------ plumbing

    async def _wait_for(
        self, attempt: Any, wait: float | None, *, commit: list[Op] | None = None
    ) -> Any:
        """Retry ``attempt`` each time the table changes, for at most ``wait`` seconds."""
        deadline = time.monotonic() + (float(wait) if wait else 0.0)
        async with self.changed:
            while True:
                result = attempt()
                if commit:
                    pending, commit[:] = list(commit), []
                    await self._log(pending)
                if result is not None:
                    return result
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                try:
                    await asyncio.wait_for(self.changed.wait(), left)
                except asyncio.TimeoutError:
                    return attempt()

    async def _commit(self, ops: list[Op]) -> None:
        """Log ``ops`` (already applied to the table), then wake every waiter."""
        if not ops:
            return
        await self._log(ops)
        async with self.changed:
            self.changed.notify_all()

    async def _log(self, ops: list[Op]) -> None:
        """Append ``ops`` to the log; returns once they are written (page cache, or disk with
        ``fsync="always"``), which is when the caller may be answered.

        Records are handed to one writer thread in the order the ops were applied (this runs
        without yielding between the table change and the submission), so the log replays in
        the same order, while the event loop keeps serving other clients during a large write.
        """
        if self.log_file is None or not ops:
            return
        records = [dumps_parts(op) for op in ops]  # tensors go to the log without a join copy
        for op in ops:
            seq = self.next_seq
            self.next_seq += 1
            if op["op"] == "put":
                self.table.mark_seq([op], seq)
        size = sum(memoryview(p).nbytes for r in records for p in r)
        self.since_compact += len(records)
        self.bytes_since_compact += size
        # Compact by records (bookkeeping) or by bytes (so big rows recycle segments early).
        compact = (
            self.since_compact >= self.compact_every
            or self.bytes_since_compact >= 2 * self.segment_bytes
        )
        if compact:
            self.since_compact = self.bytes_since_compact = 0
            state_seq = self.next_seq
            self.next_seq += 1
            oldest = self.table.oldest_live_seq()
            watermark = state_seq if oldest is None else min(oldest, state_seq)
            records.append(dumps(self.table.state_op()))
        compaction = (watermark, self.table.take_unjournaled()) if compact else None
        if size < _INLINE_WRITE_BYTES and self.writes_pending == 0:
            self._write(records, compaction)  # small: a thread hop costs more
            return
        self.writes_pending += 1
        try:
            await asyncio.get_running_loop().run_in_executor(
                self.writer, self._write, records, compaction
            )
        finally:
            self.writes_pending -= 1

    def _write(
        self, records: list[Any], compaction: tuple[int, tuple[list[str], list[str]]] | None
    ) -> None:
        """Append ``records``; at a compaction, then journal what finished since the last one
        and only then release the segments before the watermark (``relax.bus._journal``)."""
        assert self.log_file is not None
        self.log_file.append_many(records)
        if compaction is not None:
            release_before, remembered = compaction
            if any(remembered):
                _kill_point(self.run_dir, "before_journal", 0)
            for journal, keys in zip(self.journals, remembered, strict=True):
                journal.append(keys)
            deleted = self.log_file.release_before(release_before)
            if deleted:
                self.log.debug(
                    "bus log compacted", segments_deleted=deleted, watermark=release_before
                )


_SUCCEEDED = object()  # what a take of a client that has been succeeded finds

KILL_AT_ENV = "RELAX_BUS_KILL_AT"
"""Test hook: a bus whose process has this set to a point of the weights commit protocol
(``before_upload``, ``mid_upload``, ``after_weights_file``, ``after_commit_record``), to
``before_journal`` (a compaction's log records written, its journal delta not) or to
``after_lease_<task>`` (a take's lease logged, its reply not sent), optionally ``@<n>``
(``after_weights_file@3``: in version 3's commit only; ``after_lease_train@4``: at the 4th
"train" lease this bus process granted),
SIGKILLs itself there, once per run folder (a marker file records it), so fault tests hit
that exact point instead of racing for it."""


def _kill_point(run_dir: str | None, point: str, version: int) -> None:
    wanted = os.environ.get(KILL_AT_ENV)
    if not wanted or run_dir is None:
        return
    name, _, at = wanted.partition("@")
    if name != point or (at and int(at) != version):
        return
    marker = Path(run_dir, f"killed-at-{point}")
    if marker.exists():
        return
    marker.touch()
    os.kill(os.getpid(), signal.SIGKILL)
