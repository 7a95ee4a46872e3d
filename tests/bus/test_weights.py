"""The weights channel between processes: 50 MB state dicts, bit-identical, never half-applied."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest
import torch

from relax.bus import BusClient
from tests.bus.fixtures import tcp_bus
from tests.bus.weights_peer import digest

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def state_dict(seed: int) -> dict[str, torch.Tensor]:
    """About 50 MB of mixed dtypes and shapes, deterministic from the seed."""
    g = torch.Generator().manual_seed(seed)
    state = {f"layers.{i}.mlp.weight": torch.randn(1024, 1024, generator=g) for i in range(11)}
    state["embed.weight"] = torch.randn(4096, 512, generator=g).bfloat16()
    state["positions"] = torch.arange(100_000, dtype=torch.int64)
    state["norm.weight"] = torch.ones(1024)
    return state


async def peer(url: str, after: int, group_url: str | None = None) -> asyncio.subprocess.Process:
    args = [sys.executable, "-m", "tests.bus.weights_peer", url, str(after)] + (
        [group_url] if group_url else []
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return await asyncio.create_subprocess_exec(
        *args, cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE
    )


async def result(proc: asyncio.subprocess.Process) -> dict:
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0
    return json.loads(out.decode().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def bus(tmp_path):
    async with tcp_bus(str(tmp_path)) as url:
        yield url


async def test_50mb_over_tcp_arrives_bit_identical(bus) -> None:
    state = state_dict(1)
    subscriber = await peer(bus, -1)
    async with await BusClient.connect(bus) as trainer:
        assert await trainer.publish_weights(1, state, bucket_bytes=16 << 20) >= 3
    got = await result(subscriber)
    assert got["version"] == 1 and got["digests"] == {k: digest(v) for k, v in state.items()}


async def test_50mb_over_a_gloo_tensor_group_arrives_bit_identical(bus) -> None:
    from relax.transport._group import open_group

    state = state_dict(2)
    group_url = f"nccl://127.0.0.1:{free_port()}"
    subscriber = await peer(bus, -1, group_url)
    async with (
        await open_group(group_url, rank=0, world_size=2, timeout=60) as group,
        await BusClient.connect(bus) as trainer,
    ):
        await trainer.publish_weights(1, state, bucket_bytes=16 << 20, group=group)
    got = await result(subscriber)
    assert got["version"] == 1 and got["digests"] == {k: digest(v) for k, v in state.items()}


async def test_a_subscriber_killed_mid_transfer_never_applies_half_and_a_new_one_gets_the_current(
    bus,
) -> None:
    first, second = state_dict(3), state_dict(4)
    async with await BusClient.connect(bus) as trainer:
        await trainer.publish_weights(1, first, bucket_bytes=8 << 20)
        victim = await peer(bus, -1)
        line = await asyncio.wait_for(victim.stdout.readline(), 60)  # type: ignore[union-attr]
        assert line.startswith(b"bucket 1/")
        victim.send_signal(signal.SIGKILL)  # mid-transfer: it holds one bucket of several
        rest = (await victim.communicate())[0].decode()
        assert "digests" not in rest  # it never reached a whole version
        await trainer.publish_weights(2, second, bucket_bytes=8 << 20)
        replacement = await peer(bus, -1)  # a restarted subscriber: the current version first
        got = await result(replacement)
    assert got["version"] == 2 and got["digests"] == {k: digest(v) for k, v in second.items()}
