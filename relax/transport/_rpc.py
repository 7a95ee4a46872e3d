"""Message RPC, the transport chosen by URL scheme.

``serve(url, handler)`` answers requests with ``await handler(payload, peer)``;
``connect(url)`` returns a client whose ``request(payload)`` returns the handler's reply.
Payloads are anything ``relax.transport.dumps`` accepts (msgpack types and torch tensors).

- ``inproc://NAME`` — same process, no serialization: objects are handed over by reference
  (:mod:`relax.transport._inproc`).
- ``tcp://HOST:PORT`` (port 0 picks a free one; ``Server.url`` tells which), ``ipc:///path`` —
  NNG REQ/REP through contexts, so one client has many requests in flight and one server serves
  many clients at once (:mod:`relax.transport._rpc_server`, :mod:`relax.transport._rpc_client`).

What callers can rely on: a handler's exception comes back rebuilt (builtin and Relax types as
themselves, others as ``RemoteError``); each request is handled once while the server lives
(NNG resends are deduplicated); messages above ``Limits.frame_bytes`` travel in frames and are
handed over only when complete; ``MessageTooLarge`` is raised before sending anything too big;
with a secret, each connection authenticates both ways (HMAC-SHA256 challenge-response) before
any request is handled; errors are always Relax's (``relax.errors``), never pynng's.
"""

from __future__ import annotations

import os
import secrets
import socket
from urllib.parse import urlsplit

from relax.transport._auth import check_bind, normalize_secret
from relax.transport._inproc import InprocClient, InprocServer
from relax.transport._rpc_base import DEFAULT_LIMITS, Client, Handler, Limits, Peer, Server
from relax.transport._rpc_client import NngClient
from relax.transport._rpc_frames import MAX_CLIENT_ID
from relax.transport._rpc_server import NngServer

_NNG_SCHEMES = frozenset({"tcp", "tcp4", "tcp6", "ipc"})


def _scheme(url: str) -> str:
    scheme = urlsplit(url).scheme
    if scheme != "inproc" and scheme not in _NNG_SCHEMES:
        raise ValueError(
            f"unsupported URL {url!r}: use inproc://NAME, tcp://HOST:PORT or ipc:///path"
        )
    return scheme


def _inproc_name(url: str) -> str:
    name = url[len("inproc://") :]
    if not name:
        raise ValueError(f"inproc URL {url!r} has no name")
    return name


async def serve(
    url: str,
    handler: Handler,
    *,
    secret: str | bytes | None = None,
    limits: Limits = DEFAULT_LIMITS,
    concurrency: int = 64,
    raw_tensors: bool = False,
) -> Server:
    """Serve ``handler`` at ``url`` until the returned server is closed.

    With ``raw_tensors`` the handler receives tensors as ``RawTensor`` views of the received
    frame (no copy, no torch): for services that store and forward tensors without reading
    them. ``inproc://`` hands objects over as they are either way.

    ``tcp://`` binds exactly where the URL says and refuses (``ValueError``) a non-loopback
    host without a ``secret``. At most ``concurrency`` handlers run at once; further requests
    wait. A bound address raises ``TransportError``.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    key = normalize_secret(secret)
    if _scheme(url) == "inproc":
        inproc = InprocServer(_inproc_name(url), handler, secret=key, concurrency=concurrency)
        inproc.start()
        return inproc
    check_bind(url, key)
    server = NngServer(
        url, handler, secret=key, limits=limits, concurrency=concurrency, raw_tensors=raw_tensors
    )
    await server.start()
    return server


async def connect(
    url: str,
    *,
    secret: str | bytes | None = None,
    limits: Limits = DEFAULT_LIMITS,
    client_id: str | None = None,
    connect_timeout: float = 10.0,
) -> Client:
    """Connect to the server at ``url`` (waiting up to ``connect_timeout`` for it).

    Raises ``PeerGone`` if no server answers in time and ``AuthFailed`` if the secrets differ
    (a client with a secret also refuses a server that cannot prove it holds the same one).
    ``client_id`` names this client to the server (``Peer.id``); by default host:pid:random.
    """
    scheme = _scheme(url)
    if client_id is None:
        client_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
    if len(client_id) > MAX_CLIENT_ID:
        raise ValueError(f"client_id longer than {MAX_CLIENT_ID} characters")
    key = normalize_secret(secret)
    client: InprocClient | NngClient
    if scheme == "inproc":
        client = InprocClient(
            _inproc_name(url), secret=key, client_id=client_id, connect_timeout=connect_timeout
        )
    else:
        client = NngClient(
            url, secret=key, limits=limits, client_id=client_id, connect_timeout=connect_timeout
        )
    await client.start()
    return client


__all__ = ["Client", "Handler", "Limits", "Peer", "Server", "connect", "serve"]
