"""`relax up` in the foreground: run the supervisor tree in this process, show its steps as
they come, stop it on Ctrl-C, and say how the run ended (the exit status comes from that)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from relax.cli._up_progress import (
    MetricsFeed,
    PlainReporter,
    Reporter,
    RichReporter,
    want_progress,
)
from relax.cli._up_run_folder import latest_checkpoint, resume_hint, write_run_info
from relax.cli._up_signals import EXIT_INTERRUPTED, SignalRouting, StopLevels
from relax.cli._up_stderr import Descriptor2, StderrPump
from relax.cli._validate import EXIT_INVALID
from relax.log import CurrentStderr

if TYPE_CHECKING:
    from relax.config import ClusterConfig


@dataclass
class Outcome:
    """How the run ended: its layout, the error it raised, cancelled (Ctrl-C twice), and the
    signals seen on the way."""

    layout: Any = None
    error: BaseException | None = None
    cancelled: bool = False
    signals: list[int] = field(default_factory=list)


def run_foreground(
    cfg: ClusterConfig,
    *,
    cluster_toml: Path,
    overrides: Sequence[str],
    run_dir: Path,
    sync: bool,
    progress: bool | None,
    verbose: bool,
) -> int:
    """Run the cluster in this process and report it; returns the exit status."""
    from relax.control import read_metrics
    from relax.log import configure_logging

    fancy = want_progress(progress)
    write_run_info(run_dir, cfg, cluster_toml, overrides)
    done = next((int(r["step"]) for r in reversed(read_metrics(run_dir)) if "step" in r), 0)
    resume_text = "resume with: " + resume_hint(cluster_toml, overrides, run_dir, cfg)
    reporter: Reporter
    with contextlib.ExitStack() as stack:
        if fancy:
            from rich.console import Console

            console = Console(force_terminal=True)
            reporter = bar = RichReporter(console, cfg.trainer.steps)
            console.print(cfg.summary(), highlight=False, markup=False)
            console.print(f"run folder {run_dir}", highlight=False)
            stack.enter_context(StderrPump(bar.log_line, verbose=verbose))
            # JSON into descriptor 2 (the pipe), so the pump can filter and format it.
            configure_logging(level=cfg.logging.level, fmt="json", stream=Descriptor2(), force=True)
        else:
            reporter = PlainReporter(cfg.trainer.steps)
            fmt = cfg.logging.format
            configure_logging(level=cfg.logging.level, fmt=fmt, stream=CurrentStderr(), force=True)
            typer.echo(cfg.summary())
            typer.echo(f"run folder {run_dir}")
        quiet_transformers()
        stack.enter_context(SignalRouting())
        reporter.start(cfg.cluster.name, done)
        try:
            outcome = asyncio.run(_supervise(cfg, run_dir, sync, reporter, resume_text))
        finally:
            reporter.stop()
    return _report(cfg, run_dir, outcome, resume_text)


def quiet_transformers() -> None:
    # Loading tiny models prints progress bars per process; they drown the run's own output.
    # The variable reaches the actors' child processes too.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


async def _supervise(
    cfg: ClusterConfig, run_dir: Path, sync: bool, reporter: Reporter, resume_text: str
) -> Outcome:
    from relax import cluster

    metrics = MetricsFeed(run_dir, reporter)
    if sync:
        from relax.sync import run_sync

        work = asyncio.create_task(run_sync(cfg, run_dir))
    else:
        work = asyncio.create_task(cluster.run(cfg, run_dir))

    signals = StopLevels(
        note=reporter.note,
        stop_cleanly=lambda: _request_stop(run_dir, work, sync),
        leave=work.cancel,
        # Asked at the third Ctrl-C: a run that has trained no step has nothing to resume.
        resume_text=lambda: resume_text if _trained_a_step(run_dir) else "",
    )
    async with signals:
        watcher = asyncio.create_task(metrics.follow())
        try:
            await asyncio.wait({work})
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    metrics.poll()
    outcome = Outcome(signals=signals.received)
    if work.cancelled():
        outcome.cancelled = True
    elif work.exception() is not None:
        outcome.error = work.exception()
    else:
        outcome.layout = work.result()
    return outcome


async def _request_stop(run_dir: Path, work: asyncio.Task[Any], sync: bool) -> None:
    """A graceful stop: the control endpoint's "stop" (what ``relax down`` sends)."""
    from relax.control import ClusterNotRunning, control_request
    from relax.errors import RelaxError

    if sync:
        work.cancel()
        return
    try:
        await control_request(run_dir, {"op": "stop"}, timeout=10)
    except (ClusterNotRunning, RelaxError, OSError):
        work.cancel()  # not serving yet (still preparing): leaving early stops what started


