"""Prometheus metrics of a running cluster, served on loopback by its main process.

Collected on scrape from one control-plane status (the dict ``relax status --json`` prints:
supervisor tree snapshot, bus statistics, the tail of ``metrics.jsonl``), so the numbers are
exactly those of ``relax status``. A private ``CollectorRegistry`` per endpoint, never the
global one. Metric names (labels in braces):

- cluster: ``relax_cluster_info{cluster,run_dir}``, ``relax_uptime_seconds``, ``relax_paused``;
- trainer: ``relax_trainer_version`` (the newest published weights), and one gauge
  ``relax_trainer_<field>`` per numeric field of the newest ``metrics.jsonl`` record
  (``relax_trainer_reward_mean``, ``_loss``, ``_approx_kl``, ``_entropy``,
  ``_step_time_s``, ``_step``, ``_applied`` as 0/1, ...);
- rollouts: ``relax_rollout_weights_version{rollout}``, the weights each replica serves;
- evaluation ([eval]): ``relax_eval_version`` and one gauge ``relax_eval_<field>`` per
  ``eval/`` field of the newest ``eval.jsonl`` record (``relax_eval_mean_reward``,
  ``relax_eval_pass_1``, ``relax_eval_pass_k``, ``relax_eval_skipped_versions``, ...);
- actors (``actor`` is the child id; ``a/b`` inside a nested supervisor):
  ``relax_actor_restarts_total``, ``relax_actor_up``, ``relax_actor_state{state}`` (1 for the
  current state, 0 for the others), ``relax_actor_uptime_seconds``, ``relax_actor_processes``,
  and ``relax_actor_<stat>`` per numeric mailbox/handler statistic (``_queued``,
  ``_in_flight``, ``_handled``, ...); supervisors: ``relax_supervisor_restarts_in_period``,
  ``relax_supervisor_intensity``, ``relax_supervisor_gave_up``;
- buses (``bus`` = prompts / samples): ``relax_bus_up``, ``relax_bus_rows``,
  ``relax_bus_capacity``, ``relax_bus_groups``, ``relax_bus_open_leases``,
  ``relax_bus_admitted_rows``, ``relax_bus_trainer_version``, ``relax_bus_staleness``;
  per consumer task ``relax_bus_task_pending|leased|acked|lag{task}``; rows per policy version
  ``relax_bus_version_rows{version}``; one counter ``relax_bus_<name>_total`` per bus counter
  (``put``, ``trained``, ``leases``, ``acked_<task>``, ``dropped_*``, ...); and the
  ``service``, ``weights``, ``log`` and ``transport`` sections as
  ``relax_bus_<section>_<name>`` (counters end in ``_total``).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from relax.actors import ChildState
from relax.log import get_logger
from relax.observe._sinks import last_eval
from relax.schema import (
    BusStatistics,
    ChildSnapshot,
    Staleness,
    StatusSnapshot,
    TrainerInfo,
    TreeSnapshot,
)

# The classic text format every Prometheus version reads (our names need no escaping).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

StatusSource = Callable[[], Awaitable[StatusSnapshot]]
"""Where a scrape gets its numbers: a coroutine returning a control-plane status."""

ACTOR_STATES: tuple[str, ...] = typing.get_args(ChildState)

_BUS_GAUGES = {
    "rows": "Rows on the bus.",
    "capacity": "Rows the bus holds before producers wait.",
    "groups": "Prompt groups on the bus.",
    "leases": "Leases open right now.",
    "admitted_rows": "Rows admitted (reserved) but not yet put.",
    "trainer_version": "The trainer version the bus paces producers against.",
    "staleness": "Staleness bound of the bus, in versions (+Inf: unbounded).",
}
_BUS_RENAMED = {"leases": "open_leases"}  # "leases" is also a counter
_TASK_FIELDS = ("pending", "leased", "acked", "lag")
_BUS_COUNTERS = (
    "put",
    "admitted",
    "leases",
    "released",
    "trained",
    "skipped_steps",
    "expired_leases",
    "reclaimed_leases",
    "expired_admissions",
    "duplicate_admissions",
    "dropped_stale",
    "dropped_oversized",
    "dropped_with_group",
)
# In the bus sections below, these are gauges; every other number there only grows.
_SECTION_GAUGES = {
    "service": set(),
    "weights": {"current"},
    "log": {"segments", "spares", "bytes", "records", "first_seq", "next_seq"},
    "transport": {"in_flight", "clients", "connections", "partials"},
}
_ACTOR_COUNTERS = {"handled", "failed", "calls", "casts", "heartbeats", "bad_frames"}


def _name(text: str) -> str:
    name = re.sub(r"[^a-zA-Z0-9_]", "_", str(text))
    return name if not name[:1].isdigit() else f"_{name}"


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (bool, int, float)) else None


class _Families:
    """Metric families by name; samples of one name gather in one family."""

    def __init__(self) -> None:
        self.by_name: dict[str, Metric] = {}

    def _add(self, kind: type, name: str, doc: str, value: Any, labels: dict[str, str]) -> None:
        number = _number(value)
        if number is None:
            return
        family = self.by_name.get(name)
        if family is None:
            family = self.by_name[name] = kind(name, doc, labels=list(labels))
        elif not isinstance(family, kind):
            return  # one name, two types (an odd statistic's name): keep the first, stay valid
        family.add_metric(list(labels.values()), number)

    def gauge(self, name: str, doc: str, value: Any, **labels: str) -> None:
        self._add(GaugeMetricFamily, name, doc, value, labels)

    def counter(self, name: str, doc: str, value: Any, **labels: str) -> None:
        self._add(CounterMetricFamily, name, doc, value, labels)


def status_metrics(status: StatusSnapshot) -> list[Metric]:
    """The metric families of one control-plane status (see the module docstring)."""
    out = _Families()
    info = InfoMetricFamily("relax_cluster", "The cluster this endpoint belongs to.")
    info.add_metric(
        [], {"cluster": str(status.get("cluster", "")), "run_dir": str(status.get("run_dir", ""))}
    )
    out.gauge("relax_uptime_seconds", "Seconds since the cluster started.", status.get("uptime_s"))
    out.gauge("relax_paused", "1 while generation is paused (relax pause).", status.get("paused"))
    _trainer(out, status.get("trainer") or {})
    for rollout, served in (status.get("rollouts") or {}).items():
        out.gauge(
            "relax_rollout_weights_version",
            "The weights version a rollout replica generates with (absent while it starts).",
            served.get("version"),
            rollout=str(rollout),
        )
    if status.get("run_dir"):
        _eval(out, last_eval(str(status["run_dir"])))
    tree = status.get("tree")
    if isinstance(tree, dict):
        _supervisor(out, tree, prefix="")
    for bus, stats in (status.get("bus") or {}).items():
        _bus(out, str(bus), stats)
    return [info, *out.by_name.values()]


def _trainer(out: _Families, trainer: TrainerInfo) -> None:
    out.gauge(
        "relax_trainer_version",
        "The trainer's policy version: the newest weights it published.",
        trainer.get("version"),
    )
    last = trainer.get("last")
    if not isinstance(last, dict):
        return
    for key, value in last.items():
        name = f"relax_trainer_{_name(key)}"
        if name != "relax_trainer_version":
            out.gauge(name, f"The trainer's {key!r} in its newest metrics record.", value)


def _eval(out: _Families, record: dict[str, Any] | None) -> None:
    """Gauges of the newest evaluation ([eval]), read from ``eval.jsonl``."""
    if record is None:
        return
    out.gauge(
        "relax_eval_version", "The policy version of the newest evaluation.", record.get("version")
    )
    for key, value in record.items():
        if str(key).startswith("eval/"):
            name = f"relax_{_name(key)}"
            out.gauge(name, f"The evaluator's {key!r} in its newest evaluation.", value)


def _supervisor(out: _Families, node: TreeSnapshot | ChildSnapshot, prefix: str) -> None:
    sup = prefix.rstrip("/") or str(node.get("id", ""))
    for name, doc, value in (
        (
            "restarts_in_period",
            "Restarts within the supervisor's period (it gives up above its intensity).",
            node.get("restarts_in_period", 0),
        ),
        ("intensity", "Restarts the supervisor allows within its period.", node.get("intensity")),
        ("gave_up", "1 once the supervisor gave up.", bool(node.get("gave_up"))),
    ):
        out.gauge(f"relax_supervisor_{name}", doc, value, supervisor=sup)
    for child in node.get("children") or []:
        _actor(out, child, prefix)


def _actor(out: _Families, child: ChildSnapshot, prefix: str) -> None:
    actor = f"{prefix}{child.get('id')}"
    state = str(child.get("state"))
    out.counter(
        "relax_actor_restarts",
        "Times the supervisor restarted this child.",
        child.get("restart_count", 0),
        actor=actor,
    )
    out.gauge(
        "relax_actor_up",
        "1 while the child is running.",
        state == "running",
        actor=actor,
        kind=str(child.get("kind")),
        placement=str(child.get("placement")),
    )
    for known in (*ACTOR_STATES, *((state,) if state not in ACTOR_STATES else ())):
        out.gauge(
            "relax_actor_state",
            "1 for the child's current state, 0 for the others.",
            known == state,
            actor=actor,
            state=known,
        )
    for name, doc, value in (
        ("uptime_seconds", "Seconds since this incarnation started.", child.get("uptime_s")),
        ("processes", "Processes of this child (gang members).", len(child.get("pids") or [])),
    ):
        out.gauge(f"relax_actor_{name}", doc, value, actor=actor)
    stats = child.get("stats")
    members = stats.get("members") if isinstance(stats, dict) else None
    for rank, member in enumerate(members if isinstance(members, list) else [stats]):
        if not isinstance(member, dict):
            continue
        labels = {"actor": actor, "rank": str(rank)}
        for key, value in member.items():
            name = f"relax_actor_{_name(key)}"
            if key in _ACTOR_COUNTERS:
                out.counter(name, f"The child's {key!r} count.", value, **labels)
            else:
                out.gauge(name, f"The child's {key!r} right now.", value, **labels)
    if "children" in child:
        _supervisor(out, child, prefix=f"{actor}/")


def _bus(out: _Families, bus: str, stats: BusStatistics) -> None:
    ok = isinstance(stats, dict) and "error" not in stats
    out.gauge("relax_bus_up", "1 while the bus answers for its statistics.", ok, bus=bus)
    if not ok:
        return
    for key, doc in _BUS_GAUGES.items():
        value = _staleness_limit(stats.get(key)) if key == "staleness" else stats.get(key)
        out.gauge(f"relax_bus_{_BUS_RENAMED.get(key, key)}", doc, value, bus=bus)
    for task, fields in (stats.get("tasks") or {}).items():
        for field in _TASK_FIELDS:
            out.gauge(
                f"relax_bus_task_{field}",
                f"Rows {field} for a consumer task (lag: rows it has yet to ack).",
                fields.get(field),
                bus=bus,
                task=str(task),
            )
    for version, rows in (stats.get("versions_in_flight") or {}).items():
        out.gauge(
            "relax_bus_version_rows",
            "Rows on the bus per policy version they were generated with.",
            rows,
            bus=bus,
            version=str(version),
        )
    # Counters the bus has not bumped yet are 0 (the bus creates them on first use), so
    # rate() and alerts work from the first scrape.
    counters = dict.fromkeys(_BUS_COUNTERS, 0)
    counters |= {f"acked_{task}": 0 for task in stats.get("tasks") or {}}
    counters |= stats.get("counters") or {}
    for key, value in counters.items():
        out.counter(f"relax_bus_{_name(key)}", f"Bus counter {key!r}.", value, bus=bus)
    for section, gauges in _SECTION_GAUGES.items():
        data = stats.get(section)
        if not isinstance(data, dict):
            continue
        for key, value in data.items():
            name = f"relax_bus_{section}_{_name(key)}"
            if key in gauges:
                out.gauge(name, f"Bus {section} {key!r}.", value, bus=bus)
            else:
                out.counter(name, f"Bus {section} {key!r} so far.", value, bus=bus)
        if section == "weights" and isinstance(data.get("versions"), list):
            out.gauge(
                "relax_bus_weights_versions_held",
                "Weight versions the bus keeps.",
                len(data["versions"]),
                bus=bus,
            )


def _staleness_limit(value: Any) -> Any:
    """A bus's staleness as a number (``"inf"``: +Inf); what is no staleness is left as it is
    (and dropped, unless it is a number)."""
    try:
        return Staleness.parse(value).limit
    except ValueError:
        return value


class StatusCollector:
    """A custom collector over one status: register it on a (private) ``CollectorRegistry``."""

    def __init__(self, status: StatusSnapshot) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        yield from status_metrics(self.status)


def render(status: StatusSnapshot) -> bytes:
    """The Prometheus text exposition of one status, through a private registry made for this
    scrape (never the process-global one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(status))
    return generate_latest(registry)


