"""The Typer application object every `relax` sub-command registers on."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="relax",
    help="Relax: asynchronous RL post-training on a supervised actor tree.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_show_locals=False,
)


@app.callback()
def _root() -> None:
    """Relax: asynchronous RL post-training on a supervised actor tree."""
