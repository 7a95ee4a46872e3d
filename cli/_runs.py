"""Finding a run folder: `relax status`, `logs`, `down`, `plot` and `ckpt` default to the most
recent run under ``./runs`` (the default ``cluster.run_dir``) when ``--run-dir`` is not given."""

from __future__ import annotations

from pathlib import Path

import typer

DEFAULT_RUNS = Path("runs")
"""Where runs live unless a cluster.toml says otherwise (``cluster.run_dir``)."""


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` looks like a run folder (a cluster wrote into it)."""
    return path.is_dir() and any(
        (path / name).exists() for name in ("control.json", "metrics.jsonl", "model", "samples")
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
