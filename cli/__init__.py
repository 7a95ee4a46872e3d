"""The `relax` command line (installed as ``relax.cli``)."""

from __future__ import annotations

from relax.cli import (  # noqa: F401  (each module registers its commands)
    _ckpt,
    _demo,
    _down,
    _init,
    _logs,
    _plot,
    _replay,
    _scale,
    _set,
    _status,
    _up,
    _validate,
)
from relax.cli._app import app


def main() -> None:
    """Entry point of the `relax` console script.

    The working folder is not put on ``sys.path``: ``relax validate`` / ``relax up`` add only
    the config's own folder, after the standard library and site-packages.
    """
    app()


__all__ = ["app", "main"]
