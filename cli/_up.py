"""`relax up`: validate a cluster.toml, run the whole supervisor tree, report the run."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer

from relax.cli._app import app
from relax.cli._validate import load_or_exit


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
) -> None:
    """Start the cluster described by CLUSTER_TOML and train until trainer.steps are done."""
    from relax import cluster
    from relax.errors import RelaxError
    from relax.log import configure_logging

    cfg = load_or_exit(cluster_toml, overrides or ())
    configure_logging(level=cfg.logging.level, fmt=cfg.logging.format)
    _quiet_transformers()
    typer.echo(cfg.summary())
    if resume:
        run_dir = run_dir or _newest_run(Path(cfg.cluster.run_dir), cfg.cluster.name)
        typer.echo(f"resuming {run_dir}")
    try:
        if sync:
            from relax.sync import run_sync

            layout = asyncio.run(run_sync(cfg, run_dir))
        else:
            layout = asyncio.run(cluster.run(cfg, run_dir))
    except RelaxError as exc:
        typer.echo(f"the cluster stopped: {exc}", err=True)
        raise typer.Exit(1) from None
    steps = [
        json.loads(line) for line in (layout.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    applied = [s for s in steps if s.get("applied")]
    if applied:
        k = max(1, len(applied) // 4)
        first = sum(s.get("reward_mean", 0.0) for s in applied[:k]) / k
        last = sum(s.get("reward_mean", 0.0) for s in applied[-k:]) / k
        typer.echo(
            f"{len(applied)} steps ({len(steps) - len(applied)} skipped); mean reward "
            f"{first:.3f} over the first {k} → {last:.3f} over the last {k}; run folder {layout.run_dir}"
        )


def _quiet_transformers() -> None:
    # Loading tiny models prints progress bars per process; they drown the run's own output.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _newest_run(runs: Path, name: str) -> Path:
    found = sorted(p for p in runs.glob(f"{name}-*") if p.is_dir()) if runs.exists() else []
    if not found:
        typer.echo(
            f"nothing to resume: no run of {name!r} in {runs}/; start one without --resume",
            err=True,
        )
        raise typer.Exit(2)
    return found[-1]
