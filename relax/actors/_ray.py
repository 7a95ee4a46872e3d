"""The ``Ray`` placement: each member runs on a Ray node, in the same child host as ``Process``.

A member is two processes on the node Ray picks: a small Ray actor (``_Launcher``) and, under
it, the very child ``relax.actors._host`` that ``Process`` runs, spawned by that actor. The
child dials the supervisor over the same PAIR protocol (tcp), so calls, casts, heartbeats,
hung-loop detection and ``ActorDead`` for pending calls are the process placement's, reused
(``RayMember`` is a ``ProcessMember`` with another way to spawn and to see the end).

One supervisor decides: the Ray actor has ``max_restarts=0`` and ``max_task_retries=0``, so
Ray never restarts it behind our back. The supervisor awaits a long-running method of it
(``wait``) that returns the child's exit status, so the end of a member reaches it as an
``Exit`` either way:

- the child died (SIGKILL, a crash, the kernel's OOM killer): ``wait`` returns its exit status
  — ``signal``/``exit_code``, exactly as for a ``Process`` child;
- the Ray actor itself died: ``wait`` raises Ray's error, read into ``node_lost`` (its node
  left the cluster), ``oom`` (Ray's memory monitor), ``placement`` (no node could host it) or
  ``ray`` (any other death Ray reports). The child is gone with it (``PR_SET_PDEATHSIG``).

``ray`` is imported only here, and only when a Ray member starts: nothing else pays for it.
A child no live node can host (its resource is on no node, or its node was lost) fails to
start with a ``placement`` cause, and the placement's ``wait_for_resources`` tells the
supervisor when one could: the child shows ``waiting`` meanwhile, without burning restart
intensity. Not built yet: gangs (one placement group per gang), and children on other
machines (the child dials the supervisor on 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from relax.actors._exit import Exit
from relax.actors._placement import Incarnation, LaunchSpec, Member, Process, start_member
from relax.actors._process import _CHILD_BOOT, ProcessMember, ProcessOptions
from relax.errors import MissingPackage, StartFailed

RAY_INSTALL_HINT = 'pip install -e ".[ray]"'
"""How to install the optional Ray extra (the preflight names it when ray is missing)."""

_KILL_GRACE = 5.0
"""Seconds the launcher gets to SIGKILL its child before the Ray actor itself is killed."""


@dataclass(frozen=True)
class Ray(ProcessOptions):
    """Run each member on a Ray node that has what it asks for, watched like a process child.

    The supervisor's process must be connected to Ray (``ray_session``, or the caller's own
    ``ray.init``) before such a child starts.
    """

    transport: Literal["ipc", "tcp"] = "tcp"
    """Always ``tcp``: a Ray node need not share a file system with the supervisor."""
    num_cpus: float = 1.0
    """Logical CPUs one member reserves on its node (Ray's unit of scheduling)."""
    num_gpus: float = 0.0
    """GPUs one member reserves; Ray sets ``CUDA_VISIBLE_DEVICES`` for it."""
    resources: Mapping[str, float] = field(default_factory=dict)
    """Custom Ray resources one member needs (``{"node-b": 0.01}`` pins it to that node)."""
    kind: Literal["ray"] = field(default="ray", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.transport != "tcp":
            raise ValueError("a Ray child reaches its supervisor over tcp only")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError("num_cpus and num_gpus must be >= 0")
        if any(amount <= 0 for amount in self.resources.values()):
            raise ValueError("every custom resource amount must be > 0")

    def check(self, spec: LaunchSpec) -> None:
        Process().check(spec)  # importable target, args that cross the wire
        if spec.gang > 1:
            raise ValueError(
                f"child {spec.id!r}: a gang ({spec.gang} members) on Ray is not built yet;"
                ' use placement "process" for gangs'
            )

    def demand(self) -> dict[str, Any]:
        """What one member asks Ray for, as Ray's actor options."""
        return {
            "num_cpus": self.num_cpus,
            "num_gpus": self.num_gpus,
            "resources": dict(self.resources),
        }

    def needs(self) -> dict[str, float]:
        """What one member needs from a node, in Ray's resource names."""
        need = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {name: amount for name, amount in need.items() if amount > 0}

    async def wait_for_resources(self, spec: LaunchSpec, poll: float = 0.5) -> None:
        """Until some live node of the cluster has, in all, what a member needs (a node was
        added, or came back); the supervisor then starts the waiting child again."""
        # Ray's control store has no subscription for "a node joined" in its public API: ask.
        while True:
            if await asyncio.to_thread(_hostable, self.needs()):
                return
            await asyncio.sleep(poll)

    async def launch(self, spec: LaunchSpec) -> Incarnation:
        _ray()  # fail here, named, when ray is missing or not connected
        if not await asyncio.to_thread(_hostable, self.needs()):
            # Ray would queue the actor forever: say so now, and let the supervisor wait.
            cause = _unhostable(self.needs())
            raise StartFailed(f"{spec.id}: {cause.describe()}", actor_id=spec.id, cause=cause)

        async def start(rank: int) -> Member:
            return await start_member(RayMember, spec, self, rank, {})

        return await Incarnation.launch(spec.id, [start] * spec.gang)


_LAUNCHER: Any = None
"""``ray.remote(_Launcher)``, made once: Ray exports a remote class each time it is made."""


def _launcher_class() -> Any:
    global _LAUNCHER
    if _LAUNCHER is None:
        _LAUNCHER = _ray().remote(_Launcher)
    return _LAUNCHER


def _ray() -> Any:
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


class _Launcher:
    """The Ray actor of one member: spawns the child host on its node and reports its end.

    An async actor on purpose: its methods run on one event-loop thread that lives as long as
    the actor, and the child's ``PR_SET_PDEATHSIG`` follows the thread that spawned it.
    """

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None

    async def spawn(self, env: dict[str, str]) -> dict[str, Any]:
        import ray

        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _CHILD_BOOT,
            env={**os.environ, **env},  # the node's own environment (CUDA_VISIBLE_DEVICES, ...)
            stdin=asyncio.subprocess.DEVNULL,
        )
        context = ray.get_runtime_context()
        return {
            "pid": self._proc.pid,
            "ray_pid": os.getpid(),
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "ray_actor_id": context.get_actor_id(),
        }

    async def wait(self) -> int:
        assert self._proc is not None
        return await self._proc.wait()

    async def kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGKILL)


