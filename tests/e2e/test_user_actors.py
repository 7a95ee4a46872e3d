"""``[[actors]]`` are started in the tree next to the roles (they used to be accepted and
never built), in their own process when asked, with their ``kwargs``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from relax import cluster
from relax.actors import Actor
from relax.config import parse_config
from tests.tiny import tiny_toml

pytestmark = pytest.mark.slow


class Recorder(Actor):
    """Writes where it ran when it starts, and again when it stops."""

    def __init__(self, out: str, label: str) -> None:
        self.out, self.label = Path(out), label

    async def on_start(self) -> None:
        self.out.write_text(json.dumps({"label": self.label, "pid": os.getpid()}))

    async def on_stop(self) -> None:
        self.out.with_suffix(".stopped").write_text("1")


@pytest.mark.anyio
async def test_user_actors_run_in_the_tree(tmp_path) -> None:
    inproc, process = tmp_path / "inproc.json", tmp_path / "process.json"
    actors = f"""
[[actors]]
id = "near"
start = "{__name__}:Recorder"
kwargs = {{ out = "{inproc}", label = "here" }}

[[actors]]
id = "far"
start = "{__name__}:Recorder"
placement = "process"
kwargs = {{ out = "{process}", label = "there" }}
"""
    cfg = parse_config(tiny_toml("actors", steps=1, extra=actors))
    await cluster.run(cfg, tmp_path / "run")
    assert json.loads(inproc.read_text()) == {"label": "here", "pid": os.getpid()}
    far = json.loads(process.read_text())
    assert far["label"] == "there" and far["pid"] != os.getpid()
    assert inproc.with_suffix(".stopped").exists() and process.with_suffix(".stopped").exists()
