"""`relax status`: what a running cluster is doing — a live TUI, or one JSON snapshot.

``relax status --json`` prints the control endpoint's ``status`` reply (the supervisor tree,
both buses' statistics, the trainer's version and its recent metrics) and exits; scripts and
tests read that. Without ``--json`` it opens the live dashboard of ``relax.cli._tui`` on a
terminal, and prints one plain-text snapshot (``_status_text``) when stdout is not one: a
dashboard's escape codes in a pipe or a CI log help nobody. A run whose cluster has ended is
reported from what its run folder recorded (``_runs.run_outcome``), never waited for.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from relax.cli._app import app
from relax.cli._runs import RunDirOption, resolve_run_dir

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
    from relax.observe import last_eval

    snapshot = await control_request(run_dir, {"op": "status", "history": history}, timeout=timeout)
    # The newest evaluation ([eval]), from the run folder the cluster writes it to.
    snapshot["eval"] = last_eval(run_dir)
    return snapshot


@app.command("status")
def status(
    run_dir: RunDirOption = None,
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

    On a terminal it opens the live dashboard, which polls every --interval seconds and keeps
    retrying while the cluster is down (a restarting or resumed cluster reappears). When stdout
    is not a terminal (a pipe, a file, CI) it prints one plain-text snapshot and exits. A run
    whose cluster has ended is reported (finished, stopped early or died, and its last
    reward) instead of waited for. Exit status: 0 when a cluster answered, 1 when none does.

    Keys: r restarts the selected actor (after a y/n question), p pauses/resumes generation,
    + and - add or remove a rollout replica, s sets the staleness bound, q quits.
    """
    from relax.cli._runs import run_outcome
    from relax.control import ClusterNotRunning
    from relax.errors import RelaxError

    run_dir = resolve_run_dir(run_dir)
    dashboard = not as_json and sys.stdout.isatty()
    try:
        snapshot = asyncio.run(fetch_status(run_dir, history=history))
    except ClusterNotRunning as exc:
        outcome, ended = run_outcome(run_dir)
        if dashboard and not ended:  # starting, or alive but not answering yet: watch it
            _dashboard(run_dir, interval, history)
            return
        if as_json:  # stdout stays JSON or nothing
            typer.echo(f"{not_running_message(run_dir, exc)}\n  {outcome}", err=True)
        else:
            typer.echo(outcome)
            typer.echo(not_running_message(run_dir, exc), err=True)
        raise typer.Exit(EXIT_NOT_RUNNING) from None
    except RelaxError as exc:  # alive but not answering (hung, or stopping right now)
        if dashboard:
            _dashboard(run_dir, interval, history)
            return
        typer.echo(f"the cluster in {run_dir} did not answer: {exc}", err=True)
        raise typer.Exit(EXIT_NOT_RUNNING) from None
    if dashboard:
        _dashboard(run_dir, interval, history)
    elif as_json:
        typer.echo(json.dumps(snapshot, indent=2, default=str))
    else:
        from relax.cli._status_text import plain_snapshot

        typer.echo(plain_snapshot(snapshot))


def _dashboard(run_dir: Path, interval: float, history: int) -> None:
    from relax.cli._tui import StatusApp

    StatusApp(run_dir, interval=interval, history=history).run()
