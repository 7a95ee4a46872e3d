"""`relax up`: validate a cluster.toml, run the whole supervisor tree, report the run.

In a terminal it draws a progress bar of the trainer's steps (reward, step time, staleness,
throughput), fed by the run's ``metrics.jsonl``, with warnings and errors of every actor
printed above it; elsewhere (a pipe, a file, ``--detach``) it prints one plain line per step.

Stopping: Ctrl-C (or SIGTERM) stops the tree in reverse start order, as ``relax down`` does —
the trainer writes a final checkpoint — and exits 130 saying how to resume. A second Ctrl-C
cancels the stop in progress; a third exits at once (process children die with the cluster).
A tree that gives up exits 1 with the cause. ``--detach`` runs the cluster in the background
(a new session) and returns once its control endpoint answers (``relax status``/``down``).

Files ``relax up`` adds to a run folder: ``run.json`` (how it was started: the config, the
overrides, where checkpoints and the tokenizer are), ``plots/`` (charts at the end of a run,
with matplotlib installed), and with ``--detach`` ``up.log`` (all output) and ``up.pid``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from relax.cli._app import app
from relax.cli._validate import EXIT_INVALID, _format_issue, load_or_exit

if TYPE_CHECKING:
    from rich.console import Console

    from relax.config import ClusterConfig

RUN_INFO = "run.json"
"""How a run was started (written by ``relax up``); ``relax ckpt``/``down`` read it."""
UP_LOG = "up.log"
UP_PID = "up.pid"
EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C: 128 + SIGINT, as shells report it."""
POLL_S = 0.25


# --------------------------------------------------------------------------- run folder


def read_run_info(run_dir: Path) -> dict[str, Any]:
    """The run's ``run.json`` (empty when ``relax up`` did not write one, or it is unreadable)."""
    try:
        data = json.loads((Path(run_dir) / RUN_INFO).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _absolute(path: str | Path, base: Path | None = None) -> str:
    p = Path(path).expanduser()
    if not p.is_absolute():
        p = (base or Path.cwd()) / p
    return str(p.resolve())


def write_run_info(
    run_dir: Path, cfg: ClusterConfig, cluster_toml: Path, overrides: Sequence[str]
) -> None:
    """Record how the run was started (the latest start, for a resumed run)."""
    tokenizer = cfg.model.effective_tokenizer
    info = {
        "cluster": cfg.cluster.name,
        "cluster_toml": _absolute(cluster_toml),
        "overrides": list(overrides),
        "steps": cfg.trainer.steps,
        "run_dir": _absolute(run_dir),
        "checkpoint_dir": _absolute(Path(run_dir) / cfg.checkpoint.dir),
        "model_dir": _absolute(Path(run_dir) / "model")
        if cfg.model.init is not None
        else _absolute(cfg.model.path or ""),
        "tokenizer": tokenizer if tokenizer == "byte" else _absolute(tokenizer),
        "pid": os.getpid(),
        "started_at": time.time(),
    }
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / RUN_INFO).write_text(json.dumps(info, indent=2) + "\n")


def default_run_dir(cfg: ClusterConfig) -> Path:
    """``cluster.run_dir/NAME-YYYYmmdd-HHMMSS`` (what the cluster picks itself), made unique."""
    base = Path(cfg.cluster.run_dir) / f"{cfg.cluster.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def newest_run_of(runs: Path, name: str) -> Path | None:
    found = sorted(p for p in runs.glob(f"{name}-*") if p.is_dir()) if runs.exists() else []
    return found[-1] if found else None


def resume_hint(
    cluster_toml: Path, overrides: Sequence[str], run_dir: Path, cfg: ClusterConfig
) -> str:
    """The command that continues this run (``--run-dir`` only when ``--resume`` alone would
    pick another folder)."""
    argv = ["relax", "up", str(cluster_toml), "--resume"]
    newest = newest_run_of(Path(cfg.cluster.run_dir), cfg.cluster.name)
    if newest is None or newest.resolve() != Path(run_dir).resolve():
        argv += ["--run-dir", str(run_dir)]
    for item in overrides:
        argv += ["--set", item]
    return shlex.join(argv)


def latest_checkpoint(run_dir: Path, cfg: ClusterConfig) -> Path | None:
    folder = Path(run_dir) / cfg.checkpoint.dir
    found = sorted(folder.glob("step-*")) if folder.is_dir() else []
    return found[-1] if found else None


