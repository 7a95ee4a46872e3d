"""What runs on a Ray node for one member: the ``_Launcher`` Ray actor and its child host.

The launcher spawns the very child ``relax.actors._host`` that ``Process`` runs and reports
its end (``wait``). For a gang it also carries the gang's rendezvous across nodes: every
member gets a rendezvous folder of its own on its own node (``GANG_RENDEZVOUS_ENV``), rank 0's
child writes there the port of the store it bound (port 0: the kernel's pick, so no race),
rank 0's launcher reads it (``announced_port``), and every other member's launcher relays it
into its own member's folder. The children speak the one folder protocol ``init_world``
knows, whether the gang shares a node (``STRICT_PACK``) or not (``SPREAD``).

``ray`` is imported only when a Ray member starts: nothing else pays for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from relax.actors._process import _CHILD_BOOT
from relax.actors._ray_logs import node_folder, read_new, remove_orphans
from relax.errors import MissingPackage
from relax.log import ENV_LOG_DIR
from relax.runfiles import GANG_PORT_FILE, GANG_RENDEZVOUS_ENV

ANNOUNCE_TIMEOUT = 300.0
"""Seconds rank 0's launcher waits for its child to announce the store's port (it imports
torch first); the gang's own store timeout is as long."""


def connected_ray() -> Any:
    """The ``ray`` module, connected; ``MissingPackage`` or ``RuntimeError`` saying why not."""
    try:
        import ray
    except ImportError:
        raise MissingPackage("ray", 'placement "ray"', extra="ray") from None
    if not ray.is_initialized():
        raise RuntimeError(
            'placement "ray": this process is not connected to Ray'
            " (relax.cluster connects for [cluster.ray]; call ray.init() or use ray_session())"
        )
    return ray


_LAUNCHER: Any = None
"""``ray.remote(_Launcher)``, made once: Ray exports a remote class each time it is made."""


def launcher_class() -> Any:
    global _LAUNCHER
    if _LAUNCHER is None:
        _LAUNCHER = connected_ray().remote(_Launcher)
    return _LAUNCHER


def _node_priority(pid: int) -> int:
    """Give child ``pid`` its node's own CPU priority back; returns its nice value.

    Ray starts its workers at nice 15 (``RAY_worker_niceness``) so that the raylet stays
    responsive, and a child inherits it: a rollout or trainer there would yield the CPU to
    every other process of the node (measured: a gang's start went from seconds to over a
    minute beside two busy processes). The child does the role's real work, so it gets the
    raylet's nice value (our launcher's parent) where the OS lets us lower it (root, or an
    ``RLIMIT_NICE`` that allows it); elsewhere it keeps Ray's, and the status shows it."""
    target = os.getpriority(os.PRIO_PROCESS, os.getppid())
    with contextlib.suppress(PermissionError, ProcessLookupError):
        if os.getpriority(os.PRIO_PROCESS, pid) > target:
            os.setpriority(os.PRIO_PROCESS, pid, target)
    try:
        return os.getpriority(os.PRIO_PROCESS, pid)
    except ProcessLookupError:  # it died at once; its exit status tells why
        return target


class _Launcher:
    """The Ray actor of one member: spawns the child host on its node and reports its end.

    An async actor on purpose: its methods run on one event-loop thread that lives as long as
    the actor, and the child's ``PR_SET_PDEATHSIG`` follows the thread that spawned it.
    """

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None
        self._folder: str | None = None
        self._logs: str | None = None
        self._relay: asyncio.Task[None] | None = None
        # Set once ``spawn`` ran. Another member's launcher may ask ``announced_port`` before
        # the supervisor's ``spawn`` reached this one (Ray orders no calls across callers).
        self._spawned = asyncio.Event()
        _node_priority(os.getpid())  # relaying and watching run at the node's priority too
        remove_orphans()  # folders of launchers Ray killed outright on this node

    def where(self) -> dict[str, Any]:
        """The node this actor runs on, and a port that was free on it (``MASTER_PORT`` for
        members' own ``env://`` code; the gang's store itself binds port 0)."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ip, "port": port}

    async def spawn(
        self, env: dict[str, str], gang: bool = False, leader: Any = None
    ) -> dict[str, Any]:
        """Start the child host; for a gang member, in a rendezvous folder of its own, which
        ``leader`` (rank 0's launcher, for the other ranks) fills with the store's port."""
        import ray

        env = {**os.environ, **env}  # the node's own environment (CUDA_VISIBLE_DEVICES, ...)
        if gang:
            self._folder = node_folder("gang")
            env[GANG_RENDEZVOUS_ENV] = self._folder
        if env.get(ENV_LOG_DIR):  # the run's folder is on the head: log here, relayed there
            self._logs = env[ENV_LOG_DIR] = node_folder("logs")
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _CHILD_BOOT, env=env, stdin=asyncio.subprocess.DEVNULL
        )
        nice = _node_priority(self._proc.pid)
        self._spawned.set()
        if leader is not None:
            self._relay = asyncio.create_task(self._relay_port(leader))
        context = ray.get_runtime_context()
        return {
            "pid": self._proc.pid,
            "nice": nice,
            "ray_pid": os.getpid(),
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "ray_actor_id": context.get_actor_id(),
        }

    async def announced_port(self) -> int:
        """The port rank 0's child bound its store on, once it wrote it to its folder."""
        deadline = time.monotonic() + ANNOUNCE_TIMEOUT
        await asyncio.wait_for(self._spawned.wait(), ANNOUNCE_TIMEOUT)  # asked before spawn
        assert self._folder is not None and self._proc is not None
        port_file = Path(self._folder) / GANG_PORT_FILE
        # The child is another process writing a file: there is nothing to await but it.
        while not port_file.exists():
            if self._proc.returncode is not None:
                raise RuntimeError("rank 0 ended before it announced its store")
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 announced no store within {ANNOUNCE_TIMEOUT:g}s")
            await asyncio.sleep(0.05)
        return int(port_file.read_text())

    async def _relay_port(self, leader: Any) -> None:
        try:
            port = await leader.announced_port.remote()
            assert self._folder is not None
            partial = Path(self._folder) / f"{GANG_PORT_FILE}.relay.partial"
            partial.write_text(str(port))
            partial.replace(Path(self._folder) / GANG_PORT_FILE)  # atomic: never half a number
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            # No port will come (the leader died, or timed out): end this member now, so the
            # gang fails with a cause instead of waiting out its start timeout.
            print(f"relax: the gang's rendezvous failed: {exc!r}", file=sys.stderr, flush=True)
            await self.kill()

    def logs(self, offsets: dict[str, int], final: bool = False) -> dict[str, bytes]:
        """The child's log lines past ``offsets``; ``final`` (the child has ended): and once
        none is left, its log folder goes."""
        if self._logs is None:
            return {}
        chunks = read_new(self._logs, offsets)
        if final and not chunks:
            shutil.rmtree(self._logs, ignore_errors=True)
            self._logs = None
        return chunks

    async def wait(self) -> int:
        assert self._proc is not None
        try:
            return await self._proc.wait()
        finally:
            self._clean()

    async def kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGKILL)

    def _clean(self) -> None:
        if self._relay is not None:
            self._relay.cancel()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)


__all__ = ["connected_ray", "launcher_class"]
