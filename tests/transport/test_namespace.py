"""``relax.transport``'s public names, and its promise that importing it does not import torch
(processes that never move a tensor start fast): the names whose modules need torch load on
first use."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import relax.transport

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import sys
import relax.transport
assert "torch" not in sys.modules, "importing relax.transport imported torch"
from relax.transport import all_gather_bytes, broadcast_bytes, init_world, open_group
assert "torch" in sys.modules
print("ok")
"""


def test_importing_transport_does_not_import_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_public_namespace_is_curated() -> None:
    assert all(hasattr(relax.transport, name) for name in relax.transport.__all__)
