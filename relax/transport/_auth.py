"""Shared-secret authentication of a connection, and the rule about where a server may bind.

The handshake is per connection (NNG pipe), never per message, so a 1 MB message pays no MAC:

    client -> server   HELLO  cnonce                         (32 random bytes)
    server -> client   CHALLENGE  snonce, HMAC(secret, "server" | cnonce | snonce)
    client -> server   PROOF  HMAC(secret, "client" | snonce | cnonce)
    server -> client   WELCOME                               (the pipe is authenticated)

Each side proves it holds the secret over a nonce the *other* side chose, so neither proof can
be replayed; the two proofs use different labels, so one cannot be reflected as the other. The
client checks the server's proof before sending its own: a client with the wrong secret learns
nothing it could use and a rogue server never sees a valid client proof.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from urllib.parse import urlsplit

NONCE_BYTES = 32
_SERVER_LABEL = b"relax-rpc/v1/server\0"
_CLIENT_LABEL = b"relax-rpc/v1/client\0"


def normalize_secret(secret: str | bytes | None) -> bytes | None:
    """The secret as bytes (``str`` is UTF-8 encoded); ``None`` or empty means no secret."""
    if secret is None:
        return None
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    return raw or None


def nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def server_proof(secret: bytes, cnonce: bytes, snonce: bytes) -> bytes:
    return hmac.new(secret, _SERVER_LABEL + cnonce + snonce, hashlib.sha256).digest()


def client_proof(secret: bytes, snonce: bytes, cnonce: bytes) -> bytes:
    return hmac.new(secret, _CLIENT_LABEL + snonce + cnonce, hashlib.sha256).digest()


def same(a: object, b: bytes) -> bool:
    """Constant-time comparison that tolerates a peer sending the wrong type."""
    return isinstance(a, bytes) and hmac.compare_digest(a, b)


def is_loopback_host(host: str | None) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1)."""
    if not host:
        return False  # "tcp://:5555" binds every interface
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name (or "*") may resolve to anything


def check_bind(url: str, secret: bytes | None) -> None:
    """Refuse to serve ``tcp://`` on a non-loopback host without a shared secret."""
    parts = urlsplit(url)
    if not parts.scheme.startswith("tcp"):
        return
    if secret is None and not is_loopback_host(parts.hostname):
        raise ValueError(
            f"refusing to serve {url} without a secret: it is reachable from other machines. "
            "Pass secret=... (every client must present the same one) or bind 127.0.0.1."
        )
