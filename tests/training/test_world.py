"""A one-rank world needs no port: ``init_world`` meets nobody, so it uses an in-process store
(it used to pick a "free" port, close it and bind it again — a race with every other process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import socket
import torch.distributed as dist
from relax.training._deepspeed import init_world

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
