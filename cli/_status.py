"""`relax status`: what a running cluster is doing — a live TUI, or one JSON snapshot.

``relax status --json`` prints the control endpoint's ``status`` reply (the supervisor tree,
both buses' statistics, the trainer's version and its recent metrics) and exits; scripts and
tests read that. Without ``--json`` it opens the live dashboard of ``relax.cli._tui``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from relax.cli._app import app
from relax.cli._runs import resolve_run_dir

EXIT_NOT_RUNNING = 1
"""Exit status when no live cluster answers for the run folder."""


def not_running_message(run_dir: Path, reason: object) -> str:
    """The one-line explanation printed when no cluster answers (shared with the TUI)."""
    return (
        f"no running cluster in {run_dir}: start one with `relax up CLUSTER_TOML` (or continue "
        f"this run with `relax up CLUSTER_TOML --resume --run-dir {run_dir}`)\n  ({reason})"
    )


async def fetch_status(run_dir: Path, *, history: int, timeout: float = 30) -> dict[str, Any]:
    """One ``status`` reply of the cluster running in ``run_dir``."""
    from relax.control import control_request

    return await control_request(run_dir, {"op": "status", "history": history}, timeout=timeout)


@app.command("status")
def status(
    run_dir: Annotated[
        Path | None,
        typer.Option(help="The run folder (default: the newest run under ./runs)."),
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print one status snapshot as JSON (tree, bus statistics, trainer, recent "
            "metrics) and exit, instead of opening the live dashboard.",
        ),
    ] = False,
    interval: Annotated[
        float,
        typer.Option(min=0.1, help="Seconds between refreshes of the live dashboard."),
    ] = 1.0,
    history: Annotated[
        int,
        typer.Option(min=1, help="How many recent metrics.jsonl records to include."),
    ] = 100,
) -> None:
    """Show what the cluster of a run is doing: actors, buses, trainer.

    The dashboard polls every --interval seconds and keeps retrying while the cluster is down.

    Keys: r restarts the selected actor, p pauses/resumes generation, q quits.
    """
    from relax.control import ClusterNotRunning
    from relax.errors import RelaxError

    run_dir = resolve_run_dir(run_dir)
    if not as_json:
        from relax.cli._tui import StatusApp

        StatusApp(run_dir, interval=interval, history=history).run()
        return
    try:
        snapshot = asyncio.run(fetch_status(run_dir, history=history))
    except ClusterNotRunning as exc:
        typer.echo(not_running_message(run_dir, exc), err=True)
        raise typer.Exit(EXIT_NOT_RUNNING) from None
    except RelaxError as exc:  # alive but not answering (hung, or stopping right now)
        typer.echo(f"the cluster in {run_dir} did not answer: {exc}", err=True)
        raise typer.Exit(EXIT_NOT_RUNNING) from None
    typer.echo(json.dumps(snapshot, indent=2, default=str))
