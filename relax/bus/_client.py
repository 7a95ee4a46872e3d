"""The bus client: what every role (and a user's own agent environment) uses to reach the bus.

Usable from any process and event loop::

    async with await BusClient.connect("tcp://127.0.0.1:7000", secret=...) as bus:
        if await bus.admit("prompt-17", rows=4, version=policy_version) == "ok":
            await bus.put([{"uid": "prompt-17/0", "group": "prompt-17", "group_size": 4,
                            "version": policy_version, "columns": {...}}, ...])
        async with bus.take("train", columns=["response_ids", "reward"], batch_size=16,
                            whole_groups=True) as batch:
            train_on(batch.rows)          # acked when the block ends normally,
                                          # given back to the queue if it raises

If the bus restarts, requests wait for it to come back (the transport redials) and retry; the
bus deduplicates, so a retried put or ack counts once.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from relax.bus._weights import VersionGone
from relax.errors import BusError, UploadLost, error_from_dict
from relax.schema import AdmitManyReply, BusStatistics, NewRow, TakenRow, TakeReply
from relax.transport import Limits, RawTensor, connect

# The server may hold a request for `wait` seconds; the transport gets this much more on top.
_MARGIN = 30.0
# Uploads of one weight version lost to bus restarts before ``publish_weights`` gives up.
_PUBLISH_ATTEMPTS = 20


@dataclass
class Batch:
    """Rows leased to one consumer task. Ack them, give them back, or drop some for good."""

    task: str
    lease: int = 0
    trainer_version: int = 0
    rows: list[TakenRow] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    acked: bool = False
    """Set once the rows were acked together with a weights commit (nothing left to ack)."""
    skipped_step: bool = False
    """Set by a trainer that consumed these rows in a skipped step (see ``BusTable.ack``)."""
    ack_with_commit: bool = False
    """Set by a trainer whose publish of the weights trained on these rows goes on after the
    ``take`` block (overlapped with the next step): they are acked with that commit, not at
    the block's end."""
    staleness: Any = None
    """The staleness bound in force when these rows were taken (``k`` or ``"inf"``)."""

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def items(self) -> list[list[Any]]:
        """``[uid, attempt]`` pairs: what an ack quotes back to the bus."""
        return [[r["uid"], r["attempt"]] for r in self.rows]

    def drop(self, uids: Iterable[str], reason: str) -> None:
        """Mark rows (and so their groups) to be dropped instead of acked, e.g. a failed reward."""
        for uid in uids:
            self.dropped[uid] = reason


