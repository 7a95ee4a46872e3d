"""Moving bytes and tensors: one wire format (msgpack header + raw tensor buffers, never pickle)
and message RPC over it, the transport chosen by URL scheme (``inproc://``, ``tcp://``,
``ipc://``; see :mod:`relax.transport._rpc`).
"""

from relax.transport._rpc import connect, serve
from relax.transport._rpc_base import Client, Handler, Limits, Peer, Server
from relax.transport._wire import RawTensor, dumps, dumps_parts, loads

__all__ = [
    "Client",
    "Handler",
    "Limits",
    "Peer",
    "RawTensor",
    "Server",
    "TensorGroup",
    "connect",
    "dumps",
    "dumps_parts",
    "loads",
    "open_group",
    "serve",
]


def __getattr__(name: str) -> object:
    # The tensor group imports torch; load it only when asked for, so processes that never
    # move tensors (a supervisor, the bus) import this package quickly.
    if name in ("TensorGroup", "open_group"):
        from relax.transport import _group

        return getattr(_group, name)
    raise AttributeError(f"module 'relax.transport' has no attribute {name!r}")