class MetricsEndpoint:
    """A tiny asyncio HTTP server: ``GET /metrics`` awaits ``source()`` and answers with the
    Prometheus text format. Runs in the cluster's event loop; binds loopback by default."""

    def __init__(self, source: StatusSource, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.source, self.host, self.port = source, host, port
        self._server: asyncio.base_events.Server | None = None
        self.scrapes = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    async def start(self) -> MetricsEndpoint:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None

    async def __aenter__(self) -> MetricsEndpoint:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            method, _, rest = request.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
            path = rest.split(" ", 1)[0].split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                await self._answer(writer, 405, b"only GET\n", head=False)
            elif path not in ("/metrics", "/metrics/"):
                await self._answer(writer, 404, b"try /metrics\n", head=method == "HEAD")
            else:
                body = render(await self.source())
                self.scrapes += 1
                await self._answer(writer, 200, body, CONTENT_TYPE, head=method == "HEAD")
        except Exception as exc:  # a bad request or a failed collection: say so, keep serving
            with contextlib.suppress(Exception):
                get_logger().warning("metrics scrape failed", error=f"{type(exc).__name__}: {exc}")
                await self._answer(writer, 500, f"{type(exc).__name__}: {exc}\n".encode())
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    @staticmethod
    async def _answer(
        writer: asyncio.StreamWriter,
        code: int,
        body: bytes,
        content_type: str = "text/plain; charset=utf-8",
        *,
        head: bool = False,
    ) -> None:
        reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed"}.get(code, "Error")
        header = (
            f"HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        writer.write(header.encode("latin-1") + (b"" if head else body))
        await writer.drain()


@contextlib.asynccontextmanager
async def serve_metrics(
    source: StatusSource, *, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[MetricsEndpoint]:
    """Serve ``/metrics`` while the block runs (``port`` 0: a free port; see ``.url``)."""
    endpoint = MetricsEndpoint(source, host=host, port=port)
    await endpoint.start()
    try:
        yield endpoint
    finally:
        await endpoint.aclose()
