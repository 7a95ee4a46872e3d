"""The ``Ray`` placement: each member runs on a Ray node, in the same child host as ``Process``.

A member is two processes on the node Ray picks: a small Ray actor (``_Launcher``, in
``_ray_node.py``) and, under it, the very child ``relax.actors._host`` that ``Process`` runs,
spawned by that actor. The child dials the supervisor over the same PAIR protocol (tcp), so
calls, casts, heartbeats, hung-loop detection and ``ActorDead`` for pending calls are the
process placement's, reused (``RayMember`` is a ``ProcessMember`` with another way to spawn
and to see the end).

One supervisor decides: the Ray actor has ``max_restarts=0`` and ``max_task_retries=0``, so
Ray never restarts it behind our back. The supervisor awaits a long-running method of it
(``wait``) that returns the child's exit status, so the end of a member reaches it as an
``Exit`` either way:

- the child died (SIGKILL, a crash, the kernel's OOM killer): ``wait`` returns its exit status
  — ``signal``/``exit_code``, exactly as for a ``Process`` child;
- the Ray actor itself died: ``wait`` raises Ray's error, read into ``node_lost`` (its node
  left the cluster), ``oom`` (Ray's memory monitor), ``placement`` (no node could host it) or
  ``ray`` (any other death Ray reports). The child is gone with it (``PR_SET_PDEATHSIG``).

A gang is one Ray placement group per start (one bundle per member, the role's ``strategy``:
``STRICT_PACK`` keeps it on one node, ``SPREAD`` spreads it), removed when that start ends;
its members meet on a store rank 0 hosts on its node (``MASTER_ADDR``), through rendezvous
folders the launchers keep in step across nodes. The supervisor's ``Incarnation`` makes it one
unit: a member's end ends the others, and the restart places a new group.

A child no live node can host (its resource is on no node, its node was lost, no node is
large enough for its ``STRICT_PACK`` gang) fails to start with a ``placement`` cause, and the
placement's ``wait_for_resources`` tells the supervisor when one could: the child shows
``waiting`` meanwhile, without burning restart intensity.

A child dials its supervisor at the placement's ``host`` (``[cluster] host``): a child placed
on a node of another machine while the supervisor listens on loopback could never reach it,
so its start fails at once, naming the setting, rather than after a dial timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from relax.actors._exit import Exit
from relax.actors._placement import Incarnation, LaunchSpec, Member, Process, start_member
from relax.actors._process import ProcessMember, ProcessOptions
from relax.actors._ray_logs import RELAY_INTERVAL, LogSink
from relax.actors._ray_node import connected_ray, launcher_class
from relax.actors._ray_run import actor_name, group_name
from relax.errors import MissingPackage, StartFailed
from relax.log import ENV_LOG_DIR

RAY_INSTALL_HINT = 'pip install -e ".[ray]"'
"""How to install the optional Ray extra (the preflight names it when ray is missing)."""

GangStrategy = Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"]
"""Ray's placement-group strategies, for where a gang's members go."""

_KILL_GRACE = 5.0
"""Seconds the launcher gets to SIGKILL its child before the Ray actor itself is killed."""

_LAUNCHER_OPTIONS = {"max_restarts": 0, "max_task_retries": 0, "max_concurrency": 4}
"""Ray never restarts a launcher (our supervisor decides); ``wait`` runs beside the rest."""


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
    strategy: GangStrategy = "STRICT_PACK"
    """Where a gang's members go: its placement group's strategy (``STRICT_PACK``: one node;
    ``PACK``: as few nodes as fit; ``SPREAD``: across nodes where it can; ``STRICT_SPREAD``:
    each on a node of its own). A single member ignores it."""
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
        if spec.gang > 1 and not self.needs():
            raise ValueError(
                f"child {spec.id!r}: a gang member on Ray must reserve something (num_cpus,"
                " num_gpus or a custom resource above 0): a placement group bundle cannot be empty"
            )

    def demand(self) -> dict[str, Any]:
        """What one member asks Ray for, as Ray's actor options."""
        return {
            "num_cpus": self.num_cpus,
            "num_gpus": self.num_gpus,
            "resources": dict(self.resources),
        }

    def needs(self) -> dict[str, float]:
        """What one member needs from a node, in Ray's resource names (a gang's bundle)."""
        need = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {name: amount for name, amount in need.items() if amount > 0}

    def hostable(self, gang: int = 1) -> bool:
        """Whether the live nodes, in all (used or not), could hold ``gang`` members."""
        return _hostable(self.needs(), gang, self.strategy)

    def unhostable(self, gang: int = 1) -> Exit:
        """The cause of a start the live nodes cannot hold: the supervisor parks such a child."""
        if gang == 1:
            return Exit("placement", f"no live Ray node has {self.needs()}")
        return Exit(
            "placement",
            f"the live Ray nodes cannot hold {gang} members of {self.needs()} ({self.strategy})",
        )

    async def wait_for_resources(self, spec: LaunchSpec, poll: float = 0.5) -> None:
        """Until the live nodes could hold the child (a node was added, or came back); the
        supervisor then starts the waiting child again."""
        # Ray's control store has no subscription for "a node joined" in its public API: ask.
        while True:
            if await asyncio.to_thread(self.hostable, spec.gang):
                return
            await asyncio.sleep(poll)

    async def launch(self, spec: LaunchSpec) -> Incarnation:
        connected_ray()  # fail here, named, when ray is missing or not connected
        if not await asyncio.to_thread(self.hostable, spec.gang):
            # Ray would queue it forever: say so now, and let the supervisor wait.
            cause = self.unhostable(spec.gang)
            raise StartFailed(f"{spec.id}: {cause.describe()}", actor_id=spec.id, cause=cause)
        if spec.gang > 1:
            return await _launch_gang(self, spec)

        async def start(rank: int) -> Member:
            return await start_member(RayMember, spec, self, rank, {})

        return await Incarnation.launch(spec.id, [start])


