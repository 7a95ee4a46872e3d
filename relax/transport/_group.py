"""``nccl://`` tensor groups: a private torch.distributed group for moving tensor bytes.

The weights channel sends its control messages (which version, which tensors) over the
message RPC; the raw bytes of a state dict travel here, over NCCL when the group lives on a
CUDA device and over gloo on CPU. Both backends take the same code path.

How the group is built without touching torch.distributed's default group: rank 0 hosts a
``TCPStore`` on the URL's host and port (on a listening socket we bind ourselves, because
TCPStore on its own listens on every interface); every rank wraps it in a ``PrefixStore``
named after the group and constructs the backend object directly
(``ProcessGroupGloo(store, rank, size, options)`` / ``ProcessGroupNCCL(...)``), the way
``torch.distributed.new_group`` does internally, but without ``init_process_group``. Nothing
is registered globally, so a trainer already inside a DeepSpeed world is unaffected and
``torch.distributed.is_initialized()`` keeps its value. (The store: ``_rendezvous``; the
backend object: ``_group_backend``.)

Every operation starts with a *handshake*: an all-gather of a small int64 header (protocol,
operation kind, source rank, sequence number, tensor count, byte count, a digest of dtypes and
shapes). Each rank then knows whether everybody is doing the same operation with matching
buffers before a single payload byte moves, so a receiver with wrong buffers gets a clear
``TransportError`` (on every rank, and the group stays usable) instead of garbage or a hang
(the header and its checks: ``_group_header``). After the handshake every rank is inside the
operation, so the payload (sent in 16 MiB chunks) gets a short "no progress" limit,
``stall_timeout``, instead of the whole ``timeout``: gloo does not notice a peer that is
SIGKILLed mid-transfer until the collective times out.

Errors, named by what the caller does next:

- ``PeerGone``: a peer died, never joined, did not take part within ``timeout``, or a payload
  chunk stalled past ``stall_timeout`` (torch's ``RuntimeError``/``DistError`` from the
  backend or the store, mapped here). A collective that half happened leaves the group
  unusable: close it and open a new one (new rendezvous). Plain slowness is reported the same
  way, not as ``CallTimeout``, because the remedy is the same: a gloo/NCCL collective cannot
  be retried on a group where one side gave up.
- ``TransportError``: the ranks disagree (different operations, source or buffer layouts), the
  group is closed, or the store's address cannot be bound. Layout disagreements leave the
  group usable.
- ``ValueError``/``TypeError``: bad arguments on this rank; the other ranks get a
  ``TransportError`` naming this rank, and the group stays usable.

Collectives block, so each group runs them, in order, on its own daemon thread
(``_group_worker``); the asyncio loop keeps serving (heartbeats) during a 50 MB transfer.
Cancelling an awaiting coroutine does not cancel the collective: it finishes (or times out) on
the group's thread, later operations queue behind it, and the ranks stay in step. Its buffers
must not be reused until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from relax.errors import PeerGone, TransportError
from relax.transport._group_backend import build_backend, parse_url, pick_device, shutdown_backend
from relax.transport._group_header import (
    CHUNK,
    KIND_BARRIER,
    KIND_BROADCAST,
    KIND_BUCKET,
    KIND_NAMES,
    KIND_OPEN,
    Layout,
    check_headers,
    header,
    peer_gone,
    validate,
)
from relax.transport._group_worker import GRACE_S, Worker, consume
from relax.transport._rendezvous import release_named_store


class TensorGroup:
    """A private torch.distributed process group for moving tensors between processes.

    Made by :func:`open_group`. Every method is a collective: all ``world_size`` ranks call
    the same methods in the same order. ``timeout`` defaults to the one given to
    ``open_group`` and bounds the whole operation; it never waits forever.
    """

    rank: int
    world_size: int
    backend: str
    """``"nccl"`` or ``"gloo"``."""
    device: torch.device
    url: str
    name: str

    def __init__(
        self,
        *,
        url: str,
        name: str,
        rank: int,
        world_size: int,
        device: torch.device,
        backend: str,
        pg: Any,
        store: Any,
        store_key: tuple[str, int] | None,
        worker: Worker,
        timeout: float,
        stall_timeout: float,
    ) -> None:
        self.url, self.name = url, name
        self.rank, self.world_size = rank, world_size
        self.device, self.backend = device, backend
        self._pg, self._store, self._store_key = pg, store, store_key
        self._worker, self._timeout, self._stall = worker, timeout, stall_timeout
        self._seq = 0  # operations issued; every rank's header must agree on it
        self._longest = timeout  # the longest timeout an operation was given
        self._broken: str | None = None
        self._closed = False
        self._pending: set[asyncio.Future[Any]] = set()
        self._bucket_buffer: torch.Tensor | None = None  # only touched on the group's thread
        self._stats = {"operations": 0, "collectives": 0, "bytes": 0, "seconds": 0.0}

    # ----------------------------------------------------------------- public API

    async def broadcast(
        self, tensors: list[torch.Tensor], *, src: int = 0, timeout: float | None = None
    ) -> list[torch.Tensor]:
        """Broadcast ``tensors`` from rank ``src``, one collective per tensor.

        On ``src`` the tensors are sent; on the other ranks they are receive buffers of the
        same dtypes and shapes, filled in place and returned. Tensors may be non-contiguous or
        on another device than the group's; they are staged through a contiguous copy.
        """
        return await self._operation(KIND_BROADCAST, tensors, src, timeout)

    async def broadcast_bucket(
        self, tensors: list[torch.Tensor], *, src: int = 0, timeout: float | None = None
    ) -> list[torch.Tensor]:
        """Like :meth:`broadcast`, but packs all tensors into one byte buffer: one collective.

        Mixed dtypes are fine. The sender copies the tensors into one contiguous ``uint8``
        buffer (64-byte aligned slots), the receivers split it into their buffers, so a state
        dict of hundreds of small tensors costs a handshake and a single broadcast. Memory: the
        byte buffer (the largest bucket so far) is kept for reuse until :meth:`aclose`; split
        huge state dicts into several buckets.
        """
        return await self._operation(KIND_BUCKET, tensors, src, timeout)

    async def barrier(self, timeout: float | None = None) -> None:
        """Return once every rank has reached the barrier."""
        await self._operation(KIND_BARRIER, [], 0, timeout)

    def statistics(self) -> dict[str, Any]:
        """Counters since open: operations, collectives, payload bytes, seconds in collectives.

        ``bytes`` counts payload bytes sent (on the source) or received (elsewhere);
        ``bytes_per_second`` is their ratio to ``seconds``.
        """
        stats: dict[str, Any] = dict(self._stats)
        stats["bytes_per_second"] = stats["bytes"] / stats["seconds"] if stats["seconds"] else 0.0
        stats.update(
            rank=self.rank,
            world_size=self.world_size,
            backend=self.backend,
            broken=self._broken,
            closed=self._closed,
        )
        return stats

    async def aclose(self) -> None:
        """Release the group on this rank (local, not a collective). Idempotent.

        Waits for an operation still running on the group's thread (bounded by its timeout).
        """
        if self._closed:
            return
        self._closed = True
        if self._pending:
            # Bounded even if nobody awaits the operation any more (its caller was cancelled)
            # and the backend ignores its timeout: then abort it, which makes it return.
            _, stuck = await asyncio.wait(set(self._pending), timeout=self._longest + GRACE_S)
            if stuck:
                with contextlib.suppress(Exception):
                    self._pg.abort()
        pg, self._pg = self._pg, None
        self._worker.submit(functools.partial(shutdown_backend, pg))
        del pg
        self._worker.stop()
        # Joined, so the backend and rank 0's store are really released when we return (the
        # port can be reused at once); bounded, in case a backend is stuck in C++.
        await asyncio.to_thread(self._worker.join, GRACE_S)
        self._store = self._bucket_buffer = None
        if self._store_key is not None:
            release_named_store(*self._store_key)
            self._store_key = None

    async def __aenter__(self) -> TensorGroup:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return (
            f"TensorGroup({self.url!r}, name={self.name!r}, rank={self.rank}, "
            f"world_size={self.world_size}, backend={self.backend!r})"
        )

    # ----------------------------------------------------------------- machinery

    async def _operation(
        self, kind: int, tensors: Sequence[torch.Tensor], src: int, timeout: float | None
    ) -> list[torch.Tensor]:
        if self._closed:
            raise TransportError(f"{self!r} is closed")
        if self._broken is not None:
            raise PeerGone(f"{self!r} is unusable since {self._broken}; close it and open anew")
        if not 0 <= src < self.world_size:
            raise ValueError(f"src={src} is not a rank of a group of {self.world_size}")
        timeout = self._timeout if timeout is None else float(timeout)
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        tensors = list(tensors)
        problem = validate(tensors)
        if problem is not None:
            # Still take part in the handshake, so the peers learn at once instead of timing out.
            tensors = []
        seq = self._seq
        self._seq += 1
        self._longest = max(self._longest, timeout)
        return await self._run(
            lambda: self._collective(kind, tensors, src, seq, timeout, problem),
            f"{KIND_NAMES[kind]} #{seq}",
            timeout,
        )

    async def _run(self, job: Callable[[], Any], what: str, timeout: float) -> Any:
        loop = asyncio.get_running_loop()
        started = asyncio.Event()

        def wrapped() -> Any:
            loop.call_soon_threadsafe(started.set)
            return job()

        future = asyncio.wrap_future(self._worker.submit(wrapped), loop=loop)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        future.add_done_callback(consume)  # a cancelled caller never reads the outcome
        # Cancelling the caller must not drop a queued collective, or the ranks would fall
        # out of step: neither wait below cancels what it waits for (asyncio.wait, shield),
        # so the job runs (or times out) on the group's thread regardless.
        waiter = asyncio.ensure_future(started.wait())
        try:
            while not started.is_set():
                await asyncio.wait({waiter}, timeout=1.0)
                if self._broken is not None and not started.is_set():
                    # The operation ahead of us hung and was abandoned; this one never runs.
                    raise PeerGone(f"{self!r} is unusable since {self._broken}; close it")
        finally:
            waiter.cancel()
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout + GRACE_S)
        except asyncio.TimeoutError:
            # The backend ignored its own timeout (an NCCL hang). Abort it so the thread
            # returns, and give up on the group.
            self._broken = f"{what} hung past its {timeout:g} s timeout"
            with contextlib.suppress(Exception):
                self._pg.abort()
            raise PeerGone(f"{self!r}: {self._broken}") from None

    def _collective(
        self,
        kind: int,
        tensors: list[torch.Tensor],
        src: int,
        seq: int,
        timeout: float,
        problem: Exception | None,
    ) -> list[torch.Tensor]:
        """Runs on the group's thread: prepare, handshake, payload, unpack."""
        deadline = time.monotonic() + timeout
        what = f"{self!r}: {KIND_NAMES[kind]} #{seq}"
        if self._broken is not None:  # an earlier queued operation broke the group
            raise PeerGone(f"{self!r} is unusable since {self._broken}; close it and open anew")
        layout = Layout.of(tensors)
        with torch.no_grad():  # receive buffers may be parameters that require grad
            # Everything slow (packing, staging, allocating) happens before the handshake, so
            # once every rank has passed it the payload flows at once on all of them, and a
            # chunk that makes no progress for `stall_timeout` means a peer died mid-transfer.
            payload: list[torch.Tensor] = []
            unpack: list[tuple[torch.Tensor, torch.Tensor]] = []  # (from, into) on receivers
            if problem is None and kind == KIND_BUCKET:
                payload, unpack = self._prepare_bucket(tensors, layout, src)
            elif problem is None and kind == KIND_BROADCAST:
                payload, unpack = self._prepare_each(tensors, src)
            fields = header(kind, src, seq, self.world_size, problem is None, len(tensors), layout)
            mine = torch.tensor(fields, dtype=torch.int64, device=self.device)
            out = [torch.empty_like(mine) for _ in range(self.world_size)]
            self._wait(what, timeout, deadline, None, lambda t: self._pg.allgather(out, mine, t))
            broken, error = check_headers([t.cpu().tolist() for t in out], self.rank, what)
            if broken is not None:
                self._broken = broken
            if error is not None:
                raise error
            if problem is not None:
                raise problem
            for flat in payload:
                for start in range(0, flat.numel(), CHUNK):
                    chunk = flat[start : start + CHUNK]
                    self._wait(
                        what,
                        timeout,
                        deadline,
                        self._stall,
                        lambda t, c=chunk: self._pg.broadcast(c, src, t),
                    )
            for wire, t in unpack:
                t.copy_(wire)
        if kind in (KIND_BUCKET, KIND_BROADCAST):
            self._stats["operations"] += 1
            self._stats["bytes"] += sum(layout.nbytes)
        return tensors

    def _prepare_bucket(
        self, tensors: list[torch.Tensor], layout: Layout, src: int
    ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        if layout.total == 0:
            return [], []
        # Reused across calls: a fresh 50 MB buffer costs more in page faults (~15 ms on CPU)
        # than the copy into it (~3 ms), and a weights channel sends the same size every time.
        if self._bucket_buffer is None or self._bucket_buffer.numel() < layout.total:
            self._bucket_buffer = None  # free the old one before allocating the bigger one
            self._bucket_buffer = torch.empty(layout.total, dtype=torch.uint8, device=self.device)
        buf = self._bucket_buffer[: layout.total]
        slots = [
            buf[o : o + n].view(t.dtype).view(t.shape)
            for t, o, n in zip(tensors, layout.offsets, layout.nbytes, strict=True)
        ]
        if self.rank == src:
            for slot, t in zip(slots, tensors, strict=True):
                slot.copy_(t)  # any strides, any device
            return [buf], []
        return [buf], list(zip(slots, tensors, strict=True))

    def _prepare_each(
        self, tensors: list[torch.Tensor], src: int
    ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        payload, unpack = [], []
        for t in tensors:
            if t.numel() == 0:
                continue
            wire = t
            if not (t.is_contiguous() and t.device == self.device):
                # Staged through a contiguous copy on the group's device (clone: .to() may
                # return t itself, and a receiver must never receive into a strided view).
                wire = t.to(self.device).clone(memory_format=torch.contiguous_format)
                if self.rank != src:
                    unpack.append((wire, t))
            payload.append(wire.reshape(-1).view(torch.uint8))
        return payload, unpack

    def _wait(
        self,
        what: str,
        timeout: float,
        deadline: float,
        stall: float | None,
        issue: Callable[[datetime.timedelta], Any],
    ) -> None:
        """Issue one backend collective and wait for it, mapping torch's errors at the edge."""
        left = deadline - time.monotonic()
        stalled = stall is not None and stall < left
        # gloo needs a positive timeout; a collective that starts with none left fails fast.
        limit = datetime.timedelta(seconds=max(min(left, stall) if stalled else left, 0.001))
        start = time.perf_counter()
        try:
            issue(limit).wait(limit)
            if self.device.type == "cuda":
                # NCCL's wait orders the current stream only; the caller reads the buffers
                # from another thread, so wait for the bytes themselves.
                torch.cuda.current_stream(self.device).synchronize()
        except RuntimeError as exc:  # DistError, DistBackendError and gloo's plain RuntimeError
            self._broken = f"{what} failed: {exc}".splitlines()[0]
            if stalled:
                late = f"the transfer made no progress for {stall:g} s (a peer died or hung)"
            else:
                late = f"a peer did not take part within {timeout:g} s"
            raise peer_gone(what, exc, late) from exc
        finally:
            self._stats["collectives"] += 1
            self._stats["seconds"] += time.perf_counter() - start


async def open_group(
    url: str,
    *,
    rank: int,
    world_size: int,
    timeout: float = 60.0,
    device: str | torch.device | None = None,
    stall_timeout: float = 5.0,
) -> TensorGroup:
    """Join the tensor group at ``url`` (``nccl://HOST:PORT[/NAME]``) as ``rank``.

    Rank 0 hosts the rendezvous store on ``HOST:PORT`` (bound to that address only); the others
    connect to it. All ``world_size`` ranks must call this; it returns once all have joined and
    raises ``PeerGone`` if they have not within ``timeout`` seconds, which is also every later
    operation's default timeout. ``NAME`` (default ``"default"``) separates groups that rank 0
    hosts on one port; names are single-use while that store lives.

    ``device``: ``"cuda[:i]"`` gives an NCCL group (one distinct GPU per rank), ``"cpu"`` a
    gloo group; ``None`` picks CUDA when available, else CPU.

    ``stall_timeout``: once every rank has entered an operation (the handshake), how long a
    16 MiB payload chunk may take before the peer counts as gone. Far shorter than
    ``timeout``, which must also cover peers arriving late; gloo itself notices a peer that
    dies mid-transfer only at the operation's timeout.
    """
    host, port, name = parse_url(url)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of world_size {world_size}")
    if timeout <= 0 or stall_timeout <= 0:
        raise ValueError(f"timeouts must be positive, got {timeout} and {stall_timeout}")
    dev, backend = pick_device(device)
    opened_at = time.monotonic()
    worker = Worker(f"relax-group-{name}-r{rank}")
    key = (host, port) if rank == 0 else None

    abort = threading.Event()
    build = functools.partial(
        build_backend,
        url,
        rank=rank,
        world_size=world_size,
        backend=backend,
        timeout=timeout,
        abort=abort,
    )
    try:
        store, pg = await asyncio.wrap_future(worker.submit(build))
    except BaseException:
        abort.set()  # cancelled (rank 0): stop waiting for the others, free the thread
        worker.stop()
        # Joined: a daemon thread still dropping tensors while the interpreter finalizes
        # aborts the process ("terminate called without an active exception").
        await asyncio.to_thread(worker.join, GRACE_S)
        raise
    group = TensorGroup(
        url=url,
        name=name,
        rank=rank,
        world_size=world_size,
        device=dev,
        backend=backend,
        pg=pg,
        store=store,
        store_key=key,
        worker=worker,
        timeout=timeout,
        stall_timeout=stall_timeout,
    )
    try:
        # A first collective proves every rank is there and agrees on the world size, and
        # makes NCCL build its communicator now rather than in the first real transfer.
        left = max(timeout - (time.monotonic() - opened_at), 0.001)
        await group._operation(KIND_OPEN, [], 0, left)
    except BaseException:
        await group.aclose()
        raise
    return group


__all__ = ["TensorGroup", "open_group"]
