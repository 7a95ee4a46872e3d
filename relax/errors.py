"""Relax's exception vocabulary.

One root, a shallow tree, and names that say what the caller does next:

- ``ConfigError``      fix the config file; nothing was started.
- ``StartFailed``      an actor could not start; read the cause and fix the code or config.
- ``ActorDead``        the actor you talked to is gone; the call may or may not have run.
                       Retry (a supervisor restarts it) or give up.
- ``CallTimeout``      no answer in time; the actor may still be working on it.
- ``RemoteError``      the handler raised on the other side of a process boundary with an
                       exception type we do not rebuild locally; read ``remote_type`` and
                       ``remote_traceback``.
- ``SupervisorGaveUp`` a supervisor exceeded its restart intensity and stopped its subtree.
- ``TransportError``   bytes could not be moved or decoded; ``PeerGone`` (reconnect),
                       ``AuthFailed`` (fix the shared secret), ``MessageTooLarge`` (split it).
- ``BusError``         the TransferQueue refused an operation; ``LeaseExpired`` (drop the work,
                       the rows were handed to someone else).

Errors from libraries we sit on (pynng, msgpack, pydantic) are mapped into this tree at the
edge, so callers catch ``RelaxError`` and never a third party's type.
"""

from __future__ import annotations

import builtins
import sys
import traceback
from dataclasses import dataclass
from typing import Any


class RelaxError(Exception):
    """Root of every error Relax raises on purpose."""


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a config file: where it is and what to do about it."""

    path: str
    """Dotted key path, e.g. ``rollout.replicas`` or ``actors[1].id``; empty for the whole file."""
    message: str
    line: int | None = None
    """1-based line in the TOML file, where one can be found."""
    hint: str | None = None
    """A suggestion such as ``did you mean 'replicas'?``."""

    def __str__(self) -> str:
        where = self.path or "<file>"
        if self.line is not None:
            where += f" (line {self.line})"
        text = f"{where}: {self.message}"
        if self.hint:
            text += f" ({self.hint})"
        return text


class ConfigError(RelaxError, ValueError):
    """The configuration is invalid. Nothing was started; fix the listed keys."""

    def __init__(self, issues: list[ConfigIssue] | str, *, source: str | None = None) -> None:
        if isinstance(issues, str):
            issues = [ConfigIssue(path="", message=issues)]
        self.issues: list[ConfigIssue] = list(issues)
        self.source = source
        head = f"{source}: " if source else ""
        n = len(self.issues)
        lines = [f"{head}{n} problem{'s' if n != 1 else ''} in the configuration"]
        lines += [f"  - {issue}" for issue in self.issues]
        super().__init__("\n".join(lines))


# --------------------------------------------------------------------------- actors


class StartFailed(RelaxError):
    """An actor (or a supervisor's child) failed to start; the cause is attached."""

    def __init__(self, message: str, *, actor_id: str | None = None, cause: object = None) -> None:
        super().__init__(message)
        self.actor_id = actor_id
        self.cause = cause


class ActorDead(RelaxError):
    """The actor died (or was stopped) before answering. Retry later or give up."""

    def __init__(self, message: str, *, actor_id: str | None = None, cause: object = None) -> None:
        super().__init__(message)
        self.actor_id = actor_id
        self.cause = cause


class CallTimeout(RelaxError, TimeoutError):
    """No reply within the call's timeout; the actor may still be working on the request."""


class RemoteError(RelaxError):
    """A handler in another process raised an exception type that is not rebuilt locally."""

    def __init__(self, message: str, *, remote_type: str, remote_traceback: str = "") -> None:
        super().__init__(f"{remote_type}: {message}")
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


class SupervisorGaveUp(RelaxError):
    """A supervisor exceeded its restart intensity, stopped its children and itself."""

    def __init__(self, message: str, *, supervisor_id: str | None = None) -> None:
        super().__init__(message)
        self.supervisor_id = supervisor_id


# --------------------------------------------------------------------------- transport


class TransportError(RelaxError):
    """Bytes could not be moved or decoded (corrupt frame, closed socket, unknown format)."""


class PeerGone(TransportError):
    """The other end disappeared; reconnect and resend what was not acknowledged."""


class AuthFailed(TransportError):
    """The peer did not prove it holds the cluster's shared secret; check the secret."""


class MessageTooLarge(TransportError):
    """The message exceeds the configured maximum; split it or raise the limit."""


# --------------------------------------------------------------------------- bus


class BusError(RelaxError):
    """The TransferQueue refused an operation."""


class LeaseExpired(BusError):
    """The lease ran out; its rows went back to the queue. Drop the work you did on them."""


# --------------------------------------------------------------------------- across the wire


def error_to_dict(exc: BaseException) -> dict[str, Any]:
    """An exception as wire-safe data: type, module, message and formatted traceback."""
    return {
        "type": type(exc).__qualname__,
        "module": type(exc).__module__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    }


def error_from_dict(data: Any) -> BaseException:
    """Rebuild an exception sent by :func:`error_to_dict`.

    Only builtin exception types and Relax's own are rebuilt, by name from a fixed allow-list
    (never by importing what the peer names); anything else becomes ``RemoteError``. The remote
    traceback is attached as a note so it shows when the error is printed.
    """
    data = data if isinstance(data, dict) else {}
    name, module = str(data.get("type")), str(data.get("module"))
    message, tb = str(data.get("message", "")), str(data.get("traceback") or "")
    cls: Any = None
    if module == "builtins":
        cls = getattr(builtins, name, None)
    elif module == __name__:
        cls = getattr(sys.modules[__name__], name, None)
    exc: BaseException | None = None
    if (
        isinstance(cls, type)
        and issubclass(cls, Exception)
        and not issubclass(cls, (ConfigError, RemoteError))
    ):
        try:
            exc = cls(message)
        except TypeError:  # a constructor that wants more than a message
            exc = None
    if exc is None:
        exc = RemoteError(message, remote_type=f"{module}.{name}", remote_traceback=tb)
    if tb and hasattr(exc, "add_note"):
        exc.add_note(f"Remote traceback:\n{tb}")
    return exc


__all__ = [
    "ActorDead",
    "AuthFailed",
    "BusError",
    "CallTimeout",
    "ConfigError",
    "ConfigIssue",
    "LeaseExpired",
    "MessageTooLarge",
    "PeerGone",
    "RelaxError",
    "RemoteError",
    "StartFailed",
    "SupervisorGaveUp",
    "TransportError",
    "error_from_dict",
    "error_to_dict",
]
