"""The weight plane on one GPU: receivers whose engine is on the trainer's own GPU get each
version by CUDA IPC (device to device, a bucket at a time). Needs a CUDA device: CI has none,
``bench/gpu_check.sh`` runs these on a GPU machine."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from relax.bus import BusClient
from relax.bus._plane import PlaneOptions, WeightPublisher
from tests.bus.fixtures import tcp_bus
from tests.bus.weight_plane_peer import spawn_peer
from tests.polling import wait_until

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_check.sh)"
    ),
]
ROOT = Path(__file__).resolve().parents[2]
OPTIONS = PlaneOptions(
    bucket_bytes=16 << 20, timeout=30.0, stall_timeout=5.0, lease=4.0, local_file=False
)


@pytest.fixture
async def bus(tmp_path):
    async with tcp_bus(str(tmp_path)) as url:
        yield url


def gpu_state(seed: int, mb: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {f"layer.{i}": torch.randn(256, 1024, generator=g) for i in range(mb)}
    state["embed"] = torch.randn(333, 7, generator=g).bfloat16()
    return {k: v.cuda() for k, v in state.items()}


async def spawn(bus: str, member: str) -> asyncio.subprocess.Process:
    return await spawn_peer(bus, member, OPTIONS.lease, "group", "sum", "cuda")


async def version_line(peer: asyncio.subprocess.Process) -> dict:
    while True:
        line = await asyncio.wait_for(peer.stdout.readline(), 120)  # type: ignore[union-attr]
        assert line, "the receiver exited"
        if line.startswith(b"{"):
            return json.loads(line)


async def test_receivers_on_the_trainer_s_gpu_get_each_version_by_cuda_ipc(bus) -> None:
    peers = [await spawn(bus, m) for m in ("a", "b")]
    async with await BusClient.connect(bus) as trainer_bus:
        pub = WeightPublisher(trainer_bus, OPTIONS, device="cuda")
        try:

            async def both_on_this_gpu() -> bool:
                got = await trainer_bus._call({"op": "w_members", "lease": 10.0, "places": True})
                return sorted(got) == ["a", "b"] and {p["gpu"] for p in got.values()} == {pub._gpu}

            await wait_until(both_on_this_gpu, timeout=120, what="receivers on this GPU")
            for version, seed in ((1, 11), (2, 12)):
                state = gpu_state(seed, mb=64)  # 64 MiB: four buckets
                total = float(sum(t.double().sum() for t in state.values()))
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                assert await pub.publish(version, state) == 2
                extra = torch.cuda.max_memory_allocated() - base
                assert pub.statistics()["route"] == "ipc"
                # One staging bucket, kept for the group's life (allocated by the first).
                assert extra <= (OPTIONS.bucket_bytes if version == 1 else 0) + (1 << 20), extra
                for peer in peers:
                    line = await version_line(peer)
                    assert line["version"] == version
                    assert line["device"].startswith("cuda")
                    assert line["sum"] == pytest.approx(total, rel=1e-12)
            assert pub.statistics()["epochs"] == 1  # the same group carried both versions
        finally:
            for peer in peers:
                peer.kill()
                await peer.wait()
            await pub.aclose()


async def test_a_receiver_on_the_trainer_s_gpu_sigkilled_mid_handover_fails_only_that_publish(
    bus,
) -> None:
    """Killed between buckets of an IPC hand-off: the publish returns within the timeouts
    (the barrier fails), and the next version goes to the restarted receiver."""
    opts = replace(OPTIONS, timeout=5.0)
    victim = await spawn(bus, "victim")
    async with await BusClient.connect(bus) as trainer_bus:
        pub = WeightPublisher(trainer_bus, opts, device="cuda")
        try:

            async def member(name: str) -> bool:
                got = await trainer_bus._call({"op": "w_members", "lease": 10.0, "places": True})
                return list(got) == [name]

            await wait_until(lambda: member("victim"), timeout=120, what="the victim")
            publishing = asyncio.create_task(pub.publish(1, gpu_state(21, mb=256)))
            line = await asyncio.wait_for(victim.stdout.readline(), 120)  # type: ignore[union-attr]
            assert line.startswith(b"bucket"), line  # it took one bucket of 16
            victim.kill()
            started = asyncio.get_running_loop().time()
            sent = await publishing
            assert asyncio.get_running_loop().time() - started < 3 * opts.timeout
            assert sent == 0
            await victim.wait()
            fresh = await spawn(bus, "fresh")
            assert (await version_line(fresh))["version"] == 1  # from the bus
            await wait_until(lambda: member("fresh"), timeout=120, what="the restarted one")
            state = gpu_state(22, mb=16)
            assert await pub.publish(2, state) == 1
            line = await version_line(fresh)
            assert line["version"] == 2
            total = float(sum(t.double().sum() for t in state.values()))
            assert line["sum"] == pytest.approx(total, rel=1e-12)
            fresh.kill()
            await fresh.wait()
        finally:
            await pub.aclose()
