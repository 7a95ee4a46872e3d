"""Driving NNG contexts from asyncio directly, through pynng's cffi bindings.

pynng's ``Context.asend``/``arecv`` allocate an NNG aio, a helper object and a shielded future
per operation, and wake the task through an extra event-loop iteration; when their task is
cancelled they raise a fresh bare ``CancelledError`` (which anyio scopes do not recognise) or,
if the cancellation races a completion, lose it altogether (the task carries on). Measured on a
REQ/REP loop, that machinery costs ~20 µs per operation. A :class:`Channel` instead owns one
NNG context and one aio for its whole life, and completes each operation with one
``call_soon_threadsafe`` into a plain future, so cancellation is asyncio's own.

Messages never pass through ``pynng.Message``: :func:`new_message` writes a frame straight into
an ``nng_msg`` (whose ownership passes to NNG on a successful send), and a received message is
handed out as a memoryview of NNG's buffer that frees the message when the last view of it dies.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pynng

from relax.errors import Closed, TransportError

ffi, lib = pynng.ffi, pynng.lib

_SEND, _RECV = 1, 2
_live: set[Channel] = set()
"""Open channels. NNG calls back into a channel's cffi callback until it is closed, so a channel
must never be garbage collected while open (that would free the callback under NNG's feet)."""


def _error(rv: int, what: str) -> TransportError:
    text = ffi.string(lib.nng_strerror(rv)).decode(errors="replace")
    if rv == lib.NNG_ECLOSED:
        return Closed(f"{what}: {text}")
    return TransportError(f"{what}: {text}")


def new_message(head: Sequence[bytes], parts: Sequence[Any], start: int, length: int) -> Any:
    """An ``nng_msg`` holding ``head`` and bytes ``[start, start + length)`` of ``parts``
    concatenated, copied once, straight into NNG's buffer. The caller must send it (which
    passes ownership to NNG) or free it."""
    total = sum(len(h) for h in head) + length
    msg_p = ffi.new("nng_msg **")
    rv = lib.nng_msg_alloc(msg_p, total)
    if rv:
        raise _error(rv, f"cannot allocate a frame of {total} bytes")
    msg = msg_p[0]
    try:
        buf = ffi.buffer(lib.nng_msg_body(msg), total)
        at = 0
        for h in head:
            buf[at : at + len(h)] = h
            at += len(h)
        pos, end = 0, start + length
        for part in parts:
            n = len(part)
            if pos + n > start:
                if pos >= end:
                    break
                a, b = max(start - pos, 0), min(end - pos, n)
                buf[at : at + b - a] = part if (a == 0 and b == n) else memoryview(part)[a:b]
                at += b - a
            pos += n
        if at != total:
            raise ValueError(f"frame range [{start}, {end}) lies outside the message")
    except BaseException:
        lib.nng_msg_free(msg)
        raise
    return msg


def _take(msg: Any) -> tuple[memoryview, int, Any]:
    """A received ``nng_msg`` as (view of its body, pipe id, pipe). The view (and every slice
    of it) keeps the message alive; the last one to go frees it."""
    n = lib.nng_msg_len(msg)
    pipe = lib.nng_msg_get_pipe(msg)
    owner = ffi.gc(ffi.cast("char *", lib.nng_msg_body(msg)), lambda _, m=msg: lib.nng_msg_free(m))
    return memoryview(ffi.buffer(owner, n)), lib.nng_pipe_id(pipe), pipe


class Channel:
    """One NNG context of ``sock`` and one reusable aio: one operation at a time.

    A channel whose operation was cancelled is ``broken`` (NNG may still be finishing it):
    close it and use a new one.
    """

    __slots__ = ("_aio", "_callback", "_ctx", "_future", "_loop", "_op", "broken")

    def __init__(self, sock: pynng.Socket, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._future: asyncio.Future[None] | None = None
        self._op = 0
        self.broken = False
        self._ctx = ffi.new("nng_ctx *")
        rv = lib.nng_ctx_open(self._ctx, sock.socket)
        if rv:
            raise _error(rv, "cannot open an NNG context")
        self._callback = ffi.callback("void(void *)", self._complete)
        aio_p = ffi.new("nng_aio **")
        rv = lib.nng_aio_alloc(aio_p, self._callback, ffi.NULL)
        if rv:
            lib.nng_ctx_close(self._ctx[0])
            raise _error(rv, "cannot allocate an NNG aio")
        self._aio: Any = aio_p[0]
        _live.add(self)

    def _complete(self, _arg: Any) -> None:
        # On an NNG thread: only hop onto the loop.
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed; nobody waits any more
            pass

    def _wake(self) -> None:
        future = self._future
        if future is not None and not future.done():
            future.set_result(None)

    async def _run(self, op: int, start: Any, what: str) -> None:
        if self._aio is None:
            raise Closed(f"{what}: channel closed")
        future = self._future = self._loop.create_future()
        self._op = op
        start(self._ctx[0], self._aio)
        try:
            await future
        except asyncio.CancelledError:
            self.broken = True
            if self._aio is not None:
                lib.nng_aio_cancel(self._aio)
            raise
        finally:
            self._future = None
        if self._aio is None:
            raise Closed(f"{what}: channel closed")
        rv = lib.nng_aio_result(self._aio)
        if rv:
            if op == _SEND:  # NNG did not take the message: it is still ours to free
                lib.nng_msg_free(lib.nng_aio_get_msg(self._aio))
            self._op = 0
            raise _error(rv, what)
        self._op = 0

    async def send(self, msg: Any, what: str = "send") -> None:
        """Send an ``nng_msg`` from :func:`new_message`; NNG owns it from here on."""
        if self._aio is None:
            lib.nng_msg_free(msg)
            raise Closed(f"{what}: channel closed")
        lib.nng_aio_set_msg(self._aio, msg)
        await self._run(_SEND, lib.nng_ctx_send, what)

    async def recv(self, what: str = "receive") -> tuple[memoryview, int, Any]:
        """The next message on this context: (body view, pipe id, pipe)."""
        await self._run(_RECV, lib.nng_ctx_recv, what)
        return _take(lib.nng_aio_get_msg(self._aio))

    def close(self) -> None:
        """Abort the operation in flight (its waiter gets ``Closed``) and free everything."""
        aio = self._aio
        if aio is None:
            return
        lib.nng_aio_cancel(aio)
        lib.nng_aio_wait(aio)  # its callback has run once this returns
        if self._op:  # an operation was cut short: reclaim a message NNG left with us
            rv = lib.nng_aio_result(aio)
            if (self._op == _RECV and rv == 0) or (self._op == _SEND and rv != 0):
                msg = lib.nng_aio_get_msg(aio)
                if msg != ffi.NULL:
                    lib.nng_msg_free(msg)
        self._aio = None
        lib.nng_aio_free(aio)
        lib.nng_ctx_close(self._ctx[0])  # an error here means the socket is already closed
        _live.discard(self)
        self._wake()  # a waiter resumes and finds the channel closed
