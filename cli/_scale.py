"""`relax scale ROLE N`: add or remove replicas of a role in a running cluster.

What can be scaled: ``rollout``. Added replicas (``rollout-<i>``, the lowest free indices)
start like the first ones: each loads the current weights before it takes a prompt and joins
the weight plane at the next version. Removed ones (the newest first) are drained: paused, so
the round in flight is put and its prompts acked, then stopped and removed from the tree.
Nothing is lost either way: a replica that does not get idle within ``--drain-timeout`` is
stopped anyway, and the prompts it held are redone when their lease expires.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from relax.cli._app import app
from relax.cli._runs import RunDirOption, resolve_run_dir

SCALABLE = ("rollout",)


@app.command("scale")
def scale_command(
    role: Annotated[str, typer.Argument(help="The role to resize: rollout.")],
    replicas: Annotated[int, typer.Argument(help="How many replicas should run (1 or more).")],
    drain_timeout: Annotated[
        float,
        typer.Option(help="Seconds a removed replica gets to finish its round before it stops."),
    ] = 120.0,
    run_dir: RunDirOption = None,
) -> None:
    """Resize a role of the running cluster (rollout replicas) without stopping it."""
    from relax.cli._status import EXIT_NOT_RUNNING, not_running_message
    from relax.control import MAX_REPLICAS, ClusterNotRunning, control_request
    from relax.errors import RelaxError

    if role not in SCALABLE:
        typer.echo(f"cannot scale {role!r} live; what can be: {', '.join(SCALABLE)}", err=True)
        raise typer.Exit(2)
    if not 1 <= replicas <= MAX_REPLICAS:
        typer.echo(
            f"replicas must be between 1 and {MAX_REPLICAS}, got {replicas}"
            " (to stop generating for a while, pause: key p in relax status)",
            err=True,
        )
        raise typer.Exit(2)
    if drain_timeout <= 0:
        typer.echo(f"--drain-timeout must be > 0, got {drain_timeout}", err=True)
        raise typer.Exit(2)
    run_dir = resolve_run_dir(run_dir)
    request = {"op": "scale", "role": role, "replicas": replicas, "drain_timeout": drain_timeout}
    # Each removed replica may take the whole drain timeout, each added one a model load.
    timeout = 120.0 + drain_timeout * 2 + 60.0 * replicas
    try:
        reply = asyncio.run(control_request(run_dir, request, timeout=timeout))
    except ClusterNotRunning as exc:
        typer.echo(not_running_message(run_dir, exc), err=True)
        raise typer.Exit(EXIT_NOT_RUNNING) from None
    except (RelaxError, ValueError) as exc:
        typer.echo(f"the cluster in {run_dir} refused it: {exc}", err=True)
        raise typer.Exit(EXIT_NOT_RUNNING) from None
    for child in reply["added"]:
        typer.echo(f"added {child}")
    for child, drained in reply["drained"].items():
        typer.echo(f"removed {child}" + ("" if drained else " (not idle in time; stopped anyway)"))
    typer.echo(f"{role}: {reply['before']} -> {reply['replicas']} replicas")
