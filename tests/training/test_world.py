"""Joining the torch.distributed world without a free-port race: a one-rank world needs no port
(``init_world`` meets nobody, so it uses an in-process store), and a gang's rank 0 binds port 0
and announces the port it got (it used to pick a "free" port, close it and bind it again — a
race with every other process)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from relax.actors import Actor, ChildSpec, Process, Supervisor
from relax.actors import _placement as placement

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import socket
import torch.distributed as dist
from relax.transport import init_world

binds = []
real_bind = socket.socket.bind
def bind(self, address):
    binds.append(address)
    return real_bind(self, address)
socket.socket.bind = bind
init_world()
store = dist.distributed_c10d._get_default_store()
store = getattr(store, "underlying_store", store)  # torch wraps it in a PrefixStore
print(dist.get_world_size(), type(store).__name__, binds)
dist.destroy_process_group()
"""


def test_a_world_of_one_uses_an_in_process_store_and_binds_no_port() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    # One rank, an in-process store, and no socket bound from Python (the old code bound one
    # to find a "free" port for a TCP store).
    assert out.stdout.split()[-3:] == ["1", "HashStore", "[]"], out.stdout


class WorldMember(Actor):
    """A gang member that joins the world as the trainer does and sums its ranks."""

    async def on_start(self) -> None:
        from relax.transport import init_world

        await asyncio.to_thread(init_world)  # off the loop: heartbeats go on meanwhile

    async def all_reduce_rank(self) -> int:
        import torch
        import torch.distributed as dist

        value = torch.tensor([dist.get_rank() + 1])
        await asyncio.to_thread(dist.all_reduce, value)
        return int(value.item())


@pytest.mark.anyio
@pytest.mark.timeout(240)
async def test_a_gang_meets_even_when_its_master_port_was_taken(monkeypatch) -> None:
    """The port ``MASTER_PORT`` names was free when the placement picked it, then taken (here
    by this test, as any process could) before rank 0 bound it: rank 0's store binds port 0
    and announces what it got in the gang's rendezvous folder, so the world still meets. (With
    env:// rank 0 failed to start: address already in use.)"""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    real = placement._gang_env
    folders: list[Path] = []

    def gang_env(size: int, rendezvous: str | None) -> dict[str, str]:
        assert rendezvous is not None
        folders.append(Path(rendezvous))
        return {**real(size, rendezvous), "MASTER_PORT": str(port)}

    monkeypatch.setattr(placement, "_gang_env", gang_env)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    spec = ChildSpec("world", WorldMember, placement=Process(start_timeout=180), gang=2)
    try:
        async with Supervisor([spec], name="world-test") as sup:
            ref = sup.ref("world")
            sums = await asyncio.gather(
                *(ref.rank(r).call("all_reduce_rank", timeout=60) for r in (0, 1))
            )
            assert sums == [1 + 2, 1 + 2]  # one world of two ranks
            snap = await sup.snapshot()
            [child] = snap["children"]
            assert child["restart_count"] == 0
            [folder] = folders
            assert (folder / "port").read_text() != str(port)
        assert not folder.exists()  # the rendezvous folder went with the gang
    finally:
        taken.close()