# --------------------------------------------------------------------------- pre-flight


def preflight(cfg: ClusterConfig) -> list[Any]:
    """Files the config points to that are missing: found before anything starts (or any run
    folder is made), as config issues."""
    from relax.errors import ConfigIssue

    issues = []

    def model_folder(key: str, value: str | None, what: str) -> None:
        if value is None:
            return
        path = Path(value).expanduser()
        if not (path / "config.json").is_file():
            reason = "does not exist" if not path.exists() else "has no config.json"
            issues.append(
                ConfigIssue(
                    key,
                    f"{str(value)!r} {reason}: it must be a local Hugging Face model folder",
                    hint=f"point {key} at a folder holding config.json and the {what} weights"
                    + (
                        ", or use a [model.init] table for a tiny model"
                        if key == "model.path"
                        else ""
                    ),
                )
            )

    model_folder("model.path", cfg.model.path, "model")
    tokenizer = cfg.model.tokenizer
    if tokenizer not in (None, "byte") and not Path(tokenizer).expanduser().is_dir():
        issues.append(
            ConfigIssue(
                "model.tokenizer",
                f"tokenizer folder {tokenizer!r} does not exist",
                hint='set it to a tokenizer folder, "byte", or remove it to use the model\'s',
            )
        )
    if cfg.reference.enabled:
        model_folder("reference.model_path", cfg.reference.model_path, "reference")
    if cfg.critic.enabled:
        model_folder("critic.model_path", cfg.critic.model_path, "critic")
    if cfg.data.path is not None and not Path(cfg.data.path).expanduser().is_file():
        issues.append(
            ConfigIssue(
                "data.path",
                f"no such file {cfg.data.path!r} (relative paths start from {Path.cwd()})",
                hint="fix the path, or remove it to use the built-in arithmetic task",
            )
        )
    return issues


def preflight_or_exit(cfg: ClusterConfig, cluster_toml: Path) -> None:
    issues = preflight(cfg)
    if not issues:
        return
    for issue in issues:
        typer.echo(_format_issue(str(cluster_toml), issue), err=True)
    count = len(issues)
    typer.echo(
        f"{cluster_toml}: {count} missing file{'s' if count != 1 else ''}; nothing was started.",
        err=True,
    )
    raise typer.Exit(EXIT_INVALID)


# --------------------------------------------------------------------------- progress


def staleness_of(record: dict[str, Any]) -> int | None:
    """trainer version at take - oldest row version: how far behind the batch's oldest row was."""
    take, oldest = record.get("trainer_version_at_take"), record.get("oldest_row_version")
    if isinstance(take, int | float) and isinstance(oldest, int | float):
        return int(take - oldest)
    return None


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
        from rich.text import Text

        self.console.print(Text.from_ansi(text))

    def stop(self) -> None:
        self.progress.stop()


class StderrPump:
    """While a progress bar is drawn, everything written to file descriptor 2 — this process's
    structured logs and those of its child processes, which inherit the descriptor — goes
    through a pipe and is printed readably above the bar (warnings and errors only, unless
    ``verbose``) instead of tearing it."""

    def __init__(self, show: Callable[[str], None], *, verbose: bool) -> None:
        self.show, self.verbose = show, verbose
        self.saved: int | None = None
        self.thread: threading.Thread | None = None

    def __enter__(self) -> StderrPump:
        sys.stderr.flush()
        self.saved = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self.thread = threading.Thread(target=self._pump, args=(read,), daemon=True)
        self.thread.start()
        return self

    def _pump(self, fd: int) -> None:
        from relax.cli._logs import format_record, level_rank, parse_line

        with os.fdopen(fd, "rb") as lines:
            for raw in lines:
                text = raw.decode("utf-8", "replace").rstrip("\n")
                record = parse_line(text)
                try:
                    if record is None:
                        if text.strip():
                            self.show(text)
                    elif self.verbose or level_rank(record.get("level")) >= 2:
                        self.show(format_record(record))
                except Exception:  # never let a display problem block the writers
                    continue

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        if self.saved is not None:
            os.dup2(self.saved, 2)  # closes our end of the pipe: the pump reads to the end
            os.close(self.saved)
        if self.thread is not None:
            self.thread.join(timeout=2)  # a child still holding the pipe must not hang us


