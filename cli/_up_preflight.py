"""Pre-flight checks of `relax up`: the files a config points at (model, tokenizer, reference
and critic folders, the data file) must exist before anything starts or any run folder is
made, so that a typo costs a message rather than a half-started cluster."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from relax.cli._validate import EXIT_INVALID, _format_issue

if TYPE_CHECKING:
    from relax.config import ClusterConfig
    from relax.errors import ConfigIssue


def preflight(cfg: ClusterConfig) -> list[ConfigIssue]:
    """Files the config points to that are missing: found before anything starts (or any run
    folder is made), as config issues."""
    from relax.errors import ConfigIssue

    issues: list[ConfigIssue] = []

    def model_folder(key: str, value: str | None, what: str) -> None:
        if value is None:
            return
        path = Path(value).expanduser()
        if not (path / "config.json").is_file():
            reason = "does not exist" if not path.exists() else "has no config.json"
            issues.append(
                ConfigIssue(
                    key,
                    f"{str(value)!r} {reason}: it must be a local Hugging Face model folder",
                    hint=f"point {key} at a folder holding config.json and the {what} weights"
                    + (
                        ", or use a [model.init] table for a tiny model"
                        if key == "model.path"
                        else ""
                    ),
                )
            )

    model_folder("model.path", cfg.model.path, "model")
    tokenizer = cfg.model.tokenizer
    if tokenizer not in (None, "byte") and not Path(tokenizer).expanduser().is_dir():
        issues.append(
            ConfigIssue(
                "model.tokenizer",
                f"tokenizer folder {tokenizer!r} does not exist",
                hint='set it to a tokenizer folder, "byte", or remove it to use the model\'s',
            )
        )
    if cfg.reference.enabled:
        model_folder("reference.model_path", cfg.reference.model_path, "reference")
    if cfg.critic.enabled:
        model_folder("critic.model_path", cfg.critic.model_path, "critic")
    if cfg.data.path is not None and not Path(cfg.data.path).expanduser().is_file():
        issues.append(
            ConfigIssue(
                "data.path",
                f"no such file {cfg.data.path!r} (relative paths start from {Path.cwd()})",
                hint="fix the path, or remove it to use the built-in arithmetic task",
            )
        )
    return issues


def preflight_or_exit(cfg: ClusterConfig, cluster_toml: Path) -> None:
    """Print each missing file as ``relax validate`` prints an issue, and exit 2 if any."""
    issues = preflight(cfg)
    if not issues:
        return
    for issue in issues:
        typer.echo(_format_issue(str(cluster_toml), issue), err=True)
    count = len(issues)
    typer.echo(
        f"{cluster_toml}: {count} missing file{'s' if count != 1 else ''}; nothing was started.",
        err=True,
    )
    raise typer.Exit(EXIT_INVALID)
