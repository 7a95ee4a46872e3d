"""What the RPC server remembers per client session to handle each request exactly once, and
requests being reassembled from several frames. See ``_rpc_server`` for the protocol.

The cache is bounded: ``REPLY_CACHE`` reply bodies and ``REMEMBERED_IDS`` finished request ids
per session. Bodies go as soon as the client acknowledges them (its next requests carry
``ack_below``, its lowest request id still waiting, and ``acks``, finished ids above it); the
ids of evicted bodies are kept so that a duplicate is refused rather than run again.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import OrderedDict, deque
from typing import Any

from relax.transport._rpc_base import Peer
from relax.transport._rpc_frames import encode

REPLY_CACHE = 1024
"""Reply bodies kept per client session until the client acknowledges them."""
REMEMBERED_IDS = 65536
"""Finished request ids remembered per client session (to refuse, not re-run, duplicates)."""


class Reply:
    """An encoded reply, kept as wire-format parts (a returned tensor is not copied)."""

    __slots__ = ("ok", "parts", "size")

    def __init__(self, ok: bool, payload: Any) -> None:
        self.ok = ok
        self.parts, self.size = encode(payload)


class Session:
    """Dedup state of one client session."""

    __slots__ = (
        "bodies",
        "client_id",
        "done",
        "floor",
        "heap",
        "inflight",
        "last_seen",
        "order",
        "peer",
        "peer_pipe",
    )

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self.floor = 0  # every rid below this was received or abandoned by the client
        self.inflight: dict[int, asyncio.Future[Reply] | None] = {}
        self.done: OrderedDict[int, Reply | None] = OrderedDict()  # None: body evicted
        self.heap: list[int] = []  # rids in `done`, to drop them when the floor passes
        self.order: deque[int] = deque()  # rids with a body, oldest first, to evict bodies
        self.bodies = 0
        self.last_seen = time.monotonic()
        self.peer: Peer | None = None  # made once per connection, not per request
        self.peer_pipe = -1

    def advance(self, ack_below: int) -> None:
        if ack_below <= self.floor:
            return
        self.floor = ack_below
        heap, done = self.heap, self.done
        while heap and heap[0] < ack_below:
            if done.pop(heapq.heappop(heap), None) is not None:
                self.bodies -= 1

    def forget(self, acks: list[Any]) -> None:
        """Drop the bodies of replies the client has (the ids stay, to refuse duplicates)."""
        done = self.done
        for rid in acks:
            if type(rid) is int and done.get(rid) is not None:
                done[rid] = None
                self.bodies -= 1

    def complete(self, rid: int, reply: Reply) -> None:
        self.inflight.pop(rid, None)
        if rid < self.floor:
            return  # its client gave up on it; a late duplicate is refused as stale
        self.done[rid] = reply
        heapq.heappush(self.heap, rid)
        self.order.append(rid)
        self.bodies += 1
        while self.bodies > REPLY_CACHE and self.order:
            old = self.order.popleft()
            if self.done.get(old) is not None:
                self.done[old] = None
                self.bodies -= 1
        while len(self.done) > REMEMBERED_IDS:
            if self.done.popitem(last=False)[1] is not None:
                self.bodies -= 1
        if len(self.heap) > 2 * REMEMBERED_IDS:
            self.heap = list(self.done)
            heapq.heapify(self.heap)
        if len(self.order) > 2 * REPLY_CACHE:
            self.order = deque(r for r in self.order if self.done.get(r) is not None)


class Partial:
    """A request arriving in several frames, reassembled in one buffer that grows as its
    bytes arrive (``total`` is only what the sender announced: memory is not taken on its
    word)."""

    __slots__ = ("buf", "pipe", "received", "total", "touched")

    def __init__(self, total: int, pipe: int) -> None:
        self.buf = bytearray()
        self.total = total
        self.received = 0
        self.pipe = pipe
        self.touched = time.monotonic()
