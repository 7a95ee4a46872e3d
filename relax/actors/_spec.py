"""Child specifications and supervision flags, with Erlang/OTP's names and defaults."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

from relax.actors._placement import InProc, Placement


class Restart(str, Enum):
    """When a supervisor restarts a child that ended."""

    PERMANENT = "permanent"
    """Always."""
    TRANSIENT = "transient"
    """Only when it ended abnormally (a crash, not a normal return)."""
    TEMPORARY = "temporary"
    """Never."""


class Strategy(str, Enum):
    """Which children a supervisor restarts when one of them crashes."""

    ONE_FOR_ONE = "one_for_one"
    """Only the crashed child."""
    REST_FOR_ONE = "rest_for_one"
    """The crashed child and every child started after it."""
    ONE_FOR_ALL = "one_for_all"
    """All children."""


# OTP's defaults: at most 1 restart in 5 seconds, 5 s to stop a worker, forever for a supervisor.
DEFAULT_INTENSITY = 1
DEFAULT_PERIOD = 5.0
DEFAULT_SHUTDOWN = 5.0

BRUTAL_KILL = "brutal_kill"
_ID = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class ChildSpec:
    """How a supervisor starts, restarts and stops one child.

    ``start`` makes the actor: a class or factory function called with ``args``/``kwargs``,
    or an import path ``"package.module:Name"``. A child placed in another process must be
    importable there and its arguments must cross the wire (no pickling, ever).
    """

    id: str
    start: Callable[..., Any] | str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    restart: Restart = Restart.PERMANENT
    shutdown: float | Literal["brutal_kill"] = DEFAULT_SHUTDOWN
    """Seconds a child gets to stop before it is killed; ``"brutal_kill"`` kills at once."""
    placement: Placement = field(default_factory=InProc)
    gang: int = 1
    """Members that start, stop and restart as a unit (e.g. the ranks of a trainer)."""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not _ID.match(self.id):
            raise ValueError(f"child id {self.id!r} must be non-empty and use only [A-Za-z0-9_.-]")
        object.__setattr__(self, "restart", Restart(self.restart))
        object.__setattr__(self, "args", tuple(self.args))
        if self.shutdown != BRUTAL_KILL and not (
            isinstance(self.shutdown, (int, float)) and self.shutdown > 0
        ):
            raise ValueError(f"child {self.id!r}: shutdown must be seconds > 0 or 'brutal_kill'")
        if not isinstance(self.gang, int) or self.gang < 1:
            raise ValueError(f"child {self.id!r}: gang must be an integer >= 1")
        self.placement.check(self)

    @property
    def shutdown_timeout(self) -> float:
        """Seconds to wait before killing; 0 for a brutal kill, ``inf`` to wait forever."""
        return 0.0 if self.shutdown == BRUTAL_KILL else float(self.shutdown)

    @classmethod
    def supervisor(
        cls,
        id: str,
        children: Sequence[ChildSpec],
        *,
        strategy: Strategy | str = Strategy.ONE_FOR_ONE,
        intensity: int = DEFAULT_INTENSITY,
        period: float = DEFAULT_PERIOD,
        restart: Restart | str = Restart.PERMANENT,
    ) -> ChildSpec:
        """A nested supervisor as a child (OTP: shutdown ``infinity`` for supervisors)."""
        from relax.actors._supervisor import Supervisor

        return cls(
            id=id,
            start=Supervisor,
            kwargs={
                "children": tuple(children),
                "strategy": strategy,
                "intensity": intensity,
                "period": period,
                "name": id,
            },
            restart=Restart(restart),
            shutdown=math.inf,
        )
