"""The control endpoint of a running cluster: what ``relax status``, ``relax down`` and the
TUI talk to.

A cluster serves one small RPC endpoint next to its buses and writes where it is to
``RUN_DIR/control.json`` (mode 0600, with a random token that authenticates clients — only
someone who can read the run folder can steer the run). Requests are plain dicts:

- ``{"op": "status"}`` → the supervisor tree snapshot, both buses' statistics, the trainer's
  version, the weights version each rollout serves, and its most recent ``metrics.jsonl`` records (and ``metrics_url``, the Prometheus
  endpoint that serves the same numbers, when ``[logging] prometheus`` is on);
- ``{"op": "restart", "child": ID}`` → restart one child in place;
- ``{"op": "pause"}`` / ``{"op": "resume"}`` → stop / restart generation (every rollout); the
  state is kept in ``RUN_DIR/paused``, so a rollout restarted meanwhile comes back in it;
- ``{"op": "set", "key": "staleness", "value": K}`` → change the staleness bound of the
  running cluster (``k`` or ``"inf"``) at the next admission (``relax set staleness K``);
- ``{"op": "scale", "role": "rollout", "replicas": N}`` → add or remove rollout replicas
  (``relax scale rollout N``): an added one starts like the others (it loads the current
  weights before it takes a prompt); a removed one, newest first, is drained — paused, so the
  round in flight is put and its prompts acked, within ``drain_timeout`` seconds (default 120;
  after it the replica is stopped anyway and its leased prompts are redone when their lease
  expires) — and then stopped and removed from the tree;
- ``{"op": "stop"}`` → stop the tree in reverse start order (the trainer checkpoints first).

Nothing here is specific to the TUI: scripts get the same data from ``relax status --json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from relax.actors import ChildSpec, Supervisor
from relax.bus import BusClient
from relax.errors import ClusterNotRunning, RelaxError
from relax.log import get_logger
from relax.runfiles import CONTROL_FILE, read_control, set_pause_requested
from relax.schema import BusStatistics, MetricRecord, RolloutInfo, StatusSnapshot, TrainerInfo
from relax.transport import Client, Peer, connect, serve

log = get_logger("relax.control")
MAX_REPLICAS = 256
"""The most replicas ``scale`` adds a role up to: a typo (``relax scale rollout 1000``) is an
error, not a thousand engines."""


class ControlServer:
    """Serves the control requests of one cluster (see the module docstring)."""

    def __init__(
        self,
        tree: Supervisor,
        *,
        run_dir: Path,
        name: str,
        bus_urls: dict[str, str],
        bus_secret: str | None,
        rollouts: list[str],
        scalable: Mapping[str, Callable[[int], ChildSpec]] | None = None,
        host: str | None = None,
        port: int = 0,
    ) -> None:
        self.tree, self.run_dir, self.name = tree, Path(run_dir), name
        self.bus_urls, self.bus_secret = bus_urls, bus_secret
        self.rollouts = list(rollouts)
        """The rollout replicas running now (``scale`` changes them)."""
        self.scalable = dict(scalable or {})
        """Roles ``scale`` can resize: the spec of replica ``i`` of each."""
        self._scaling = asyncio.Lock()  # one resize at a time; pause/resume wait for it
        self.host = host
        self.port = port
        """TCP port to listen on with ``host`` (``cluster.ports.control``); 0 picks a free one."""
        self.stop_requested = asyncio.Event()
        self.paused = False
        self._buses: dict[str, BusClient] = {}
        self._started = time.time()
        self.url = ""
        self.metrics_url: str | None = None
        """The Prometheus endpoint of this cluster, if it serves one (set before ``serving``)."""

    async def _bus(self, name: str) -> BusClient:
        if name not in self._buses:
            self._buses[name] = await BusClient.connect(
                self.bus_urls[name], secret=self.bus_secret, client_id=f"control-{name}"
            )
        return self._buses[name]

    async def status(self, *, history: int = 200) -> StatusSnapshot:
        """One JSON-ready snapshot of the whole run (its keys: ``relax.schema.StatusSnapshot``)."""
        buses: dict[str, BusStatistics] = {}
        for name in self.bus_urls:
            try:
                buses[name] = await asyncio.wait_for((await self._bus(name)).statistics(), 5)
            except (RelaxError, TimeoutError) as exc:  # a bus restarting: say so, don't fail
                buses[name] = {"error": str(exc)}
        records = read_metrics(self.run_dir, last=history)
        applied = [r for r in records if r.get("applied")]
        samples = buses.get("samples", {})
        weights = samples.get("weights", {}) if isinstance(samples, dict) else {}
        trainer: TrainerInfo = {
            "version": weights.get("current", applied[-1]["step"] if applied else 0),
            "last": records[-1] if records else None,
        }
        return {
            "rollouts": await self._rollouts(),
            "cluster": self.name,
            "pid": os.getpid(),
            "run_dir": str(self.run_dir),
            "started_at": self._started,
            "uptime_s": round(time.time() - self._started, 3),
            "paused": self.paused,
            "metrics_url": self.metrics_url,
            "tree": await self.tree.snapshot(),
            "bus": buses,
            "trainer": trainer,
            "metrics": records,
        }

    async def _rollouts(self) -> dict[str, RolloutInfo]:
        """What each rollout replica serves, asked of all at once (a replica that does not
        answer within a second, starting or busy restarting, is shown so, not waited for)."""

        async def one(child: str) -> RolloutInfo:
            try:
                stats = await self.tree.ref(child).call("statistics", timeout=1.0)
            except (RelaxError, KeyError) as exc:
                return {"error": str(exc) or type(exc).__name__}
            plane = stats.get("weight_plane") or {}
            info: RolloutInfo = {"version": int(stats.get("version", -1))}
            if "start_version" in stats:
                info["start_version"] = int(stats["start_version"])
            for key in ("via_group", "via_file", "via_bus"):
                if key in plane:
                    info[key] = int(plane[key])  # type: ignore[literal-required]
            return info

        children = list(self.rollouts)
        found = await asyncio.gather(*(one(child) for child in children))
        return dict(zip(children, found, strict=True))

    async def _handle(self, payload: Any, peer: Peer) -> Any:
        op = payload.get("op") if isinstance(payload, dict) else None
        if op == "status":
            return await self.status(history=int(payload.get("history", 200)))
        if op == "restart":
            child = str(payload["child"])
            await self.tree.restart_child(child)
            return {"restarted": child}
        if op in ("pause", "resume"):
            # Recorded first: a rollout that restarts while (or after) it is told reads it.
            self.paused = op == "pause"
            set_pause_requested(self.run_dir, self.paused)
            async with self._scaling:
                for rollout in self.rollouts:
                    await self.tree.ref(rollout).call(op, timeout=30)
            return {"paused": self.paused}
        if op == "set":
            return await self._set(str(payload.get("key")), payload.get("value"))
        if op == "scale":
            return await self.scale(
                str(payload.get("role")),
                payload.get("replicas"),
                drain_timeout=float(payload.get("drain_timeout", 120.0)),
            )
        if op == "stop":
            self.stop_requested.set()
            return {"stopping": True}
        raise ValueError(
            f"unknown control op {op!r}; expected status, restart, pause, resume, set, scale, stop"
        )

    async def _set(self, key: str, value: Any) -> dict[str, Any]:
        """A live knob of the running cluster (only ``staleness`` so far)."""
        if key != "staleness":
            raise ValueError(f"unknown setting {key!r}; what can be set live: staleness")
        from relax.schema import Staleness

        bound = Staleness.parse(value)  # ValueError with the config's wording
        samples = await self._bus("samples")
        before = (await samples.statistics()).get("staleness")
        now = await samples.set_staleness(bound.wire)
        return {"staleness": now, "before": before}

    async def scale(
        self, role: str, replicas: Any, *, drain_timeout: float = 120.0
    ) -> dict[str, Any]:
        """Resize ``role`` (only ``rollout`` so far) to ``replicas`` running replicas: new ones
        are started (lowest free index first), surplus ones drained and removed, newest first."""
        if role not in self.scalable:
            can = ", ".join(sorted(self.scalable)) or "nothing"
            raise ValueError(f"unknown role {role!r} to scale; what can be scaled live: {can}")
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise ValueError(f"replicas must be an integer, got {replicas!r}")
        if not 1 <= replicas <= MAX_REPLICAS:
            raise ValueError(
                f"replicas must be between 1 and {MAX_REPLICAS}, got {replicas}"
                " (to stop generating for a while, pause: key p in relax status)"
            )
        async with self._scaling:
            before = list(self.rollouts)
            added: list[str] = []
            drained: dict[str, bool] = {}
            while len(self.rollouts) < replicas:
                taken = {int(m.group(1)) for r in self.rollouts if (m := _INDEX.search(r))}
                index = min(set(range(len(taken) + 1)) - taken)
                spec = self.scalable[role](index)
                await self.tree.start_child(spec)
                self.rollouts.append(spec.id)
                added.append(spec.id)
                log.info("replica added", role=role, child=spec.id, replicas=len(self.rollouts))
            while len(self.rollouts) > replicas:
                child = self.rollouts.pop()
                drained[child] = await self._drain(child, drain_timeout)
                log.info("replica removed", role=role, child=child, replicas=len(self.rollouts))
            return {
                "role": role,
                "replicas": len(self.rollouts),
                "before": len(before),
                "added": added,
                "removed": list(drained),
                "drained": drained,
            }

    async def _drain(self, child: str, timeout: float) -> bool:
        """Pause ``child`` (its round in flight is put and acked), then stop and remove it.
        False when it did not get idle within ``timeout``: stopped anyway, its leased prompts
        come back when their lease expires (nothing is lost either way)."""
        try:
            await self.tree.ref(child).call("pause", timeout=timeout)
            idle = True
        except RelaxError as exc:  # CallTimeout, or it died meanwhile (ActorDead)
            log.warning("replica not drained; stopping it anyway", child=child, error=str(exc))
            idle = False
        await self.tree.delete_child(child)
        return idle

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[ControlServer]:
        """Serve while the block runs; ``control.json`` exists exactly that long."""
        token = secrets.token_hex(16)
        # A new cluster starts unpaused, whatever an earlier run in this folder left.
        set_pause_requested(self.run_dir, False)
        sockets: Path | None = None
        if self.host:
            url = f"tcp://{self.host}:{self.port}"
        else:
            sockets = Path(tempfile.mkdtemp(prefix="relax-ctl-"))  # 0700; socket paths are short
            url = f"ipc://{sockets}/control.sock"
        try:
            server = await serve(url, self._handle, secret=token, concurrency=8)
        except BaseException:
            if sockets is not None:
                shutil.rmtree(sockets, ignore_errors=True)
            raise
        self.url = server.url
        info = {
            "url": server.url,
            "token": token,
            "pid": os.getpid(),
            "cluster": self.name,
            "started_at": self._started,
        }
        if self.metrics_url:
            info["metrics_url"] = self.metrics_url
        path = self.run_dir / CONTROL_FILE
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
        tmp.replace(path)
        try:
            yield self
        finally:
            path.unlink(missing_ok=True)
            await server.aclose()
            if sockets is not None:  # the temporary folder goes with the endpoint
                shutil.rmtree(sockets, ignore_errors=True)
            for bus in self._buses.values():
                with contextlib.suppress(Exception):
                    await bus.aclose()


_INDEX = re.compile(r"-(\d+)$")


def read_metrics(run_dir: Path, *, last: int | None = None) -> list[MetricRecord]:
    """The run's ``metrics.jsonl`` records (the ``last`` ones), skipping a torn final line.

    With ``last``, only the end of the file is read: cheap enough for every status request and
    Prometheus scrape of a long run.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = _tail_lines(path, last) if last else path.read_text().splitlines()
    records = []
    for line in lines:
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records


