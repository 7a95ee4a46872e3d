"""Metrics sinks: where the trainer's per-step records go.

One interface, :class:`MetricsSink`; three sinks, picked by ``[logging]``:

- :class:`JsonlSink` — ``RUN_DIR/metrics.jsonl``, one ``json.dumps(record)`` per line (the
  file ``relax status``, the TUI and the Prometheus endpoint read);
- :class:`TensorBoardSink` — ``RUN_DIR/tensorboard/``, one scalar per numeric metric per step;
- :class:`WandbSink` — a Weights & Biases run (files under ``RUN_DIR/wandb/``; set
  ``WANDB_MODE=offline`` to stay off the network and ``wandb sync`` later).

:class:`MetricsFanout` sends each record to every sink; a sink that raises is reported with a
warning and never stops training.
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import json
import math
import secrets
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from relax.errors import MissingPackage
from relax.log import get_logger
from relax.schema import MetricRecord

METRICS_FILE = "metrics.jsonl"
"""The trainer's metrics in a run folder."""
TENSORBOARD_DIR = "tensorboard"
"""TensorBoard event files in a run folder."""
EVAL_FILE = "eval.jsonl"
"""The evaluator's metrics in a run folder ([eval]): one record per evaluated version."""
EVAL_TENSORBOARD_DIR = "tensorboard/eval"
"""The evaluator's TensorBoard events in a run folder (a TensorBoard run beside the trainer's)."""
WANDB_DIR = "wandb"
"""Weights & Biases' local files in a run folder."""
WANDB_ID_FILE = "wandb-run-id"
"""The W&B run id of a run folder: a restarted or resumed trainer continues the same W&B run."""


def numeric_metrics(record: Mapping[str, Any], *, skip: Iterable[str] = ()) -> dict[str, float]:
    """The numeric fields of ``record`` as floats (booleans as 0/1); text, ``None`` and
    containers are left out."""
    skipped = set(skip)
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in skipped or isinstance(value, str) or value is None:
            continue
        if isinstance(value, (bool, int, float)):
            out[str(key)] = float(value)
    return out


def last_eval(run_dir: str | Path) -> dict[str, Any] | None:
    """The newest record of ``RUN_DIR/eval.jsonl`` (``None`` when there is none yet); a torn
    last line (being written) is skipped. The file holds one short line per evaluation."""
    path = Path(run_dir) / EVAL_FILE
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            if isinstance(record, dict):
                return record
    return None


def _step_of(record: MetricRecord, fallback: int) -> int:
    step = record.get("step")
    if isinstance(step, (int, float)) and not isinstance(step, bool) and math.isfinite(step):
        return int(step)
    return fallback


class MetricsSink(abc.ABC):
    """Somewhere a run's metric records go. ``write`` gets one record (a flat dict with a
    ``step``: ``relax.schema.MetricRecord``) at a time, in order; ``close`` flushes and
    releases what the sink holds."""

    name: str = "sink"

    @abc.abstractmethod
    def write(self, record: MetricRecord) -> None: ...

    def close(self) -> None:
        """Flush and release; the sink is not written to afterwards."""


class JsonlSink(MetricsSink):
    """Appends ``json.dumps(record)`` and a newline per record (the ``metrics.jsonl`` format)."""

    name = "jsonl"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def write(self, record: MetricRecord) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(dict(record)) + "\n")