class BusClient:
    """A connection to one bus. See the module docstring."""

    def __init__(self, rpc: Any) -> None:
        self._rpc = rpc
        self._take_prefix = uuid.uuid4().hex[:16]  # tells this client's takes from others'
        self._take_ids = itertools.count()
        # Per task, the id of a take that raised (timed out, cancelled) before its answer: the
        # bus may have leased rows to it. The next take of the task goes under that id and
        # gets them, instead of leaving them to the lease timeout.
        self._unanswered: dict[str, str] = {}

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        secret: str | None = None,
        client_id: str | None = None,
        limits: Limits | None = None,
        connect_timeout: float = 30.0,
    ) -> BusClient:
        rpc = await connect(
            url,
            secret=secret,
            client_id=client_id,
            limits=limits or Limits(),
            connect_timeout=connect_timeout,
        )
        return cls(rpc)

    async def aclose(self) -> None:
        await self._rpc.aclose()

    async def __aenter__(self) -> BusClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _call(self, payload: dict[str, Any], wait: float | None = None) -> Any:
        timeout = None if wait is not None and math.isinf(wait) else (wait or 0.0) + _MARGIN
        return await self._rpc.request(payload, timeout=timeout)

    # ------------------------------------------------------------------ producers

    async def admit(self, group: str, rows: int, version: int, *, wait: float = 60.0) -> str:
        """Permission to generate ``rows`` rows for ``group`` with weights ``version``.

        Waits while the bus is full or generating now would run ahead of the trainer; returns
        ``"ok"``, or ``"behind"`` (sync weights first), or ``"ahead"``/``"full"`` if still so
        after ``wait`` seconds.
        """
        return await self._call(
            {"op": "admit", "group": group, "rows": rows, "version": version, "wait": wait}, wait
        )

    async def admit_many(
        self, groups: list[str], rows: int, version: int, *, wait: float = 60.0
    ) -> AdmitManyReply:
        """``admit`` for ``groups`` in order, in one round trip: admits until the first group
        refused; the reply's ``verdicts`` go up to it (all ``"ok"`` when every group was
        admitted), its ``staleness`` is the bound in force. Waits up to ``wait`` seconds
        while the first group is ``"full"`` or ``"ahead"`` (room may come at this version: a
        group dropped; a trainer that moves on makes it ``"behind"``, answered at once)."""
        return await self._call(
            {"op": "admit_many", "groups": groups, "rows": rows, "version": version, "wait": wait},
            wait,
        )

    async def put(
        self, rows: list[NewRow], *, wait: float = 60.0, failed_groups: Iterable[str] = ()
    ) -> int:
        """Add rows (all or nothing), waiting while the bus is full. Returns rows added.

        ``failed_groups``: groups among ``rows`` whose reward failed where they were scored
        (a rollout scoring its own samples): put, then dropped with the rest of their group
        in the same request, as the reward role drops them (``dropped_reward_failed``)."""
        request: dict[str, Any] = {"op": "put", "rows": rows, "wait": wait}
        failed = sorted(set(failed_groups))
        if failed:
            request["failed_groups"] = failed
        return await self._call(request, wait)

    async def add_columns(self, uid: str, columns: dict[str, Any]) -> None:
        """Write columns of an existing row (each column once)."""
        await self._call({"op": "columns", "uid": uid, "columns": columns})

    async def add_columns_many(
        self, items: list[tuple[str, dict[str, Any]]]
    ) -> list[BaseException | None]:
        """``add_columns`` for many rows in one request (a role scoring a batch pays one round
        trip, not one per row). Returns, per item, None or the exception that refused that
        row's write (``ColumnConflict``, a ``BusError`` for a row gone from the bus), rebuilt
        as its own type: the other rows' writes are kept."""
        if not items:
            return []
        reply = await self._call({"op": "columns_many", "items": [[u, c] for u, c in items]})
        return [None if e is None else error_from_dict(e) for e in reply]

    # ------------------------------------------------------------------ consumers

    async def take_batch(
        self,
        task: str,
        *,
        batch_size: int,
        columns: Iterable[str] = (),
        optional: Iterable[str] = (),
        min_rows: int = 1,
        whole_groups: bool = False,
        token_budget: int | None = None,
        max_row_tokens: int | None = None,
        lease_timeout: float | None = None,
        wait: float = 30.0,
        trainer_version: int | None = None,
        turn: bool = False,
    ) -> Batch:
        """Lease up to ``batch_size`` rows ready for ``task`` (empty if none came in ``wait``).

        ``trainer_version``: the trainer's own version when its last publish is still on the
        way (overlapped with this take): rows are judged stale against it.

        A row is ready when it has every one of ``columns``; rows come with those columns
        (all of them when ``columns`` is empty) plus whichever of ``optional`` they have. A
        unit (row or whole group) holding a row of more than ``max_row_tokens`` tokens is
        dropped as "oversized" (counted), like one above the whole ``token_budget``.

        ``turn``: take the task's turn with the rows. Turn-takes are granted one at a time:
        the next waits until this one ends its turn (``release(..., end_turn=True)``), its
        lease ends, or this client takes again. A producer that leases work, then asks another
        bus for admission, takes turns so that work is admitted in the queue's order.
        """
        # A take that raised before its answer is sent again under its id (see _unanswered).
        take_id = self._unanswered.pop(task, None) or f"{self._take_prefix}-{next(self._take_ids)}"
        request = {
            "op": "take",
            "task": task,
            "columns": list(columns),
            "optional": list(optional),
            "batch_size": batch_size,
            "min_rows": min_rows,
            "whole_groups": whole_groups,
            "token_budget": token_budget,
            "max_row_tokens": max_row_tokens,
            "lease_timeout": lease_timeout,
            "wait": wait,
            "trainer_version": trainer_version,
            "turn": turn,
            # Resent unchanged if the bus restarts before answering: the same lease comes
            # back instead of a second one (the first's rows stranded until it expired).
            "take_id": take_id,
        }
        try:
            reply: TakeReply | None = await self._call(request, wait)
        except BaseException:
            self._unanswered[task] = take_id
            raise
        if reply is None:
            return Batch(task)
        batch = Batch(task, reply["lease"], reply["trainer_version"], reply["rows"])
        batch.staleness = reply.get("staleness")
        return batch

    @contextlib.asynccontextmanager
    async def take(self, task: str, **kwargs: Any) -> AsyncIterator[Batch]:
        """``take_batch`` as a block: acked on normal exit, given back if the block raises."""
        batch = await self.take_batch(task, **kwargs)
        try:
            yield batch
        except BaseException:
            if batch.rows:
                with contextlib.suppress(Exception):
                    await self.release(batch)
            raise
        if batch.rows and not batch.acked and not batch.ack_with_commit:
            await self.ack(batch)

    async def ack(self, batch: Batch) -> int:
        """Ack the batch's rows (dropping those marked with ``drop``); returns rows newly acked.

        Rows whose lease ran out and were handed to another holder are not acked by this call
        (fewer than ``len(batch)`` come back; the bus counts them as ``ignored_acks``): the new
        holder's ack counts, so each row is still finished once. This is not an error.
        """
        keep = [i for i in batch.items if i[0] not in batch.dropped]
        for reason in set(batch.dropped.values()):
            items = [i for i in batch.items if batch.dropped.get(i[0]) == reason]
            await self._call({"op": "release", "task": batch.task, "items": items, "drop": reason})
        if not keep:
            return 0
        request = {"op": "ack", "task": batch.task, "items": keep}
        if batch.skipped_step:
            request["skipped_step"] = True
        return await self._call(request)

    async def release(
        self, batch: Batch, *, drop: str | None = None, end_turn: bool = False
    ) -> None:
        """Give the batch back to the queue (or drop it for good with a reason).

        ``end_turn``: the batch was taken with ``turn=True``; its turn ends with this request
        (the batch's rows may be none: then the request only ends the turn)."""
        await self._call(
            {
                "op": "release",
                "task": batch.task,
                "lease": batch.lease,
                "items": batch.items,
                "drop": drop,
                "end_turn": end_turn,
            }
        )

    async def reclaim(self) -> dict[str, int]:
        """End everything held under this client's name (``client_id``): its leases, and the
        weight plane's receivers that polled under it. Returns how many of each
        (``{"leases": …, "weight_members": …}``).

        For a process that takes over a name from a dead one (a restarted role): the rows its
        predecessor had leased go back to the queue now instead of after the lease timeout,
        and the next weights version is not held up waiting for the dead receiver to join.
        Call it once, right after connecting and before taking or polling anything. Every
        live client of a bus needs a name of its own: a reclaim ends the leases of whoever
        shares it (no row is trained twice — their acks no longer count — but their work is
        lost)."""
        return await self._call({"op": "reclaim"})

    # ------------------------------------------------------------------ trainer and status

    async def set_trainer_version(self, version: int) -> int:
        return await self._call({"op": "version", "version": version})

    async def set_staleness(self, staleness: int | str | float) -> int | str:
        """Change the staleness bound of the running bus (``k``, or ``"inf"``); returns the
        bound now in force. Logged (a restarted bus keeps it); admissions follow it at once,
        and rows queued for the trainer that it makes too stale are dropped as ``"stale"``."""
        from relax.schema import Staleness

        return await self._call({"op": "staleness", "staleness": Staleness.parse(staleness).wire})

    async def statistics(self) -> BusStatistics:
        return await self._call({"op": "stats"})

    # ------------------------------------------------------------------ weights

    async def publish_weights(
        self,
        version: int,
        state: dict[str, Any],
        *,
        bucket_bytes: int = 64 << 20,
        set_trainer_version: bool = True,
        group: Any = None,
        ack: Batch | None = None,
    ) -> int:
        """Publish ``state`` as weight version ``version`` in buckets; visible only once whole.

        Through the bus by default. With ``group`` (a ``relax.transport.TensorGroup`` the
        subscribers joined, this process its source), the bus carries only the version and
        layout and the bytes go over the group (NCCL on GPUs, gloo on CPU), one collective per
        bucket. Returns the number of buckets. Committing also moves the trainer version.

        ``ack``: the batch these weights were trained on, acked in the same bus operation as
        the commit — a trainer killed in between can neither lose the update's rows nor have
        them trained again on top of weights that already contain them.
        """
        buckets = _buckets(state, bucket_bytes)
        meta: dict[str, Any] = {"buckets": len(buckets), "names": list(state)}
        if group is not None:
            meta["via"] = "group"
            meta["layout"] = [
                [
                    [name, str(t.dtype).removeprefix("torch."), list(t.shape)]
                    for name, t in b.items()
                ]
                for b in buckets
            ]
        # One id for this publish, however often it is retried: a bus that logged its commit
        # and died before answering tells the retry "already committed" instead of failing.
        publish = uuid.uuid4().hex
        commit: dict[str, Any] = {
            "op": "w_commit",
            "version": version,
            "publish": publish,
            "set_trainer_version": set_trainer_version,
        }
        if ack is not None and ack.rows:
            commit["ack"] = {"task": ack.task, "items": ack.items}
        for _ in range(_PUBLISH_ATTEMPTS):
            try:
                began = await self._call(
                    {"op": "w_begin", "version": version, "meta": meta, "publish": publish}
                )
                if not (isinstance(began, dict) and began.get("already")):
                    if group is None:
                        for index, bucket in enumerate(buckets):
                            await self._call(
                                {
                                    "op": "w_put",
                                    "version": version,
                                    "index": index,
                                    "tensors": bucket,
                                }
                            )
                    await self._call(commit)
                break
            except UploadLost:
                # The bus restarted (or another upload replaced ours) before the commit was
                # logged: nothing of this version is visible; upload it again.
                continue
        else:
            raise BusError(f"weight version {version}: upload lost {_PUBLISH_ATTEMPTS} times")
        if ack is not None and ack.rows:
            ack.acked = True
        if group is not None:
            for bucket in buckets:
                await group.broadcast_bucket(list(bucket.values()), src=group.rank)
        return len(buckets)

    async def poll_weights(
        self,
        after: int = -1,
        *,
        wait: float = 30.0,
        group: Any = None,
        src: int = 0,
        progress: Any = None,
    ) -> tuple[int, dict[str, Any]] | None:
        """The newest weight version above ``after``, whole (``None`` if none came in ``wait``).

        The result is assembled completely before it is returned: a caller never sees a mix
        of two versions, and a transfer cut short (the caller is cancelled or killed) exposes
        nothing. With ``group``, the bytes come from rank ``src`` of that tensor group (every
        subscriber in the group must poll each version). ``progress(done, total)`` is called
        after each bucket.
        """
        import torch

        while True:
            head = await self._call({"op": "w_poll", "after": after, "wait": wait}, wait)
            if head is None:
                return None
            meta, total = head["meta"], head["buckets"]
            state: dict[str, Any] = {}
            try:
                for index in range(total):
                    # A weight plane version (``store``) is served by the bus like any other;
                    # only a legacy group publish must be received over its group.
                    if meta.get("via") == "group" and not meta.get("store"):
                        if group is None:
                            raise BusError("these weights travel over a tensor group: pass group=")
                        layout = meta["layout"][index]
                        buffers = [
                            torch.empty(shape, dtype=getattr(torch, dtype))
                            for _, dtype, shape in layout
                        ]
                        await group.broadcast_bucket(buffers, src=src)
                        state.update(
                            {name: t for (name, _, _), t in zip(layout, buffers, strict=True)}
                        )
                    else:
                        part = await self._call(
                            {"op": "w_get", "version": head["version"], "index": index}
                        )
                        state.update(torch_tensors(part["tensors"]))
                    if progress is not None:
                        progress(index + 1, total)
            except VersionGone:
                continue  # superseded while we read it: fetch the newest instead
            names = meta.get("names")
            if names is not None and list(state) != names:
                state = {name: state[name] for name in names}
            return head["version"], state


def torch_tensors(tensors: dict[str, Any]) -> dict[str, Any]:
    """A bucket as torch tensors. Over ``inproc://`` the bus hands over what it holds as it is,
    and a version it serves from its file is in wire form (``RawTensor``); over a socket the
    decoder already made torch tensors of them."""
    return {name: t.to_torch() if isinstance(t, RawTensor) else t for name, t in tensors.items()}


def _buckets(state: dict[str, Any], bucket_bytes: int) -> list[dict[str, Any]]:
    """Split a state dict into buckets of about ``bucket_bytes`` (a big tensor gets its own)."""
    if not state:
        raise BusError("cannot publish an empty state dict")
    buckets: list[dict[str, Any]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append({})
            size = 0
        buckets[-1][name] = tensor
        size += nbytes
    return buckets
