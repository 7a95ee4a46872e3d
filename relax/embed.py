"""A whole cluster inside your own asyncio program.

::

    async with relax.embed.start("cluster.toml") as run:     # the supervisor tree, here
        async with await run.policy() as policy:              # its OpenAI-compatible endpoint
            while not run.done.done():                        # until the trainer is done
                try:
                    ...                                       # play episodes, policy.finish(...)
                except RunFinished:                           # the run ended mid-episode
                    break
        await run.done                                        # raises if the tree gave up

The tree runs as tasks of the caller's event loop (roles with ``placement = "process"`` in
their own processes, as always). When the trainer has done ``trainer.steps`` the run ends by
itself: ``run.done`` (an ``asyncio.Future``) resolves, the endpoint goes away with the tree,
and the client's calls raise ``RunFinished`` (also the call that met the closing endpoint).
Leaving the block stops the tree in reverse order, as ``relax down`` does: the trainer
checkpoints, every child is stopped, nothing is left running — also when the block is left by
an exception or a cancellation.

Like any run, an embedded one writes ``RUN_DIR/logs/<actor>.jsonl`` (and metrics, checkpoints).
Its log lines and the libraries' progress bars stay off the host program's terminal (stdout
and stderr, child processes included) unless ``start(..., console=True)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax.actors import Supervisor
from relax.agents import Policy, connect
from relax.cluster import Layout, build_tree, prepare
from relax.config import ClusterConfig
from relax.log import ENV_CONSOLE, LOGS_DIR, configure_logging, log_files
from relax.preflight import load_checked
from relax.runfiles import set_pause_requested

_QUIET_ENV = {ENV_CONSOLE: "0", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
"""What keeps an embedded run's processes off the terminal (children inherit it)."""

_ENDING = ("stopping", "stopped", "crashed")


@dataclass
class EmbeddedCluster:
    """A running cluster started by :func:`start`."""

    config: ClusterConfig
    layout: Layout
    tree: Supervisor
    done: asyncio.Future[None] = field(init=False, repr=False)
    """Resolves when the run has ended: ``None`` when the trainer finished its steps (or the
    block was left), ``SupervisorGaveUp`` when the tree gave up. Await it, or poll
    ``done.done()``."""

    def __post_init__(self) -> None:
        self.done = asyncio.get_running_loop().create_future()
        # Retrieved here, so a run nobody awaits does not warn "exception never retrieved".
        self.done.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._watcher = asyncio.ensure_future(self._watch())

    @property
    def run_dir(self) -> Path:
        return self.layout.run_dir

    @property
    def finished(self) -> bool:
        """Whether the run has ended (``done`` resolved)."""
        return self.done.done()

    async def policy(self, replica: int = 0, *, wait: float = 120.0) -> Policy:
        """A client of rollout ``replica``'s endpoint (waits until it serves); its calls raise
        ``RunFinished`` once the run has ended."""
        policy = await connect(self.run_dir, replica, wait=wait)
        policy.run_ended = self._ended_within
        return policy

    async def wait(self) -> None:
        """Until the run has ended (raises if the tree gave up): ``await run.done``."""
        await asyncio.shield(self.done)

    async def status(self) -> dict[str, Any]:
        """The supervisor tree's snapshot: every child's state, pids and restarts."""
        return await self.tree.snapshot()

    async def _watch(self) -> None:
        try:
            await self.tree.wait()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if not self.done.done():
                self.done.set_exception(exc)
        finally:
            if not self.done.done():  # ended, or the block was left: the run is over
                self.done.set_result(None)

    async def _ended_within(self, within: float) -> str | None:
        """Why the run has ended (or is ending: its trainer is done and the tree is stopping),
        waiting up to ``within`` seconds for it; ``None`` while it goes on."""
        with contextlib.suppress(TimeoutError, Exception):
            if not self.done.done() and not await self._ending():
                await asyncio.wait_for(asyncio.shield(self.done), within)
        if self.done.done():
            failed = self.done.exception() if not self.done.cancelled() else None
            return f"it failed: {failed}" if failed else "the trainer finished its steps"
        return "the trainer finished its steps" if await self._ending() else None

    async def _ending(self) -> bool:
        try:
            snapshot = await self.tree.snapshot()
        except Exception:  # the tree is gone
            return True
        return snapshot.get("gave_up") is not None or any(
            c["state"] in _ENDING
            for c in snapshot["children"]
            if c["id"] == "trainer" or c["id"].startswith("rollout-")
        )


@contextlib.asynccontextmanager
async def start(
    config: ClusterConfig | str | Path,
    run_dir: str | Path | None = None,
    *,
    console: bool = False,
) -> AsyncIterator[EmbeddedCluster]:
    """Start a cluster in this event loop; stopped when the block ends (see the module
    docstring). ``config`` is a validated config or the path of a ``cluster.toml``;
    ``console``: also print the run's log lines (and progress bars) to this terminal."""
    # A path gets the same load + preflight as `relax up` (the config's folder joins sys.path).
    cfg = config if isinstance(config, ClusterConfig) else load_checked(config)
    with contextlib.ExitStack() as stack:
        if not console:
            stack.enter_context(_quiet())
        layout = prepare(cfg, run_dir)
        set_pause_requested(layout.run_dir, False)  # nothing steers an embedded run's pause
        logs = layout.run_dir / LOGS_DIR if cfg.logging.log_files else None
        stack.enter_context(log_files(logs))
        tree = build_tree(cfg, layout)
        async with tree:
            run = EmbeddedCluster(cfg, layout, tree)
            try:
                yield run
            finally:
                run._watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await run._watcher
        if not run.done.done():
            run.done.set_result(None)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No log lines or progress bars on the terminal (this process and its children): the
    log files get everything. Restores the process's logging and environment afterwards."""
    import structlog

    import relax.log as relax_log

    saved_env = {key: os.environ.get(key) for key in _QUIET_ENV}
    saved_config = structlog.get_config()
    was_configured = getattr(relax_log, "_configured", False)
    bars = _progress_bars(False)
    os.environ.update(_QUIET_ENV)
    configure_logging(force=True)  # reads RELAX_LOG_CONSOLE=0: files only
    try:
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        structlog.configure(**saved_config)
        relax_log._configured = was_configured
        _progress_bars(bars)


def _progress_bars(enabled: bool) -> bool:
    """Turn transformers' progress bars on or off; returns whether they were on."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    return was
