"""How `relax up` shows a run's steps, read from its ``metrics.jsonl`` as the trainer writes
it: a progress bar on a terminal (:class:`RichReporter`: steps, reward, step time, staleness,
throughput), one plain line per step anywhere else (:class:`PlainReporter`: a pipe, a file,
``--detach``)."""

from __future__ import annotations

import asyncio
import os
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import typer

from relax.plot import staleness as staleness_of

if TYPE_CHECKING:
    from rich.console import Console

POLL_S = 0.25
"""How often the run's ``metrics.jsonl`` is read for new steps."""


class Reporter(Protocol):
    """Where the run's steps and `relax up`'s own notes (stopping, ...) go."""

    def start(self, name: str, done: int) -> None: ...
    def record(self, record: dict[str, Any]) -> None: ...
    def note(self, text: str) -> None: ...
    def stop(self) -> None: ...


def want_progress(progress: bool | None) -> bool:
    """``--progress``/``--no-progress`` as given, else whether a bar can be drawn."""
    if progress is not None:
        return progress
    # Both: stderr redirected to a file must keep every log line.
    terminal = sys.stdout.isatty() and sys.stderr.isatty()
    return terminal and os.environ.get("TERM") != "dumb"


def _fmt(value: Any, spec: str = ".4g") -> str:
    return format(value, spec) if isinstance(value, int | float) else "-"


@dataclass
class StepStats:
    """Running view of the steps: the latest record and a window for rates."""

    total: int
    done: int = 0
    window: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=10))
    last: dict[str, Any] | None = None
    skipped: int = 0

    def add(self, record: dict[str, Any]) -> None:
        self.last = record
        if isinstance(record.get("step"), int | float):
            self.done = max(self.done, int(record["step"]))
        if record.get("applied") is False:
            self.skipped += 1
        self.window.append(record)

    def tokens_per_s(self) -> float | None:
        wall = sum(r.get("wall_s") or 0.0 for r in self.window)
        tokens = sum(r.get("tokens") or 0.0 for r in self.window)
        return tokens / wall if wall > 0 and tokens > 0 else None

    def step_s(self) -> float | None:
        walls = [r["wall_s"] for r in self.window if isinstance(r.get("wall_s"), int | float)]
        return sum(walls) / len(walls) if walls else None

    def summary(self) -> str:
        """``reward 0.125 · 1.21 s/step · staleness 1 · 523 tok/s`` (latest step, window rates)."""
        r = self.last or {}
        parts = [f"reward {_fmt(r.get('reward_mean'), '.3f')}"]
        step_s = self.step_s()
        if step_s is not None:
            parts.append(f"{step_s:.2f} s/step")
        stale = staleness_of(r)
        if stale is not None:
            parts.append(f"staleness {stale}")
        rate = self.tokens_per_s()
        if rate is not None:
            parts.append(f"{rate:,.0f} tok/s")
        if self.skipped:
            parts.append(f"{self.skipped} skipped")
        return " · ".join(parts)


def plain_line(record: dict[str, Any], total: int) -> str:
    """One step as a plain log line (not a terminal)."""
    step = record.get("step", "?")
    if record.get("applied") is False:
        return f"step {step}/{total} skipped: {record.get('skipped_reason') or 'no reason given'}"
    parts = [f"step {step}/{total}", f"reward {_fmt(record.get('reward_mean'), '.4f')}"]
    for key, label in (("loss", "loss"), ("kl", "kl"), ("entropy", "entropy")):
        if isinstance(record.get(key), int | float):
            parts.append(f"{label} {record[key]:.4g}")
    stale = staleness_of(record)
    if stale is not None:
        parts.append(f"staleness {stale}")
    wall = record.get("wall_s")
    if isinstance(wall, int | float):
        parts.append(f"{wall:.2f} s")
        tokens = record.get("tokens")
        if isinstance(tokens, int | float) and wall > 0:
            parts.append(f"{tokens / wall:,.0f} tok/s")
    return "  ".join(parts)


class PlainReporter:
    """One line per step on stdout; notes on stderr."""

    def __init__(self, total: int) -> None:
        self.stats = StepStats(total)

    def start(self, name: str, done: int) -> None:
        self.stats.done = done

    def record(self, record: dict[str, Any]) -> None:
        self.stats.add(record)
        typer.echo(plain_line(record, self.stats.total))
        sys.stdout.flush()

    def note(self, text: str) -> None:
        typer.echo(text, err=True)

    def stop(self) -> None:
        pass


class RichReporter:
    """A progress bar of steps on a terminal (the step's numbers on a line below it), with log
    lines printed above it."""

    def __init__(self, console: Console, total: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.text import Text

        class TwoLines(Progress):
            def get_renderables(self) -> Any:
                yield self.make_tasks_table(self.tasks)
                for task in self.tasks:
                    yield Text(
                        f"  {task.fields.get('stats', '')}", style="dim", overflow="ellipsis"
                    )

        self.console = console
        self.stats = StepStats(total)
        self.progress = TwoLines(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=30),
            MofNCompleteColumn(),
            TextColumn("steps"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            refresh_per_second=4,
        )
        self.task: Any = None

    def start(self, name: str, done: int) -> None:
        self.stats.done = done
        self.progress.start()
        self.task = self.progress.add_task(
            name, total=self.stats.total, completed=done, stats="starting the tree…"
        )

    def record(self, record: dict[str, Any]) -> None:
        self.stats.add(record)
        self.progress.update(self.task, completed=self.stats.done, stats=self.stats.summary())

    def note(self, text: str) -> None:
        from rich.text import Text

        self.console.print(Text(text, style="yellow"))

    def log_line(self, text: str) -> None:
        """A log line (already formatted, maybe with ANSI colors) above the bar."""
        from rich.text import Text

        self.console.print(Text.from_ansi(text))

    def stop(self) -> None:
        self.progress.stop()


class MetricsFeed:
    """The run's ``metrics.jsonl`` read as it grows: each new step record goes to the reporter.

    Opened at its end, so that a resumed run reports only its new steps.
    """

    def __init__(self, run_dir: Path, reporter: Reporter) -> None:
        from relax.cli._logs import Source

        self.reporter = reporter
        self.source = Source(run_dir / "metrics.jsonl", None)
        self.source.tail(1)

    def poll(self) -> None:
        """Report the step records written since the last poll."""
        for record in self.source.read_new():
            if "step" in record:
                self.reporter.record(record)

    async def follow(self) -> None:
        """Poll every ``POLL_S`` until cancelled."""
        while True:
            self.poll()
            await asyncio.sleep(POLL_S)
