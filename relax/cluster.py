"""The composition root: a validated ``ClusterConfig`` becomes a running supervisor tree.

::

    root (strategy from [supervisor]; ends when the trainer finishes its steps)
    ├── prompts    a bus of prompts (task "rollout")
    ├── samples    the TransferQueue of samples (tasks "reward", "train", and "reference" /
    │              "critic" when those roles are enabled; staleness-paced)
    ├── dataset    prompts → prompt bus
    ├── reward-i   samples → reward column (failed rewards dropped with their group; none
    │              with [reward] in_rollout, where each rollout scores what it generated)
    ├── reference-i  samples → ref_logprobs column ([reference] enabled; the frozen policy)
    ├── critic-0   samples with a reward → values column, then a critic update ([critic])
    ├── trainer    whole groups within the staleness bound → step → publish weights
    ├── eval       published weights → held-out prompts → eval.jsonl ([eval] every_steps > 0)
    └── rollout-i  prompts + weights → admitted, generated samples

Roles meet only on the buses. Everything a run writes goes under one run folder:
the tiny model built from ``[model.init]``, the bus logs, ``metrics.jsonl`` (and the critic's
``critic.jsonl``), checkpoints (the critic's under ``<checkpoint.dir>/critic``), TensorBoard
events in ``tensorboard/`` ([logging] tensorboard), and every process's log lines as JSON, one
file per actor, in ``logs/<actor-id>.jsonl`` ([logging] log_files). While it runs, the main
process serves Prometheus metrics on ``http://127.0.0.1:PORT/metrics`` ([logging] prometheus;
the URL is in ``relax status`` and ``control.json``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import socket
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax.actors import (
    ChildSpec,
    InProc,
    Placement,
    Process,
    Ray,
    Restart,
    Supervisor,
    connected_to,
    ray_session,
    run_namespace,
)
from relax.bus import BusService
from relax.config import ClusterConfig
from relax.control import ControlServer
from relax.errors import ConfigError
from relax.log import LOGS_DIR, configure_logging, get_logger, log_files
from relax.observe import check_sinks, serve_metrics
from relax.preflight import check, resolve_secret
from relax.roles import (
    CriticRole,
    DatasetRole,
    EvalRole,
    ReferenceRole,
    RewardRole,
    RolloutRole,
    TrainerRole,
)
from relax.runfiles import RayInfo, write_ray_info


@dataclass(frozen=True)
class Layout:
    """Where a run lives and how its parts reach each other.

    ``release()`` removes what the run holds outside its folder — the private folder of its
    ipc sockets, the TCP ports it reserved — once the run ends (``run`` does it; otherwise it
    happens when the layout is garbage-collected or the interpreter exits).
    """

    run_dir: Path
    model_dir: Path
    prompts_url: str
    samples_url: str
    sockets: Path | None = field(default=None, compare=False)
    """The temporary folder of the buses' ipc sockets, if they use ipc."""
    reserved: tuple[socket.socket, ...] = field(default=(), compare=False, repr=False)
    """Sockets holding the buses' TCP ports for the life of the run (see ``_reserve_port``)."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "_finalizer", weakref.finalize(self, _release, self.sockets, self.reserved)
        )

    def release(self) -> None:
        """Remove the ipc socket folder and free the reserved ports (idempotent)."""
        self._finalizer()  # type: ignore[attr-defined]


def _release(sockets: Path | None, reserved: tuple[socket.socket, ...]) -> None:
    for sock in reserved:
        sock.close()
    if sockets is not None:
        shutil.rmtree(sockets, ignore_errors=True)


def make_private_dir(path: Path) -> None:
    """Create ``path`` (and its parents) and make it 0700: a run folder holds data, logs and
    endpoint files only its owner should read."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def prepare(cfg: ClusterConfig, run_dir: str | Path | None = None) -> Layout:
    """Run the preflight, create the run folder (0700), build or check the model, and pick
    the bus addresses.

    Raises ``ConfigError`` with every problem ``relax.preflight`` finds before anything is made.
    """
    check_sinks(cfg.logging)  # a missing sink package raises its own MissingPackage
    check(cfg)
    root = (
        Path(run_dir)
        if run_dir
        else Path(cfg.cluster.run_dir) / f"{cfg.cluster.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    make_private_dir(root)
    if cfg.model.init is not None:
        from relax.models import build_tiny_model

        model_dir = root / "model"
        if not (model_dir / "config.json").exists():
            build_tiny_model(cfg.model.init, model_dir)
    else:
        model_dir = Path(cfg.model.path or "")
        if not (model_dir / "config.json").exists():
            raise ConfigError(
                f"model.path: {str(model_dir)!r} is not a Hugging Face model folder (no config.json)"
            )
    transport = cfg.bus_transport
    host = cfg.cluster.host
    if transport == "inproc":
        return Layout(root, model_dir, f"inproc://{root}/prompts", f"inproc://{root}/samples")
    if transport == "ipc":
        sockets = Path(tempfile.mkdtemp(prefix="relax-"))  # 0700; unix socket paths are short
        return Layout(
            root,
            model_dir,
            f"ipc://{sockets}/prompts.sock",
            f"ipc://{sockets}/samples.sock",
            sockets=sockets,
        )
    prompts = _reserve_port(host)
    if cfg.cluster.ports.bus:
        samples_url = f"tcp://{host}:{cfg.cluster.ports.bus}"
        reserved: tuple[socket.socket, ...] = (prompts,)
    else:
        samples = _reserve_port(host)
        samples_url = f"tcp://{host}:{samples.getsockname()[1]}"
        reserved = (prompts, samples)
    prompts_url = f"tcp://{host}:{prompts.getsockname()[1]}"
    return Layout(root, model_dir, prompts_url, samples_url, reserved=reserved)


def _reserve_port(host: str) -> socket.socket:
    """A socket bound (not listening) to a free port of ``host``, kept open for the run.

    A bus needs a port that stays the same across its restarts (its clients reconnect to it),
    so it cannot just listen on port 0 each time. Picking a free port and closing the socket
    would let any other process take it before the bus binds it; holding it bound with
    SO_REUSEADDR keeps the kernel from handing it out, while the bus's listener (NNG sets
    SO_REUSEADDR too) may bind it, at its first start and after every restart.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    return sock


_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""Read by torch (and the BLAS it uses) when it starts: a child's thread budget."""


def _placement(role: Any, host: str = "127.0.0.1", standby: bool = False) -> Placement:
    """Where ``role`` runs; ``host`` is where a Ray child (possibly on another node) dials its
    supervisor: ``[cluster] host``; ``standby``: a process child keeps a warm spare
    (``[supervisor] standby``)."""
    if role.placement == "inproc":
        return InProc()
    threads = getattr(role, "threads", None)
    env = {} if threads is None else {v: str(threads) for v in _THREAD_VARS}
    watch = {
        "heartbeat_interval": role.heartbeat_interval,
        "heartbeat_timeout": role.heartbeat_timeout,
        "env": env,
    }
    if role.placement == "process":
        return Process(**watch, standby=standby)
    if role.placement == "ray":
        ray = role.ray
        return Ray(
            **watch,
            start_timeout=ray.start_timeout,
            num_cpus=ray.num_cpus,
            num_gpus=ray.num_gpus,
            resources=dict(ray.resources),
            strategy=ray.strategy,
            host=host,
        )
    raise ConfigError(f"placement {role.placement!r} is not built; use 'process' or 'inproc'")


def uses_ray(cfg: ClusterConfig) -> bool:
    """Whether any child of the run has placement "ray" (then ``[cluster.ray]`` is connected)."""
    children = [*cfg.enabled_roles.values(), *cfg.actors]
    return any(child.placement == "ray" for child in children)


def plain_config(cfg: ClusterConfig) -> dict[str, Any]:
    """The config as plain data for the roles (it crosses process boundaries), with the
    secret resolved once here (from ``secret`` or the ``secret_env`` variable), so every role
    and bus uses the very same one."""
    data = cfg.model_dump(mode="json")
    secret = resolve_secret(cfg)
    data["cluster"]["secret"] = secret
    data["cluster"]["secret_env"] = None
    return data


def sample_tasks(cfg: ClusterConfig) -> list[str]:
    """The consumer tasks of the samples bus: one per role that reads samples."""
    # Episodes carry their own reward: no reward role scores them.
    tasks = ["reward", "train"] if scored_by_reward_role(cfg) else ["train"]
    if cfg.reference.enabled:
        tasks.append("reference")
    if cfg.critic.enabled:
        tasks.append("critic")
    return tasks


def scored_by_reward_role(cfg: ClusterConfig) -> bool:
    """Whether samples are single replies the reward role scores (episodes score themselves,
    and with ``[reward] in_rollout`` the rollout scores its own)."""
    return cfg.rollout.agent.kind == "single" and not cfg.reward.in_rollout


def build_tree(cfg: ClusterConfig, layout: Layout) -> Supervisor:
    """The supervisor tree of a run (see the module docstring)."""
    plain = plain_config(cfg)
    bus = cfg.bus
    secret = plain["cluster"].get("secret")
    common_bus = {
        "persist": bus.persist,
        "segment_bytes": bus.segment_bytes,
        "fsync": bus.fsync,
        "secret": secret,
        "frame_bytes": bus.frame_bytes,
        "max_message_bytes": bus.max_message_bytes,
        "lease_timeout": bus.lease_timeout,
    }
    prompts_bus = {
        **common_bus,
        "url": layout.prompts_url,
        "run_dir": str(layout.run_dir / "prompts"),
        "tasks": ["rollout"],
        "trainer_task": "rollout",
        "staleness": "inf",
        "capacity": max(4, 2 * cfg.rollout.batch_size * cfg.rollout.replicas),
    }
    samples_bus = {
        **common_bus,
        "url": layout.samples_url,
        "run_dir": str(layout.run_dir / "samples"),
        "tasks": sample_tasks(cfg),
        "trainer_task": "train",
        "staleness": cfg.staleness.wire,  # plain data: the bus may be another process
        "capacity": bus.capacity,
        "batch_size": cfg.trainer.global_batch_size,
        "end_version": cfg.trainer.steps,  # no sample generated that no step would train
    }
    standby = cfg.supervisor.standby
    in_process = InProc() if cfg.bus_transport == "inproc" else Process(standby=standby)
    shared = {"config": plain, "model_dir": str(layout.model_dir)}
    run_dir = {"run_dir": str(layout.run_dir)}
    prompts_at = {"prompts_url": layout.prompts_url}
    samples_at = {"samples_url": layout.samples_url}

    def role(
        child_id: str, cls: type, role_cfg: Any, *, restart: str | None = None, **kwargs: Any
    ) -> ChildSpec:
        return _role_spec(cfg, child_id, cls, role_cfg, restart=restart, **shared, **kwargs)

    def replica(name: str, i: int, cls: type, role_cfg: Any, **kwargs: Any) -> ChildSpec:
        # A role's replicas wait for none of each other: they start at once (a start group).
        return role(f"{name}-{i}", cls, role_cfg, start_group=name, **kwargs)

    children = [
        ChildSpec("prompts", BusService, kwargs=prompts_bus, placement=in_process),
        ChildSpec("samples", BusService, kwargs=samples_bus, placement=in_process),
        *(
            # External agents bring their own tasks: no prompts to serve.
            [role("dataset", DatasetRole, cfg.dataset, **prompts_at, **run_dir)]
            if cfg.rollout.agent.kind != "external"
            else []
        ),
        *(
            replica("reward", i, RewardRole, cfg.reward, **samples_at)
            for i in range(cfg.reward.replicas if scored_by_reward_role(cfg) else 0)
        ),
        *(
            replica("reference", i, ReferenceRole, cfg.reference, **samples_at)
            for i in range(cfg.reference.replicas if cfg.reference.enabled else 0)
        ),
        *(
            replica("critic", i, CriticRole, cfg.critic, **samples_at, **run_dir)
            for i in range(cfg.critic.replicas if cfg.critic.enabled else 0)
        ),
        # The trainer is transient: finishing its steps is a normal end, which ends the run.
        role("trainer", TrainerRole, cfg.trainer, restart="transient", **samples_at, **run_dir),
        # The evaluator ([eval]): it follows the published weights and never holds training up.
        # After the trainer, so it stops before it (reverse order) — and, the buses stopping
        # last, its final evaluation in on_stop still reaches the weights channel.
        *([role("eval", EvalRole, cfg.eval, **samples_at, **run_dir)] if cfg.eval.enabled else []),
        *(rollout_spec(cfg, layout, i, plain=plain) for i in range(cfg.rollout.replicas)),
        # The user's [[actors]], last: they may talk to the roles and buses.
        *(
            ChildSpec(
                actor.id,
                actor.start,
                kwargs=dict(actor.kwargs),
                placement=_placement(actor, cfg.cluster.host, cfg.supervisor.standby),
                restart=Restart(actor.restart),
                shutdown=cfg.shutdown_for(actor),
                gang=actor.gang,
            )
            for actor in cfg.actors
        ),
    ]
    sup = cfg.supervisor
    return Supervisor(
        children,
        strategy=sup.strategy,
        intensity=sup.intensity,
        period=sup.period,
        auto_shutdown="any_significant",
        significant=["trainer"],
        name=cfg.cluster.name,
    )


def _role_spec(
    cfg: ClusterConfig,
    child_id: str,
    cls: type,
    role_cfg: Any,
    *,
    restart: str | None,
    start_group: str | None = None,
    **kwargs: Any,
) -> ChildSpec:
    return ChildSpec(
        child_id,
        cls,
        kwargs=kwargs,
        placement=_placement(role_cfg, cfg.cluster.host, cfg.supervisor.standby),
        restart=Restart(restart or role_cfg.restart),
        shutdown=cfg.shutdown_for(role_cfg),
        gang=role_cfg.gang,
        start_group=start_group,
    )


def rollout_spec(
    cfg: ClusterConfig, layout: Layout, index: int, *, plain: dict[str, Any] | None = None
) -> ChildSpec:
    """Replica ``index`` of the rollout role, ``rollout-<index>``: the tree starts
    ``rollout.replicas`` of them, ``relax scale rollout N`` adds more the same way."""
    return _role_spec(
        cfg,
        f"rollout-{index}",
        RolloutRole,
        cfg.rollout,
        restart=None,
        start_group="rollout",  # the replicas start at once
        config=plain if plain is not None else plain_config(cfg),
        model_dir=str(layout.model_dir),
        prompts_url=layout.prompts_url,
        samples_url=layout.samples_url,
        run_dir=str(layout.run_dir),
    )


def control_server(cfg: ClusterConfig, layout: Layout, tree: Supervisor) -> ControlServer:
    """The control endpoint of a running tree (``relax status``, ``relax down``, the TUI)."""
    return ControlServer(
        tree,
        run_dir=layout.run_dir,
        name=cfg.cluster.name,
        bus_urls={"prompts": layout.prompts_url, "samples": layout.samples_url},
        bus_secret=resolve_secret(cfg),
        rollouts=[f"rollout-{i}" for i in range(cfg.rollout.replicas)],
        # Resolved once: every replica added later gets the very config (and secret) of these.
        scalable={"rollout": functools.partial(rollout_spec, cfg, layout, plain=plain_config(cfg))},
        # TCP when the cluster talks TCP or a fixed port is asked for; ipc otherwise.
        host=cfg.cluster.host if cfg.bus_transport == "tcp" or cfg.cluster.ports.control else None,
        port=cfg.cluster.ports.control,
    )


async def run(cfg: ClusterConfig, run_dir: str | Path | None = None) -> Layout:
    """Run a whole cluster until the trainer finishes, a ``stop`` arrives on the control
    endpoint (``relax down``), or the tree gives up (which raises)."""
    configure_logging()  # no-op when the application configured it already
    layout = prepare(cfg, run_dir)
    # Log files for this run: every actor of this task and every child process started
    # meanwhile (they inherit RELAX_LOG_DIR) writes RUN_DIR/logs/<actor>.jsonl.
    logs = layout.run_dir / LOGS_DIR if cfg.logging.log_files else None
    try:
        with log_files(logs):
            await _serve(cfg, layout)
    finally:
        layout.release()
    return layout


async def _serve(cfg: ClusterConfig, layout: Layout) -> None:
    tree = build_tree(cfg, layout)
    control = control_server(cfg, layout, tree)
    # The endpoints outlive the tree: status and metrics stay readable while it stops, and
    # the reply to a stop request goes out before the control endpoint closes.
    async with contextlib.AsyncExitStack() as stack:
        if uses_ray(cfg):  # connected before the tree starts, let go after it stopped
            owned = stack.enter_context(
                ray_session(
                    cfg.cluster.ray.address,
                    num_cpus=cfg.cluster.ray.num_cpus,
                    namespace=run_namespace(layout.run_dir.name),
                )
            )
            # For `relax down`'s check of what is left — only in a namespace this run owns: an
            # application's own Ray connection (relax.embed) may hold its other actors there.
            if owned:
                gcs_address, namespace = connected_to()
                local = cfg.cluster.ray.address == "local"
                write_ray_info(layout.run_dir, RayInfo(gcs_address, namespace, local))
        if cfg.logging.prometheus:
            port = cfg.cluster.ports.metrics
            try:
                metrics = await stack.enter_async_context(
                    serve_metrics(lambda: control.status(history=1), port=port)
                )
            except OSError as exc:
                raise ConfigError(
                    f"cluster.ports.metrics: cannot serve Prometheus metrics on 127.0.0.1:{port} "
                    f"({exc.strerror or exc}); pick another port, 0 for a free one, or set "
                    "logging.prometheus = false"
                ) from None
            control.metrics_url = metrics.url
            get_logger().info("prometheus metrics", url=metrics.url)
        await stack.enter_async_context(control.serving())
        await stack.enter_async_context(tree)
        finished = asyncio.create_task(tree.wait())
        stop = asyncio.create_task(control.stop_requested.wait())
        await asyncio.wait({finished, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if finished.done():
            finished.result()
        else:  # stopped on request: leaving the block stops the tree in reverse order
            finished.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await finished
