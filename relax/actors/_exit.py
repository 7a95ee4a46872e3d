"""How an actor ended, and exceptions as plain data that can cross a process boundary."""

from __future__ import annotations

import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from relax.errors import SupervisorGaveUp, Unrecoverable, error_to_dict

ExitKind = Literal[
    "normal",  # the actor finished on its own (run() returned, or it called stop())
    "shutdown",  # its supervisor stopped it
    "exception",  # an exception escaped the actor
    "exit_code",  # the process exited with a non-zero code and said nothing
    "signal",  # the process was killed by a signal (SIGKILL includes the kernel's OOM kill)
    "heartbeat",  # the process stopped sending heartbeats (hung event loop) and was killed
    "start",  # the actor failed while starting
    "peer",  # a gang member went down, so this one was stopped with it
    # The Ray placement's causes, read from Ray's own report of its actor's death:
    "node_lost",  # the Ray node hosting it left the cluster (removed, crashed, preempted)
    "oom",  # Ray's memory monitor killed it to save its node
    "placement",  # Ray could not place it (no node has what it asks for)
    "ray",  # its Ray actor died for another reason Ray names (its worker killed, ray.kill)
]


@dataclass(frozen=True)
class Exit:
    """Why an actor incarnation ended; kept by its supervisor as the last crash cause."""

    kind: ExitKind
    message: str = ""
    error_type: str | None = None
    traceback: str | None = None
    exit_code: int | None = None
    signal: str | None = None
    member: int | None = None
    """Gang rank of the member whose end ended the gang, if the child is a gang."""
    at: float = field(default_factory=time.time)
    fatal: bool = False
    """It raised ``Unrecoverable``: its supervisor stops the tree instead of restarting it."""

    @property
    def normal(self) -> bool:
        """True when nobody should call this a crash (finished or stopped on purpose)."""
        return self.kind in ("normal", "shutdown")

    def describe(self) -> str:
        """One line for a status table."""
        text = {
            "normal": "exited normally",
            "shutdown": "stopped by its supervisor",
            "exception": f"raised {self.error_type}: {self.message}",
            "exit_code": f"process exited with code {self.exit_code}",
            "signal": f"killed by {self.signal}",
            "heartbeat": f"missed heartbeats: {self.message}",
            "start": f"failed to start: {self.error_type}: {self.message}",
            "peer": f"stopped with its gang: {self.message}",
            "node_lost": f"node lost: {self.message}",
            "oom": f"killed by Ray's memory monitor (oom): {self.message}",
            "placement": f"placement failed: {self.message}",
            "ray": f"its Ray actor died: {self.message}",
        }[self.kind]
        return f"rank {self.member}: {text}" if self.member is not None else text

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "description": self.describe()}

    @classmethod
    def from_exception(cls, exc: BaseException, kind: ExitKind = "exception") -> Exit:
        data = error_to_dict(exc)
        fatal = isinstance(exc, Unrecoverable) or (
            isinstance(exc, SupervisorGaveUp) and getattr(exc.cause, "fatal", False) is True
        )
        return cls(kind, data["message"], data["type"], data["traceback"], fatal=fatal)

    @classmethod
    def from_returncode(cls, returncode: int) -> Exit:
        if returncode < 0:
            try:
                name = signal.Signals(-returncode).name
            except ValueError:
                name = f"signal {-returncode}"
            return cls("signal", f"killed by {name}", signal=name, exit_code=returncode)
        if returncode == 0:
            return cls("normal")
        return cls("exit_code", f"exit code {returncode}", exit_code=returncode)
