"""The weight plane: published versions go to the rollouts over a tensor group, not the bus.

The bus's RPC moves bytes at about 0.05x memcpy; a tensor group (gloo on CPU, NCCL on GPUs,
``relax.transport.open_group``) is what a weight sync inside a cluster should use. The bus
still carries what must be ordered and durable: the announcement of a version (its layout,
one checksum per bucket and the group to receive it on), and the commit (with the ack of the
rows the version was trained on). The bytes of each version also land in the bus's weights
directory, written by the publisher itself (no RPC), so late joiners, a receiver whose
transfer failed, the evaluator and a restarted trainer read them there through the bus.

One publish of version ``V`` (``WeightPublisher.publish``):

1. ``w_members``: the receivers that polled within their lease. When they changed since the
   last version (a rollout restarted, added or removed), or the group broke, a new group is
   formed: a new epoch, one named group on the store this publisher keeps listening.
2. ``w_begin`` announces ``V``; receivers long-polling with ``pending_after`` learn it.
3. At once, and concurrently: the group transfer (bucket by bucket, every collective with a
   timeout; a receiver SIGKILLed mid-transfer is a ``PeerGone`` within ``stall_timeout``:
   logged, the group is dropped and formed anew at the next version, of the receivers that
   polled since) and the durable copy (the staged file, or bucket puts when the bus's
   directory is not reachable from here); once both ended, ``w_commit``. The publisher never
   waits for a receiver longer than the timeouts.

A receiver (``WeightSubscriber.next``) checks each bucket against the publisher's checksum
(computed where the tensors are: a wrapping sum of 64-bit words per tensor, weighted by its
position, so a flipped byte or two swapped tensors are caught) and switches to ``V`` only when
the bus committed ``V`` with the same publish id: never half a version, never two mixed, never
one whose commit (and ack) was not logged. Anything else (not a member yet, a failed or
corrupt transfer, a newer commit) reads the committed version from the bus instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax.bus._client import Batch, BusClient, _buckets, torch_tensors
from relax.bus._plane_routes import (
    HANDLE_BYTES,
    choose_route,
    gpu_of,
    open_shared,
    pack_bucket,
    share,
    slots,
    this_process,
    unpack_bucket,
)
from relax.bus._weights import write_version_file
from relax.errors import BusError, TransportError, UploadLost, VersionGone, WeightsCorrupt
from relax.log import get_logger

_PUBLISH_ATTEMPTS = 20
# How often a transfer asks the bus whether a receiver left on purpose (a rollout stopping).
_LEAVE_POLL_S = 0.2
_PROBE_EVERY = 60.0  # seconds between a group receiver's checks whether it can read the file
_MASK = (1 << 64) - 1


def bucket_digest(tensors: list[Any]) -> int:
    """A cheap checksum of ``tensors``' bytes, computed on their device: per tensor the
    wrapping sum of its 64-bit words (its tail bytes weighted by position) plus its byte
    count, combined weighted by the tensor's position in the bucket."""
    import torch

    total = 0
    for k, tensor in enumerate(tensors):
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        n = flat.numel()
        whole = n - n % 8
        try:
            words = flat[:whole].view(torch.int64)
        except RuntimeError:  # a storage offset not on a word boundary: copy it once
            words = flat[:whole].clone().view(torch.int64)
        s = int(words.sum()) if whole else 0
        if n > whole:
            tail = flat[whole:].to(torch.int64)
            s += int((tail * torch.arange(1, n - whole + 1, device=tail.device)).sum())
        total = (total + (k + 1) * ((s + n) & _MASK)) & _MASK
    return total


@dataclass(frozen=True)
class PlaneOptions:
    """How the weight plane moves versions (``[weights]``)."""

    host: str = "127.0.0.1"
    """Where the publisher's group store listens: an address every receiver reaches."""
    bucket_bytes: int = 64 << 20
    join_timeout: float = 10.0
    """Seconds every receiver has to join a newly formed group."""
    timeout: float = 30.0
    """Seconds a bucket may take to start moving on every receiver."""
    stall_timeout: float = 5.0
    """Seconds a moving bucket may make no progress before its peer counts as gone."""
    lease: float = 10.0
    """Seconds after its last poll that a receiver still counts as a member."""
    device: str | None = None
    """The group's device, forced (``None``: the publisher picks a route per group from the
    receivers' GPUs, ``relax.bus._plane_routes.choose_route``)."""
    local_file: bool | None = None
    """Receivers that can read the bus's weight file read committed versions there, verified,
    and the group leaves them out (``None``: a receiver whose engine is on CPU)."""

    def reads_local_file(self, gpu: str | None = None) -> bool:
        """Whether a receiver whose engine is on ``gpu`` reads the bus's file when it can."""
        if self.local_file is not None:
            return self.local_file
        if self.device is not None:
            return not self.device.startswith("cuda")
        return gpu is None


