"""Moving bytes and tensors: one wire format (msgpack header + raw tensor buffers, never pickle).

Issue 3 adds the transports chosen by URL scheme (inproc, tcp, ipc, nccl) on top of it.
"""

from relax.transport._wire import dumps, loads

__all__ = ["dumps", "loads"]
