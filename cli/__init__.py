"""The `relax` command line (installed as ``relax.cli``)."""

from __future__ import annotations

from relax.cli import _demo, _up, _validate  # noqa: F401  (each module registers its commands)
from relax.cli._app import app


def main() -> None:
    """Entry point of the `relax` console script."""
    app()


__all__ = ["app", "main"]
