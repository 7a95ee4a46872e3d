"""Relax's exception vocabulary: every error Relax raises on purpose, in one place.

One root, a shallow tree, and names that say what the caller does next:

- ``ConfigError``        fix the config file; nothing was started. ``MissingPackage`` (install
                         the named package), ``OptionError`` (fix that option of a reward
                         function).
- ``StartFailed``        an actor could not start; read the cause and fix the code or config.
- ``ActorDead``          the actor you talked to is gone; the call may or may not have run.
                         Retry (a supervisor restarts it) or give up.
- ``CallTimeout``        no answer in time; the actor may still be working on it.
- ``RemoteError``        the handler raised on the other side of a process boundary with an
                         exception type that is not rebuilt (not Relax's, not a plain builtin);
                         read ``remote_type`` and ``remote_traceback``.
- ``SupervisorGaveUp``   a supervisor exceeded its restart intensity and stopped its subtree.
- ``Unrecoverable``      an actor cannot go on and a restart would not help: the tree stops with
                         it as the cause (``RewardFailing``: the reward fails group after group).
- ``ClusterNotRunning``  no live cluster answers for that run folder: start one (``relax up``).
- ``EndpointNotFound``   the run serves no agent endpoint (yet): enable it, or wait longer.
- ``AgentEndpointError`` the agent endpoint answered with an HTTP error: read ``status``,
                         ``type`` and ``param``, fix the request.
- ``RunFinished``        the run behind an agent endpoint has ended: stop calling it.
- ``TransportError``     bytes could not be moved or decoded; ``PeerGone`` (reconnect),
                         ``AuthFailed`` (fix the shared secret), ``MessageTooLarge`` (split it),
                         ``WeightsCorrupt`` (weights failed their checksum: fetch them again),
                         ``BadFrame`` (the peer does not speak our protocol), ``Closed`` (our own
                         endpoint was closed: we are shutting down).
- ``BusError``           the TransferQueue refused an operation; ``VersionGone`` (poll for the
                         latest weights and start over), ``UnknownTask`` (declare the consumer
                         task), ``ColumnConflict`` (columns are write-once: it is written
                         already), ``LogCorrupt`` (restore the bus log from a copy),
                         ``UploadLost`` (a weights upload to start over), ``BadRow`` /
                         ``BadColumn`` (a malformed row or column value, named by uid and
                         field: fix it; nothing of that put was applied).
- ``EngineError``, ``MediaError``, ``ChatFormatError`` (also ``ValueError``s): one request,
                         media item or conversation was refused and nothing changed; fix that
                         input and send it again.
- ``PlotError``          the charts cannot be drawn: install matplotlib, or wait for metrics.
- ``RecordError``        a run cannot be replayed: no record, a damaged one, or a bad ``--set``.

Every class here crosses a process boundary as itself (actor calls, bus and control RPC):
``error_to_dict`` writes its registered name, message and the attributes that matter as plain
data, and ``error_from_dict`` rebuilds it from the fixed registry ``REGISTERED`` — never by
unpickling or importing what the peer names. Plain builtin exceptions are rebuilt too; anything
else becomes ``RemoteError``. A stale ack (its lease ran out and the rows went to someone else)
is not an error: acks are idempotent and the bus counts it (``ignored_acks``).

Errors from libraries we sit on (pynng, msgpack, pydantic) are mapped into this tree at the
edge, so callers catch ``RelaxError`` and never a third party's type.
"""

from __future__ import annotations

import builtins
import dataclasses
import os
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar


