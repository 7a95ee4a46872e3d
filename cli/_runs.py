"""Finding a run folder: `relax status`, `logs`, `down`, `plot` and `ckpt` default to the most
recent run under ``./runs`` (the default ``cluster.run_dir``) when ``--run-dir`` is not given.

``RunDirOption`` is that ``--run-dir`` option, declared once for every command that takes it
(``run_dir_option`` gives it another help text: ``relax up`` picks a new folder by default)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from relax.runfiles import CONTROL_FILE, RAY_FILE, read_control

DEFAULT_RUNS = Path("runs")
"""Where runs live unless a cluster.toml says otherwise (``cluster.run_dir``)."""


def run_dir_option(help: str = "The run folder (default: the newest run under ./runs).") -> Any:
    """The ``--run-dir`` option (a ``typer.Option``), with ``help`` as its help text."""
    return typer.Option("--run-dir", help=help)


RunDirOption = Annotated[Path | None, run_dir_option()]
"""``run_dir: RunDirOption = None``: the run folder a command works on (None: the newest)."""

RunDirArgument = Annotated[
    Path | None,
    typer.Argument(
        metavar="RUN_DIR",
        help="The run folder (default: the newest run under ./runs).",
        show_default=False,
    ),
]
"""The same, as the command's first argument (`relax plot RUN_DIR`, `relax replay RUN_DIR`)."""


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` looks like a run folder (a cluster wrote into it)."""
    return path.is_dir() and any(
        (path / name).exists()
        for name in (CONTROL_FILE, RAY_FILE, "metrics.jsonl", "model", "samples")
    )


def newest_run(runs: Path = DEFAULT_RUNS, name: str | None = None) -> Path | None:
    """The most recently started run folder under ``runs`` (of cluster ``name``), or None."""
    if not runs.is_dir():
        return None
    pattern = f"{name}-*" if name else "*"
    found = [p for p in runs.glob(pattern) if is_run_dir(p)]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def resolve_run_dir(run_dir: Path | None, *, runs: Path = DEFAULT_RUNS) -> Path:
    """``run_dir`` if given (and a run folder), else the newest run; exits 2 with a hint."""
    if run_dir is not None:
        if not is_run_dir(run_dir):
            typer.echo(f"{run_dir} is not a run folder (no metrics, model or bus logs)", err=True)
            raise typer.Exit(2)
        return run_dir
    found = newest_run(runs)
    if found is None:
        typer.echo(
            f"no run found under {runs}/: start one with `relax up CLUSTER_TOML`,"
            " or point at one with --run-dir DIR",
            err=True,
        )
        raise typer.Exit(2)
    return found


def process_alive(pid: object) -> bool:
    """Whether ``pid`` names a live process (one owned by someone else counts as alive)."""
    import os

    try:
        os.kill(int(pid), 0)  # type: ignore[call-overload]
    except (ProcessLookupError, ValueError, TypeError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


def cluster_running(run_dir: Path) -> bool:
    """Whether the run's cluster is alive (its ``control.json`` names a live pid)."""
    control = read_control(run_dir)
    return control is not None and process_alive(control.pid)


def run_outcome(run_dir: Path) -> tuple[str, bool]:
    """How the run of ``run_dir`` stands when no cluster answers there, from what the run
    folder recorded: ``(one line, ended)``. ``ended`` is False while the ``relax up`` that
    started it is still alive (it has not served its control endpoint yet, or is shutting
    down); otherwise the line says how far it got — finished, stopped early or died — with its
    last reward and, for ``relax up --detach`` runs, the last line ``up.log`` holds (the run's
    own report of how it ended)."""
    import json

    from relax.control import read_metrics

    info: dict = {}
    try:
        loaded = json.loads((run_dir / "run.json").read_text())
        info = loaded if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        pass
    control = read_control(run_dir)
    if control is not None and process_alive(control.pid):
        return f"the cluster (pid {control.pid}) is running but does not answer", False
    if control is None and info.get("pid") and process_alive(info["pid"]):
        return f"the cluster (pid {info['pid']}) is starting or stopping: not serving yet", False
    records = [r for r in read_metrics(run_dir, last=200) if isinstance(r.get("step"), int)]
    if not (records or info or control is not None):
        return f"no run has recorded anything in {run_dir} yet", True
    step = max((r["step"] for r in records), default=0)
    planned = info.get("steps")
    of = f" of {planned}" if isinstance(planned, int) else ""
    if control is not None:  # control.json left behind: its process did not get to remove it
        state = f"its process (pid {control.pid}) died at step {step}{of}"
    elif isinstance(planned, int) and step >= planned:
        state = f"finished all {planned} steps"
    elif records or isinstance(planned, int):
        state = f"stopped at step {step}{of}"
    else:
        state = "no step recorded"  # a run.json without steps: not written by this version
    applied = [r for r in records if r.get("applied") and "reward_mean" in r]
    if applied:
        state += f"; last mean reward {float(applied[-1]['reward_mean']):.3f}"
    last_line = _last_line(run_dir / "up.log")
    if last_line:
        state += f"; up.log ends: {last_line}"
    return f"the run in {run_dir} has ended ({state})", True


def _last_line(path: Path, block: int = 4096) -> str:
    """The last non-empty line of a (possibly long) text file, or ''."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - block))
            tail = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1] if lines else ""
