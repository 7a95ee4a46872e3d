"""The control endpoint of a running cluster: what ``relax status``, ``relax down`` and the
TUI talk to.

A cluster serves one small RPC endpoint next to its buses and writes where it is to
``RUN_DIR/control.json`` (mode 0600, with a random token that authenticates clients — only
someone who can read the run folder can steer the run). Requests are plain dicts:

- ``{"op": "status"}`` → the supervisor tree snapshot, both buses' statistics, the trainer's
  version and its most recent ``metrics.jsonl`` records (and ``metrics_url``, the Prometheus
  endpoint that serves the same numbers, when ``[logging] prometheus`` is on);
- ``{"op": "restart", "child": ID}`` → restart one child in place;
- ``{"op": "pause"}`` / ``{"op": "resume"}`` → stop / restart generation (every rollout); the
  state is kept in ``RUN_DIR/paused``, so a rollout restarted meanwhile comes back in it;
- ``{"op": "set", "key": "staleness", "value": K}`` → change the staleness bound of the
  running cluster (``k`` or ``"inf"``) at the next admission (``relax set staleness K``);
- ``{"op": "stop"}`` → stop the tree in reverse start order (the trainer checkpoints first).

Nothing here is specific to the TUI: scripts get the same data from ``relax status --json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from relax.actors import Supervisor
from relax.bus import BusClient
from relax.errors import ClusterNotRunning, RelaxError
from relax.runfiles import CONTROL_FILE, read_control, set_pause_requested
from relax.schema import BusStatistics, MetricRecord, StatusSnapshot, TrainerInfo
from relax.transport import Client, Peer, connect, serve


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
        host: str | None = None,
        port: int = 0,
    ) -> None:
        self.tree, self.run_dir, self.name = tree, Path(run_dir), name
        self.bus_urls, self.bus_secret, self.rollouts = bus_urls, bus_secret, rollouts
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
            for rollout in self.rollouts:
                await self.tree.ref(rollout).call(op, timeout=30)
            return {"paused": self.paused}
        if op == "set":
            return await self._set(str(payload.get("key")), payload.get("value"))
        if op == "stop":
            self.stop_requested.set()
            return {"stopping": True}
        raise ValueError(
            f"unknown control op {op!r}; expected status, restart, pause, resume, set, stop"
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