class _Unhostable(Exception):
    """While a member waited to be placed, every node that could host it left."""


class RayMember(ProcessMember):
    """A ``ProcessMember`` whose child a Ray actor spawns on the node Ray chose."""

    placement_kind = "ray"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._handle: Any = None
        self._ended: Any = None  # the ObjectRef of the launcher's `wait`
        self._where: dict[str, Any] = {}

    async def _spawn(self, env: dict[str, str]) -> None:
        opts = self._options
        assert isinstance(opts, Ray)
        launcher = _launcher_class().options(
            **opts.demand(), max_restarts=0, max_task_retries=0, max_concurrency=4
        )
        self._handle = launcher.remote()
        try:
            self._where = await self._placed(
                asyncio.wrap_future(self._handle.spawn.remote(env).future()), opts
            )
        except BaseException as exc:
            self._release()
            if self._channel is not None:
                self._channel.close()
            if isinstance(exc, _Unhostable):
                cause = _unhostable(opts.needs())
            elif isinstance(exc, asyncio.TimeoutError):
                cause = Exit(
                    "placement",
                    f"no Ray node could host it within {opts.start_timeout:g}s"
                    f" (it asks for {opts.demand()})",
                )
            elif isinstance(exc, Exception):
                cause = await _ray_exit(exc, None)
            else:
                raise
            raise StartFailed(
                f"{self.actor_id}: {cause.describe()}", actor_id=self.actor_id, cause=cause
            ) from None
        self.pid = int(self._where["pid"])
        self._ended = asyncio.wrap_future(self._handle.wait.remote().future())

    async def _placed(self, spawned: asyncio.Future[Any], opts: Ray) -> dict[str, Any]:
        """``spawned``'s result once Ray placed the launcher, within ``start_timeout``; raises
        ``_Unhostable`` as soon as no live node could host it (its node was just lost)."""
        deadline = asyncio.get_running_loop().time() + opts.start_timeout
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise asyncio.TimeoutError
            done, _ = await asyncio.wait({spawned}, timeout=min(1.0, left))
            if done:
                return spawned.result()
            if not await asyncio.to_thread(_hostable, opts.needs()):
                spawned.cancel()
                raise _Unhostable

    async def _process_end(self) -> Exit:
        try:
            return Exit.from_returncode(await self._ended)
        except Exception as exc:
            return await _ray_exit(exc, self._where.get("node_id"))
        finally:
            self._release()  # the child is gone: give its node's resources back

    def _kill(self) -> None:
        if self._handle is None or (self._ended is not None and self._ended.done()):
            return
        # SIGKILL the child through its launcher (so its Exit says SIGKILL); if the launcher
        # cannot do it (hung, its node unreachable), kill the Ray actor, and the child with it.
        self._handle.kill.remote()
        asyncio.get_running_loop().call_later(_KILL_GRACE, self._release)

    def _release(self) -> None:
        if self._handle is not None:
            with contextlib.suppress(Exception):
                _ray().kill(self._handle, no_restart=True)

    def statistics(self) -> dict[str, Any]:
        where = {k: self._where.get(k) for k in ("node_id", "node_ip", "ray_actor_id", "ray_pid")}
        return {**super().statistics(), **where}


