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

This module holds the command: its options and the order of things (the config and the
preflight — exactly what ``relax validate`` checks, ``relax.preflight`` — then which run
folder, then the foreground or a detached run). The parts live beside it:

- ``_up_run_folder``: ``run.json``, the run folder's name, ``--resume``'s pick, the resume hint;
- ``_up_foreground``: running the tree here and reporting how it ended;
- ``_up_progress``: the progress bar or plain step lines, fed by ``metrics.jsonl``;
- ``_up_stderr``: log lines routed above the progress bar;
- ``_up_signals``: Ctrl-C levels, and SIGINT kept from the actors' processes;
- ``_up_detach``: ``--detach``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from relax.cli._app import app
from relax.cli._runs import cluster_running, run_dir_option
from relax.cli._up_detach import launch_detached
from relax.cli._up_foreground import run_foreground
from relax.cli._up_run_folder import default_run_dir, newest_run_of
from relax.cli._up_signals import EXIT_INTERRUPTED
from relax.cli._validate import EXIT_INVALID, load_or_exit


def _refuse_a_running_run(run_dir: Path) -> None:
    """Two clusters writing one run folder would corrupt it: exit 1 if one runs there."""
    from relax.runfiles import read_control

    if not cluster_running(run_dir):
        return
    control = read_control(run_dir)
    pid = control.pid if control is not None else None
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
        Path | None, run_dir_option("Run folder (default: cluster.run_dir/NAME-TIMESTAMP).")
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
    # A background `relax up --detach` gets its secret overrides from the environment.
    from relax.cli._up_detach import ENV_SECRET_OVERRIDES

    overrides += json.loads(os.environ.pop(ENV_SECRET_OVERRIDES, "[]"))
    # Everything the run writes (bus segments, logs, endpoint files, checkpoints) is for its
    # owner only; children inherit the mask.
    umask = os.umask(0o077)
    try:
        _up(
            cluster_toml,
            overrides,
            run_dir,
            resume,
            sync,
            detach,
            progress,
            verbose,
            start_timeout,
        )
    finally:
        os.umask(umask)


def _up(
    cluster_toml: Path,
    overrides: list[str],
    run_dir: Path | None,
    resume: bool,
    sync: bool,
    detach: bool,
    progress: bool | None,
    verbose: bool,
    start_timeout: float,
) -> None:
    try:
        cfg = load_or_exit(cluster_toml, overrides)
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
