"""Moving bytes and tensors: one wire format (msgpack header + raw tensor buffers, never pickle)
and message RPC over it, the transport chosen by URL scheme (``inproc://``, ``tcp://``,
``ipc://``; see :mod:`relax.transport._rpc`).
"""

from relax.transport._rpc import connect, serve
from relax.transport._rpc_base import Client, Handler, Limits, Peer, Server
from relax.transport._wire import dumps, loads

__all__ = ["Client", "Handler", "Limits", "Peer", "Server", "connect", "dumps", "loads", "serve"]