class SignalRouting:
    """SIGINT blocked in this (main) thread while the cluster runs, and received on a helper
    thread instead (Python still runs the handler on the main thread's event loop).

    Why: a child process inherits the signal mask of the thread that starts it, so the
    actors' processes start with SIGINT blocked. A Ctrl-C in a terminal goes to the whole
    foreground process group; this way only ``relax up`` sees it and stops the tree in order,
    instead of every child dying at once of a KeyboardInterrupt (and being restarted).
    """

    def __init__(self) -> None:
        self._blocked = False
        self._release = threading.Event()

    def __enter__(self) -> SignalRouting:
        if threading.current_thread() is threading.main_thread() and hasattr(
            signal, "pthread_sigmask"
        ):
            # Started before the mask changes, so it can still take a SIGINT.
            threading.Thread(target=self._release.wait, name="relax-sigint", daemon=True).start()
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            self._blocked = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        self._release.set()


# --------------------------------------------------------------------------- running


@dataclass
class Outcome:
    layout: Any = None
    error: BaseException | None = None
    cancelled: bool = False
    signals: list[int] = field(default_factory=list)


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


async def _supervise(
    cfg: ClusterConfig, run_dir: Path, sync: bool, reporter: Any, resume_text: str
) -> Outcome:
    from relax import cluster
    from relax.cli._logs import Source

    loop = asyncio.get_running_loop()
    outcome = Outcome()
    metrics = Source(run_dir / "metrics.jsonl", None)
    metrics.tail(1)  # a resumed run: report only the new steps

    if sync:
        from relax.sync import run_sync

        work = asyncio.create_task(run_sync(cfg, run_dir))
    else:
        work = asyncio.create_task(cluster.run(cfg, run_dir))

    stopping: set[asyncio.Task[None]] = set()

    def on_signal(signum: int) -> None:
        outcome.signals.append(signum)
        level = len(outcome.signals) + (1 if signum == signal.SIGTERM else 0)
        if level == 1:
            reporter.note(
                "stopping: the tree stops in reverse order and the trainer saves a checkpoint "
                "(Ctrl-C again to stop faster)"
            )
            stopping.add(loop.create_task(_request_stop(run_dir, work, sync)))
        elif level == 2:
            reporter.note("stopping faster: leaving the run (Ctrl-C again to exit at once)")
            work.cancel()
        else:
            reporter.note(f"exiting at once; {resume_text}")
            os._exit(EXIT_INTERRUPTED)

    handled = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
            loop.add_signal_handler(signum, on_signal, signum)
            handled.append(signum)

    def report_new() -> None:
        for record in metrics.read_new():
            if "step" in record:
                reporter.record(record)

    async def watch() -> None:
        while True:
            report_new()
            await asyncio.sleep(POLL_S)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait({work})
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        for signum in handled:
            loop.remove_signal_handler(signum)
        for task in stopping:
            task.cancel()
        await asyncio.gather(*stopping, return_exceptions=True)
    report_new()
    if work.cancelled():
        outcome.cancelled = True
    elif work.exception() is not None:
        outcome.error = work.exception()
    else:
        outcome.layout = work.result()
    return outcome


def _quiet_transformers() -> None:
    # Loading tiny models prints progress bars per process; they drown the run's own output.
    # The variable reaches the actors' child processes too.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


