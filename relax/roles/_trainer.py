"""The trainer role: takes whole groups within the staleness bound, steps, publishes weights.

Each step: lease ``global_batch_size`` rows (whole groups, reward present); train; on success
publish the new weights as version N+1 (which also moves the bus's trainer version, so stale
rows are dropped and producers are paced); ack the rows; checkpoint every ``every_steps``.
A skipped step (NaN loss, exploding gradients) publishes nothing and gives the rows back
acked: they were consumed, and retrying the same poisoned batch would skip again.

A trainer gang (``[trainer] gang`` > 1, placement "process", backend "deepspeed") runs this
role in every member. Rank 0 alone talks to the bus and writes metrics; every operation that
touches the model (step, publish, adopt, checkpoint, resume) is collective, so rank 0 first
broadcasts it (with its rows or weights, in the wire format over torch.distributed, never
pickled) and then every rank runs it together; the others wait for the next one. All of it
runs on one worker thread per rank, so heartbeats keep flowing during collectives.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from relax.bus import Batch, BusClient, WeightPublisher, plane_options
from relax.config import ClusterConfig
from relax.observe import MetricsFanout, build_sinks
from relax.replay import RecordWriter, drop_unpublished, weights_digest
from relax.roles._common import (
    LearnerRole,
    as_list,
    connect_bus,
    stall_point,
    training_row,
    without_poisoned,
)
from relax.roles._reward import component_metrics
from relax.schema import (
    EPISODE_END,
    LOGPROBS,
    LOSS_MASK,
    MM_INPUTS,
    PROMPT_IDS,
    REF_LOGPROBS,
    RESPONSE_IDS,
    REWARD,
    ROUTED_EXPERTS,
    SUCCESS,
    TOKEN_VERSIONS,
    TURNS,
    VALUES,
)
from relax.training import StepResult, build_backend, checkpoint_name
from relax.transport import dumps, loads


def broadcast_message(payload: Any = None) -> Any:
    """Rank 0's ``payload`` (rows, weights: anything the wire format carries) on every rank
    of the trainer gang's torch.distributed world. Wire-encoded bytes, never pickled."""
    import torch.distributed as dist

    from relax.transport import broadcast_bytes  # imports torch: only a gang calls this

    data = dumps(payload) if dist.get_rank() == 0 else None
    return loads(broadcast_bytes(data, src=0))


def train_columns(cfg: ClusterConfig) -> tuple[str, ...]:
    """The columns a row needs before the trainer may take it."""
    columns = [PROMPT_IDS, RESPONSE_IDS, LOGPROBS, REWARD]
    if cfg.algorithm.kl.coef > 0:
        columns.append(REF_LOGPROBS)  # written by the reference role
    if cfg.algorithm.advantage == "gae":
        columns.append(VALUES)  # written by the critic role
    return tuple(columns)


OPTIONAL_COLUMNS = (
    LOSS_MASK,
    TURNS,
    EPISODE_END,
    SUCCESS,
    MM_INPUTS,
    ROUTED_EXPERTS,
    TOKEN_VERSIONS,  # for the per-token lag metrics of partial rollouts
    "reward_components",
)
"""Columns some rows have (multi-turn episodes, media prompts): taken when present."""


def train_row(row: dict[str, Any], columns: tuple[str, ...]) -> dict[str, Any]:
    """A bus row as the training backend's ``Row``."""
    return training_row(row, columns)