class TensorBoardSink(MetricsSink):
    """One TensorBoard scalar per numeric field per record, at the record's ``step``
    (``torch.utils.tensorboard.SummaryWriter``; flushed after every record)."""

    name = "tensorboard"

    def __init__(self, log_dir: str | Path, *, prefix: str = "") -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch is a dependency; its TensorBoard writer needs `tensorboard`
            raise MissingPackage("tensorboard", "logging.tensorboard", "tensorboard") from None
        self.log_dir, self.prefix = Path(log_dir), prefix
        self._writer = SummaryWriter(log_dir=str(self.log_dir))
        self._count = 0

    def write(self, record: MetricRecord) -> None:
        step = _step_of(record, self._count)
        self._count += 1
        for key, value in numeric_metrics(record, skip=("step",)).items():
            self._writer.add_scalar(f"{self.prefix}{key}", value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink(MetricsSink):
    """Logs the numeric fields of each record to a Weights & Biases run at its ``step``.

    ``wandb.init`` (which may wait on the network for a while) runs on a background thread, so
    building the sink never blocks the trainer's event loop; records written meanwhile are
    kept and sent, in order, once the run exists. If ``init`` fails, every write raises its
    error (the fan-out turns that into warnings). ``close`` waits for ``init`` (up to
    ``init_timeout``) and finishes the run.

    The run's id is kept in ``RUN_DIR/wandb-run-id``, so a restarted (or resumed) trainer
    continues the same W&B run rather than starting a new one.

    The evaluator (``[eval]``) runs in a process of its own and writes ``RUN_DIR/eval.jsonl``;
    one W&B run takes one writer, so this sink forwards the evaluator's new records into the
    trainer's run: at each write and at ``close``, every whole new line of ``eval.jsonl`` is
    logged at the current step, its version as ``eval/version`` (an evaluation that ends after
    the trainer closed its sinks is not in W&B).
    """

    name = "wandb"

    def __init__(
        self,
        *,
        project: str | None,
        run_dir: str | Path,
        entity: str | None = None,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        init_timeout: float = 120.0,
    ) -> None:
        wandb = import_wandb()  # a missing package fails here, at once
        run_dir = Path(run_dir)
        (run_dir / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        id_file = run_dir / WANDB_ID_FILE
        if id_file.exists():
            run_id = id_file.read_text().strip()
        else:
            run_id = secrets.token_hex(8)
            id_file.write_text(run_id + "\n")
        options = {
            "project": project,
            "entity": entity,
            "name": name or run_dir.name,
            "id": run_id,
            "resume": "allow",
            "dir": str(run_dir),
            "config": dict(config) if config is not None else None,
        }
        self.init_timeout = init_timeout
        self.run: Any = None
        self._error: BaseException | None = None
        self._pending: list[tuple[dict[str, float], int]] = []
        self._lock = threading.Lock()
        self._count = 0
        self._eval_file = run_dir / EVAL_FILE
        self._eval_offset = 0  # bytes of eval.jsonl already forwarded
        self._step = 0
        self._init = threading.Thread(
            target=self._start, args=(wandb, options), name="wandb-init", daemon=True
        )
        self._init.start()

    def _start(self, wandb: Any, options: dict[str, Any]) -> None:
        try:
            run = wandb.init(**options)
        except BaseException as exc:
            self._error = exc
            return
        with self._lock:
            for data, step in self._pending:
                run.log(data, step=step)
            self._pending.clear()
            self.run = run

    def write(self, record: MetricRecord) -> None:
        if self._error is not None:
            raise RuntimeError(f"wandb.init failed: {self._error}") from self._error
        step = self._step = _step_of(record, self._count)
        self._count += 1
        self._log(numeric_metrics(record, skip=("step",)), step)
        self._forward_evals()

    def _log(self, data: dict[str, float], step: int) -> None:
        with self._lock:
            if self.run is None:
                self._pending.append((data, step))
            else:
                self.run.log(data, step=step)

    def _forward_evals(self) -> None:
        """Log the evaluator's records added to ``eval.jsonl`` since the last look (whole
        lines only: one being written waits for the next look)."""
        try:
            with self._eval_file.open("rb") as f:
                f.seek(self._eval_offset)
                data = f.read()
        except OSError:  # no evaluator, or no evaluation yet
            return
        whole = data[: data.rfind(b"\n") + 1]
        self._eval_offset += len(whole)
        for line in whole.splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    metrics = numeric_metrics(record, skip=("step", "time", "started"))
                    metrics["eval/version"] = float(record.get("version", record.get("step", 0)))
                    self._log(metrics, self._step)

    def close(self) -> None:
        self._forward_evals()  # the evaluator's final record, written as the run stopped
        self._init.join(self.init_timeout)
        if self._error is not None:
            raise RuntimeError(f"wandb.init failed: {self._error}") from self._error
        if self.run is None:
            raise TimeoutError(f"wandb.init did not finish within {self.init_timeout}s")
        self.run.finish()


def import_wandb() -> Any:
    """The ``wandb`` module, or a ``MissingPackage`` error that names it."""
    try:
        return importlib.import_module("wandb")
    except ImportError:
        raise MissingPackage("wandb", "logging.wandb.enabled") from None


def check_sinks(logging: Any) -> None:
    """Raise ``MissingPackage`` now (before anything starts) if a sink that ``logging`` (a
    ``LoggingConfig``) enables needs a package that is not installed."""
    if logging.tensorboard:
        try:
            importlib.import_module("tensorboard")
        except ImportError:
            raise MissingPackage("tensorboard", "logging.tensorboard", "tensorboard") from None
    if logging.wandb.enabled:
        import_wandb()


def build_sinks(
    logging: Any,
    run_dir: str | Path,
    *,
    config: Mapping[str, Any] | None = None,
    on_error: Callable[[str, BaseException], None] | None = None,
) -> list[MetricsSink]:
    """The sinks ``logging`` (a ``LoggingConfig``) asks for, writing into ``run_dir``.

    A sink that cannot be built raises, unless ``on_error`` is given: then it is told (sink
    name, exception) and the other sinks are built anyway.
    """
    run_dir = Path(run_dir)
    makers: list[tuple[str, Callable[[], MetricsSink]]] = []
    if logging.jsonl:
        makers.append(("jsonl", lambda: JsonlSink(run_dir / METRICS_FILE)))
    if logging.tensorboard:
        makers.append(("tensorboard", lambda: TensorBoardSink(run_dir / TENSORBOARD_DIR)))
    if logging.wandb.enabled:
        wandb = logging.wandb
        makers.append(
            (
                "wandb",
                lambda: WandbSink(
                    project=wandb.project, entity=wandb.entity, run_dir=run_dir, config=config
                ),
            )
        )
    sinks: list[MetricsSink] = []
    for name, make in makers:
        try:
            sinks.append(make())
        except Exception as exc:
            if on_error is None:
                raise
            on_error(name, exc)
    return sinks


class MetricsFanout:
    """Sends each record to every sink. A sink that raises is logged (a warning on its 1st,
    10th, 100th, ... failure) and skipped for that record; the others still get it."""

    def __init__(self, sinks: Iterable[MetricsSink], log: Any | None = None) -> None:
        self.sinks = list(sinks)
        self.log = log if log is not None else get_logger()
        self.failures: dict[str, int] = {}

    def write(self, record: MetricRecord) -> None:
        for sink in self.sinks:
            try:
                sink.write(record)
            except Exception as exc:
                self._failed(sink, "write", exc)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            try:
                sink.close()
            except Exception as exc:
                self._failed(sink, "close", exc)

    def _failed(self, sink: MetricsSink, what: str, exc: BaseException) -> None:
        n = self.failures[sink.name] = self.failures.get(sink.name, 0) + 1
        if what == "close" or math.log10(n).is_integer():
            with contextlib.suppress(Exception):
                self.log.warning(
                    f"metrics sink failed to {what}; training goes on",
                    sink=sink.name,
                    error=f"{type(exc).__name__}: {exc}",
                    failures=n,
                )
