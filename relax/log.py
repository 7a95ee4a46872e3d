"""Structured logging, configured once per process.

Readable console lines when stderr is a terminal, JSON lines otherwise (CI, log files, child
processes whose output is collected). Every line carries the process id and, inside an actor,
the actor's id: the actor runtime binds it with :func:`bind_actor` in the actor's own task
context, so concurrent actors in one process never mix up their ids.

Inside a run, every process also writes each line as JSON to one file per actor:
``RUN_DIR/logs/<actor-id>.jsonl`` (lines without an actor go to ``cluster.jsonl``), one object
per line with at least ``event``, ``level``, ``timestamp``, ``pid`` and (but in
``cluster.jsonl``) ``actor``; a line's level filter is the console's. The cluster
turns this on with :func:`log_files` before its tree starts; child processes inherit the folder
through ``RELAX_LOG_DIR``. Each line is one ``write`` to a file opened for appending, so the
processes of a gang (or an old and a new incarnation) can share a file without tearing lines,
and a child that leaves with ``os._exit`` loses nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, TextIO

import structlog

Format = Literal["auto", "console", "json"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_LEVELS |= {"error": logging.ERROR}
_configured = False

# Child processes inherit the parent's choice through these variables.
ENV_LEVEL = "RELAX_LOG_LEVEL"
ENV_FORMAT = "RELAX_LOG_FORMAT"
ENV_LOG_DIR = "RELAX_LOG_DIR"
ENV_CONSOLE = "RELAX_LOG_CONSOLE"
"""``0``: no console lines (log files only) — an embedded run keeps its host's terminal clean."""
"""The folder of per-actor JSON log files; child processes inherit it."""

LOGS_DIR = "logs"
"""The per-actor log files of a run live in ``RUN_DIR/logs/``."""
CLUSTER_LOG = "cluster"
"""Lines logged outside any actor go to ``RUN_DIR/logs/cluster.jsonl``."""

# The log folder of this task's run; the environment variable is the fallback (child
# processes, threads that did not inherit the context).
_log_dir: contextvars.ContextVar[str | None] = contextvars.ContextVar("relax_log_dir", default=None)


def _add_pid(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    event.setdefault("pid", os.getpid())
    return event


def log_file(log_dir: str | Path, actor: str | None) -> Path:
    """The file that holds ``actor``'s lines (``None``: lines outside any actor) in ``log_dir``.

    Actor ids are used as they are; characters that cannot be in a file name (``/`` of a
    nested path, spaces, ...) become ``_``.
    """
    name = re.sub(r"[^A-Za-z0-9._-]", "_", actor) if actor else CLUSTER_LOG
    if name.strip(".") == "":
        name = name.replace(".", "_")
    return Path(log_dir) / f"{name}.jsonl"


def _json_default(value: Any) -> Any:
    return repr(value) if not isinstance(value, (Path, BaseException)) else str(value)


class _LogFiles:
    """The structlog processor that appends every event, as JSON, to its actor's file."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()  # actors log from worker threads too

    def __call__(self, _: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
        folder = _log_dir.get() or os.environ.get(ENV_LOG_DIR)
        if folder:
            with contextlib.suppress(Exception):  # logging must never break the logger
                self._write(log_file(folder, event.get("actor")), event)
        return event

    def _write(self, path: Path, event: dict[str, Any]) -> None:
        line = (json.dumps(event, default=_json_default) + "\n").encode()
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                path.parent.mkdir(parents=True, exist_ok=True)
                flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
                fd = self._fds[path] = os.open(path, flags, 0o644)
            try:
                os.write(fd, line)
            except OSError:
                self._fds.pop(path, None)
                os.close(fd)
                raise

    def close(self, folder: str | Path | None = None) -> None:
        """Close the files (of ``folder`` only, if given); later lines reopen them."""
        with self._lock:
            for path in list(self._fds):
                if folder is None or path.parent == Path(folder):
                    with contextlib.suppress(OSError):
                        os.close(self._fds.pop(path))


_files = _LogFiles()


@contextlib.contextmanager
def log_files(log_dir: str | Path | None) -> Iterator[Path | None]:
    """Write every log line of this task (and the tasks it starts) and of the child processes
    started meanwhile to per-actor files in ``log_dir`` (see the module docstring); ``None``
    turns it off for this task. The environment is restored on the way out."""
    folder = str(Path(log_dir).resolve()) if log_dir is not None else None
    if folder is not None:
        Path(folder).mkdir(parents=True, exist_ok=True)
    token = _log_dir.set(folder)
    entry = object()
    if not _env_contexts:  # the first of the active contexts: remember what was there
        _env_before[:] = [ENV_LOG_DIR in os.environ, os.environ.get(ENV_LOG_DIR)]
    _env_contexts.append((entry, folder))
    _set_env(folder)
    try:
        yield None if folder is None else Path(folder)
    finally:
        _log_dir.reset(token)
        # Contexts of concurrent runs (two clusters in one event loop) may end in any order:
        # the variable names the newest context still active, or goes back to what it was.
        _env_contexts[:] = [c for c in _env_contexts if c[0] is not entry]
        if _env_contexts:
            _set_env(_env_contexts[-1][1])
        else:
            had, before = _env_before
            _set_env(before or "" if had else None)
        if folder is not None:
            _files.close(folder)


_env_contexts: list[tuple[object, str | None]] = []
"""The ``log_files`` contexts active in this process, oldest first."""
_env_before: list[Any] = [False, None]
"""Whether ``RELAX_LOG_DIR`` was set, and to what, before the oldest active context."""


def _set_env(folder: str | None) -> None:
    if folder is None:
        os.environ.pop(ENV_LOG_DIR, None)
    else:
        os.environ[ENV_LOG_DIR] = folder


def child_log_dir() -> str | None:
    """The log folder a child process started by this task should write to: this task's
    ``log_files`` context's (the environment variable may name a concurrent run's)."""
    return _log_dir.get() or os.environ.get(ENV_LOG_DIR)


class CurrentStderr:
    """``sys.stderr`` as it is when a line is written, not when logging was configured: a host
    that swaps ``sys.stderr`` later (a notebook, a test's capture, an embedding app) still gets
    the lines, and no line goes to a stream someone has since closed."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


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
    if stream is None and os.environ.get(ENV_CONSOLE) == "0":
        stream = open(os.devnull, "w")  # noqa: SIM115 - the process's logger, for good
    stream = stream or CurrentStderr()
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
            _files,
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