def length_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The batch's response lengths in tokens (mean, max): the long tail that decides how
    long generation takes, and what ``[rollout] schedule`` acts on."""
    lengths = [len(r["columns"][RESPONSE_IDS]) for r in rows if RESPONSE_IDS in r["columns"]]
    if not lengths:
        return {}
    return {
        "response_length_mean": sum(lengths) / len(lengths),
        "response_length_max": max(lengths),
    }


def token_version_metrics(rows: list[dict[str, Any]], trainer_version: int) -> dict[str, float]:
    """Partial rollouts, per token: the share of response tokens sampled under a newer version
    than their row's oldest (a weight update landed mid-response), and the mean token lag
    (the trainer's version at the take minus each token's version; a row's ``lag_hist`` counts
    its oldest token)."""
    tokens = newer = lag = 0
    for row in rows:
        versions = row["columns"].get(TOKEN_VERSIONS)
        if versions is None:
            continue
        versions = as_list(versions)
        tokens += len(versions)
        newer += sum(v > row["version"] for v in versions)
        lag += sum(trainer_version - v for v in versions)
    if not tokens:
        return {}
    return {"resumed_token_share": newer / tokens, "token_lag_mean": lag / tokens}


def episode_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Means over a batch's episode rows: task success (when the environment reports it),
    turns, and the share of episodes a failure ended."""
    cols = [r["columns"] for r in rows if EPISODE_END in r["columns"]]
    if not cols:
        return {}
    out = {
        "turns_mean": sum(float(c.get(TURNS, 0)) for c in cols) / len(cols),
        "episode_failed": sum(
            c[EPISODE_END] in ("tool_error", "tool_timeout", "agent_error") for c in cols
        )
        / len(cols),
    }
    success = [float(c[SUCCESS]) for c in cols if SUCCESS in c]
    if success:
        out["success_rate"] = sum(success) / len(success)
    return out


LEDGER = "trainer-ledger.jsonl"
"""The trainer's own record, in the run folder, of which rows each step consumed: one JSON line
per step, ``{"step", "applied", "items": [[uid, attempt], ...]}``, made durable before the step
is published (or, skipped, acked). On a restart the lines of applied steps above the published
version are removed (that update never happened), so the file is the lineage of the final
weights: audits check it against the bus log (``tests/e2e/audit.py``)."""


def lag_histogram(trainer_version: int, versions: list[int]) -> dict[str, int]:
    """Rows per lag (the trainer's version at the take minus the row's), keys as strings
    (JSON object keys), in ascending lag."""
    lags = sorted(trainer_version - v for v in versions)
    return {str(lag): lags.count(lag) for lag in dict.fromkeys(lags)}


@functools.cache
def _has_gpu() -> bool:
    """Asked once per process (every step asks ``_overlaps``)."""
    import torch

    return torch.cuda.is_available()


