"""nccl:// tensor groups (gloo on CPU): real processes, real sockets, real SIGKILLs.

Multi-rank checks that need no second process run all ranks inside the test process (each
group runs its collectives on its own thread); state-dict transfers, deaths and the bandwidth
figure use child processes running ``tests/transport/group_peer.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from relax.errors import PeerGone, TransportError
from relax.transport._group import TensorGroup, open_group
from relax.transport._rendezvous import join_store, release_named_store, reserve_named_store
from tests.actors.helpers import wait_until
from tests.transport.group_peer import MB, digest, make_state_dict, run_step

pytestmark = pytest.mark.anyio

PEER = Path(__file__).with_name("group_peer.py")
REPO = PEER.parents[2]


_default_group = [False]


@pytest.fixture(autouse=True)
def _remember_default_group() -> None:
    """Whether torch's default process group existed before the test (another test in this
    process may have created one, e.g. an in-process vLLM engine); open_group must not change it."""
    _default_group[0] = dist.is_initialized()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def url(port: int | None = None, name: str = "") -> str:
    return f"nccl://127.0.0.1:{port or free_port()}" + (f"/{name}" if name else "")


@contextlib.asynccontextmanager
async def local_group(
    world_size: int = 2, timeout: float = 10.0, address: str | None = None
) -> AsyncIterator[list[TensorGroup]]:
    """All ranks of one group, inside this process."""
    address = address or url()
    groups = await asyncio.gather(
        *(
            open_group(address, rank=r, world_size=world_size, timeout=timeout)
            for r in range(world_size)
        )
    )
    try:
        yield list(groups)
    finally:
        for g in groups:
            await g.aclose()


class Peer:
    """A child process running group_peer.py; its JSON events are read from stdout."""

    def __init__(self, proc: asyncio.subprocess.Process, stderr: Path) -> None:
        self.proc, self.stderr = proc, stderr

    @classmethod
    async def start(cls, spec: dict[str, Any], tmp_path: Path) -> Peer:
        stderr = tmp_path / f"peer-{len(list(tmp_path.glob('peer-*')))}.err"
        with stderr.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                str(PEER),
                json.dumps(spec),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo"},
            )
        return cls(proc, stderr)

    async def event(self, timeout: float = 20.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            raise AssertionError(f"peer exited early:\n{self.stderr.read_text()[-3000:]}")
        return json.loads(line)

    async def events_until(self, kind: str, timeout: float = 20.0) -> list[dict[str, Any]]:
        seen = []
        while True:
            seen.append(await self.event(timeout))
            if seen[-1]["event"] == kind:
                return seen
            assert seen[-1]["event"] != "error", seen[-1]

    def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)

    async def finish(self) -> None:
        self.kill()
        await self.proc.wait()


@pytest.fixture
async def peers(tmp_path: Path) -> AsyncIterator[list[Peer]]:
    started: list[Peer] = []
    yield started
    for p in started:
        await p.finish()


def spec(address: str, rank: int, world_size: int, steps: list[Any], timeout: float = 20.0) -> dict:
    return {
        "groups": [{"url": address, "rank": rank, "world_size": world_size, "timeout": timeout}],
        "steps": steps,
    }


def state_tensors(seed: int, size: int, receive: bool) -> tuple[list[str], list[torch.Tensor]]:
    sd = make_state_dict(seed, size)
    names = sorted(sd)
    return names, [torch.zeros_like(sd[n]) if receive else sd[n] for n in names]


# --------------------------------------------------------------------------- in one process


async def test_broadcast_and_bucket_fill_receive_buffers_in_place() -> None:
    sent = [
        torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # non-contiguous sender
        torch.randn(5, 3).bfloat16(),
        torch.tensor([True, False, True]),
        torch.tensor(7, dtype=torch.int64),  # 0-d
        torch.empty(0, 3),
        torch.randint(0, 255, (1001,), dtype=torch.uint8),
        torch.randn(2, 2_700_000),  # 21.6 MB: more than one 16 MiB payload chunk
    ]
    async with local_group() as (g0, g1):
        assert dist.is_initialized() is _default_group[0]  # untouched by open_group
        assert (g0.backend, g0.rank, g1.rank, g0.world_size) == ("gloo", 0, 1, 2)
        for method in ("broadcast", "broadcast_bucket"):
            wide = torch.zeros(4, 6)
            recv = [wide[:, :3]] + [torch.zeros_like(t) for t in sent[1:]]  # non-contiguous view
            _, out = await asyncio.gather(
                getattr(g0, method)(sent), getattr(g1, method)(recv, timeout=5)
            )
            assert all(a is b for a, b in zip(out, recv, strict=True))  # filled in place
            assert all(torch.equal(a, b) for a, b in zip(sent, recv, strict=True)), method
            assert torch.equal(wide[:, 3:], torch.zeros(4, 3))  # only the view was written
        stats = g1.statistics()
        assert stats["operations"] == 2 and stats["bytes"] > 0 and stats["seconds"] > 0
        # open: handshake. broadcast: handshake + one per non-empty tensor, two for the big
        # one. bucket: handshake + two 16 MiB chunks.
        assert stats["collectives"] == 1 + (1 + 5 + 2) + (1 + 2)


async def test_receive_buffers_that_do_not_match_fail_on_every_rank_and_group_survives() -> None:
    sent = [torch.randn(10), torch.randn(4, 4).bfloat16()]
    async with local_group() as (g0, g1):
        cases = {
            "rank 1 expects 2 tensors / 76 bytes": [torch.zeros(11), torch.zeros(4, 4).bfloat16()],
            "rank 1 expects 1 tensors / 40 bytes": [torch.zeros(10)],
            "72 bytes of other dtypes or shapes": [torch.zeros(10), torch.zeros(16).bfloat16()],
        }
        for expected, recv in cases.items():
            results = await asyncio.gather(
                g0.broadcast_bucket(sent), g1.broadcast_bucket(recv), return_exceptions=True
            )
            for r in results:  # the sender learns it too, and nobody waits for a timeout
                assert isinstance(r, TransportError) and not isinstance(r, PeerGone), r
                assert "do not match what rank 0 sends (2 tensors / 72 bytes" in str(r)
                assert expected in str(r)
        # Nothing moved and the ranks are still in step: a correct transfer works.
        recv = [torch.zeros(10), torch.zeros(4, 4).bfloat16()]
        await asyncio.gather(g0.broadcast(sent), g1.broadcast(recv))
        assert torch.equal(recv[1], sent[1])


async def test_bad_arguments_raise_locally_and_tell_the_peers() -> None:
    async with local_group() as (g0, g1):
        local, remote = await asyncio.gather(
            g0.broadcast_bucket([torch.ones(2), "two"]),  # type: ignore[list-item]
            g1.broadcast_bucket([torch.zeros(2)]),
            return_exceptions=True,
        )
        assert isinstance(local, TypeError) and "tensors[1]" in str(local)
        assert isinstance(remote, TransportError) and "rank(s) [0] rejected" in str(remote)
        with pytest.raises(ValueError, match="src=2"):
            await g0.broadcast([torch.ones(1)], src=2)
        with pytest.raises(ValueError, match="timeout"):
            await g0.barrier(timeout=0)
        await asyncio.gather(g0.barrier(), g1.barrier())  # still usable


async def test_ranks_out_of_step_break_the_group() -> None:
    async with local_group() as (g0, g1):
        results = await asyncio.gather(
            g0.barrier(), g1.broadcast([torch.zeros(1)]), return_exceptions=True
        )
        assert all(isinstance(r, TransportError) and "out of step" in str(r) for r in results)
        with pytest.raises(PeerGone, match="unusable"):
            await g0.barrier()


async def test_stalled_peer_is_peer_gone_within_the_timeout() -> None:
    async with local_group() as (g0, _g1):
        start = time.monotonic()
        with pytest.raises(PeerGone, match=r"did not take part within 0\.5 s"):
            await g0.broadcast_bucket([torch.ones(1000)], timeout=0.5)  # rank 1 never calls
        assert 0.4 < time.monotonic() - start < 2.0
        with pytest.raises(PeerGone, match="unusable"):
            await g0.barrier()
        assert g0.statistics()["broken"]


async def test_peer_that_never_joins_is_peer_gone_within_the_timeout() -> None:
    for rank in (0, 1):  # rank 0 waits for the others; rank 1 finds no store to join
        start = time.monotonic()
        with pytest.raises(PeerGone, match=r"within 0\.5 s"):
            await open_group(url(), rank=rank, world_size=2, timeout=0.5)
        assert time.monotonic() - start < 2.0
    assert dist.is_initialized() is _default_group[0]  # untouched by open_group


async def test_a_cancelled_join_ends_at_once_for_every_rank_already_there() -> None:
    """Rank 0 cancelled while it waits for a rank that will never come (a receiver stopped
    on purpose): it ends now, not at the join timeout, its thread freed, and the rank that
    did arrive learns the group was abandoned at once too."""
    # A store kept listening between groups, as the weight plane's publisher keeps it.
    port = reserve_named_store("127.0.0.1", datetime.timedelta(seconds=30))
    address = url(port, name="abandoned")
    host = asyncio.create_task(open_group(address, rank=0, world_size=3, timeout=30))
    joined = asyncio.create_task(open_group(address, rank=1, world_size=3, timeout=30))
    await wait_until(lambda: _thread_named("relax-group-abandoned-r0"), what="rank 0 hosting")
    store = await asyncio.to_thread(join_store, "127.0.0.1", port, time.monotonic() + 10)
    arrived = "relax/group/abandoned/arrived/1"
    await wait_until(lambda: store.check([arrived]), what="rank 1 at the store")
    started = time.monotonic()
    host.cancel()
    with pytest.raises(asyncio.CancelledError):
        await host
    with pytest.raises(PeerGone, match="rank 0 abandoned the group"):
        await joined
    assert time.monotonic() - started < 2.0  # the join timeout is 30 s
    await wait_until(lambda: not _thread_named("relax-group-abandoned-r"), what="threads gone")
    release_named_store("127.0.0.1", port)


def _thread_named(prefix: str) -> bool:
    import threading

    return any(t.name.startswith(prefix) for t in threading.enumerate())


async def test_cancelled_caller_does_not_drop_the_collective() -> None:
    async with local_group() as (g0, g1):
        data = torch.randn(1 << 16)
        task = asyncio.ensure_future(g0.broadcast_bucket([data]))
        await asyncio.sleep(0)  # let it queue on the group's thread
        task.cancel()
        recv = torch.zeros_like(data)
        await g1.broadcast_bucket([recv], timeout=5)  # rank 0's collective still ran
        assert torch.equal(recv, data)
        await asyncio.gather(g0.barrier(timeout=5), g1.barrier(timeout=5))


async def test_groups_on_one_store_are_kept_apart_by_name() -> None:
    port = free_port()
    async with (
        local_group(address=url(port, "weights")) as (a0, a1),
        local_group(address=url(port, "values")) as (b0, b1),
    ):
        x, y = torch.randn(100), torch.randn(7, 3)
        rx, ry = torch.zeros_like(x), torch.zeros_like(y)
        await asyncio.gather(
            a0.broadcast_bucket([x]),
            b1.broadcast_bucket([y], src=1),
            a1.broadcast_bucket([rx]),
            b0.broadcast_bucket([ry], src=1),
        )
        assert torch.equal(rx, x) and torch.equal(ry, y)
        with pytest.raises(TransportError, match="already opened"):
            await open_group(url(port, "weights"), rank=0, world_size=2, timeout=1)


async def test_invalid_urls_and_ranks_and_closed_groups() -> None:
    for bad in ("tcp://127.0.0.1:1", "nccl://127.0.0.1", "nccl://:5"):
        with pytest.raises(ValueError):
            await open_group(bad, rank=0, world_size=1)
    with pytest.raises(ValueError, match="rank 2"):
        await open_group(url(), rank=2, world_size=2)
    with pytest.raises(ValueError, match="cuda"):
        await open_group(url(), rank=0, world_size=1, device="meta")
    async with local_group(world_size=1) as (g,):
        t = torch.ones(3)
        assert (await g.broadcast([t]))[0] is t
        assert (await g.broadcast_bucket([t]))[0] is t
    with pytest.raises(TransportError, match="closed"):
        await g.barrier()
    await g.aclose()  # idempotent


# --------------------------------------------------------------------------- child processes


@pytest.mark.slow
async def test_50mb_state_dict_to_another_process_bit_identical_and_bandwidth(
    tmp_path: Path, peers: list[Peer]
) -> None:
    address, size = url(), 50 * MB
    bench = [["bench", 0, 0, 5, size, 5, "bucket"], ["bench", 0, 0, 5, size, 5, "plain"]]
    peer = await Peer.start(spec(address, 1, 2, [["bucket", 0, 0, 1, size], *bench]), tmp_path)
    peers.append(peer)
    names, tensors = state_tensors(1, size, receive=False)
    async with await open_group(address, rank=0, world_size=2, timeout=20) as group:
        assert dist.is_initialized() is _default_group[0]  # untouched by open_group
        gaps: list[float] = []

        async def ticker() -> None:  # stands in for an actor's heartbeats
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.002)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.ensure_future(ticker())
        await group.broadcast_bucket(tensors)
        tick.cancel()
        events = await peer.events_until("done")
        assert events[-1]["sha256"] == digest(dict(zip(names, tensors, strict=True)))
        assert max(gaps) < 0.25, f"event loop blocked for {max(gaps):.3f} s"

        for step in bench:
            mine = (await run_step([group], step))["seconds"]
            theirs = (await peer.events_until("done"))[-1]["seconds"]
            ms = statistics.median(max(a, b) for a, b in zip(mine, theirs, strict=True)) * 1e3
            print(
                f"\n{step[-1]}: {size / MB:.0f} MB in {ms:.1f} ms median "
                f"({size / ms / 1e6:.2f} GB/s), {len(names)} tensors"
            )
    await peer.events_until("closed")


@pytest.mark.slow
async def test_three_processes_child_is_source(tmp_path: Path, peers: list[Peer]) -> None:
    address, size = url(), 50 * MB
    for rank in (1, 2):
        peers.append(
            await Peer.start(spec(address, rank, 3, [["bucket", 0, 1, 2, size]]), tmp_path)
        )
    names, recv = state_tensors(2, size, receive=True)
    async with await open_group(address, rank=0, world_size=3, timeout=20) as group:
        await group.broadcast_bucket(recv, src=1)
        _, expected = state_tensors(2, size, receive=False)
        assert all(torch.equal(a, b) for a, b in zip(recv, expected, strict=True))
        shas = [(await p.events_until("done"))[-1]["sha256"] for p in peers]
        assert shas == [digest(dict(zip(names, expected, strict=True)))] * 2
        assert group.statistics()["bytes"] == sum(t.numel() * t.element_size() for t in recv)


@pytest.mark.slow
@pytest.mark.parametrize("we_send", [True, False], ids=["peer-receiving", "peer-sending"])
async def test_peer_sigkilled_mid_broadcast_is_peer_gone(
    tmp_path: Path, peers: list[Peer], we_send: bool
) -> None:
    address, size, src = url(), 100 * MB, 0 if we_send else 1
    peer = await Peer.start(
        spec(address, 1, 2, [["bench", 0, src, 3, size, 100, "bucket"]]), tmp_path
    )
    peers.append(peer)
    _, tensors = state_tensors(3, size, receive=not we_send)
    group = await open_group(address, rank=0, world_size=2, timeout=30, stall_timeout=1.0)
    async with group:
        await group.barrier()
        await group.broadcast_bucket(tensors, src=src)  # one good round first
        await group.barrier()
        before = group.statistics()["collectives"]
        transfer = asyncio.ensure_future(group.broadcast_bucket(tensors, src=src))
        await wait_until(  # the handshake is done: the payload is moving
            lambda: group.statistics()["collectives"] > before, timeout=10, what="handshake"
        )
        peer.kill()
        start = time.monotonic()
        with pytest.raises(PeerGone):
            await transfer
        # Noticed at once (connection reset) or after the 1 s stall limit, not after 30 s.
        assert time.monotonic() - start < 5.0
        with pytest.raises(PeerGone, match="unusable"):
            await group.barrier()


@pytest.mark.slow
async def test_two_groups_on_two_ports_in_the_same_processes(
    tmp_path: Path, peers: list[Peer]
) -> None:
    a, b, size = url(), url(), 8 * MB
    child = {
        # The child is also inside a torch.distributed world, as a DeepSpeed trainer would be.
        "default_group_file": str(tmp_path / "default-group"),
        "groups": [
            {"url": a, "rank": 1, "world_size": 2, "timeout": 20},
            {"url": b, "rank": 0, "world_size": 2, "timeout": 20},
        ],
        "steps": [["concurrent", [["bucket", 0, 0, 11, size], ["broadcast", 1, 0, 12, size]]]],
    }
    peer = await Peer.start(child, tmp_path)
    peers.append(peer)
    na, xa = state_tensors(11, size, receive=False)
    nb, xb = state_tensors(12, size, receive=True)
    async with (
        await open_group(a, rank=0, world_size=2, timeout=20) as ga,
        await open_group(b, rank=1, world_size=2, timeout=20) as gb,
    ):
        assert dist.is_initialized() is _default_group[0]  # untouched by open_group
        await asyncio.gather(ga.broadcast_bucket(xa), gb.broadcast(xb))
    events = await peer.events_until("closed")
    assert events[0] == {"event": "open", "initialized": True}
    done = next(e for e in events if e["event"] == "done")
    assert [r["sha256"] for r in done["results"]] == [
        digest(dict(zip(na, xa, strict=True))),
        digest(dict(zip(nb, xb, strict=True))),
    ]
    assert {"event": "default_group", "world_size": 1, "value": 1.0} in events
