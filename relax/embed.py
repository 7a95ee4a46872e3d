"""A whole cluster inside your own asyncio program.

::

    async with relax.embed.start("cluster.toml") as run:     # the supervisor tree, here
        async with await run.policy() as policy:              # its OpenAI-compatible endpoint
            reply = (await policy.chat([{"role": "user", "content": "hi"}], session="ep-1"))[0]
            await policy.finish("ep-1", reward=1.0, group="task-1", group_size=1)
        await run.wait()                                       # until the trainer is done

The tree runs as tasks of the caller's event loop (roles with ``placement = "process"`` in
their own processes, as always). Leaving the block stops it in reverse order, as ``relax
down`` does: the trainer checkpoints, every child is stopped, nothing is left running — also
when the block is left by an exception or a cancellation.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax.actors import Supervisor
from relax.agents import Policy
from relax.agents._connect import connect
from relax.cluster import Layout, build_tree, prepare
from relax.config import ClusterConfig, load_config


@dataclass
class EmbeddedCluster:
    """A running cluster started by :func:`start`."""

    config: ClusterConfig
    layout: Layout
    tree: Supervisor

    @property
    def run_dir(self) -> Path:
        return self.layout.run_dir

    async def policy(self, replica: int = 0, *, wait: float = 120.0) -> Policy:
        """A client of rollout ``replica``'s endpoint (waits until it serves)."""
        return await connect(self.run_dir, replica, wait=wait)

    async def wait(self) -> None:
        """Until the trainer has finished its steps (raises if the tree gave up)."""
        await self.tree.wait()

    async def status(self) -> dict[str, Any]:
        """The supervisor tree's snapshot: every child's state, pids and restarts."""
        return await self.tree.snapshot()


@contextlib.asynccontextmanager
async def start(
    config: ClusterConfig | str | Path, run_dir: str | Path | None = None
) -> AsyncIterator[EmbeddedCluster]:
    """Start a cluster in this event loop; stopped when the block ends (see the module
    docstring). ``config`` is a validated config or the path of a ``cluster.toml``."""
    cfg = config if isinstance(config, ClusterConfig) else load_config(config)
    layout = prepare(cfg, run_dir)
    tree = build_tree(cfg, layout)
    async with tree:
        yield EmbeddedCluster(cfg, layout, tree)