async def _launch_gang(opts: Ray, spec: LaunchSpec) -> Incarnation:
    """One start of a gang: a placement group, one launcher in each bundle, the members."""
    ray = connected_ray()
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    namespace = ray.get_runtime_context().namespace
    group = ray.util.placement_group(
        [opts.needs()] * spec.gang, strategy=opts.strategy, name=group_name(namespace, spec.id)
    )
    try:
        await _placing(
            spec.id, opts, spec.gang, asyncio.wrap_future(group.ready().future()), group=True
        )
        launchers = [
            launcher_class()
            .options(
                **opts.demand(),
                **_LAUNCHER_OPTIONS,
                name=actor_name(spec.id, rank),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank
                ),
            )
            .remote()
            for rank in range(spec.gang)
        ]
        where = await _placing(
            spec.id,
            opts,
            spec.gang,
            asyncio.gather(*(asyncio.wrap_future(h.where.remote().future()) for h in launchers)),
        )
        envs = _gang_envs(where, gpus=opts.num_gpus > 0)

        def starter(rank: int) -> Any:
            async def start(_: int) -> Member:
                leader = launchers[0] if rank else None
                extra = {"launcher": launchers[rank], "leader": leader}
                return await start_member(RayMember, spec, opts, rank, envs[rank], extra)

            return start

        incarnation = await Incarnation.launch(spec.id, [starter(r) for r in range(spec.gang)])
    except BaseException:
        _remove_group(group)  # its launchers (and their children) go with it
        raise
    loop = asyncio.get_running_loop()
    incarnation.done.add_done_callback(lambda _: _remove_group_soon(loop, group))
    return incarnation


