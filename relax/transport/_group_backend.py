"""Building a tensor group's torch backend object from its URL, without the default group.

Rank 0 hosts a ``TCPStore`` on the URL's host and port (:mod:`relax.transport._rendezvous`);
every rank wraps it in a ``PrefixStore`` named after the group and constructs the backend
object directly (``ProcessGroupGloo(store, rank, size, options)`` /
``ProcessGroupNCCL(...)``), the way ``torch.distributed.new_group`` does internally, but
without ``init_process_group``: nothing is registered globally.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from relax.errors import PeerGone
from relax.transport._group_header import peer_gone
from relax.transport._rendezvous import (
    host_named_store,
    join_store,
    local_address_towards,
    release_named_store,
)


def parse_url(url: str) -> tuple[str, int, str]:
    """``(host, port, name)`` of ``nccl://HOST:PORT[/NAME]`` (``NAME`` defaults to
    ``"default"``); ``ValueError`` for anything else."""
    parts = urlsplit(url)
    if parts.scheme != "nccl":
        raise ValueError(f"a tensor group URL looks like nccl://HOST:PORT[/NAME], got {url!r}")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"bad port in {url!r}: {exc}") from None
    if not parts.hostname or not port:
        raise ValueError(f"a tensor group URL needs a host and a port: {url!r}")
    name = parts.path.strip("/") or "default"
    return parts.hostname, port, name


def pick_device(device: str | torch.device | None) -> tuple[torch.device, str]:
    """The group's device and backend name (``"nccl"`` or ``"gloo"``); ``None`` picks CUDA
    when available, else CPU."""
    if device is None:
        cuda = torch.cuda.is_available() and dist.is_nccl_available()
        device = "cuda" if cuda else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ValueError(f"device {dev} asked for, but CUDA with NCCL is not available here")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev, "nccl"
    if dev.type != "cpu":
        raise ValueError(f"tensor groups run on cpu (gloo) or cuda (NCCL), not {dev.type}")
    if not dist.is_gloo_available():
        raise ValueError("this torch build has no gloo backend")
    return dev, "gloo"


def _meet(
    store: Any,
    rank: int,
    world_size: int,
    deadline: float,
    abort: threading.Event | None,
    what: str,
) -> None:
    """Every rank checks in at the store before any builds the backend, whose own wait (in
    C++) nothing interrupts. Rank 0 waits for the others' ``arrived`` keys, then says ``go``;
    abandoned (``abort``: the publisher's receivers left on purpose) or out of time, it says
    ``abandoned`` and the ranks already there give up at once too, their threads free."""
    if rank == 0:
        keys = [f"arrived/{r}" for r in range(1, world_size)]
        while not store.check(keys):
            if (abort is not None and abort.is_set()) or time.monotonic() >= deadline:
                store.set("abandoned", b"1")
                if time.monotonic() >= deadline:
                    raise RuntimeError("timed out waiting for the other ranks at the store")
                raise PeerGone(f"{what}: abandoned while waiting for the other ranks")
            time.sleep(_MEET_POLL_S)
        store.set("go", b"1")
        return
    store.set(f"arrived/{rank}", b"1")
    while not store.check(["go"]):
        if store.check(["abandoned"]):
            raise PeerGone(f"{what}: rank 0 abandoned the group before every rank joined")
        if abort is not None and abort.is_set():
            raise PeerGone(f"{what}: abandoned while waiting for rank 0")
        if time.monotonic() >= deadline:
            raise RuntimeError("timed out waiting for rank 0 to start the group")
        time.sleep(_MEET_POLL_S)


_MEET_POLL_S = 0.02


@contextlib.contextmanager
def _nccl_env() -> Iterator[None]:
    # NCCL's default error handling kills the whole process when a collective times out; a
    # trainer must survive a rollout worker dying, so ask for "abort the communicator only"
    # unless the user chose otherwise. Read once, in ProcessGroupNCCL's constructor.
    key = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    if key in os.environ:
        yield
        return
    os.environ[key] = "2"
    try:
        yield
    finally:
        os.environ.pop(key, None)


def build_backend(
    url: str,
    *,
    rank: int,
    world_size: int,
    backend: str,
    timeout: float,
    abort: threading.Event | None = None,
) -> tuple[Any, Any]:
    """Meet the other ranks and build the backend object: ``(store, process_group)``.

    Blocking (run it on the group's thread). ``PeerGone`` when rank 0's store cannot be
    reached or not every rank joined within ``timeout``; rank 0's store is given back then.
    ``abort``: set (the caller was cancelled), the wait for the others ends at once with
    ``PeerGone`` (rank 0: theirs as well).
    """
    host, port, name = parse_url(url)
    deadline = time.monotonic() + timeout

    def left() -> datetime.timedelta:
        return datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))

    what = f"opening {url} as rank {rank}/{world_size}"
    try:
        if rank == 0:
            store = host_named_store(host, port, name, left())
        else:
            store = join_store(host, port, deadline)
    except (RuntimeError, TimeoutError) as exc:  # DistNetworkError etc.: rank 0 not there
        late = f"rank 0 did not host it within {timeout:g} s"
        raise peer_gone(f"{what}: cannot reach rank 0's store", exc, late) from exc
    try:
        prefixed = dist.PrefixStore(f"relax/group/{name}", store)
        _meet(prefixed, rank, world_size, deadline, abort, what)
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = left()
            # Listen where rank 0 can reach us (loopback in tests), not on whatever the
            # machine's hostname resolves to.
            iface = local_address_towards(host, port)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=iface)]
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = left()
            opts.is_high_priority_stream = False
            with _nccl_env():
                pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    except RuntimeError as exc:  # rendezvous timed out: some rank never joined
        if rank == 0:
            release_named_store(host, port)
        late = f"a peer did not join within {timeout:g} s"
        raise peer_gone(f"{what}: not every rank joined", exc, late) from exc
    except BaseException:
        if rank == 0:
            release_named_store(host, port)
        raise
    return store, pg


def shutdown_backend(pg: Any) -> None:
    """Free NCCL communicators now instead of at garbage collection; gloo needs nothing."""
    if pg is None:
        return
    if hasattr(pg, "shutdown") and not isinstance(pg, dist.ProcessGroupGloo):
        with contextlib.suppress(Exception):
            pg.shutdown()
