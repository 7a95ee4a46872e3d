"""The shapes of a run's status: what ``{"op": "status"}`` answers (and ``relax status --json``
prints), the bus statistics inside it, and the metric record the trainer appends to
``metrics.jsonl`` each step.

``TypedDict``s over the JSON-ready dicts the control endpoint sends: the keys are named here
once, for the control endpoint that assembles a status, the TUI and plain text that show it,
and the Prometheus exporter that turns it into metrics. Every key may be missing in what a
reader gets (an older cluster, a bus that did not answer), so readers use ``.get``.
"""

from __future__ import annotations

from typing import Any, TypedDict

from relax.schema._staleness import StalenessWire


class CrashInfo(TypedDict, total=False):
    """Why a child's incarnation ended (``relax.actors.Exit.to_dict``)."""

    kind: str
    message: str
    error_type: str | None
    traceback: str | None
    exit_code: int | None
    signal: str | None
    member: int | None
    at: float
    fatal: bool
    description: str
    """One line for a status table."""


class ChildSnapshot(TypedDict, total=False):
    """One child of a supervisor; a nested supervisor's also has ``strategy`` and ``children``."""

    id: str
    kind: str
    """``"worker"`` or ``"supervisor"``."""
    placement: str
    gang: int
    restart: str
    state: str
    """One of ``relax.observe.ACTOR_STATES``."""
    waiting: str | None
    """While ``state == "waiting"``: what resources it waits for (else ``None``)."""
    pids: list[int]
    restart_count: int
    started_at: float | None
    uptime_s: float | None
    last_exit: CrashInfo | None
    last_crash: CrashInfo | None
    stats: dict[str, Any] | None
    """Mailbox and handler counters; a gang's carries ``members``, one dict per rank."""
    strategy: str
    children: list[ChildSnapshot]


class TreeSnapshot(TypedDict, total=False):
    """A supervisor and its children (``relax.actors.Supervisor.snapshot``)."""

    id: str
    kind: str
    strategy: str
    intensity: int
    period: float
    restarts_in_period: int
    pid: int
    gave_up: str | None
    children: list[ChildSnapshot]


class TaskCounts(TypedDict):
    """Where one consumer task stands with the rows on the bus."""

    pending: int
    leased: int
    acked: int
    lag: int
    """Rows it has yet to ack: pending + leased."""


class WeightsStatistics(TypedDict, total=False):
    current: int
    """The newest weights version served (-1: none yet)."""
    versions: list[int]
    """Weight versions the bus keeps."""
    members: list[str]
    """The weight plane's receivers (``<rollout id>-<rank>-<incarnation>``) that polled within
    their lease and have not left."""


class BusStatistics(TypedDict, total=False):
    """One bus's statistics (``BusTable.statistics`` and what ``BusService`` adds), or
    ``{"error": ...}`` for a bus that did not answer."""

    rows: int
    capacity: int
    groups: int
    leases: int
    admitted_rows: int
    trainer_version: int
    staleness: StalenessWire
    tasks: dict[str, TaskCounts]
    versions_in_flight: dict[str, int]
    """Rows on the bus per policy version (keys are the versions as text)."""
    counters: dict[str, int]
    turns: dict[str, str]
    """Per task, the client holding its turn (``take(turn=True)``), if any."""
    service: dict[str, int]
    weights: WeightsStatistics
    log: dict[str, Any]
    transport: dict[str, Any]
    error: str
    """Set instead of everything else when the bus did not answer."""


class MetricRecord(TypedDict, total=False):
    """One line of ``metrics.jsonl``: one training step. Beyond these, the step's own
    numbers (``loss``, ``reward_mean``, ``approx_kl``, ``entropy``, ``step_time_s``,
    ``tokens``, ``rows``, ``reward/<component>``, episode numbers, ...)."""

    step: int
    applied: bool
    skipped_reason: str | None
    trainer_version_at_take: int
    oldest_row_version: int
    newest_row_version: int
    staleness_max: int
    """How far behind the trainer the stalest row of the batch was."""
    staleness_bound: int | str | None
    """The staleness bound in force when the batch was taken (``relax set staleness``)."""
    lag_hist: dict[str, int]
    """Rows of the batch per lag (versions behind the trainer), keys as strings."""
    publish_overlapped: bool
    """This step's publish went on during the next step (``[weights] overlap``)."""
    wall_s: float
    time: float
    """When the step ended (Unix seconds)."""
    loss: float
    reward_mean: float
    approx_kl: float
    entropy: float
    step_time_s: float
    """The backend's step: ``gradient_time_s`` (forward/backward) + ``update_time_s``."""
    gradient_time_s: float
    update_time_s: float
    take_time_s: float
    """Waiting for the batch (rows within the bound) and the bus's take."""
    publish_time_s: float
    """The previous step's publish (and ack), as far as it held this loop (~0 overlapped)."""
    tokens: int


class TrainerInfo(TypedDict):
    version: int
    """The newest weights the trainer published."""
    last: MetricRecord | None


class RolloutInfo(TypedDict, total=False):
    """What one rollout replica serves, or ``{"error": ...}`` when it did not answer (a
    replica starting or restarting)."""

    version: int
    """The weights version it generates with."""
    start_version: int
    """The version it held before it served anything (an added or restarted replica)."""
    via_group: int
    via_file: int
    via_bus: int
    """Versions it received over the weight plane's group, from the bus's file, and through
    the bus."""
    error: str


class StatusSnapshot(TypedDict, total=False):
    """One ``status`` reply: the whole run at one moment."""

    cluster: str
    pid: int
    run_dir: str
    started_at: float
    uptime_s: float
    paused: bool
    metrics_url: str | None
    tree: TreeSnapshot
    bus: dict[str, BusStatistics]
    """By bus name: ``prompts``, ``samples``."""
    trainer: TrainerInfo
    rollouts: dict[str, RolloutInfo]
    """By replica id: the weights each rollout serves (``relax scale`` changes the set)."""
    metrics: list[MetricRecord]
    """The newest ``metrics.jsonl`` records, oldest first."""
