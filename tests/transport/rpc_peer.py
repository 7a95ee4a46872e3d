"""A real peer process for the RPC fault tests (killed with SIGKILL, restarted on the same URL).

    python -m tests.transport.rpc_peer serve URL [--secret S] [--frame-bytes N]
                                       [--die-after-parts N] [--die-after-pulls N] [--log FILE]
    python -m tests.transport.rpc_peer upload URL NBYTES [--frame-bytes N] [--die-after-parts N]

``serve`` prints ``ready <url>`` and serves :func:`make_handler`'s ops; with
``--die-after-parts`` (``--die-after-pulls``) it SIGKILLs itself when that many request parts
(reply-chunk pulls) have arrived: mid-way through a chunked upload (download).
``upload`` sends one chunked request and SIGKILLs itself after that many parts were acked.
``--log`` appends one line per handled request, to count handler runs across restarts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import Any

import torch

from relax.transport import Limits, Peer, connect, serve
from relax.transport._rpc_client import NngClient
from relax.transport._rpc_frames import PART
from relax.transport._rpc_server import NngServer


def checksum(t: torch.Tensor) -> int:
    return int(t.to(torch.int64).sum())


def make_handler(log_file: str | None) -> Any:
    async def handler(payload: Any, peer: Peer) -> Any:
        op = payload["op"]
        if log_file is not None:
            with open(log_file, "a") as f:
                f.write(f"{op} {payload.get('tag', '')}\n")
        if op == "echo":
            return payload["x"]
        if op == "sleep":
            await asyncio.sleep(payload["s"])
            return payload.get("x")
        if op == "block":
            await asyncio.Event().wait()
        if op == "sum":
            t = payload["t"]
            return {"sum": checksum(t), "n": t.numel()}
        if op == "pid":
            return os.getpid()
        if op == "wait_file":  # blocks until the test creates the file; says who answered
            # The file comes from another process: there is nothing to wait on but polling.
            while not os.path.exists(payload["path"]):  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            return os.getpid()
        if op == "big":
            return torch.arange(payload["n"], dtype=torch.int32)
        raise ValueError(f"unknown op {op!r}")

    return handler


def die_after(n: int, count: Any) -> None:
    count[0] += 1
    if count[0] >= n:
        os.kill(os.getpid(), signal.SIGKILL)


async def run_server(args: argparse.Namespace) -> None:
    if args.die_after_parts:
        parts = [0]
        original_part = NngServer._part

        async def part(self: NngServer, ch: Any, pipe_id: int, pipe: Any, header: Any, data: Any):
            die_after(args.die_after_parts, parts)
            return await original_part(self, ch, pipe_id, pipe, header, data)

        NngServer._part = part  # type: ignore[method-assign]
    if args.die_after_pulls:
        pulls = [0]
        original_pull = NngServer._pull

        async def pull(self: NngServer, ch: Any, header: Any) -> None:
            die_after(args.die_after_pulls, pulls)
            await original_pull(self, ch, header)

        NngServer._pull = pull  # type: ignore[method-assign]
    server = await serve(
        args.url,
        make_handler(args.log),
        secret=args.secret,
        limits=Limits(frame_bytes=args.frame_bytes),
    )
    print(f"ready {server.url}", flush=True)
    await asyncio.Event().wait()


async def run_upload(args: argparse.Namespace) -> None:
    count = [0]
    original = NngClient._exchange

    async def exchange(self: NngClient, header: Any, *rest: Any) -> Any:
        out = await original(self, header, *rest)
        if header[0] == PART:
            die_after(args.die_after_parts, count)
        return out

    NngClient._exchange = exchange  # type: ignore[method-assign]
    client = await connect(args.url, limits=Limits(frame_bytes=args.frame_bytes))
    print("connected", flush=True)
    t = torch.ones(args.nbytes, dtype=torch.uint8)
    await client.request({"op": "sum", "t": t})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["serve", "upload"])
    parser.add_argument("url")
    parser.add_argument("nbytes", type=int, nargs="?", default=0)
    parser.add_argument("--secret")
    parser.add_argument("--frame-bytes", type=int, default=1 << 20)
    parser.add_argument("--die-after-parts", type=int, default=0)
    parser.add_argument("--die-after-pulls", type=int, default=0)
    parser.add_argument("--log")
    args = parser.parse_args()
    asyncio.run(run_server(args) if args.mode == "serve" else run_upload(args))


if __name__ == "__main__":
    sys.exit(main())