def _gang_envs(where: list[dict[str, Any]], *, gpus: bool) -> list[dict[str, str]]:
    """Each member's torch.distributed environment: rank 0's node hosts the store
    (``MASTER_ADDR``); ``LOCAL_RANK`` counts the members on a node — except with GPUs, where
    Ray shows each member only its own (``CUDA_VISIBLE_DEVICES``), so each is device 0."""
    size = len(where)
    per_node: dict[str, int] = {}
    local: list[int] = []
    for w in where:
        local.append(per_node.get(w["node_id"], 0))
        per_node[w["node_id"]] = local[-1] + 1
    return [
        {
            "MASTER_ADDR": where[0]["ip"],
            "MASTER_PORT": str(where[0]["port"]),
            "WORLD_SIZE": str(size),
            "RANK": str(rank),
            "LOCAL_RANK": "0" if gpus else str(local[rank]),
            "LOCAL_WORLD_SIZE": "1" if gpus else str(per_node[w["node_id"]]),
        }
        for rank, w in enumerate(where)
    ]


def _remove_group_soon(loop: asyncio.AbstractEventLoop, group: Any) -> None:
    """Remove ``group`` off the event loop: it is a blocking call to Ray's control store."""
    try:
        loop.run_in_executor(None, _remove_group, group)
    except RuntimeError:  # the loop's executor has shut down: the run is ending anyway
        _remove_group(group)


def _remove_group(group: Any) -> None:
    with contextlib.suppress(Exception):  # Ray disconnected at the end of a run: gone anyway
        connected_ray().util.remove_placement_group(group)


class _Unhostable(Exception):
    """While it waited to be placed, every node that could host it left."""


async def _placing(
    actor_id: str,
    opts: Ray,
    gang: int,
    placed: asyncio.Future[Any],
    *,
    group: bool = False,
) -> Any:
    """``placed``'s result once Ray placed what it waits on, within ``start_timeout``; a
    ``StartFailed`` with a ``placement`` cause when it timed out or the live nodes could no
    longer hold it (a node was just lost), with Ray's own cause when Ray refused it."""
    try:
        return await _await_placement(placed, opts.start_timeout, lambda: opts.hostable(gang))
    except _Unhostable:
        cause = opts.unhostable(gang)
    except asyncio.TimeoutError:
        what = f"a placement group of {gang} x {opts.needs()}" if group else opts.demand()
        cause = Exit(
            "placement", f"no Ray node could host it within {opts.start_timeout:g}s ({what})"
        )
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        cause = await _ray_exit(exc, None)
    raise StartFailed(f"{actor_id}: {cause.describe()}", actor_id=actor_id, cause=cause)


async def _await_placement(
    placed: asyncio.Future[Any], timeout: float, hostable: Callable[[], bool]
) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise asyncio.TimeoutError
            done, _ = await asyncio.wait({placed}, timeout=min(1.0, left))
            if done:
                return placed.result()
            if not await asyncio.to_thread(hostable):
                raise _Unhostable
    finally:
        placed.cancel()  # a no-op once it is done


