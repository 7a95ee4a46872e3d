"""Frames of the RPC protocol over NNG REQ/REP, and the edge where pynng errors become ours.

A frame is one NNG message::

    b"RRP1" | u16 header length | header (msgpack list, first item = kind) | data

``data`` is a slice of a payload in the wire format (``relax.transport._wire.dumps_parts``), so
a frame carries at most ``frame_bytes`` of payload plus a header of at most ``HEADER_ROOM``
bytes. Frames are written straight into NNG's message buffer from the encoded parts (one copy,
the one ``pynng.Socket.send`` makes too; tensor bytes are not copied before it) and read through
a view of NNG's buffer (no copy at all).

Client -> server                                   Server -> client
  HELLO  [1, cnonce]                                 CHALLENGE [10, snonce?, smac?, frame, max]
  PROOF  [2, cmac]                                   WELCOME   [11]
  PART   [3, client_id, session, rid, ack_below,     RESULT    [12, ok, total] + first chunk
          acks, offset, total, max_chunk] + chunk    ACK       [13]  (part stored, send the next)
  PULL   [4, session, rid, offset, max_chunk]        CHUNK     [14, offset] + chunk
                                                     REFUSED   [15, code, message]
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import msgpack
import pynng

from relax.errors import BadFrame
from relax.transport._rpc_aio import new_message
from relax.transport._wire import dumps_parts

MAGIC = b"RRP1"
_PREFIX = struct.Struct("<4sH")
HEADER_ROOM = 4096
"""Bytes a frame may carry on top of its chunk; ``recv_max_size = frame_bytes + HEADER_ROOM``."""
MAX_CLIENT_ID = 256
SESSION_BYTES = 16
MAX_ACKS = 64
"""Finished request ids one PART frame may acknowledge (besides ``ack_below``)."""

HELLO, PROOF, PART, PULL = 1, 2, 3, 4
CHALLENGE, WELCOME, RESULT, ACK, CHUNK, REFUSED = 10, 11, 12, 13, 14, 15

# Refusal codes (REFUSED frames): what the client does next.
UNAUTHENTICATED = "unauthenticated"  # this connection has not done the handshake: do it, retry
AUTH = "auth"  # the handshake failed: wrong secret
REHELLO = "rehello"  # a PROOF arrived on a connection without a pending HELLO: start over
RESTART = "restart"  # the server holds no partial upload for this request: send it from offset 0
GONE = "gone"  # the server holds no reply for this request: send the request again
EVICTED = "evicted"  # the reply was handled but dropped from the dedup cache
STALE = "stale"  # the request was abandoned by its client (below its acknowledged floor)
TOO_LARGE = "too_large"  # the request exceeds the server's max_message_bytes
BUSY = "busy"  # the server holds as many partial uploads (or bytes of them) as its limits allow
BAD = "bad"  # the frame is malformed

_N = type(None)
# Types of the header fields after the kind, per kind; anything else is a bad frame.
_SCHEMA: dict[int, tuple[Any, ...]] = {
    HELLO: (bytes,),
    PROOF: (bytes,),
    PART: (str, bytes, int, int, list, int, int, int),
    PULL: (bytes, int, int, int),
    CHALLENGE: ((bytes, _N), (bytes, _N), int, int),
    WELCOME: (),
    RESULT: (bool, int),
    ACK: (),
    CHUNK: (int,),
    REFUSED: (str, str),
}


Parts = Sequence[bytes | memoryview]
"""An encoded message as pieces (``relax.transport._wire.dumps_parts``): tensor bytes are not
copied until they are written into a frame."""
_NO_PARTS: Parts = ()


def encode(payload: Any) -> tuple[Parts, int]:
    """``payload`` in the wire format, as parts (byte views) and its total size."""
    parts: Parts = [
        p if isinstance(p, bytes) else memoryview(p).cast("B") for p in dumps_parts(payload)
    ]
    return parts, sum(len(p) for p in parts)


def message(header: list[Any], parts: Parts = _NO_PARTS, start: int = 0, length: int = 0) -> Any:
    """One frame as an ``nng_msg``: ``header`` and bytes ``[start, start + length)`` of the
    concatenated ``parts`` (see :func:`relax.transport._rpc_aio.new_message`)."""
    head = msgpack.packb(header, use_bin_type=True)
    return new_message((_PREFIX.pack(MAGIC, len(head)), head), parts, start, length)


def parse(view: memoryview) -> tuple[list[Any], memoryview]:
    """Header and data (a view, no copy) of a received frame; raises ``BadFrame``."""
    if view.nbytes < _PREFIX.size:
        raise BadFrame(f"frame too short ({view.nbytes} bytes)")
    magic, n_head = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise BadFrame(f"not an RPC frame (magic {bytes(magic)!r})")
    end = _PREFIX.size + n_head
    if end > view.nbytes:
        raise BadFrame("truncated frame header")
    try:
        header = msgpack.unpackb(view[_PREFIX.size : end], raw=False, use_list=True)
    except Exception as exc:  # msgpack raises a zoo of types on corrupt input
        raise BadFrame(f"corrupt frame header: {exc}") from exc
    if not (isinstance(header, list) and header and type(header[0]) is int):
        raise BadFrame("frame header is not a [kind, ...] list")
    schema = _SCHEMA.get(header[0])
    if schema is None or len(header) != len(schema) + 1:
        raise BadFrame(f"unknown frame kind or arity: {header[0]!r}/{len(header)}")
    for value, typ in zip(header[1:], schema, strict=True):
        if not isinstance(value, typ):
            raise BadFrame(f"bad field in frame of kind {header[0]}: {value!r:.40}")
    return header, view[end:]


def close_quietly(obj: pynng.Socket) -> None:
    """Close a pynng socket, ignoring that it may be closed already."""
    try:
        obj.close()
    except pynng.NNGException:
        pass
