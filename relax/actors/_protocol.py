"""The small protocol between a supervisor and an actor hosted in a child process.

Every message is one wire-format frame (``relax.transport.dumps``) holding a dict with ``t``
(its type), ``from`` (sender identity) and ``seq`` (per-sender sequence number)::

    child  -> parent   hello{token, pid}  started  start_failed{exit}  hb
                       reply{id, ok, value | error}  exit{exit}
    parent -> child    init{target, args, kwargs, id, rank, size, hb, placement, env}
                       call{id, m, a, k}
                       cast{m, a, k}  stop  bye

The child proves it was started by this parent with a one-time token passed in its
environment; the IPC socket lives in a private (0700) directory.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
from typing import Any, get_args

import pynng

from relax.actors._exit import Exit, ExitKind
from relax.errors import PeerGone, TransportError, register_exit_decoder
from relax.transport import dumps, loads

ENV_ADDR = "RELAX_HOST_ADDR"
ENV_TOKEN = "RELAX_HOST_TOKEN"
ENV_PRELOAD = "RELAX_HOST_PRELOAD"
"""The actor's import path, which a spare child imports before its hello (see ``Process``)."""
STACKS_SIGNAL = signal.SIGUSR1
"""Sent to a child that did not stop when asked, just before its SIGKILL: it writes every
thread's stack to its log (``faulthandler``)."""

_KINDS = frozenset(get_args(ExitKind))
_EXIT_FIELDS = (
    "kind",
    "message",
    "error_type",
    "traceback",
    "exit_code",
    "signal",
    "member",
    "at",
    "fatal",
)


class Channel:
    """A pynng PAIR socket speaking the protocol above; maps pynng errors into ours."""

    def __init__(self, sock: pynng.Socket, identity: str) -> None:
        self.sock = sock
        self.identity = identity
        self._seq = itertools.count()

    async def send(self, kind: str, **fields: Any) -> None:
        frame = dumps({"t": kind, "from": self.identity, "seq": next(self._seq), **fields})
        try:
            await self.sock.asend(frame)
        except pynng.Closed as exc:
            raise PeerGone(f"{self.identity}: channel closed") from exc
        except pynng.NNGException as exc:
            raise TransportError(f"{self.identity}: send failed: {exc}") from exc

    async def recv(self) -> dict[str, Any]:
        """The next well-formed message; corrupt frames raise ``TransportError``."""
        try:
            frame = await self.sock.arecv()
        except asyncio.CancelledError:
            raise
        except pynng.Closed as exc:
            raise PeerGone(f"{self.identity}: channel closed") from exc
        except pynng.NNGException as exc:
            raise TransportError(f"{self.identity}: receive failed: {exc}") from exc
        msg = loads(frame)
        if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
            raise TransportError(f"{self.identity}: frame is not a protocol message")
        return msg

    def close(self) -> None:
        self.sock.close()


def exit_to_wire(exit_: Exit) -> dict[str, Any]:
    return {name: getattr(exit_, name) for name in _EXIT_FIELDS}


def exit_from_wire(data: Any) -> Exit:
    """Rebuild an ``Exit`` from a peer's dict, accepting only known fields of sane types."""
    if not isinstance(data, dict):
        return Exit("exception", "peer sent an unreadable exit reason")
    fields = {k: data[k] for k in _EXIT_FIELDS if k in data}
    if fields.get("kind") not in _KINDS:
        fields["kind"] = "exception"
    if not isinstance(fields.get("fatal", False), bool):
        fields["fatal"] = False
    try:
        return Exit(**fields)
    except TypeError:
        return Exit("exception", str(data.get("message", "")))


register_exit_decoder(exit_from_wire)
