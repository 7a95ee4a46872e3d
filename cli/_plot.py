"""`relax plot`: PNG charts of a run's metrics (reward, loss, KL, entropy, staleness, step time)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from relax.cli._app import app
from relax.cli._runs import RunDirArgument, resolve_run_dir


@app.command("plot")
def plot(
    run_dir: RunDirArgument = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Where to write the PNGs (default: RUN_DIR/plots)."),
    ] = None,
    compare: Annotated[
        list[Path] | None,
        typer.Option(
            "--compare",
            metavar="FOLDER",
            help="Another run or replay folder to draw dashed on the same charts (repeatable), "
            "e.g. RUN_DIR/replays/replay-1 from `relax replay --set`.",
        ),
    ] = None,
) -> None:
    """Draw PNG charts of a run's metrics: reward, loss, KL, entropy, staleness, step time.

    Reads RUN_DIR/metrics.jsonl; KL, entropy and per-phase step times are drawn when logged.
    Works on a finished run and on one still running (it plots what is there so far).
    Needs matplotlib: pip install 'relax-rl[plot]'.
    """
    from relax.plot import PLOTS_DIR, PlotError, write_plots

    run = resolve_run_dir(run_dir)
    target = out if out is not None else run / PLOTS_DIR
    try:
        written = write_plots(run, target, compare=compare or ())
    except PlotError as exc:
        typer.echo(f"cannot plot {run}: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"wrote {len(written)} plots to {target}/: " + ", ".join(p.name for p in written))
