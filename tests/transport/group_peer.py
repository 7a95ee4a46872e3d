"""A peer process for tests/transport/test_group.py: joins tensor groups and runs steps.

Run as ``python group_peer.py SPEC`` where SPEC is JSON::

    {"groups": [{"url": ..., "rank": ..., "world_size": ..., "timeout": ...}, ...],
     "default_group_file": null | path,         # first join a world-1 default group
     "steps": [[op, group_index, *args], ...]}

Every event is one JSON line on stdout (``open``, ``done``, ``error``, ``default_group``, ``closed``) so the
test can follow the peer without sleeping. Also home of :func:`make_state_dict` and
:func:`digest`, which both sides use to check that bytes arrived intact.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
from typing import Any

import torch

MB = 1 << 20


def make_state_dict(seed: int, total_bytes: int = 50 * MB) -> dict[str, torch.Tensor]:
    """A deterministic, model-like state dict of about ``total_bytes``.

    Mixed float32/bfloat16/int64 tensors of many shapes: a few big matrices and a couple of
    hundred small vectors, scalars and an empty tensor, so a bucket mixes alignments.
    """
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    small = 0
    for layer in range(48):
        out[f"layers.{layer}.norm.weight"] = torch.randn(96 + layer, generator=gen)
        out[f"layers.{layer}.bias"] = torch.randn(7, 3 + layer % 5, generator=gen).bfloat16()
        out[f"layers.{layer}.steps"] = torch.randint(-(2**40), 2**40, (5,), generator=gen)
        out[f"layers.{layer}.scale"] = torch.randn((), generator=gen)
        small += sum(t.numel() * t.element_size() for t in list(out.values())[-4:])
    out["empty"] = torch.empty(0, 4)
    big = max(total_bytes - small, 0)
    # Split the rest between a float32 matrix, a bfloat16 matrix and an int64 vector.
    rows = 1021
    f32 = big // 2 // 4 // rows
    bf16 = big // 4 // 2 // rows
    i64 = max((big - f32 * rows * 4 - bf16 * rows * 2) // 8, 1)
    out["embed.weight"] = torch.randn(rows, f32, generator=gen)
    out["head.weight"] = torch.randn(rows, bf16, generator=gen).bfloat16()
    out["positions"] = torch.randint(0, 2**62, (i64,), generator=gen)
    return out


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


async def _transfer(group: Any, op: str, src: int, seed: int, size: int) -> dict[str, Any]:
    sent = make_state_dict(seed, size)
    names = sorted(sent)
    if group.rank == src:
        tensors = [sent[n] for n in names]
    else:
        tensors = [torch.zeros_like(sent[n]) for n in names]
    start = time.perf_counter()
    if op == "bucket":
        await group.broadcast_bucket(tensors, src=src)
    else:
        await group.broadcast(tensors, src=src)
    seconds = time.perf_counter() - start
    return {"sha256": digest(dict(zip(names, tensors, strict=True))), "seconds": seconds}


async def run_step(groups: list[Any], step: list[Any]) -> dict[str, Any]:
    """Run one step on this rank; the test process runs the same steps as the other side."""
    op = step[0]
    if op in ("bucket", "broadcast"):
        _, g, src, seed, size = step
        return await _transfer(groups[g], op, src, seed, size)
    if op == "barrier":
        await groups[step[1]].barrier()
        return {}
    if op == "bench":  # n timed rounds; a barrier first, so only the transfer is timed
        _, g, src, seed, size, n, kind = step
        group = groups[g]
        sent = make_state_dict(seed, size)
        tensors = [
            sent[k] if group.rank == src else torch.empty_like(sent[k]) for k in sorted(sent)
        ]
        seconds = []
        for _ in range(n):
            await group.barrier()
            start = time.perf_counter()
            if kind == "bucket":
                await group.broadcast_bucket(tensors, src=src)
            else:
                await group.broadcast(tensors, src=src)
            seconds.append(time.perf_counter() - start)
        return {"seconds": seconds}
    if op == "concurrent":  # several steps at once (on different groups)
        results = await asyncio.gather(*(run_step(groups, s) for s in step[1]))
        return {"results": results}
    raise ValueError(f"unknown step {op!r}")


async def main(spec: dict[str, Any]) -> None:
    import torch.distributed as dist

    from relax.transport._group import open_group

    if spec.get("default_group_file"):
        # As a trainer inside a torch.distributed world would be. A FileStore, and gloo on
        # loopback (GLOO_SOCKET_IFNAME=lo from the test), so nothing listens beyond 127.0.0.1.
        dist.init_process_group(
            "gloo", init_method=f"file://{spec['default_group_file']}", rank=0, world_size=1
        )
    groups = await asyncio.gather(
        *(
            open_group(g["url"], rank=g["rank"], world_size=g["world_size"], timeout=g["timeout"])
            for g in spec["groups"]
        )
    )
    emit(event="open", initialized=dist.is_initialized())
    for index, step in enumerate(spec["steps"]):
        start = time.monotonic()
        try:
            result = await run_step(list(groups), step)
        except Exception as exc:
            emit(
                event="error",
                step=index,
                type=type(exc).__name__,
                message=str(exc),
                elapsed=time.monotonic() - start,
            )
            break
        emit(event="done", step=index, **result)
    if dist.is_initialized():
        # The default group still works and still has its own world.
        t = torch.ones(1)
        dist.all_reduce(t)
        emit(event="default_group", world_size=dist.get_world_size(), value=t.item())
        dist.destroy_process_group()
    for group in groups:
        await group.aclose()
    emit(event="closed")


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
