"""Structured logging, configured once per process.

Readable console lines when stderr is a terminal, JSON lines otherwise (CI, log files, child
processes whose output is collected). Every line carries the process id and, inside an actor,
the actor's id: the actor runtime binds it with :func:`bind_actor` in the actor's own task
context, so concurrent actors in one process never mix up their ids.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Literal, TextIO

import structlog

Format = Literal["auto", "console", "json"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_LEVELS |= {"error": logging.ERROR}
_configured = False

# Child processes inherit the parent's choice through these variables.
ENV_LEVEL = "RELAX_LOG_LEVEL"
ENV_FORMAT = "RELAX_LOG_FORMAT"


def _add_pid(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    event.setdefault("pid", os.getpid())
    return event


def configure_logging(
    level: str | None = None,
    fmt: Format | None = None,
    *,
    stream: TextIO | None = None,
    force: bool = False,
) -> None:
    """Configure structlog for this process. Later calls are no-ops unless ``force``."""
    global _configured
    if _configured and not force:
        return
    level = (level or os.environ.get(ENV_LEVEL) or "info").lower()
    fmt = fmt or os.environ.get(ENV_FORMAT) or "auto"  # type: ignore[assignment]
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=stream.isatty())
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_pid,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    os.environ[ENV_LEVEL] = level
    os.environ[ENV_FORMAT] = fmt
    _configured = True


def get_logger(name: str | None = None, **bound: Any) -> Any:
    """A lazy structlog logger: safe at import time, it uses whatever configuration is in
    force when it first logs (the CLI, a child host or a root supervisor configures it)."""
    log = structlog.get_logger(name) if name else structlog.get_logger()
    return log.bind(**bound) if bound else log


def bind_actor(actor_id: str) -> None:
    """Tag every log line of the current task (and tasks it starts) with ``actor_id``."""
    structlog.contextvars.bind_contextvars(actor=actor_id)