class RelaxError(Exception):
    """Root of every error Relax raises on purpose."""

    _wire_attrs: ClassVar[tuple[str, ...]] = ()
    """Instance attributes that travel with the error across a process boundary."""

    def _wire_state(self) -> dict[str, Any]:
        return {name: _plain(getattr(self, name, None)) for name in self._wire_attrs}

    def _set_wire_state(self, state: Mapping[str, Any]) -> None:
        for name in self._wire_attrs:
            setattr(self, name, _plain(state.get(name)))

    @classmethod
    def _from_wire(cls, message: str, state: Mapping[str, Any]) -> RelaxError:
        # Not through __init__: constructors format their message from their arguments, and
        # the message the peer sent is already that text.
        exc = cls.__new__(cls)
        exc.args = (message,)
        exc._set_wire_state(state)
        return exc


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

    _wire_attrs = ("source",)

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

    def _wire_state(self) -> dict[str, Any]:
        issues = [dataclasses.asdict(issue) for issue in self.issues]
        return {**super()._wire_state(), "issues": _plain(issues)}

    def _set_wire_state(self, state: Mapping[str, Any]) -> None:
        super()._set_wire_state(state)
        raw = state.get("issues")
        self.issues = [_issue(item) for item in raw] if isinstance(raw, list) else []


def _issue(item: Any) -> ConfigIssue:
    """A ``ConfigIssue`` from a peer's dict, keeping only fields of the right type."""
    item = item if isinstance(item, dict) else {"message": str(item)}
    line, hint = item.get("line"), item.get("hint")
    return ConfigIssue(
        path=str(item.get("path") or ""),
        message=str(item.get("message") or ""),
        line=line if isinstance(line, int) and not isinstance(line, bool) else None,
        hint=hint if isinstance(hint, str) else None,
    )


class MissingPackage(ConfigError):
    """A configured feature (a metrics sink) needs a package that is not installed."""

    _wire_attrs = (*ConfigError._wire_attrs, "package")

    def __init__(self, package: str, key: str, extra: str | None = None) -> None:
        hint = f"pip install {package}" + (f" (or relax-rl[{extra}])" if extra else "")
        super().__init__(f"{key} is enabled but the {package!r} package is not installed: {hint}")
        self.package = package


class OptionError(ConfigError):
    """A bad ``options`` entry (or target) of one reward function; ``key`` is the option's
    name (``None`` for the function as a whole), ``message`` what is wrong with it."""

    _wire_attrs = (*ConfigError._wire_attrs, "key", "message")

    def __init__(self, key: str | None, message: str) -> None:
        super().__init__([ConfigIssue(path=key or "", message=message)])
        self.key = key
        self.message = message


# --------------------------------------------------------------------------- actors


class StartFailed(RelaxError):
    """An actor (or a supervisor's child) failed to start; the cause is attached."""

    _wire_attrs = ("actor_id", "cause")

    def __init__(self, message: str, *, actor_id: str | None = None, cause: object = None) -> None:
        super().__init__(message)
        self.actor_id = actor_id
        self.cause = cause

    def _wire_state(self) -> dict[str, Any]:
        return {"actor_id": _plain(self.actor_id), "cause": _exit_to_wire(self.cause)}

    def _set_wire_state(self, state: Mapping[str, Any]) -> None:
        self.actor_id = _plain(state.get("actor_id"))
        self.cause = _exit_from_wire(state.get("cause"))


class ActorDead(RelaxError):
    """The actor died (or was stopped) before answering. Retry later or give up."""

    _wire_attrs = ("actor_id", "cause")
    _wire_state = StartFailed._wire_state
    _set_wire_state = StartFailed._set_wire_state

    def __init__(self, message: str, *, actor_id: str | None = None, cause: object = None) -> None:
        super().__init__(message)
        self.actor_id = actor_id
        self.cause = cause


def _exit_to_wire(cause: object) -> Any:
    # The cause of an actor's end is an ``Exit`` (a dataclass of plain fields); anything else
    # is not data a peer can use.
    if dataclasses.is_dataclass(cause) and not isinstance(cause, type):
        return {"exit": _plain(dataclasses.asdict(cause))}
    return None


_exit_decoder: Any = None
"""How an ``Exit`` is rebuilt from a peer's dict: the actor runtime (a floor above this module,
which it must not import) registers it when it is imported (``register_exit_decoder``)."""


def register_exit_decoder(decode: Any) -> None:
    """Called by ``relax.actors`` with its checked ``Exit`` builder."""
    global _exit_decoder
    _exit_decoder = decode


