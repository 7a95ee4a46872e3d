"""`relax set KEY VALUE`: change a live knob of a running cluster through its control endpoint.

What can be set: ``staleness`` (``k`` versions, 0 = strict on-policy, or ``inf``). The bus logs
the change (a restarted bus keeps it), admissions follow it at once, and rows already queued
for the trainer that the new bound makes too stale are dropped with the reason ``"stale"``,
never trained. Each metrics record says the bound in force when its batch was taken
(``staleness_bound``) and how far behind its rows were (``lag_hist``).
"""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from relax.cli._app import app
from relax.cli._runs import RunDirOption, resolve_run_dir

SETTABLE = ("staleness",)


@app.command("set")
def set_command(
    key: Annotated[str, typer.Argument(help="What to change: staleness.")],
    value: Annotated[str, typer.Argument(help='The new value (staleness: 0, 1, 2, ... or "inf").')],
    run_dir: RunDirOption = None,
) -> None:
    """Change a setting of the running cluster without stopping it (staleness so far)."""
    from relax.cli._status import EXIT_NOT_RUNNING, not_running_message
    from relax.control import ClusterNotRunning, control_request
    from relax.errors import RelaxError
    from relax.schema import Staleness

    if key not in SETTABLE:
        typer.echo(f"cannot set {key!r} live; what can be: {', '.join(SETTABLE)}", err=True)
        raise typer.Exit(2)
    try:
        bound = Staleness.parse(int(value) if value.lstrip("-").isdigit() else value)
    except ValueError as exc:
        typer.echo(f"{key}: {exc}", err=True)
        raise typer.Exit(2) from None
    run_dir = resolve_run_dir(run_dir)
    request = {"op": "set", "key": key, "value": bound.wire}
    try:
        reply = asyncio.run(control_request(run_dir, request))
    except ClusterNotRunning as exc:
        typer.echo(not_running_message(run_dir, exc), err=True)
        raise typer.Exit(EXIT_NOT_RUNNING) from None
    except RelaxError as exc:
        typer.echo(f"the cluster in {run_dir} refused it: {exc}", err=True)
        raise typer.Exit(EXIT_NOT_RUNNING) from None
    typer.echo(f"{key}: {reply['before']} -> {reply[key]}")
