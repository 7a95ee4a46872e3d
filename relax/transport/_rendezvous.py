"""Where ranks meet: hosting and joining the ``TCPStore`` a torch.distributed world is built on.

One hosting path for every store Relax runs (a tensor group's, a gang's): rank 0 binds the
listening socket itself, on the given address only (``TCPStore`` on its own listens on every
interface), and hands its descriptor to the store; port 0 takes the port the kernel picks, so
no other process can take it between picking and binding. The other ranks wait until the
store accepts connections, then connect.

A tensor group's store may carry several groups that rank 0 hosts on one ``(host, port)``;
:func:`host_named_store` shares one server between them and keeps their names apart.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from relax.errors import TransportError


def local_address_towards(host: str, port: int) -> str:
    """The local IP that routes to ``host``: where gloo should listen so rank 0 can reach us.

    A UDP ``connect`` sends nothing; it only asks the kernel for the route. On loopback this is
    127.0.0.1, so tests never listen on a public interface.
    """
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(addr)
        return str(probe.getsockname()[0])


def wait_for_listener(host: str, port: int, deadline: float) -> None:
    """Wait until rank 0's store accepts connections, or raise ``TimeoutError`` at deadline.

    TCPStore's client does retry by itself, but it overshoots its timeout (it retries once
    after timing out) and logs a C++ stack trace for every failed try; rank 0 starting a
    little later than the others is normal, not worth a trace.
    """
    delay = 0.01
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"timed out: nothing listens on {host}:{port}")
        try:
            socket.create_connection((host, port), timeout=left).close()
            return
        except OSError:
            time.sleep(min(delay, max(deadline - time.monotonic(), 0)))  # connect backoff
            delay = min(delay * 2, 0.2)


def host_store(
    host: str,
    port: int,
    timeout: datetime.timedelta,
    *,
    world_size: int | None = None,
    what: str = "store",
) -> tuple[Any, int]:
    """Rank 0's ``TCPStore`` listening on ``host:port`` only; returns ``(store, port)``.

    ``port`` 0 binds the port the kernel picks (the returned one). ``TransportError`` when the
    address cannot be bound; ``what`` names the store in that message.
    """
    import torch.distributed as dist

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(256)
        bound = int(listener.getsockname()[1])
        store = dist.TCPStore(
            host,
            bound,
            world_size,
            True,
            timeout,
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
    except OSError as exc:
        listener.close()
        raise TransportError(f"cannot host the {what} at {host}:{port}: {exc}") from exc
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns (and closes) the descriptor from now on
    return store, bound


def join_store(
    host: str,
    port: int,
    deadline: float,
    *,
    timeout: datetime.timedelta | None = None,
    world_size: int | None = None,
) -> Any:
    """A client of rank 0's store, once it listens (``TimeoutError`` if not by ``deadline``).

    ``timeout`` bounds the store's own operations; by default, whatever is left until
    ``deadline``.
    """
    import torch.distributed as dist

    wait_for_listener(host, port, deadline)
    if timeout is None:
        timeout = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
    return dist.TCPStore(host, port, world_size, False, timeout)


# rank 0's store servers, shared by the groups this process hosts on one (host, port); the
# PrefixStore keeps their keys apart. Names are single-use per server: gloo's rendezvous keys
# stay in the store, and a second group of the same name would read the first one's.
@dataclass
class _StoreServer:
    store: Any
    names: set[str] = field(default_factory=set)
    users: int = 0


_servers: dict[tuple[str, int], _StoreServer] = {}
_servers_lock = threading.Lock()


def host_named_store(host: str, port: int, name: str, timeout: datetime.timedelta) -> Any:
    """Rank 0's store on ``host:port`` for the group ``name``, shared with the other groups
    hosted there; give it back with :func:`release_named_store`."""
    with _servers_lock:
        server = _servers.get((host, port))
        if server is None:
            store, _ = host_store(host, port, timeout, what="group store")
            server = _servers[(host, port)] = _StoreServer(store)
        if name in server.names:
            raise TransportError(
                f"a group named {name!r} was already opened on {host}:{port} while its store "
                "lives; give each group (or each reopening) its own name"
            )
        server.names.add(name)
        server.users += 1
        return server.store


def reserve_named_store(host: str, timeout: datetime.timedelta) -> int:
    """Host a group store on a port the kernel picks on ``host`` and keep it listening until
    :func:`release_named_store`: a process that opens group after group (the weight plane,
    one per membership) announces one address, and no other process can take its port."""
    with _servers_lock:
        store, port = host_store(host, 0, timeout, what="group store")
        _servers[(host, port)] = _StoreServer(store, users=1)
        return port


def release_named_store(host: str, port: int) -> None:
    """One group fewer on ``host:port``'s store; the last one stops it listening."""
    with _servers_lock:
        server = _servers.get((host, port))
        if server is not None:
            server.users -= 1
            if server.users <= 0:
                del _servers[(host, port)]  # the last reference: the server stops listening