def _trained_a_step(run_dir: Path) -> bool:
    from relax.control import read_metrics

    return any(int(r.get("step", 0)) > 0 for r in read_metrics(run_dir))


def _report(cfg: ClusterConfig, run_dir: Path, outcome: Outcome, resume_text: str) -> int:
    """Say how the run ended and return the exit status: 1 when the tree gave up (or failed),
    130 after Ctrl-C, 0 when done or stopped on request, 2 for a config ``--sync`` cannot
    run."""
    from relax.control import read_metrics
    from relax.errors import RelaxError, SupervisorGaveUp

    plots = _write_plots(run_dir)
    records = [r for r in read_metrics(run_dir) if "step" in r]
    step = max((int(r["step"]) for r in records), default=0)
    checkpoint = latest_checkpoint(run_dir, cfg)
    saved = f"; latest checkpoint {checkpoint}" if checkpoint else ""
    # A run that never trained a step has nothing to resume (a step-0 checkpoint is the
    # initial model): start it again instead.
    if step == 0:
        resume_text = ""
    if outcome.error is not None:
        exc = outcome.error
        if isinstance(exc, NotImplementedError):  # --sync with roles it cannot run
            typer.echo(f"cannot run this config: {exc}", err=True)
            return EXIT_INVALID
        kind = "" if isinstance(exc, RelaxError) else f"{type(exc).__name__}: "
        typer.echo(
            f"the cluster stopped at step {step} of {cfg.trainer.steps}: {kind}{exc}", err=True
        )
        if not isinstance(exc, RelaxError):
            import traceback

            traceback.print_exception(exc, file=sys.stderr)
        cause = getattr(exc, "cause", None)
        if isinstance(exc, SupervisorGaveUp) and getattr(cause, "fatal", False) and cause.traceback:
            # An unrecoverable actor (e.g. a reward function that always raises): its own
            # traceback, the user's code first, printed this once.
            typer.echo(cause.traceback.rstrip("\n"), err=True)
        typer.echo(f"  what happened: relax logs --run-dir {run_dir} --level warning", err=True)
        if checkpoint:
            typer.echo(f"  latest checkpoint: {checkpoint}", err=True)
        if resume_text:
            typer.echo(f"  once the cause is fixed, {resume_text}", err=True)
        return 1
    if outcome.signals or outcome.cancelled:
        typer.echo(f"stopped at step {step} of {cfg.trainer.steps}{saved}{plots}", err=True)
        if resume_text:
            typer.echo(resume_text, err=True)
        return EXIT_INTERRUPTED
    if step < cfg.trainer.steps:  # a control "stop" (relax down)
        typer.echo(f"stopped on request at step {step} of {cfg.trainer.steps}{saved}{plots}")
        if resume_text:
            typer.echo(resume_text)
        return 0
    applied = [r for r in records if r.get("applied")]
    if applied:
        k = max(1, len(applied) // 4)
        first = sum(s.get("reward_mean", 0.0) for s in applied[:k]) / k
        last = sum(s.get("reward_mean", 0.0) for s in applied[-k:]) / k
        typer.echo(
            f"{len(applied)} steps ({len(records) - len(applied)} skipped); mean reward "
            f"{first:.3f} over the first {k} → {last:.3f} over the last {k}; run folder {run_dir}"
        )
    if checkpoint or plots:
        typer.echo(f"final checkpoint {checkpoint}{plots}" if checkpoint else plots.lstrip("; "))
    return 0


def _write_plots(run_dir: Path) -> str:
    """Charts into RUN_DIR/plots when matplotlib is there; a ``; plots in ...`` note or ''."""
    from relax.plot import PLOTS_DIR, PlotError, matplotlib_available, write_plots

    if not matplotlib_available() or not (run_dir / "metrics.jsonl").exists():
        return ""
    try:
        written = write_plots(run_dir)
    except PlotError:
        return ""
    except Exception as exc:  # a plotting problem must never hide how the run ended
        typer.echo(f"warning: could not draw the plots: {exc}", err=True)
        return ""
    return f"; plots in {run_dir / PLOTS_DIR}" if written else ""
