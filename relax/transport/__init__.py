"""Moving bytes and tensors: one wire format (msgpack header + raw tensor buffers, never pickle)
and message RPC over it, the transport chosen by URL scheme (``inproc://``, ``tcp://``,
``ipc://``; see :mod:`relax.transport._rpc`); ``nccl://`` tensor groups (:func:`open_group`);
and the default torch.distributed world a gang shares (:func:`init_world`, with
:func:`broadcast_bytes` and :func:`all_gather_bytes` over it).
"""

from relax.transport._rendezvous import (
    local_address_towards,
    release_named_store,
    reserve_named_store,
)
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
    "all_gather_bytes",
    "broadcast_bytes",
    "connect",
    "dumps",
    "dumps_parts",
    "init_world",
    "loads",
    "local_address_towards",
    "open_group",
    "release_named_store",
    "reserve_named_store",
    "serve",
]

# Names whose modules import torch, loaded only when asked for, so processes that never move
# tensors (a supervisor, the bus, `relax status`) import this package quickly.
_LAZY = {
    "TensorGroup": "relax.transport._group",
    "open_group": "relax.transport._group",
    "init_world": "relax.transport._collective",
    "broadcast_bytes": "relax.transport._collective",
    "all_gather_bytes": "relax.transport._collective",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'relax.transport' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
