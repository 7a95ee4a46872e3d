"""The `relax` command line (installed as ``relax.cli``)."""

from __future__ import annotations

from relax.cli import (  # noqa: F401  (each module registers its commands)
    _ckpt,
    _demo,
    _down,
    _init,
    _logs,
    _plot,
    _status,
    _up,
    _validate,
)
from relax.cli._app import app


def main() -> None:
    """Entry point of the `relax` console script."""
    _importable_working_directory()
    app()


def _importable_working_directory() -> None:
    """Modules of the folder ``relax`` runs in are importable, as with ``python -m``: a
    config's ``program``, ``env``, ``generator`` or reward ``target`` may name the user's own
    code (``"my_agents.solver:solve"``). Children started as processes inherit it."""
    import os
    import sys

    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if cwd not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([cwd, *filter(None, paths)])


__all__ = ["app", "main"]
