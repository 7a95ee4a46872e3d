"""What every role shares: its slice of the config, and its bus connections (and, for the trainer
and the critic, the base class ``LearnerRole``)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
from collections import Counter, deque
from pathlib import Path
from typing import Any, ClassVar

from relax.actors import Actor, ActorContext
from relax.bus import Batch, BusClient, column_problem
from relax.config import ClusterConfig
from relax.errors import BusError, ColumnConflict
from relax.log import get_logger
from relax.media import mm_from_wire
from relax.schema import LOSS_MASK, MM_INPUTS, REWARD, ROUTED_EXPERTS


def cluster_config(config: dict[str, Any]) -> ClusterConfig:
    """Roles receive the validated config as plain data (it crosses process boundaries)."""
    return ClusterConfig.model_validate(config)


class LearnerRole(Actor):
    """A role that learns from the samples bus (the trainer, the critic): the model it starts
    from, its run folder, and ``metrics_file`` there (named by the subclass's
    ``METRICS_FILE``), to which it appends one record per update and keeps the latest
    ``HISTORY_KEPT`` in ``history`` (the file has them all: a long run must not grow)."""

    METRICS_FILE: ClassVar[str]
    HISTORY_KEPT: ClassVar[int] = 1000

    def __init__(
        self, *, config: dict[str, Any], samples_url: str, model_dir: str, run_dir: str
    ) -> None:
        self.cfg = cluster_config(config)
        self.samples_url, self.model_dir = samples_url, model_dir
        self.run_dir = Path(run_dir)
        self.metrics_file = self.run_dir / self.METRICS_FILE
        self.history: deque[dict[str, Any]] = deque(maxlen=self.HISTORY_KEPT)


def cluster_secret(cfg: ClusterConfig) -> str | None:
    """The shared secret: from the config, or from the environment variable it names."""
    if cfg.cluster.secret_env:
        return os.environ.get(cfg.cluster.secret_env)
    return cfg.cluster.secret.get_secret_value() if cfg.cluster.secret else None


async def connect_bus(url: str, cfg: ClusterConfig, name: str) -> BusClient:
    """A role's connection to a bus under ``name``, one name per live connection (see
    ``client_name``). Whatever an earlier incarnation under that name still held (a role
    SIGKILLed mid-batch, restarted by its supervisor) goes back to the queue now: its rows
    would otherwise wait out the lease timeout, and at staleness 0 the whole run with them."""
    bus = await BusClient.connect(
        url, secret=cluster_secret(cfg), client_id=name, connect_timeout=60
    )
    try:
        reclaimed = await bus.reclaim()
    except BaseException:
        await bus.aclose()
        raise
    if any(reclaimed.values()):
        get_logger().info("took back what a dead incarnation held", client=name, **reclaimed)
    return bus


def client_name(context: ActorContext) -> str:
    """A child's bus client name: its id (``reward-1``), and its rank inside a gang. Replicas
    must not share one: a restarted replica takes back the leases held under its name."""
    return context.id if context.rank == 0 else f"{context.id}.{context.rank}"


def as_list(value: Any) -> list[Any]:
    """A column as a plain list (columns may arrive as tensors)."""
    return value.tolist() if hasattr(value, "tolist") else list(value)


def training_row(row: dict[str, Any], columns: tuple[str, ...]) -> dict[str, Any]:
    """A bus row as a training backend's ``Row``: its ``columns``, its ``loss_mask`` when it
    has one (multi-turn rows: observations are conditioned on, never trained on) and its
    ``mm_inputs`` when its prompt has media."""
    cols = row["columns"]
    out: dict[str, Any] = {"group": row["group"], "uid": row["uid"]}
    for name in columns:
        out[name] = float(cols[name]) if name == REWARD else as_list(cols[name])
    if cols.get(LOSS_MASK) is not None:
        out[LOSS_MASK] = as_list(cols[LOSS_MASK])
    if cols.get(MM_INPUTS) is not None:  # the prompt's media, as the rollout saw them
        out[MM_INPUTS] = mm_from_wire(cols[MM_INPUTS])
    routed = cols.get(ROUTED_EXPERTS)
    if routed is not None:  # an MoE policy's routing at generation (R3)
        out[ROUTED_EXPERTS] = routed.to_torch() if hasattr(routed, "to_torch") else routed
    return out


def prompt_seed(seed: int | None, uid: str) -> int | None:
    """The sampling seed of one prompt: stable across processes, retries and batchings."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{uid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