def plane_host(bus_url: str) -> str:
    """Where a publisher's group store listens: this machine's address on the way to the bus
    (every receiver reaches the bus, so it reaches that network too); loopback when the bus
    is local (``inproc://``, ``ipc://``, a loopback ``tcp://``)."""
    from urllib.parse import urlsplit

    from relax.transport import local_address_towards

    parts = urlsplit(bus_url)
    if parts.scheme != "tcp" or not parts.hostname:
        return "127.0.0.1"
    return local_address_towards(parts.hostname, parts.port or 1)


def plane_options(weights: Any, bus_url: str) -> PlaneOptions:
    """``PlaneOptions`` from a ``[weights]`` section (``relax.config.WeightsConfig``)."""
    return PlaneOptions(
        host=plane_host(bus_url),
        bucket_bytes=int(weights.bucket_mb) << 20,
        join_timeout=float(weights.join_timeout),
        timeout=float(weights.timeout),
        stall_timeout=float(weights.stall_timeout),
        lease=float(weights.lease),
        local_file={"auto": None, "on": True, "off": False}[weights.local_file],
    )


def _layout(bucket: dict[str, Any]) -> list[list[Any]]:
    return [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in bucket.items()]


class WeightPublisher:
    """The trainer's side: publishes each version to the current receivers over a group."""

    def __init__(
        self, bus: BusClient, options: PlaneOptions = PlaneOptions(), *, device: Any = None
    ) -> None:
        """``device``: where the trainer's weights live (its GPU decides the routes)."""
        self._bus, self._opts = bus, options
        self._log = get_logger("weights")
        self._port: int | None = None
        self._group: Any = None
        self._members: list[str] = []
        self._device = device
        self._gpu = gpu_of(device)
        self._route = "gloo"
        # Route "ipc": the bucket buffer shared with the receivers, and its handle message.
        self._staging: Any = None
        self._staging_handle: Any = None
        self._pack_stream: Any = None
        self._epoch = 0
        self._file_ok = True  # False once the bus could not find a file written here
        self._failed_at: float | None = None  # when the last transfer failed
        # Set by ``abandon``: transfers stop (the receivers read from the bus) from now on.
        self._abandoned = asyncio.Event()
        self._stats: dict[str, Any] = {
            "published": 0,
            "via_group": 0,
            "group_failures": 0,
            "epochs": 0,
            "last_publish_s": 0.0,
            "last_transfer_s": 0.0,
            # Seconds, summed over publishes: checksums, and (route "ipc") packing buckets
            # into the staging buffer and waiting for the receivers to copy them out.
            "digest_s": 0.0,
            "ipc_pack_s": 0.0,
            "ipc_wait_s": 0.0,
            "last_failure": None,
        }

    def statistics(self) -> dict[str, Any]:
        group = self._group.statistics() if self._group is not None else None
        return {
            **self._stats,
            "members": list(self._members),
            "route": self._route,
            "group": group,
        }

    async def publish(
        self, version: int, state: dict[str, Any], *, ack: Batch | None = None
    ) -> int:
        """Publish ``state`` as ``version``; returns how many receivers got it over the group."""
        started = time.monotonic()
        buckets = _buckets(state, self._opts.bucket_bytes)
        digests = await asyncio.to_thread(
            lambda: [bucket_digest(list(b.values())) for b in buckets]
        )
        self._stats["digest_s"] += time.monotonic() - started
        lease = self._opts.lease
        if self._failed_at is not None:
            # After a failed transfer only the receivers that polled since count: the one that
            # died (whose lease has not run out yet) would make the next group wait for it.
            lease = min(lease, time.monotonic() - self._failed_at)
            self._failed_at = None
        places = await self._bus._call({"op": "w_members", "lease": lease, "places": True})
        members = [] if self._abandoned.is_set() else sorted(places)
        import torch.distributed as dist

        route = choose_route(
            self._gpu,
            {m: place.get("gpu") for m, place in places.items()},
            forced=self._opts.device,
            nccl=dist.is_nccl_available(),
            same_process=[m for m, place in places.items() if place.get("proc") == this_process()],
        )
        changed = members != self._members or route != self._route
        if changed or (self._group is None and members):
            await self._close_group()
            self._members, self._route = members, route
            if members:
                self._epoch += 1
                self._stats["epochs"] += 1
        meta: dict[str, Any] = {
            "buckets": len(buckets),
            "names": list(state),
            "via": "group",
            "store": "file",
            "layout": [_layout(b) for b in buckets],
            "digests": [str(d) for d in digests],  # msgpack ints stop at 64 bits signed
            "group": self._group_info() if members else None,
        }
        publish = uuid.uuid4().hex
        transfer: asyncio.Task[bool] | None = None
        try:
            for _ in range(_PUBLISH_ATTEMPTS):
                try:
                    began = await self._bus._call(
                        {"op": "w_begin", "version": version, "meta": meta, "publish": publish}
                    )
                    if began.get("already"):
                        break
                    if transfer is None and members:
                        transfer = asyncio.create_task(self._transfer(buckets))
                    stored = await self._store(version, meta, buckets, began.get("file"))
                    if transfer is not None:
                        # Committed once the transfer ended (bounded by its timeouts): a
                        # receiver sees the version pending, never committed, while it moves.
                        await asyncio.wait({transfer})
                    commit: dict[str, Any] = {
                        "op": "w_commit",
                        "version": version,
                        "publish": publish,
                        "stored": stored,
                        "set_trainer_version": True,
                    }
                    if ack is not None and ack.rows:
                        commit["ack"] = {"task": ack.task, "items": ack.items}
                    await self._bus._call(commit)
                    break
                except UploadLost as exc:
                    if "file is missing" in str(exc):
                        # This folder only looks like the bus's (another machine, the same
                        # path): send the bytes through the bus from now on.
                        self._file_ok = False
                    continue  # or the bus restarted before the commit was logged: again
            else:
                raise BusError(f"weight version {version}: upload lost {_PUBLISH_ATTEMPTS} times")
            if ack is not None and ack.rows:
                ack.acked = True
            sent = await transfer if transfer is not None else False
        finally:
            if transfer is not None and not transfer.done():
                await asyncio.wait({transfer})  # bounded by the group's own timeouts
        self._stats["published"] += 1
        self._stats["via_group"] += bool(sent)
        self._stats["last_publish_s"] = time.monotonic() - started
        return len(members) if sent else 0

    def abandon(self) -> None:
        """Send no more over the group: a transfer under way stops now and every later
        version goes through the bus (its commit is not held up). For a trainer that is
        stopping: its receivers are stopping too (the tree stops the rollouts first), and a
        publish waiting for them would outlast its shutdown timeout and lose its commit."""
        self._abandoned.set()

    async def aclose(self) -> None:
        await self._close_group()
        if self._port is not None:
            from relax.transport import release_named_store

            release_named_store(self._opts.host, self._port)
            self._port = None

    # ------------------------------------------------------------------ machinery

    def _group_info(self) -> dict[str, Any]:
        if self._port is None:
            from relax.transport import reserve_named_store

            limit = datetime.timedelta(seconds=self._opts.timeout)
            self._port = reserve_named_store(self._opts.host, limit)
        host = f"[{self._opts.host}]" if ":" in self._opts.host else self._opts.host
        url = f"nccl://{host}:{self._port}/weights-{self._epoch}"
        return {
            "url": url,
            "epoch": self._epoch,
            "members": list(self._members),
            "route": self._route,
        }

    def _group_device(self) -> str:
        if self._route == "nccl":
            return self._opts.device or str(self._device)
        return "cpu"  # gloo, and ipc's control group (handles and barriers only)

    async def _transfer(self, buckets: list[dict[str, Any]]) -> bool:
        """Send ``buckets`` over the group; ``False`` (the receivers read this version from the
        bus, the group is formed again at the next one) if a receiver died, hung or left."""
        began = time.monotonic()
        sending = asyncio.create_task(self._send(buckets))
        watching = asyncio.create_task(self._watch_leaves(list(self._members)))
        abandoned = asyncio.create_task(self._abandoned.wait())
        try:
            await asyncio.wait({sending, watching, abandoned}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            abandoned.cancel()
            watching.cancel()
            # A receiver that stopped on purpose (a rollout stopping with the run) would hold
            # the publish, and with it the trainer's own stop, for the whole join timeout.
            sending.cancel()
            left = await _outcome(watching)
            failed = await _outcome(sending)
        if failed is None and not sending.cancelled():
            self._stats["last_transfer_s"] = time.monotonic() - began
            return True
        if isinstance(failed, BaseException) and not isinstance(failed, TransportError):
            raise failed
        if failed is not None:
            why = failed
        elif self._abandoned.is_set():
            why = "abandoned: the publisher is stopping"
        else:
            why = f"receivers left the plane: {left}"
        self._stats["group_failures"] += 1
        self._failed_at = time.monotonic()
        self._stats["last_failure"] = str(why).splitlines()[0]
        self._log.warning(
            "weight transfer failed; receivers read this version from the bus",
            members=self._members,
            error=self._stats["last_failure"],
        )
        await self._close_group()
        return False

    async def _send(self, buckets: list[dict[str, Any]]) -> None:
        from relax.transport import open_group

        if self._group is None:
            self._log.info(
                "forming the weight group",
                epoch=self._epoch,
                members=self._members,
                route=self._route,
            )
            self._group = await open_group(
                self._group_info()["url"],
                rank=0,
                world_size=len(self._members) + 1,
                timeout=self._opts.join_timeout,
                stall_timeout=self._opts.stall_timeout,
                device=self._group_device(),
            )
        for bucket in buckets:
            if self._route == "ipc":
                await self._hand_over(bucket)
            else:
                tensors = list(bucket.values())
                await self._group.broadcast_bucket(tensors, src=0, timeout=self._opts.timeout)

    async def _watch_leaves(self, members: list[str]) -> list[str]:
        """Returns once one of ``members`` has left the plane (``w_leave``)."""
        while True:
            await asyncio.sleep(_LEAVE_POLL_S)
            with contextlib.suppress(BusError, TransportError):
                left = await self._bus._call({"op": "w_left", "members": members})
                if left:
                    return list(left)

    async def _hand_over(self, bucket: dict[str, Any]) -> None:
        """Route "ipc": one bucket, packed into the staging buffer on this GPU, which every
        receiver maps (they copy it out device to device); refilled once all of them passed
        the barrier."""
        import torch

        layout = _layout(bucket)
        _, total = slots(layout)
        if self._staging is None or self._staging.numel() < total:
            self._staging = self._staging_handle = None  # a bucket bigger than any so far
            size = max(total, self._opts.bucket_bytes)
            self._staging = torch.empty(size, dtype=torch.uint8, device=self._device)
            self._staging_handle = share(self._staging)
            if self._pack_stream is None:
                self._pack_stream = torch.cuda.Stream(self._staging.device)
        began = time.perf_counter()
        await asyncio.to_thread(
            pack_bucket, self._staging, list(bucket.values()), layout, self._pack_stream
        )
        packed = time.perf_counter()
        await self._group.broadcast([self._staging_handle], src=0, timeout=self._opts.timeout)
        await self._group.barrier(timeout=self._opts.timeout)
        self._stats["ipc_pack_s"] += packed - began
        self._stats["ipc_wait_s"] += time.perf_counter() - packed

    async def _store(
        self, version: int, meta: dict[str, Any], buckets: list[dict[str, Any]], file: Any
    ) -> str:
        """The durable copy: the staged file when the bus's directory is reachable from here,
        else the buckets through the bus."""
        if self._file_ok and file is not None and Path(file).parent.is_dir():
            await asyncio.to_thread(
                write_version_file, Path(file), version, meta, buckets, fsync=False
            )
            return "file"
        for index, bucket in enumerate(buckets):
            await self._bus._call(
                {"op": "w_put", "version": version, "index": index, "tensors": bucket}
            )
        return "put"

    async def _close_group(self) -> None:
        group, self._group = self._group, None
        # The old group's receivers may still map it: CUDA keeps it until they let go.
        self._staging = self._staging_handle = None
        if group is not None:
            await group.aclose()


async def _outcome(task: asyncio.Task[Any]) -> BaseException | Any:
    """Wait for a cancelled-or-finished task: its exception, else its result (``None`` for
    one cancelled)."""
    try:
        return await task
    except asyncio.CancelledError:
        if not task.cancelled():
            raise  # we ourselves are being cancelled
        return None
    except Exception as exc:
        return exc


@dataclass
class _Received:
    version: int
    publish: str
    state: dict[str, Any]


class WeightSubscriber:
    """A rollout's side: receives versions over the group, verified, switching on commits."""

    def __init__(
        self,
        bus: BusClient,
        member: str,
        options: PlaneOptions = PlaneOptions(),
        *,
        poll_wait: float | None = None,
        device: Any = None,
    ) -> None:
        """``device``: where the engine's weights live; a CUDA one is reported to the
        publisher (it picks the route by it) and receives the tensors there."""
        self._bus, self.member, self._opts = bus, member, options
        self._device = device
        self._gpu = gpu_of(device)
        # Polls are the lease's heartbeat: well inside it.
        self._poll_wait = poll_wait if poll_wait is not None else options.lease / 2
        self._log = get_logger("weights")
        self._group: Any = None
        self._mapped: tuple[bytes, Any] | None = None  # route "ipc": (handle, its mapping)
        self._epoch: int | None = None
        # The newest pending publish taken part in (or given up on): (version, publish id).
        self._handled: tuple[int, str | None] = (-1, None)
        self._received: _Received | None = None
        # Reads committed versions from the bus's own file (this machine, or a shared file
        # system), so the group leaves it out: learnt by reading one, verified, from there.
        self._local = False
        self._reads_file = options.reads_local_file(self._gpu)
        self._probed_at = -math.inf
        self._stats: dict[str, Any] = {
            "via_group": 0,
            "via_file": 0,
            "via_bus": 0,
            "corrupt": 0,
            "transfer_failures": 0,
            "last_failure": None,
            # Seconds, summed: in the group's collectives, checking buckets, and (route
            # "ipc") copying buckets out of the publisher's staging buffer.
            "collective_s": 0.0,
            "digest_s": 0.0,
            "ipc_copy_s": 0.0,
        }

    def statistics(self) -> dict[str, Any]:
        group = self._group.statistics() if self._group is not None else None
        return {**self._stats, "epoch": self._epoch, "group": group}

    async def next(self, after: int, wait: float = 30.0) -> tuple[int, dict[str, Any]] | None:
        """The newest committed version above ``after``, whole and verified (``None`` if none
        came within ``wait``). Keeps this receiver a member while it waits."""
        deadline = time.monotonic() + wait
        while True:
            poll = max(0.0, min(self._poll_wait, deadline - time.monotonic()))
            head = await self._bus._call(
                {
                    "op": "w_poll",
                    "after": after,
                    "wait": poll,
                    "member": self.member,
                    # The newest publish taken part in is skipped, not its version: a
                    # restarted trainer publishes that version again, under a new id. And a
                    # publish of the version we hold already (the trainer's first, of the
                    # weights every rollout starts from) is taken part in too: the group is
                    # formed with us, and would wait its join timeout for us otherwise.
                    "pending_after": max(after - 1, self._handled[0] - 1),
                    "pending_skip": self._handled[1],
                    "local": self._local,
                    "gpu": self._gpu,
                    "proc": this_process(),
                },
                poll,
            )
            if head is None:
                if time.monotonic() >= deadline:
                    return None
                continue
            if not head.get("committed"):
                await self._receive(head)
                if self._received is not None and self._received.version <= after:
                    self._received = None  # taken part in for the others; we hold it already
                continue
            got = self._received
            self._received = None
            if got is not None and (got.version, got.publish) == (head["version"], head["publish"]):
                self._stats["via_group"] += 1
                await self._probe_file(head)
                return got.version, got.state
            fetched = await self._from_file(head)
            if fetched is not None:
                self._stats["via_file"] += 1
                return fetched
            fetched = await self._fetch(head)
            if fetched is not None:
                self._stats["via_bus"] += 1
                return fetched

    async def aclose(self) -> None:
        group, self._group = self._group, None
        self._mapped = None
        if group is not None:
            await group.aclose()

    async def leave(self, timeout: float = 5.0) -> None:
        """Leave the plane now (a rollout stopping on purpose), so the next version's group
        is formed without this receiver instead of waiting out its lease, then close the
        group. Best effort: a bus that does not answer lets the lease expire instead."""
        try:
            await asyncio.wait_for(
                self._bus._call({"op": "w_leave", "member": self.member}), timeout
            )
        except (BusError, TransportError, TimeoutError) as exc:
            self._log.warning("could not leave the weight plane; its lease expires", error=str(exc))
        await self.aclose()

    # ------------------------------------------------------------------ machinery

    async def _receive(self, head: dict[str, Any]) -> None:
        """Take part in the transfer of a pending version, if this receiver is in its group."""
        import torch

        version, meta = int(head["version"]), head["meta"]
        self._handled = (version, head.get("publish"))
        info = meta.get("group")
        if not info or self.member not in info["members"]:
            return  # formed without us (we joined after it): the commit is read from the bus
        try:
            if self._group is None or self._epoch != info["epoch"]:
                await self.aclose()
                self._epoch = info["epoch"]
                self._group = await self._open(info)
                self._log.info(
                    "joined the weight group",
                    epoch=self._epoch,
                    rank=self._group.rank,
                    size=self._group.world_size,
                    backend=self._group.backend,
                )
            route = info.get("route", "gloo")
            where = self._device if route == "nccl" else "cpu"
            state: dict[str, Any] = {}
            corrupt: list[int] = []
            for index, layout in enumerate(meta["layout"]):
                began = time.perf_counter()
                if route == "ipc":
                    buffers = await self._take_over(layout)
                else:
                    buffers = [
                        torch.empty(s, dtype=getattr(torch, d), device=where) for _, d, s in layout
                    ]
                    await self._group.broadcast_bucket(buffers, src=0, timeout=self._opts.timeout)
                received = time.perf_counter()
                self._stats["collective_s"] += received - began
                # Every bucket is taken part in even after a bad one: the ranks stay in step.
                if await asyncio.to_thread(bucket_digest, buffers) != int(meta["digests"][index]):
                    corrupt.append(index)
                self._stats["digest_s"] += time.perf_counter() - received
                state.update({name: t for (name, _, _), t in zip(layout, buffers, strict=True)})
            if corrupt:
                raise WeightsCorrupt(
                    f"weight version {version}: buckets {corrupt} do not match the publisher's"
                    " checksums; not applied"
                )
        except WeightsCorrupt as exc:
            self._stats["corrupt"] += 1
            self._stats["last_failure"] = str(exc)
            self._log.error(
                "corrupt weights discarded; reading the version from the bus",
                version=version,
                error=str(exc),
            )
            return
        except TransportError as exc:
            self._stats["transfer_failures"] += 1
            self._stats["last_failure"] = str(exc).splitlines()[0]
            self._log.warning(
                "weight transfer failed; reading the version from the bus",
                version=version,
                error=self._stats["last_failure"],
            )
            await self.aclose()
            return
        names = meta.get("names")
        if names is not None:
            state = {name: state[name] for name in names}
        self._received = _Received(version, str(head.get("publish") or ""), state)

    async def _open(self, info: dict[str, Any]) -> Any:
        from relax.transport import open_group

        nccl = info.get("route") == "nccl"
        return await open_group(
            info["url"],
            rank=info["members"].index(self.member) + 1,
            world_size=len(info["members"]) + 1,
            timeout=self._opts.join_timeout,
            stall_timeout=self._opts.stall_timeout,
            device=(self._opts.device or str(self._device)) if nccl else "cpu",
        )

    async def _take_over(self, layout: list[list[Any]]) -> list[Any]:
        """Route "ipc": map the publisher's bucket, copy it out on this GPU, then pass the
        barrier that lets the publisher free it (passed even when the copy failed, so the
        publisher is not kept waiting; the failure is raised after)."""
        import torch

        handle = torch.empty(HANDLE_BYTES, dtype=torch.uint8)
        await self._group.broadcast([handle], src=0, timeout=self._opts.timeout)

        def copy() -> list[Any]:
            key = handle.numpy().tobytes()
            if self._mapped is None or self._mapped[0] != key:
                self._mapped = None  # the publisher's buffer was replaced: let the old go
                self._mapped = (key, open_shared(handle))
            shared = self._mapped[1]
            tensors = unpack_bucket(shared, layout)
            torch.cuda.current_stream(shared.device).synchronize()
            return tensors

        began = time.perf_counter()
        try:
            tensors = await asyncio.to_thread(copy)
        except Exception as exc:
            await self._group.barrier(timeout=self._opts.timeout)
            raise TransportError(f"cannot map the publisher's bucket over CUDA IPC: {exc}") from exc
        self._stats["ipc_copy_s"] += time.perf_counter() - began
        await self._group.barrier(timeout=self._opts.timeout)
        return tensors

    async def _from_file(self, head: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        """A committed version read from the bus's file where this receiver can read it,
        every bucket checked against the publisher's checksum (``None``: not readable here,
        or not the same bytes — then the bus sends them, and the group carries the next)."""
        meta, path = head["meta"], head.get("file")
        if not self._reads_file:
            return None
        if not path or not meta.get("digests") or not meta.get("layout"):
            return None  # a version published without checksums (transport "bus")
        try:
            state = await asyncio.to_thread(_read_verified, Path(path), meta)
        # Any failure only costs the fast path (another machine, a pruned file, a corrupt or
        # foreign one: OSError, SafetensorError, WeightsCorrupt, ...): the bus serves it.
        except Exception as exc:
            if self._local:
                self._log.warning("cannot read the bus's weight file", file=path, error=str(exc))
            self._local = False
            return None
        self._local = True
        return int(head["version"]), state

    async def _probe_file(self, head: dict[str, Any]) -> None:
        """Received over the group: could this receiver read the bus's file instead? One
        bucket of it, checked against its checksum, says so (then the group leaves it out
        from the next version); tried at most once a minute."""
        now = time.monotonic()
        if self._local or not self._reads_file or now - self._probed_at < _PROBE_EVERY:
            return
        self._probed_at = now
        meta, path = head["meta"], head.get("file")
        if not path or not meta.get("digests") or not meta.get("layout"):
            return
        try:
            await asyncio.to_thread(_read_verified, Path(path), meta, only=0)
        except Exception:  # not readable here, or not the same bytes: stay on the group
            return
        self._local = True
        self._log.info("reading versions from the bus's file from now on", file=path)

    async def _fetch(self, head: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        """A committed version through the bus (``None``: superseded while read)."""
        state: dict[str, Any] = {}
        try:
            for index in range(int(head["buckets"])):
                part = await self._bus._call(
                    {"op": "w_get", "version": head["version"], "index": index}
                )
                state.update(torch_tensors(part["tensors"]))
        except VersionGone:
            return None
        meta = head["meta"]
        if meta.get("digests") and meta.get("layout"):
            # The bus's copy is checked too (a disk that flipped a bit): never applied corrupt.
            for index, layout in enumerate(meta["layout"]):
                tensors = [state[name] for name, _, _ in layout]
                if await asyncio.to_thread(bucket_digest, tensors) != int(meta["digests"][index]):
                    raise WeightsCorrupt(
                        f"weight version {head['version']}: the bus's copy of bucket {index} does"
                        " not match the publisher's checksum; not applied"
                    )
        names = meta.get("names")
        if names is not None and list(state) != names:
            state = {name: state[name] for name in names}
        return int(head["version"]), state


def _read_verified(path: Path, meta: dict[str, Any], *, only: int | None = None) -> dict[str, Any]:
    """The tensors of a version file (bucket ``only``, or all), bucket by bucket, each bucket
    checked against its checksum; ``WeightsCorrupt`` when one does not match."""
    from safetensors import safe_open

    state: dict[str, Any] = {}
    with safe_open(str(path), framework="pt") as f:
        for index, layout in enumerate(meta["layout"]):
            if only is not None and index != only:
                continue
            tensors = [f.get_tensor(f"{index}/{name}") for name, _, _ in layout]
            if bucket_digest(tensors) != int(meta["digests"][index]):
                raise WeightsCorrupt(f"{path}: bucket {index} does not match its checksum")
            state.update({name: t for (name, _, _), t in zip(layout, tensors, strict=True)})
    names = meta.get("names")
    if only is not None or names is None:
        return state
    return {name: state[name] for name in names}


__all__ = [
    "PlaneOptions",
    "WeightPublisher",
    "WeightSubscriber",
    "bucket_digest",
    "plane_host",
    "plane_options",
]
