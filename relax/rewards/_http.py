"""A minimal async HTTP/1.1 JSON POST on asyncio streams, for the "http" reward kind.

Why not httpx/aiohttp: the reward floor may not add dependencies, and a reward endpoint needs
one request shape only. One connection per request (``Connection: close``) keeps it simple and
correct; a reward server far away would gain from keep-alive, which this does not do. The caller
bounds the whole exchange with its timeout, so nothing here waits on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from typing import Any
from urllib.parse import urlsplit

MAX_BODY = 1 << 20
"""Largest reply body read (1 MiB); a reward reply is a few bytes, anything huge is a fault."""


class HttpError(Exception):
    """The endpoint answered, but not with a usable reply (status, framing or body)."""


async def post_json(
    url: str, payload: Any, *, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """POST ``payload`` as JSON to ``url``; return (status, body). Raises on network faults."""
    parts = urlsplit(url)
    secure = parts.scheme == "https"
    host = parts.hostname or ""
    port = parts.port or (443 if secure else 80)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    body = json.dumps(payload, allow_nan=False).encode()
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {parts.netloc}",
        "Content-Type: application/json",
        "Accept: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{key}: {value}" for key, value in (headers or {}).items()),
    ]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
    context = ssl.create_default_context() if secure else None
    reader, writer = await asyncio.open_connection(
        host, port, ssl=context, server_hostname=host if secure else None, limit=MAX_BODY
    )
    try:
        writer.write(request)
        await writer.drain()
        return await _read_response(reader)
    finally:
        writer.close()
        # A peer that vanished mid-close must not turn a good reply into an error.
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    status_line = await reader.readline()
    fields = status_line.decode("latin-1").split(None, 2)
    if len(fields) < 2 or not fields[0].startswith("HTTP/") or not fields[1].isdigit():
        raise HttpError(f"not an HTTP reply: {status_line[:80]!r}")
    status = int(fields[1])
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        key, _, value = line.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return status, await _read_chunked(reader)
    if "content-length" in headers:
        length = int(headers["content-length"])
        if length > MAX_BODY:
            raise HttpError(f"reply body of {length} bytes exceeds {MAX_BODY}")
        return status, await reader.readexactly(length)
    data = await reader.read(MAX_BODY + 1)
    if len(data) > MAX_BODY:
        raise HttpError(f"reply body exceeds {MAX_BODY} bytes")
    return status, data


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size_line = await reader.readline()
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return bytes(body)
        body += await reader.readexactly(size)
        await reader.readline()  # the CRLF after each chunk
        if len(body) > MAX_BODY:
            raise HttpError(f"reply body exceeds {MAX_BODY} bytes")