async def _ray_exit(exc: BaseException, node_id: str | None) -> Exit:
    """Read Ray's error about a dead (or never placed) actor into an ``Exit`` with its cause."""
    import ray.exceptions as rex

    text = str(exc)
    detail = _detail(text)
    if isinstance(exc, (rex.ActorUnschedulableError, rex.RuntimeEnvSetupError)):
        return Exit("placement", detail, error_type=type(exc).__name__)
    if "NODE_OUT_OF_MEMORY" in text or "running low on memory" in text:
        return Exit("oom", detail, error_type=type(exc).__name__)
    if "node has died" in text or "node was terminated" in text:
        return Exit("node_lost", detail, error_type=type(exc).__name__)
    if node_id is not None and not await asyncio.to_thread(_node_alive, node_id):
        return Exit("node_lost", f"node {node_id[:12]} left the cluster; {detail}")
    if "never ran" in text:
        return Exit("placement", detail, error_type=type(exc).__name__)
    return Exit("ray", detail, error_type=type(exc).__name__)


def _detail(text: str) -> str:
    """The informative part of Ray's multi-line error message, on one line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    keep = [line for line in lines if not line.startswith(("class_name:", "actor_id:", "pid:"))]
    return " ".join(keep)[:400]


def _unhostable(needs: Mapping[str, float]) -> Exit:
    """The cause of a start no live node could host: the supervisor parks such a child."""
    return Exit("placement", f"no live Ray node has {dict(needs)}")


def _hostable(needs: Mapping[str, float]) -> bool:
    """Whether a live node has, in all (used or not), every resource in ``needs``."""
    import ray

    try:
        nodes = ray.nodes()
    except Exception:  # the control store is unreachable: let Ray's own placement decide
        return True
    return any(
        n["Alive"] and all(n["Resources"].get(k, 0.0) >= v for k, v in needs.items()) for n in nodes
    )


def _node_alive(node_id: str) -> bool:
    """Whether Ray's control store still counts ``node_id`` among the live nodes."""
    import ray

    try:
        return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())
    except Exception:  # the control store itself is unreachable: say what Ray said instead
        return True


@contextlib.contextmanager
def ray_session(address: str = "local", *, num_cpus: int | None = None) -> Iterator[None]:
    """Connect this process to Ray for the length of the block.

    ``"local"`` starts a private Ray instance on 127.0.0.1 (every node on loopback) and stops
    it afterwards; ``"auto"`` and ``"ray://host:port"`` join an existing cluster and leave it
    running. A process already connected (an application's own ``ray.init``) is left as it is.
    """
    try:
        import ray
    except ImportError:
        raise MissingPackage("ray", 'placement "ray"', extra="ray") from None
    if ray.is_initialized():
        yield
        return
    from ray._private import ray_constants

    options: dict[str, Any] = {}
    saved = os.environ.get(_LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER
    if address == "local":
        # Without this, Ray's control store binds the machine's public address: the variable
        # for the processes Ray starts, the constant for this one (read when ray was imported).
        os.environ.setdefault(_LOOPBACK_ENV, "0")
        ray_constants.ENABLE_RAY_CLUSTER = False
        options = {
            "_node_ip_address": "127.0.0.1",
            "num_cpus": num_cpus,
            "include_dashboard": False,
        }
    try:
        ray.init(address=address, **options)
        yield
    finally:
        ray.shutdown()
        if saved[0] is None:
            os.environ.pop(_LOOPBACK_ENV, None)
        ray_constants.ENABLE_RAY_CLUSTER = saved[1]


_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to 0, Ray puts every node of a local instance on 127.0.0.1 (Ray 2.60 on Linux)."""


__all__ = ["RAY_INSTALL_HINT", "Ray", "RayMember", "ray_session"]
