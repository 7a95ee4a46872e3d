"""`relax validate CLUSTER_TOML`: check a config file without starting anything."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from relax.cli._app import app
from relax.config import ClusterConfig
from relax.errors import ConfigError, ConfigIssue

EXIT_INVALID = 2
"""Exit status for an invalid (or unreadable) config; the same code Typer uses for usage errors."""


def _format_issue(source: str, issue: ConfigIssue) -> str:
    """``cluster.toml:12: rollout.replicas: expected ... (hint)``, like a compiler error."""
    where = f"{source}:{issue.line}" if issue.line is not None else source
    key = f" {issue.path}:" if issue.path else ""
    text = f"{where}:{key} {issue.message}"
    if issue.hint:
        text += f"\n    hint: {issue.hint}"
    return text


@app.command("validate")
def validate(
    cluster_toml: Annotated[
        Path, typer.Argument(metavar="CLUSTER_TOML", help="The cluster config file to check.")
    ],
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print the validated config, defaults filled in, as JSON."),
    ] = False,
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="KEY=VALUE",
            help="Override a key before validating, e.g. --set rollout.replicas=2 (repeatable).",
        ),
    ] = None,
) -> None:
    """Check CLUSTER_TOML and print a summary; on errors list every problem and exit 2.

    The same checks `relax up` runs before it starts anything: every key, the files the config
    points to, its import paths (they are imported), the secret it names, its fixed ports.
    Nothing is started and no run folder is made.
    """
    source = str(cluster_toml)
    config = load_or_exit(cluster_toml, overrides or ())
    if as_json:
        typer.echo(config.model_dump_json(indent=2))
    else:
        typer.echo(config.summary())
        typer.echo(f"{source} is valid.")


def load_or_exit(cluster_toml: Path, overrides: Sequence[str] = ()) -> ClusterConfig:
    """The validated config that passed the preflight (``relax.preflight.load_checked``), or
    every problem printed to stderr and exit code 2 (nothing starts, no run folder is made)."""
    from relax.preflight import load_checked

    source = str(cluster_toml)
    try:
        return load_checked(cluster_toml, overrides)
    except ConfigError as exc:
        origin = exc.source if exc.source == "overrides" else source
        for issue in exc.issues:
            typer.echo(_format_issue(origin, issue), err=True)
        count = len(exc.issues)
        typer.echo(
            f"{source} is invalid: {count} problem{'s' if count != 1 else ''}; nothing was started.",
            err=True,
        )
        raise typer.Exit(EXIT_INVALID) from None