class RayMember(ProcessMember):
    """A ``ProcessMember`` whose child a Ray actor spawns on the node Ray chose.

    A gang's member gets its ``launcher`` already placed in the gang's placement group, and,
    above rank 0, the ``leader`` (rank 0's launcher) its rendezvous folder is kept in step with.
    """

    placement_kind = "ray"

    def __init__(self, *, launcher: Any = None, leader: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._handle: Any = launcher
        self._gang_member = launcher is not None
        self._leader = leader
        self._ended: Any = None  # the ObjectRef of the launcher's `wait`
        self._where: dict[str, Any] = {}
        self._sink: LogSink | None = None  # where the child's log lines are relayed to
        self._relay: asyncio.Task[None] | None = None

    async def _spawn(self, env: dict[str, str]) -> None:
        opts = self._options
        assert isinstance(opts, Ray)
        if self._handle is None:
            name = actor_name(self.actor_id, self.rank)
            self._handle = (
                launcher_class().options(**opts.demand(), **_LAUNCHER_OPTIONS, name=name).remote()
            )
        spawned = self._handle.spawn.remote(env, self._gang_member, self._leader)
        try:
            self._where = await _placing(
                self.actor_id, opts, 1, asyncio.wrap_future(spawned.future())
            )
        except BaseException:
            self._release()
            if self._channel is not None:
                self._channel.close()
            raise
        self.pid = int(self._where["pid"])
        unreachable = unreachable_supervisor(opts.host, str(self._where.get("node_ip", "")))
        if unreachable is not None:
            self._release()
            raise StartFailed(f"{self.actor_id}: {unreachable}", actor_id=self.actor_id)
        self._ended = asyncio.wrap_future(self._handle.wait.remote().future())
        if env.get(ENV_LOG_DIR):
            self._sink = LogSink(env[ENV_LOG_DIR])
            self._relay = asyncio.create_task(self._relay_logs())
            self._tasks.append(self._relay)

    async def _relay_logs(self) -> None:
        while True:
            await asyncio.sleep(RELAY_INTERVAL)
            try:
                await self._pull_logs()
            except Exception:  # the launcher is gone: its end reaches the supervisor anyway
                return

    async def _pull_logs(self, final: bool = False) -> None:
        assert self._sink is not None
        while True:  # one pull brings PULL_LIMIT bytes at most: again until none is new
            pulled = self._handle.logs.remote(dict(self._sink.offsets), final)
            chunks = await asyncio.wrap_future(pulled.future())
            if not chunks:
                return  # (after the final pull, the launcher removed the child's folder)
            # Written here, with no await between the pull and its offsets: a cancelled relay
            # never leaves a write behind that the final pull would repeat.
            self._sink.write(chunks)

    async def _process_end(self) -> Exit:
        try:
            # Shielded: a watcher cancelled with its loop watches again (ProcessMember).
            exit_ = Exit.from_returncode(await asyncio.shield(self._ended))
        except Exception as exc:
            exit_ = await _ray_exit(exc, self._where.get("node_id"))
        try:
            if self._sink is not None:  # the child's last lines (a crash's traceback)
                if self._relay is not None:
                    self._relay.cancel()
                    await asyncio.gather(self._relay, return_exceptions=True)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._pull_logs(final=True), _KILL_GRACE)
            return exit_
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
                connected_ray().kill(self._handle, no_restart=True)

    def statistics(self) -> dict[str, Any]:
        keys = ("node_id", "node_ip", "ray_actor_id", "ray_pid", "nice")
        where = {k: self._where.get(k) for k in keys}
        return {**super().statistics(), **where}


def unreachable_supervisor(host: str, node_ip: str) -> str | None:
    """Why a child on the node at ``node_ip`` cannot dial a supervisor listening on ``host``
    (loopback, while the node is another machine), or None when it can."""
    if not (_loopback(host) and node_ip and not _loopback(node_ip)):
        return None
    return (
        f"placed on the Ray node at {node_ip}, which cannot reach this supervisor on {host}"
        " (cluster.host): set cluster.host to this machine's address on the cluster network,"
        " with cluster.secret_env (see docs/cluster.md)"
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: let the child try to resolve and dial it
        return False


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


def _hostable(needs: Mapping[str, float], gang: int = 1, strategy: str = "STRICT_PACK") -> bool:
    """Whether the live nodes, in all (used or not), could hold ``gang`` members of ``needs``
    placed by ``strategy`` (a single member: some node has every resource it needs)."""
    import ray

    try:
        nodes = ray.nodes()
    except Exception:  # the control store is unreachable: let Ray's own placement decide
        return True
    holds = [_members_fit(n["Resources"], needs) for n in nodes if n["Alive"]]
    if strategy == "STRICT_PACK":
        return max(holds, default=0) >= gang
    if strategy == "STRICT_SPREAD":
        return sum(1 for h in holds if h >= 1) >= gang
    return sum(holds) >= gang


def _members_fit(has: Mapping[str, float], needs: Mapping[str, float]) -> float:
    """How many members of ``needs`` a node with ``has`` holds, in all."""
    # Ray counts resources in units of 1e-4: 1.0 / 0.1 is 10 members, not 9.9999.
    return min((math.floor(has.get(k, 0.0) / v + 1e-6) for k, v in needs.items()), default=math.inf)


def _node_alive(node_id: str) -> bool:
    """Whether Ray's control store still counts ``node_id`` among the live nodes."""
    import ray

    try:
        return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())
    except Exception:  # the control store itself is unreachable: say what Ray said instead
        return True