def _exit_from_wire(data: Any) -> Any:
    if not isinstance(data, dict) or not isinstance(data.get("exit"), dict):
        return None
    # Without the actor runtime in this process, nothing here could use an Exit: the plain
    # fields are kept as they came.
    return _exit_decoder(data["exit"]) if _exit_decoder is not None else dict(data["exit"])


class CallTimeout(RelaxError, TimeoutError):
    """No reply within the call's timeout; the actor may still be working on the request."""


class RemoteError(RelaxError):
    """A handler in another process raised an exception type that is not rebuilt locally."""

    _wire_attrs = ("remote_type", "remote_traceback")

    def __init__(self, message: str, *, remote_type: str, remote_traceback: str = "") -> None:
        super().__init__(f"{remote_type}: {message}")
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


class SupervisorGaveUp(RelaxError):
    """A supervisor exceeded its restart intensity (or a child ended ``Unrecoverable``),
    stopped its children and itself; ``cause`` is that child's ``Exit`` when known."""

    _wire_attrs = ("supervisor_id", "cause")

    def __init__(
        self, message: str, *, supervisor_id: str | None = None, cause: object = None
    ) -> None:
        super().__init__(message)
        self.supervisor_id = supervisor_id
        self.cause = cause

    def _wire_state(self) -> dict[str, Any]:
        return {"supervisor_id": _plain(self.supervisor_id), "cause": _exit_to_wire(self.cause)}

    def _set_wire_state(self, state: Mapping[str, Any]) -> None:
        self.supervisor_id = _plain(state.get("supervisor_id"))
        self.cause = _exit_from_wire(state.get("cause"))


class Unrecoverable(RelaxError):
    """An actor cannot go on and restarting it would not help (say, user code that fails
    every time): its supervisor does not restart it but stops the whole tree with it as the
    cause, and ``relax up`` exits 1 printing its traceback once. Fix the cause, start again."""


class RewardFailing(Unrecoverable):
    """The reward failed for ``failed_groups`` groups in a row (``[reward]
    max_failed_groups``): the reward function is broken, not the samples. Raised from the
    function's last exception, so its traceback is the function's."""

    _wire_attrs = ("failed_groups",)

    def __init__(self, message: str, *, failed_groups: int) -> None:
        super().__init__(message)
        self.failed_groups = failed_groups


# --------------------------------------------------------------------------- a run and its endpoints


class ClusterNotRunning(RelaxError):
    """No live cluster answers for this run folder: start one with ``relax up``."""


class EndpointNotFound(RelaxError, LookupError):
    """No rollout of that run serves the endpoint (yet): start the cluster with
    ``[rollout.server] enabled = true`` (or an agent kind that needs it), or wait longer."""


