"""The default torch.distributed world a gang shares: joining it, and bytes over it.

:func:`init_world` joins (or reuses) the default process group: a Relax gang meets on a store
its rank 0 hosts on a port the kernel picked and announces in the gang's rendezvous folder
(:data:`relax.runfiles.GANG_RENDEZVOUS_ENV`), a launcher's world on ``env://``, and a world of
one on an in-process store. :func:`broadcast_bytes` and :func:`all_gather_bytes` move opaque
bytes (wire-encoded messages, JSON) between its ranks, on the device its backend needs.

Unlike a tensor group (:mod:`relax.transport._group`) this *is* the global default group: it is
what DeepSpeed and a trainer gang's own collectives run on.
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relax.runfiles import GANG_PORT_FILE, GANG_RENDEZVOUS_ENV
from relax.transport._rendezvous import host_store, join_store

COLLECTIVE_TIMEOUT = datetime.timedelta(hours=24)
"""How long a rank waits in a collective: ranks above 0 wait for rank 0's next command while
rank 0 waits for rollouts, which may take long. A dead rank ends the whole gang anyway."""
STORE_TIMEOUT = datetime.timedelta(minutes=5)
"""How long a gang's ranks wait for each other to meet (starting means importing torch)."""


def init_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """Join (or reuse) the default torch.distributed group; returns ``(rank, world_size)``.

    An existing default group is reused as it is (a launcher or an earlier backend made it).
    Otherwise a world of more than one rank meets through the gang's rendezvous folder, or
    through ``env://`` (``MASTER_ADDR``/``MASTER_PORT``, as a launcher's members have them),
    and a single rank makes its own one-member group on an in-process store (no port): no
    launcher and no environment variables needed. DeepSpeed insists on ``LOCAL_RANK``; it is
    set only when missing.
    """
    if dist.is_initialized():
        have = dist.get_world_size()
        if world_size is not None and world_size != have:
            raise RuntimeError(
                f"torch.distributed already has a world of {have} ranks, not {world_size}"
            )
        return dist.get_rank(), have
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    backend = "gloo" if not torch.cuda.is_available() else "nccl"
    rendezvous = os.environ.get(GANG_RENDEZVOUS_ENV)
    if world_size > 1 and rendezvous:
        # A Relax gang: rank 0's store listens on a port the kernel picked, announced in the
        # gang's rendezvous folder (a port picked free and bound again later is a race).
        dist.init_process_group(
            backend,
            store=gang_store(Path(rendezvous), rank, world_size),
            rank=rank,
            world_size=world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
    elif world_size > 1:  # a launcher's env:// rendezvous (torchrun, deepspeed)
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
    else:
        # A world of one meets nobody: an in-process store, no port to pick (picking a free
        # port, closing it and binding it again races with every other process).
        dist.init_process_group(
            backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=COLLECTIVE_TIMEOUT,
        )
    return rank, world_size


def gang_store(folder: Path, rank: int, world_size: int) -> Any:
    """The store a gang's world meets on: rank 0 listens on port 0 of ``MASTER_ADDR`` and
    writes the port it got to ``folder/port`` (atomically); the other ranks wait for that file,
    then connect. Sets ``MASTER_PORT`` to the real port, for code that reads it later."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port_file = folder / GANG_PORT_FILE
    if rank == 0:
        store, port = host_store(host, 0, STORE_TIMEOUT, world_size=world_size, what="gang's store")
        partial = folder / f"port.{os.getpid()}.partial"
        partial.write_text(str(port))
        partial.replace(port_file)
    else:
        deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
        while not port_file.exists():  # rank 0 is starting (importing torch, binding)
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank 0 never announced its store in {folder}")
            time.sleep(0.05)
        port = int(port_file.read_text())
        store = join_store(
            host,
            port,
            time.monotonic() + STORE_TIMEOUT.total_seconds(),
            timeout=STORE_TIMEOUT,
            world_size=world_size,
        )
    os.environ["MASTER_PORT"] = str(port)
    return store


def _device() -> torch.device:
    """Where the default group's collectives take their tensors: NCCL needs this process's
    current CUDA device, gloo the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_bytes(data: bytes | None, src: int = 0) -> bytes:
    """Rank ``src``'s ``data`` on every rank of the default group (a length, then the bytes)."""
    device = _device()
    mine = dist.get_rank() == src
    if mine and data is None:
        raise ValueError("the source rank must pass the bytes to broadcast")
    size = torch.tensor(
        [len(data) if mine and data is not None else 0], dtype=torch.int64, device=device
    )
    dist.broadcast(size, src)
    n = int(size.item())
    if n == 0:
        return b""
    if mine and data is not None:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buffer = torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src)
    return data if mine and data is not None else buffer.cpu().numpy().tobytes()


def all_gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's ``data``, in rank order, on every rank of the default group."""
    device = _device()
    world = dist.get_world_size()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(max(longest, 1), dtype=torch.uint8, device=device)
    if data:
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [
        g[: int(s.item())].cpu().numpy().tobytes() for g, s in zip(gathered, sizes, strict=True)
    ]