async def write_once(bus: BusClient, items: list[tuple[str, dict[str, Any]]]) -> int:
    """Write many rows' columns in one request, treating "already written" as done; returns
    how many were already written.

    A role restarted with rows still leased retakes them once their lease expires; what its
    earlier incarnation wrote stands (columns are write-once), even if a recompute would
    differ in the last bit. Any other refusal (a row gone from the bus) is an error.
    """
    errors = await bus.add_columns_many(items)
    already = [e for e in errors if isinstance(e, ColumnConflict)]
    other = [e for e in errors if e is not None and not isinstance(e, ColumnConflict)]
    if other:
        first = other[0]
        raise BusError(
            f"{len(other)} column writes refused, e.g. {type(first).__name__}: {first}"
        ) from first
    return len(already)


BAD_COLUMNS = "bad_columns"
"""The drop reason of a taken row whose columns break the bus's declared types (the bus counts
it as ``dropped_bad_columns``)."""


async def without_poisoned(bus: BusClient, batch: Batch, log: Any) -> Batch:
    """``batch`` less its poisoned rows: rows whose columns break ``relax.bus.SCHEMA`` (a
    string ``response_ids``, ``reward = "high"``, a NaN reward: rows an older bus let in, as
    today's bus refuses them at the put). They are dropped on the bus now, with their groups,
    for the reason ``bad_columns`` (counted), and logged; the rest of the batch is returned,
    in place. One bad sample never stops a run."""
    bad = {}
    for row in batch.rows:
        found = column_problem(row.get("columns"))
        if found is not None:
            bad[row["uid"]] = f"column {found[0]!r} {found[1]}"
    if not bad:
        return batch
    for uid, problem in bad.items():
        log.warning("dropped a row with bad columns, and its group", uid=uid, problem=problem)
    poisoned = [r for r in batch.rows if r["uid"] in bad]
    await bus.release(dataclasses.replace(batch, rows=poisoned), drop=BAD_COLUMNS)
    groups = {r["group"] for r in poisoned}  # the bus dropped their other members too
    batch.rows = [r for r in batch.rows if r["group"] not in groups]
    return batch


def well_formed(rows: list[dict[str, Any]], log: Any) -> list[dict[str, Any]]:
    """``rows`` a producer is about to put, less the groups holding a row the bus would refuse
    (an environment's NaN reward, say): those are logged and left out, so one bad sample costs
    its group rather than a crash-looping producer (a retried prompt would fail the same way)."""
    bad: dict[str, str] = {}
    for row in rows:
        found = column_problem(row.get("columns", {}))
        if found is not None:
            bad[str(row.get("group"))] = f"{row.get('uid')!r}: column {found[0]!r} {found[1]}"
    for group, problem in bad.items():
        log.warning("left out a group with a bad row", group=group, problem=problem)
    return [r for r in rows if str(r.get("group")) not in bad] if bad else rows


STALL_AT_ENV = "RELAX_STALL_AT"
"""Test hook: ``<point>@<actor id>[#<n>]=<seconds>`` (e.g. ``after_lease@rollout-1=1.5``),
several separated by commas, makes that actor pause there for that long — at the point's
``n``-th passage in the actor's process (default: the first) — once per run folder (a marker
file records it), so a test can hold one replica up, or kill it, at an exact point instead of
hoping the scheduler does. Points: ``after_lease`` (a rollout, between leasing prompts and
asking for their admission), ``after_take`` (the trainer, holding a batch it has not trained)."""

_passages: Counter[str] = Counter()


async def stall_point(run_dir: Path | None, point: str, actor: str) -> None:
    wanted = os.environ.get(STALL_AT_ENV)
    if not wanted or run_dir is None:
        return
    here = f"{point}@{actor}"
    _passages[here] += 1
    for entry in wanted.split(","):
        where, _, seconds = entry.partition("=")
        where, _, nth = where.partition("#")
        if where != here or _passages[here] != int(nth or 1):
            continue
        marker = run_dir / f"stalled-at-{here}"
        if marker.exists():
            return
        marker.touch()
        await asyncio.sleep(float(seconds))