class AgentEndpointError(RelaxError):
    """The agent endpoint answered with an error (the fields of its OpenAI error body)."""

    _wire_attrs = ("status", "type", "param", "code", "message")

    def __init__(
        self,
        message: str,
        *,
        status: int,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        where = f" (param {param!r})" if param else ""
        super().__init__(f"{status} {type or 'error'}: {message}{where}")
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.message = message


class RunFinished(RelaxError):
    """The run this client belongs to has ended (its trainer finished its steps, or it was
    stopped): its endpoint is gone for good. Stop calling it; ``run.done`` says how it ended."""


# --------------------------------------------------------------------------- transport


class TransportError(RelaxError):
    """Bytes could not be moved or decoded (corrupt frame, closed socket, unknown format)."""


class PeerGone(TransportError):
    """The other end disappeared; reconnect and resend what was not acknowledged."""


class WeightsCorrupt(TransportError):
    """Weight bytes arrived but do not match the sender's checksum: the version is not
    applied; fetch it again (the bus holds every committed version's bytes)."""


class AuthFailed(TransportError):
    """The peer did not prove it holds the cluster's shared secret; check the secret."""


class MessageTooLarge(TransportError):
    """The message exceeds the configured maximum; split it or raise the limit."""


class BadFrame(TransportError):
    """A frame that is not ours or is damaged."""


class Closed(TransportError):
    """Our own socket or context was closed (the endpoint is shutting down)."""


# --------------------------------------------------------------------------- bus


class BusError(RelaxError):
    """The TransferQueue refused an operation."""


class VersionGone(BusError):
    """That weight version was superseded and dropped; poll for the latest and start over."""


class UnknownTask(BusError):
    """The task is not one of the bus's consumer tasks; declare it in the bus config."""


class ColumnConflict(BusError):
    """A column was written twice with different values; columns are write-once."""


class LogCorrupt(BusError):
    """The log holds damaged data that is not a torn tail; replaying past it would lose data.

    ``path`` and ``offset`` locate the first bad byte. Restore the directory from a copy, or
    move the named segment (and all later ones) away if losing their records is acceptable.
    """

    _wire_attrs = ("path", "offset")

    def __init__(self, message: str, *, path: str | os.PathLike[str], offset: int) -> None:
        self.path = str(path)
        self.offset = offset
        super().__init__(f"{self.path} at offset {offset}: {message}")


class UploadLost(BusError):
    """The bus holds no open upload of that weight version (it restarted, or a newer upload
    replaced it); ``publish_weights`` starts that publish over from ``w_begin``."""


class BadRow(BusError):
    """A row the bus refused at the door (a malformed ``uid``, ``group``, ``version``,
    ``group_size``, or a group that can never fit a batch); nothing of that put was applied.

    ``uid`` names the row (``#i`` for the i-th row when it has no usable uid), ``field`` the
    bad field, ``reason`` what is wrong with it. Fix the row and send the put again.
    """

    _wire_attrs = ("uid", "field", "reason")

    def __init__(self, uid: str, field: str, reason: str) -> None:
        self.uid, self.field, self.reason = uid, field, reason
        super().__init__(f"row {uid!r}: {field} {reason}")


class BadColumn(BadRow):
    """A column value that breaks its declared type (dtype, rank, finiteness, length; see
    ``relax.bus.SCHEMA``); ``field`` is the column. Nothing of that put or write was applied."""

    def __init__(self, uid: str, field: str, reason: str) -> None:
        self.uid, self.field, self.reason = uid, field, reason
        BusError.__init__(self, f"row {uid!r}: column {field!r} {reason}")


# --------------------------------------------------------------------------- refused input


class EngineError(RelaxError, ValueError):
    """A generation engine refused a request or a weight update; nothing was changed."""


class MediaError(RelaxError, ValueError):
    """One media item could not be decoded within the limits: what, which item, and why.

    ``kind`` is ``"image"``, ``"audio"`` or ``"video"``; ``item`` names the item (a path, a row
    id, ``<bytes ...>``); ``reason`` says what is wrong with it (missing file, corrupt data,
    wrong sample rate, too many frames, too long, too large, ...).
    """

    _wire_attrs = ("kind", "item", "reason")

    def __init__(self, kind: str, item: str, reason: str) -> None:
        self.kind = kind
        self.item = item
        self.reason = reason
        super().__init__(f"{kind} {item}: {reason}")


class ChatFormatError(RelaxError, ValueError):
    """Messages the chat template cannot render (or a tokenizer without a chat template)."""


# --------------------------------------------------------------------------- tools


class PlotError(RelaxError):
    """The plots cannot be drawn: matplotlib is missing, or the run has no metrics yet."""


class RecordError(RelaxError):
    """A run's trainer record is missing, damaged, or cannot be replayed: the message says
    which (no record, a damaged frame or line, a `--set` a replay cannot honour)."""


# --------------------------------------------------------------------------- across the wire


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` if it is plain data (what msgpack carries as itself), else ``None``."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if depth < 8 and isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    if depth < 8 and isinstance(value, dict):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    return None


def _subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


REGISTERED: Mapping[str, type[RelaxError]] = MappingProxyType(
    {
        cls.__name__: cls
        for cls in [RelaxError, *_subclasses(RelaxError)]
        if cls.__module__ == __name__
    }
)
"""Every Relax exception by its wire name: the only Relax types a peer's error is rebuilt as."""

_GROUPS = tuple(getattr(builtins, n) for n in ("BaseExceptionGroup",) if hasattr(builtins, n))
# Builtins a peer's error may be rebuilt as: plain ``Exception`` types. Not StopIteration (it
# cannot be set on a future), not exception groups (their constructor wants the members).
_BUILTINS: frozenset[str] = frozenset(
    name
    for name, obj in vars(builtins).items()
    if isinstance(obj, type)
    and issubclass(obj, Exception)
    and not issubclass(obj, (StopIteration, StopAsyncIteration, *_GROUPS))
)


def error_to_dict(exc: BaseException, *, with_traceback: bool = True) -> dict[str, Any]:
    """An exception as wire-safe data: type, module, message, formatted traceback, and for a
    registered Relax type its attributes (``attrs``), for a builtin its plain ``args``."""
    cls = type(exc)
    data: dict[str, Any] = {
        "type": cls.__qualname__,
        "module": cls.__module__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(cls, exc, exc.__traceback__))
        if with_traceback
        else "",
    }
    if isinstance(exc, RelaxError) and REGISTERED.get(cls.__name__) is cls:
        data["attrs"] = exc._wire_state()
    elif (
        cls.__module__ == "builtins"
        and exc.args != (data["message"],)  # only what the message would not give back
        and all(a is None or isinstance(a, (bool, int, float, str)) for a in exc.args)
    ):
        data["args"] = list(exc.args)  # KeyError's quoting, an errno
    return data


def error_from_dict(data: Any) -> BaseException:
    """Rebuild an exception sent by :func:`error_to_dict`.

    Only types in ``REGISTERED`` (with their attributes) and plain builtin exceptions are
    rebuilt, by name from those fixed lists (never by importing or unpickling what the peer
    names); anything else becomes ``RemoteError``. The remote traceback is attached as a note
    so it shows when the error is printed.
    """
    data = data if isinstance(data, dict) else {}
    name, module = str(data.get("type")), str(data.get("module"))
    message, tb = str(data.get("message", "")), str(data.get("traceback") or "")
    exc: BaseException | None = None
    if module == __name__ and name in REGISTERED:
        attrs = data.get("attrs")
        exc = REGISTERED[name]._from_wire(message, attrs if isinstance(attrs, dict) else {})
    elif module == "builtins" and name in _BUILTINS:
        exc = _builtin(getattr(builtins, name), message, data.get("args"))
    if exc is None:
        exc = RemoteError(message, remote_type=f"{module}.{name}", remote_traceback=tb)
    if tb and hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(f"Remote traceback:\n{tb}")
    return exc


def _builtin(cls: type[Exception], message: str, args: Any) -> Exception | None:
    # The original arguments where they give back the same text (KeyError('x') prints 'x'
    # quoted; OSError(2, ...) keeps its errno); the message alone otherwise.
    if isinstance(args, list) and all(
        a is None or isinstance(a, (bool, int, float, str)) for a in args
    ):
        try:
            exc = cls(*args)
            if str(exc) == message:
                return exc
        except Exception:  # a constructor that wants other arguments
            pass
    try:
        return cls(message)
    except Exception:
        return None


__all__ = [
    "REGISTERED",
    "ActorDead",
    "AgentEndpointError",
    "AuthFailed",
    "BadFrame",
    "BusError",
    "CallTimeout",
    "ChatFormatError",
    "Closed",
    "ClusterNotRunning",
    "ColumnConflict",
    "ConfigError",
    "ConfigIssue",
    "EndpointNotFound",
    "EngineError",
    "LogCorrupt",
    "MediaError",
    "MessageTooLarge",
    "MissingPackage",
    "OptionError",
    "PeerGone",
    "PlotError",
    "RecordError",
    "RelaxError",
    "RemoteError",
    "RewardFailing",
    "StartFailed",
    "SupervisorGaveUp",
    "TransportError",
    "UnknownTask",
    "UploadLost",
    "VersionGone",
    "WeightsCorrupt",
    "error_from_dict",
    "error_to_dict",
]