def _tail_lines(path: Path, count: int, block: int = 1 << 16) -> list[str]:
    """The last ``count`` lines of ``path`` (a torn final line counts as one), read from the end."""
    with path.open("rb") as f:
        end = f.seek(0, os.SEEK_END)
        start, data = end, b""
        while start > 0 and data.count(b"\n") <= count:
            step = min(block, start)
            start -= step
            f.seek(start)
            data = f.read(step) + data
    lines = data.decode("utf-8", errors="replace").splitlines()
    if start > 0:
        lines = lines[1:]  # begins mid-line
    return lines[-count:]


async def connect_control(run_dir: str | Path, *, timeout: float = 5.0) -> Client:
    """A control client for the cluster running in ``run_dir``; ``ClusterNotRunning`` if none."""
    info = read_control(run_dir)
    if info is None:
        raise ClusterNotRunning(f"no running cluster in {run_dir} (no {CONTROL_FILE})")
    try:
        os.kill(info.pid, 0)
    except ProcessLookupError:
        raise ClusterNotRunning(
            f"the cluster of {run_dir} (pid {info.pid}) is gone; {CONTROL_FILE} is stale"
        ) from None
    except PermissionError:
        pass  # alive, owned by someone else: the token decides
    try:
        return await connect(info.url, secret=info.token, connect_timeout=timeout)
    except RelaxError as exc:
        raise ClusterNotRunning(f"the cluster of {run_dir} does not answer: {exc}") from None


async def control_request(run_dir: str | Path, payload: dict[str, Any], timeout: float = 30) -> Any:
    """One control request to the cluster running in ``run_dir``."""
    client = await connect_control(run_dir)
    try:
        return await client.request(payload, timeout=timeout)
    finally:
        await client.aclose()