@contextlib.contextmanager
def ray_session(
    address: str = "local", *, num_cpus: int | None = None, namespace: str | None = None
) -> Iterator[bool]:
    """Connect this process to Ray for the length of the block.

    ``"local"`` starts a private Ray instance on 127.0.0.1 (every node on loopback) and stops
    it afterwards; ``"auto"``, ``"host:port"`` and ``"ray://host:port"`` join an existing
    cluster and leave it
    running. A process already connected (an application's own ``ray.init``) is left as it is,
    in its own namespace; else ``namespace`` (a run's, ``run_namespace``) names the Ray
    namespace this process's actors are created in. Yields whether this block made the
    connection (and so owns the namespace: ``relax down`` may sweep it).
    """
    try:
        import ray
    except ImportError:
        raise MissingPackage("ray", 'placement "ray"', extra="ray") from None
    if ray.is_initialized():
        yield False
        return
    options: dict[str, Any] = {}
    env: dict[str, str] = {}
    if address == "local":
        # Without this, Ray's control store binds the machine's public address.
        env = {_LOOPBACK_ENV: os.environ.get(_LOOPBACK_ENV, "0")}
        env[WORKER_NICENESS_ENV] = os.environ.get(WORKER_NICENESS_ENV, "0")
        options = {
            "_node_ip_address": "127.0.0.1",
            "num_cpus": num_cpus,
            "include_dashboard": False,
        }
    with ray_process_env(env):
        try:
            ray.init(address=address, namespace=namespace, **options)
            yield True
        finally:
            ray.shutdown()


@contextlib.contextmanager
def ray_process_env(env: Mapping[str, str]) -> Iterator[None]:
    """Ray's settings from the environment, for this process and the ones Ray starts, for the
    length of the block; on the way out every one is as it was, ``RAY_AUTH_MODE`` included.

    Why the care: a local ``ray.init`` sets ``RAY_AUTH_MODE=token`` in this process's
    environment and caches it in Ray's C++ config, and both outlive ``ray.shutdown``. A later
    Ray instance in the same process (a test's cluster, a second run embedded in one program)
    then starts its raylets with one mode while this process speaks the other, and every actor
    it creates dies unscheduled. The loopback switch is also a Python constant, read when ray
    was imported.
    """
    from ray._private import ray_constants

    names = {*env, _AUTH_ENV}
    saved_env = {name: os.environ.get(name) for name in names}
    saved_cluster = ray_constants.ENABLE_RAY_CLUSTER
    os.environ.update(env)
    if _LOOPBACK_ENV in env:
        ray_constants.ENABLE_RAY_CLUSTER = ray_constants.env_bool(
            _LOOPBACK_ENV, not ray_constants.IS_WINDOWS_OR_OSX
        )
    _reload_ray_config()
    try:
        yield
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        ray_constants.ENABLE_RAY_CLUSTER = saved_cluster
        _reload_ray_config()


def _reload_ray_config() -> None:
    """Make Ray's cached C++ config and auth token read the environment again."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


_AUTH_ENV = "RAY_AUTH_MODE"
"""Ray's token authentication switch (``token`` or ``disabled``)."""
WORKER_NICENESS_ENV = "RAY_worker_niceness"
"""The nice value a raylet starts its workers at; Ray's default is 15, so that the raylet stays
responsive. A launcher is such a worker, and beside busy processes at nice 0 one at nice 15
gets a few percent of a core: measured beside four busy processes, a two-member gang's start
did not finish within 120 s at 15 and took 31 s at 0 (CI's failure). The Ray instances Relax
starts itself use 0 unless the environment says otherwise; a cluster's own `ray start` should
set it too (docs/cluster.md)."""
_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to 0, Ray puts every node of a local instance on 127.0.0.1 (Ray 2.60 on Linux)."""


__all__ = ["RAY_INSTALL_HINT", "WORKER_NICENESS_ENV", "Ray", "RayMember", "ray_session"]