class _CurrentStderr:
    """Whatever ``sys.stderr`` is when a line is written (not when logging was configured)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


class _Descriptor2(_CurrentStderr):
    """File descriptor 2 itself: past any ``sys.stderr`` replacement (rich's, while the
    progress bar is drawn), into the pipe of :class:`StderrPump`."""

    def write(self, text: str) -> int:
        os.write(2, text.encode("utf-8", "replace"))
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _want_progress(progress: bool | None) -> bool:
    if progress is not None:
        return progress
    # Both: stderr redirected to a file must keep every log line.
    terminal = sys.stdout.isatty() and sys.stderr.isatty()
    return terminal and os.environ.get("TERM") != "dumb"


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

    fancy = _want_progress(progress)
    write_run_info(run_dir, cfg, cluster_toml, overrides)
    done = next((int(r["step"]) for r in reversed(read_metrics(run_dir)) if "step" in r), 0)
    resume_text = "resume with: " + resume_hint(cluster_toml, overrides, run_dir, cfg)
    with contextlib.ExitStack() as stack:
        if fancy:
            from rich.console import Console

            console = Console(force_terminal=True)
            reporter: Any = RichReporter(console, cfg.trainer.steps)
            console.print(cfg.summary(), highlight=False, markup=False)
            console.print(f"run folder {run_dir}", highlight=False)
            stack.enter_context(StderrPump(reporter.log_line, verbose=verbose))
            # JSON into descriptor 2 (the pipe), so the pump can filter and format it.
            configure_logging(
                level=cfg.logging.level, fmt="json", stream=_Descriptor2(), force=True
            )
        else:
            reporter = PlainReporter(cfg.trainer.steps)
            fmt = cfg.logging.format
            configure_logging(level=cfg.logging.level, fmt=fmt, stream=_CurrentStderr(), force=True)
            typer.echo(cfg.summary())
            typer.echo(f"run folder {run_dir}")
        _quiet_transformers()
        stack.enter_context(SignalRouting())
        reporter.start(cfg.cluster.name, done)
        try:
            outcome = asyncio.run(_supervise(cfg, run_dir, sync, reporter, resume_text))
        finally:
            reporter.stop()
    return _report(cfg, run_dir, outcome, resume_text)


def _report(cfg: ClusterConfig, run_dir: Path, outcome: Outcome, resume_text: str) -> int:
    from relax.control import read_metrics
    from relax.errors import RelaxError

    plots = _write_plots(run_dir)
    records = [r for r in read_metrics(run_dir) if "step" in r]
    step = max((int(r["step"]) for r in records), default=0)
    checkpoint = latest_checkpoint(run_dir, cfg)
    saved = f"; latest checkpoint {checkpoint}" if checkpoint else ""
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
        typer.echo(f"  what happened: relax logs --run-dir {run_dir} --level warning", err=True)
        if checkpoint:
            typer.echo(f"  latest checkpoint: {checkpoint}", err=True)
        typer.echo(f"  once the cause is fixed, {resume_text}", err=True)
        return 1
    if outcome.signals or outcome.cancelled:
        typer.echo(f"stopped at step {step} of {cfg.trainer.steps}{saved}{plots}", err=True)
        typer.echo(resume_text, err=True)
        return EXIT_INTERRUPTED
    if step < cfg.trainer.steps:  # a control "stop" (relax down)
        typer.echo(f"stopped on request at step {step} of {cfg.trainer.steps}{saved}{plots}")
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


# --------------------------------------------------------------------------- detached


def launch_detached(
    cfg: ClusterConfig,
    *,
    cluster_toml: Path,
    overrides: Sequence[str],
    run_dir: Path,
    resume: bool,
    start_timeout: float,
) -> int:
    """Start ``relax up`` again in a new session, output to ``RUN_DIR/up.log``; return once
    its control endpoint is up (``control.json`` naming it) or it died."""
    from relax.control import CONTROL_FILE

    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "relax.cli", "up", str(cluster_toml), "--run-dir", str(run_dir)]
    argv.append("--no-progress")
    if resume:
        argv.append("--resume")
    for item in overrides:
        argv += ["--set", item]
    log_path = run_dir / UP_LOG
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_path.open("ab") as log:
        log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(argv)}\n".encode())
        log.flush()
        child = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # no terminal: Ctrl-C here or a closed shell leave it be
            env=env,
        )
    (run_dir / UP_PID).write_text(f"{child.pid}\n")
    control = run_dir / CONTROL_FILE
    deadline = time.monotonic() + start_timeout
    while True:
        code = child.poll()
        if code is not None:
            typer.echo(
                f"the cluster exited (status {code}) before it was up; {log_path} ends:", err=True
            )
            for line in _tail(log_path, 25):
                typer.echo(f"  {line}", err=True)
            return 1
        if _names_pid(control, child.pid):
            break
        if time.monotonic() > deadline:
            typer.echo(
                f"the cluster (pid {child.pid}) is still starting after {start_timeout:g} s; "
                f"watch {log_path}",
                err=True,
            )
            break
        time.sleep(0.1)
    typer.echo(f'started cluster "{cfg.cluster.name}" in the background (pid {child.pid})')
    typer.echo(f"  run folder  {run_dir}")
    typer.echo(f"  output      {log_path}")
    typer.echo(f"  watch       relax status --run-dir {run_dir}")
    typer.echo(f"  logs        relax logs -f --run-dir {run_dir}")
    typer.echo(f"  stop        relax down --run-dir {run_dir}")
    return 0


def _names_pid(control: Path, pid: int) -> bool:
    try:
        return int(json.loads(control.read_text()).get("pid", -1)) == pid
    except (OSError, ValueError, AttributeError):
        return False


def _tail(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


# --------------------------------------------------------------------------- command


def _refuse_a_running_run(run_dir: Path) -> None:
    """Two clusters writing one run folder would corrupt it: exit 1 if one runs there."""
    from relax.cli._logs import cluster_running
    from relax.control import CONTROL_FILE

    if not cluster_running(run_dir):
        return
    pid = json.loads((run_dir / CONTROL_FILE).read_text()).get("pid")
    typer.echo(
        f"a cluster is already running in {run_dir} (pid {pid}): watch it with "
        f"`relax status --run-dir {run_dir}`, stop it with `relax down --run-dir {run_dir}`",
        err=True,
    )
    raise typer.Exit(1)


@app.command("up")
def up(
    cluster_toml: Annotated[
        Path, typer.Argument(metavar="CLUSTER_TOML", help="The cluster config.")
    ],
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set", metavar="KEY=VALUE", help="Override a key, e.g. --set trainer.steps=20."
        ),
    ] = None,
    run_dir: Annotated[
        Path | None, typer.Option(help="Run folder (default: cluster.run_dir/NAME-TIMESTAMP).")
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Continue the newest run of this cluster (or --run-dir): its checkpoint, bus "
            "logs, weights and dataset position.",
        ),
    ] = False,
    sync: Annotated[
        bool,
        typer.Option(
            "--sync",
            help="Run the same recipe as one synchronous loop in this process (no actors, no "
            "bus): the strictly on-policy reference a staleness-0 cluster run must equal.",
        ),
    ] = False,
    detach: Annotated[
        bool,
        typer.Option(
            "--detach",
            "-d",
            help="Run in the background (output in RUN_DIR/up.log); watch it with relax status "
            "and relax logs, stop it with relax down.",
        ),
    ] = False,
    progress: Annotated[
        bool | None,
        typer.Option(
            "--progress/--no-progress",
            help="Draw a progress bar (default: when stdout is a terminal) or print a line per step.",
            show_default=False,
        ),
    ] = None,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="With the progress bar, show info lines too (not only warnings).",
        ),
    ] = False,
    start_timeout: Annotated[
        float,
        typer.Option(help="With --detach: seconds to wait for the cluster to be up.", min=1),
    ] = 600.0,
) -> None:
    """Start the cluster described by CLUSTER_TOML and train until trainer.steps are done.

    Ctrl-C stops it cleanly (the trainer saves a checkpoint) and tells you how to resume.
    """
    overrides = list(overrides or ())
    try:
        cfg = load_or_exit(cluster_toml, overrides)
        preflight_or_exit(cfg, cluster_toml)
        if detach and sync:
            typer.echo("--sync runs in this process; it cannot be combined with --detach", err=True)
            raise typer.Exit(EXIT_INVALID)
        if resume:
            run_dir = run_dir or newest_run_of(Path(cfg.cluster.run_dir), cfg.cluster.name)
            if run_dir is None:
                typer.echo(
                    f"nothing to resume: no run of {cfg.cluster.name!r} in "
                    f"{cfg.cluster.run_dir}/; start one without --resume",
                    err=True,
                )
                raise typer.Exit(EXIT_INVALID)
            typer.echo(f"resuming {run_dir}")
        run_dir = run_dir or default_run_dir(cfg)
        _refuse_a_running_run(run_dir)
        if detach:
            code = launch_detached(
                cfg,
                cluster_toml=cluster_toml,
                overrides=overrides,
                run_dir=run_dir,
                resume=resume,
                start_timeout=start_timeout,
            )
        else:
            code = run_foreground(
                cfg,
                cluster_toml=cluster_toml,
                overrides=overrides,
                run_dir=run_dir,
                sync=sync,
                progress=progress,
                verbose=verbose,
            )
    except KeyboardInterrupt:  # before the event loop took over the signal
        typer.echo("\ninterrupted before the cluster started; nothing is running", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    if code:
        raise typer.Exit(code)
