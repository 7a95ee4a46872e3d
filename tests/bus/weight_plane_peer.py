"""A weight plane receiver in its own process (for SIGKILLs mid-transfer).

``python -m tests.bus.weight_plane_peer BUS_URL MEMBER LEASE [group|file|bus] [sum] [cuda]``:
receives versions until killed, over the weight plane's group (``group``, the default), over
the weight plane reading the bus's file where it can (``file``: ``[weights] local_file``), or
by polling the bus (``bus``); prints ``bucket i`` after each bucket it receives over the group and one JSON line
per version it switched to: ``{"version": v, "t": time.monotonic()}``, with ``"sum"`` (of
every element) when asked. With ``cuda`` its engine is on this process's GPU (the publisher
then picks the route by it) and each line says where the tensors arrived (``"device"``). ``bench/weights.py`` times publishes with it too.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from relax.bus import BusClient
from relax.bus._plane import PlaneOptions, WeightSubscriber
from relax.log import configure_logging
from relax.transport import Limits
from relax.transport._group import TensorGroup

_original = TensorGroup.broadcast_bucket
_original_take_over = WeightSubscriber._take_over


async def _announcing(self, tensors, **kwargs):  # type: ignore[no-untyped-def]
    out = await _original(self, tensors, **kwargs)
    print(f"bucket {self.statistics()['operations']}", flush=True)
    return out


async def _announcing_take_over(self, layout):  # type: ignore[no-untyped-def]
    out = await _original_take_over(self, layout)  # the CUDA IPC route's bucket
    print(f"bucket {self._group.statistics()['operations']}", flush=True)
    return out


async def spawn_peer(url: str, member: str, lease: float, *modes: str) -> Any:
    """This receiver in a process of its own (``modes``: the command line's after ``LEASE``),
    its stdout piped."""
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.bus.weight_plane_peer",
        url,
        member,
        str(lease),
        *modes,
        cwd=root,
        env={**os.environ, "PYTHONPATH": path},
        stdout=asyncio.subprocess.PIPE,
    )


async def main(
    url: str, member: str, lease: float, mode: str, with_sum: bool, device: str | None
) -> None:
    configure_logging(level="error")  # stdout carries only the lines above
    TensorGroup.broadcast_bucket = _announcing  # type: ignore[method-assign]
    WeightSubscriber._take_over = _announcing_take_over  # type: ignore[method-assign]
    limits = Limits(frame_bytes=8 << 20, max_message_bytes=1 << 30)
    async with await BusClient.connect(url, limits=limits) as bus:
        options = PlaneOptions(lease=lease, stall_timeout=2.0, local_file=mode == "file")
        sub = WeightSubscriber(bus, member, options, device=device)
        version = -1
        while True:
            if mode in ("group", "file"):
                got = await sub.next(version, wait=60)
            else:
                got = await bus.poll_weights(version, wait=60)
            if got is None:
                continue
            version = got[0]
            line: dict[str, object] = {"version": version, "t": time.monotonic()}
            line["device"] = str(next(iter(got[1].values())).device) if got[1] else None
            if mode == "group":  # where its time went (summed), for bench/weights.py
                stats = sub.statistics()
                line.update({k: stats[k] for k in ("collective_s", "digest_s", "ipc_copy_s")})
            if with_sum:
                line["sum"] = float(sum(t.double().sum() for t in got[1].values()))
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    mode = args[3] if len(args) > 3 else "group"
    device = "cuda" if "cuda" in args[4:] else None
    asyncio.run(main(args[0], args[1], float(args[2]), mode, "sum" in args[4:], device))