class TrainerRole(LearnerRole):
    METRICS_FILE = "metrics.jsonl"

    def __init__(
        self, *, config: dict[str, Any], samples_url: str, model_dir: str, run_dir: str
    ) -> None:
        super().__init__(
            config=config, samples_url=samples_url, model_dir=model_dir, run_dir=run_dir
        )
        self.ledger_file = self.run_dir / LEDGER
        self._sinks: MetricsFanout | None = None  # [logging]'s sinks, built at the first record
        self._lock = threading.Lock()  # one backend operation at a time, across threads
        self._published = -1  # the newest version the bus holds (rank 0)
        self._plane: WeightPublisher | None = None  # [weights] transport = "group" (rank 0)
        self._holding_rows = False  # a batch is taken and not yet published/acked
        # [weights] overlap: the publish of the last step, going on while the next one runs.
        self._publishing: asyncio.Task[None] | None = None
        self._resumed_from: int | None = None  # the version of the checkpoint loaded at start
        self._last_publish_s = 0.0  # how long the last step's publish held the loop
        # When this step's first take began: takes that come back empty (each waits a few
        # seconds) all count towards the step's take time, not only the last of them.
        self._waiting_since: float | None = None
        # What `relax replay` needs ([trainer] record), written by rank 0 from its first step.
        self._recorder: RecordWriter | None = None

    async def on_start(self) -> None:
        ctx = self.context

        def build() -> Any:
            return build_backend(self.cfg, self.model_dir, rank=ctx.rank, world_size=ctx.size)

        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        if ctx.size > 1:
            # Every collective of this rank runs on this one thread, in order.
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"trainer-rank{ctx.rank}"
            )
            self.backend = await self._in_thread(build)
        else:
            self.backend = build()
        # A trainer restarted inside a run (or a run resumed into its old folder) continues
        # from its newest checkpoint; see run() for weights published after that checkpoint.
        latest = self._latest_checkpoint() if ctx.rank == 0 else None
        if ctx.size > 1:
            latest = await self._in_thread(lambda: self._share_path(latest))
        if latest is not None:
            if ctx.size > 1:
                await self._in_thread(lambda: self.backend.load_checkpoint(latest))
            else:
                self.backend.load_checkpoint(latest)
            self._resumed_from = self.backend.version
            self.log.info("resumed from checkpoint", path=str(latest), version=self.backend.version)

    async def on_stop(self) -> None:
        if getattr(self, "_executor", None) is None and hasattr(self, "backend"):
            # Stopped on request (relax down, Ctrl-C): keep what was trained.
            await asyncio.to_thread(self._final_checkpoint)
        self._close_executor()
        await asyncio.to_thread(self._close_sinks)  # W&B's finish may wait on the network

    def _final_checkpoint(self) -> None:
        with self._lock:  # after a step still running in its thread
            version = self.backend.version
            if version != self._published:
                # A step applied after the stop began was never published nor acked: its rows
                # go back to the bus, so saving it would train them twice on resume.
                return
            latest = self._latest_checkpoint()
            if latest is None or latest.name != checkpoint_name(version):
                self._checkpoint()
                self.log.info("checkpoint on stop", version=version)

    async def on_failure(self, exc: BaseException) -> None:
        self._close_executor()
        await asyncio.to_thread(self._close_sinks)

    def _close_executor(self) -> None:
        executor = getattr(self, "_executor", None)
        if executor is not None:
            # A thread blocked in a collective cannot be interrupted; the process exits anyway.
            executor.shutdown(wait=False, cancel_futures=True)

    async def _in_thread(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on this rank's collective thread (a gang) or a worker thread."""
        if self._executor is None:
            return await asyncio.to_thread(fn)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    @staticmethod
    def _share_path(path: Path | None) -> Path | None:
        shared = broadcast_message({"path": None if path is None else str(path)})
        return None if shared["path"] is None else Path(shared["path"])

    def version(self) -> int:
        return self.backend.version

    def metrics(self) -> list[dict[str, Any]]:
        """The latest ``HISTORY_KEPT`` steps' metrics (all are in ``metrics.jsonl``)."""
        return list(self.history)

    def _checkpoints(self) -> Path:
        return self.run_dir / self.cfg.checkpoint.dir

    def _latest_checkpoint(self) -> Path | None:
        found = sorted(self._checkpoints().glob("step-*")) if self._checkpoints().exists() else []
        return found[-1] if found else None

    async def run(self) -> None:
        if self.context.rank != 0:
            await self._follow()
            return
        await self._lead()
        # The other ranks' run() ends too. (If rank 0 crashes instead, the gang is ended
        # as a unit: a rank waiting for an announcement is killed with it.)
        await self._together("stop")

    async def _lead(self) -> None:
        cfg = self.cfg
        size = cfg.trainer.global_batch_size
        columns = train_columns(cfg)
        async with await connect_bus(self.samples_url, cfg, "trainer") as bus:
            if cfg.weights.transport == "group":
                self._plane = WeightPublisher(
                    bus, plane_options(cfg.weights, self.samples_url), device=self.backend.device
                )
            try:
                await self._lead_on(bus, size, columns)
            finally:
                if self._plane is not None:
                    await self._plane.aclose()

    async def _publish(
        self, bus: BusClient, version: int, weights: dict[str, Any], ack: Batch | None = None
    ) -> None:
        """Publish ``weights`` as ``version``: over the weight plane, or through the bus."""
        if self._plane is not None:
            await self._plane.publish(version, weights, ack=ack)
        else:
            await bus.publish_weights(version, weights, ack=ack)

    async def _lead_on(self, bus: BusClient, size: int, columns: tuple[str, ...]) -> None:
        cfg = self.cfg
        published = (await bus.statistics())["weights"]["current"]
        newer = (
            await bus.poll_weights(after=self.backend.version, wait=0)
            if published > self.backend.version
            else None
        )
        if newer is not None:  # published after our last checkpoint: continue from there
            await self._together("adopt", version=newer[0], weights=newer[1])
            self.log.warning("continuing from published weights", version=newer[0])
        elif published < self.backend.version:  # a resumed run: the rollouts catch up first
            await self._publish(bus, self.backend.version, await self._together("publish"))
        self._published = self.backend.version
        self._forget_unpublished_steps()
        if cfg.trainer.record:
            await self._record_start(adopted=None if newer is None else newer[0])
        while self.backend.version < cfg.trainer.steps:
            self._holding_rows = False
            once = asyncio.ensure_future(self._train_once(bus, size, columns))
            try:
                await asyncio.shield(once)
            except asyncio.CancelledError:
                # Stopping. Rows already taken are trained, published and acked first, so
                # the stop's checkpoint holds them; a wait for rows is simply abandoned.
                if self._plane is not None:
                    # The rollouts stop first: a publish must not wait for them to join.
                    self._plane.abandon()
                if self._holding_rows:
                    with contextlib.suppress(Exception):
                        await once
                else:
                    once.cancel()
                with contextlib.suppress(Exception):
                    await self._published_all()
                raise
        await self._published_all()
        latest = self._latest_checkpoint()
        if latest is None or latest.name != checkpoint_name(self.backend.version):
            await self._together("checkpoint")  # the end of training is always saved

    async def _record_start(self, adopted: int | None) -> None:
        """Begin (or continue) the run's record with how this trainer started."""
        recorder = self._recorder = RecordWriter(self.run_dir)
        config = self.cfg.model_dump(mode="json")
        recorder.config(config, self.model_dir)
        dropped = recorder.forget_unpublished(self._published)
        if dropped:
            self.log.warning("dropped record lines of unpublished steps", dropped=dropped)
        weights = await self._together("publish")
        digest = await asyncio.to_thread(weights_digest, weights)
        await asyncio.to_thread(
            recorder.start,
            version=self.backend.version,
            checkpoint=self._resumed_from,
            adopted=adopted,
            weights=digest,
            threads=torch.get_num_threads(),
            config=config,
        )

    async def _published_all(self) -> None:
        """Wait for the publish still going on (``[weights] overlap``); raises its error."""
        publishing, self._publishing = self._publishing, None
        if publishing is not None:
            await publishing

    async def _publish_in_background(
        self, bus: BusClient, version: int, weights: dict[str, Any], batch: Batch
    ) -> None:
        """Publish ``version`` (acking ``batch`` with its commit) while the next step runs."""
        await self._published_all()  # versions commit in order, one at a time
        batch.ack_with_commit = True

        async def publish() -> None:
            await self._publish(bus, version, weights, ack=batch)
            self._published = version

        self._publishing = asyncio.create_task(publish())

    def _overlaps(self, batch: Batch) -> bool:
        """Whether this step's publish may go on during the next step: asked for, and the
        bound in force is not 0 (at 0 the next batch needs rollouts on this version anyway,
        and a staleness-0 run stays the synchronous loop, step for step)."""
        wanted = self.cfg.weights.overlap
        if wanted == "auto":
            wanted = "on" if _has_gpu() else "off"
        return wanted == "on" and batch.staleness not in (0, None)

    async def _train_once(self, bus: Any, size: int, columns: tuple[str, ...]) -> None:
        """Take one batch, step, record; publish (acking the batch with the commit) or, for a
        skipped step, ack it flagged as skipped; checkpoint when due."""
        cfg = self.cfg
        if self._waiting_since is None:
            self._waiting_since = time.monotonic()
        started = self._waiting_since
        if self._publishing is not None and self._publishing.done():
            await self._published_all()  # surface a failed publish at once
        async with bus.take(
            "train",
            batch_size=size,
            min_rows=size,
            whole_groups=True,
            columns=list(columns),
            optional=list(OPTIONAL_COLUMNS),
            max_row_tokens=cfg.trainer.max_sample_tokens,
            wait=5.0,
            # Our version, when its publish may still be on the way: staleness counts from it.
            trainer_version=self.backend.version,
        ) as batch:
            if not batch.rows:
                return
            await stall_point(self.run_dir, "after_take", "trainer")  # a test hook
            took = time.monotonic() - started  # waiting for rows, and the bus's take(s)
            if len(await without_poisoned(bus, batch, self.log)) < size:
                # A poisoned group (e.g. reward = "high") was dropped: the rest of the batch
                # goes back, to be taken again with other groups.
                if batch.rows:
                    await bus.release(batch)
                batch.rows = []
                return
            self._holding_rows = True
            self._waiting_since = None  # the next step's wait starts after this one
            # A fixed order (group, then uid) makes a step independent of the order
            # rows reached the bus: the same samples always give the same update.
            ordered = sorted(batch.rows, key=lambda r: (r["group"], r["uid"]))
            rows = [train_row(r, columns) for r in ordered]
            versions = [r["version"] for r in batch.rows]
            # Off the event loop: heartbeats must keep flowing during a long step.
            trainable = [r for r in rows if r[RESPONSE_IDS]]
            # Agent episodes that never reached the model leave rows without a response;
            # a batch of only those is consumed as a skipped step, not a crash.
            result = (
                await self._together("step", rows=trainable)
                if trainable
                else StepResult(False, {"rows": 0.0}, "no row of the batch has response tokens")
            )
            every = cfg.checkpoint.every_steps
            due = bool(result.applied and every and self.backend.version % every == 0)
            overlapped = result.applied and self._overlaps(batch) and not due
            record = {
                "step": self.backend.version,
                "applied": result.applied,
                "skipped_reason": result.skipped_reason,
                "trainer_version_at_take": batch.trainer_version,
                "oldest_row_version": min(versions),
                "newest_row_version": max(versions),
                # How far behind the trainer the stalest row of this batch was.
                "staleness_max": batch.trainer_version - min(versions),
                # The bound in force at the take (it can change live: `relax set staleness`),
                # and how many rows were how many versions behind ("lag": count).
                "staleness_bound": batch.staleness,
                "lag_hist": lag_histogram(batch.trainer_version, versions),
                # Whether this step's publish goes on during the next step ([weights] overlap).
                "publish_overlapped": overlapped,
                "wall_s": time.monotonic() - started,
                # Where the step's wall time went besides the backend's own phases: the take,
                # and the previous step's publish (0 when it overlapped this step).
                "take_time_s": took,
                "publish_time_s": self._last_publish_s,
                "time": time.time(),  # when the step ended (Unix seconds), for rates and plots
                **length_metrics(batch.rows),
                **token_version_metrics(batch.rows, batch.trainer_version),
                **episode_metrics(batch.rows),
                **component_metrics(batch.rows),  # reward/<component> means
                **result.metrics,
            }
            self._record(record)
            # Before the publish (or the skipped step's ack): a kill after it leaves a line that
            # the restart reconciles against the published version.
            await asyncio.to_thread(self._ledger, self.backend.version, result.applied, batch.items)
            batch.skipped_step = not result.applied
            if not result.applied:
                self.log.warning(
                    "training step skipped: nothing published, rows consumed",
                    version=self.backend.version,
                    reason=result.skipped_reason,
                )
            weights = await self._together("publish") if result.applied else None
            if self._recorder is not None:
                await asyncio.to_thread(self._record_step, result, trainable, weights)
            if weights is not None:
                version = self.backend.version
                publishing = time.monotonic()
                if overlapped:
                    await self._publish_in_background(bus, version, weights, batch)
                else:
                    await self._published_all()
                    await self._publish(bus, version, weights, ack=batch)
                    self._published = version
                self._last_publish_s = time.monotonic() - publishing
                if due:
                    await self._together("checkpoint")

    def _record_step(
        self,
        result: StepResult,
        rows: list[dict[str, Any]],
        weights: dict[str, Any] | None,
    ) -> None:
        assert self._recorder is not None
        self._recorder.step(
            step=self.backend.version,
            applied=result.applied,
            rows=rows,
            metrics=result.metrics,
            weights=None if weights is None else weights_digest(weights),
        )

    def _ledger(self, step: int, applied: bool, items: list[list[Any]]) -> None:
        line = json.dumps({"step": step, "applied": applied, "items": items})
        with open(self.ledger_file, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _forget_unpublished_steps(self) -> None:
        """Drop records of applied steps above the published version: a trainer killed between
        recording a step and publishing it left a record of an update that never happened (its
        rows went back to the bus and are trained again). Both the ledger and the metrics."""
        dropped = drop_unpublished(self.ledger_file, self._published)
        if dropped:
            self.log.warning("dropped ledger lines of unpublished steps", dropped=dropped)
        dropped = drop_unpublished(self.metrics_file, self._published)
        if dropped:
            self.log.warning("dropped records of unpublished steps", dropped=dropped)
            kept = [r for r in self.history if r.get("step", 0) <= self._published]
            self.history = deque(kept, maxlen=self.HISTORY_KEPT)

    # ------------------------------------------------------------------ gang operations

    async def _together(self, op: str, **payload: Any) -> Any:
        """Run ``op`` on the backend; in a gang, on every rank (rank 0 announces it first)."""
        if self._executor is None:
            if op == "publish":
                return self.backend.state_dict_for_publish()
            if op == "adopt":
                return self.backend.adopt(payload["version"], payload["weights"])
            if op == "stop":
                return None
            return await asyncio.to_thread(self._execute, op, payload)

        def announce_and_run() -> Any:
            broadcast_message({"op": op, **payload})
            return None if op == "stop" else self._execute(op, payload)

        return await self._in_thread(announce_and_run)

    async def _follow(self) -> None:
        """Ranks above 0: run whatever rank 0 announces, until it says stop."""

        def next_operation() -> str:
            message = broadcast_message()
            op = message.pop("op")
            if op != "stop":
                self._execute(op, message)
            return op

        while await self._in_thread(next_operation) != "stop":
            pass

    def _execute(self, op: str, payload: dict[str, Any]) -> Any:
        with self._lock:
            return self._execute_locked(op, payload)

    def _execute_locked(self, op: str, payload: dict[str, Any]) -> Any:
        if op == "step":
            return self.backend.step(payload["rows"])
        if op == "publish":
            return self.backend.state_dict_for_publish()
        if op == "adopt":
            return self.backend.adopt(payload["version"], payload["weights"])
        if op == "checkpoint":
            return self._checkpoint()
        raise ValueError(f"unknown trainer operation {op!r}")

    def _record(self, record: dict[str, Any]) -> None:
        """Keep ``record`` and send it to the sinks ``[logging]`` configures (``metrics.jsonl``,
        TensorBoard, W&B). A sink that fails is logged and never stops training."""
        self.history.append(record)
        if self._sinks is None:
            self._sinks = MetricsFanout(
                build_sinks(
                    self.cfg.logging,
                    self.run_dir,
                    config=self.cfg.model_dump(mode="json"),
                    on_error=lambda name, exc: self.log.warning(
                        "metrics sink unavailable; training goes on without it",
                        sink=name,
                        error=f"{type(exc).__name__}: {exc}",
                    ),
                ),
                self.log,
            )
        self._sinks.write(record)
        self.log.info(
            "step",
            **{k: record[k] for k in ("step", "applied") if k in record},
            reward=record.get("reward_mean"),
        )

    def _close_sinks(self) -> None:
        sinks, self._sinks = self._sinks, None
        if sinks is not None:
            sinks.close()

    def _checkpoint(self) -> None:
        target = self._checkpoints() / checkpoint_name(self.backend.version)
        self.backend.save_checkpoint(target)  # collective in a gang: every rank writes its part
        if self.context.rank != 0:
            return
        if self._recorder is not None:
            self._recorder.checkpoint(self.backend.version)
        keep = self.cfg.checkpoint.keep_last
        old = sorted(self._checkpoints().glob("step-*"))
        for stale in old[:-keep] if keep else []:
            shutil.rmtree(stale, ignore_errors=True)
