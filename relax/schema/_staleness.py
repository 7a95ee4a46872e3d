"""``Staleness``: how many policy versions generation may run ahead of training, as one value.

It is written ``0`` (strict on-policy), ``k`` (bounded async) or ``"inf"`` (fully async) in
the config, travels in that same form (its *wire form*: an ``int`` or the string ``"inf"``)
to the bus over msgpack and into status JSON, and is read back with ``Staleness.parse``. The
bus's admission and stale-row checks ask it (``oldest_version``, ``too_stale``,
``rows_in_play``) instead of each re-deriving ``math.inf`` from ``"inf"``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

INF = "inf"
"""The wire form of an unbounded staleness."""

StalenessWire = int | Literal["inf"]
"""What a staleness looks like in a config dump, over msgpack and in status JSON."""

_EXPECTED = 'must be 0, a positive integer or "inf"'


def staleness_problem(
    value: Any, show: Callable[[Any], str] = repr
) -> tuple[str, str | None] | None:
    """``(message, hint)`` when ``value`` is no staleness (``Staleness.parse`` would refuse
    it), ``None`` when it is one. ``show`` writes the value into the message (the config
    passes its own, which writes values as TOML does)."""
    if isinstance(value, Staleness):
        return None
    if isinstance(value, bool):
        return f"{_EXPECTED}, got {show(value)}", None
    if isinstance(value, int):
        return (f"{_EXPECTED}, got {value}", "0 is strict on-policy") if value < 0 else None
    if isinstance(value, float):
        if math.isinf(value) and value > 0:
            return None  # TOML's bare inf
        if value.is_integer() and value >= 0:
            return f"{_EXPECTED}, got {value}", f"write {int(value)} without the '.0'"
        return f"{_EXPECTED}, got {show(value)}", None
    if isinstance(value, str):
        if value == INF:
            return None
        if value.strip().lower() in ("inf", "infinity", "infinite"):
            return f"{_EXPECTED}, got {show(value)}", 'write "inf"'
    return f"{_EXPECTED}, got {show(value)}", None


@dataclass(frozen=True)
class Staleness:
    """A staleness bound: ``versions`` policy versions, or unbounded (``versions is None``).

    Equal to its wire form too (``Staleness.parse(2) == 2``, ``Staleness.parse("inf") ==
    "inf"``), so code and tests that compare against the written value keep reading naturally.
    """

    versions: int | None
    """The bound ``k`` (0 is strict on-policy); ``None`` when generation may run any distance
    ahead."""

    @classmethod
    def parse(cls, value: Any) -> Staleness:
        """``value`` (a ``Staleness``, an ``int ≥ 0``, ``"inf"`` or a float ``inf``) as a
        ``Staleness``; ``ValueError`` (with the config's wording) for anything else."""
        if isinstance(value, Staleness):
            return value
        problem = staleness_problem(value)
        if problem is not None:
            message, hint = problem
            raise ValueError(f"staleness {message}" + (f" ({hint})" if hint else ""))
        return cls(int(value)) if isinstance(value, int) else cls(None)

    @property
    def bounded(self) -> bool:
        """Whether rows can ever be too stale to train on."""
        return self.versions is not None

    @property
    def limit(self) -> float:
        """The bound as a number: ``k`` as a float, ``math.inf`` when unbounded."""
        return math.inf if self.versions is None else float(self.versions)

    @property
    def wire(self) -> StalenessWire:
        """The value as it is written and sent: ``k``, or ``"inf"``."""
        return INF if self.versions is None else self.versions

    def __str__(self) -> str:
        return str(self.wire)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Staleness):
            return self.versions == other.versions
        if isinstance(other, bool):
            return False
        if isinstance(other, int | str):
            return self.wire == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.wire)

    # ------------------------------------------------------------------ the bus's checks

    def oldest_version(self, trainer_version: int) -> float:
        """The oldest row version a trainer at ``trainer_version`` may still train on
        (``-math.inf`` when unbounded)."""
        return -math.inf if self.versions is None else trainer_version - self.versions

    def too_stale(self, version: int | float, trainer_version: int) -> bool:
        """Whether a row (or a producer's weights) of ``version`` is older than a trainer at
        ``trainer_version`` may use."""
        return version < self.oldest_version(trainer_version)

    def rows_in_play(self, batches_consumed: int, batch_size: int) -> float:
        """AReaL's pacing rule: the most rows that may be generated, queued or trained once
        ``batches_consumed`` batches went by, so none is consumed staler than the bound
        (``math.inf`` when unbounded)."""
        if self.versions is None:
            return math.inf
        return (batches_consumed + self.versions + 1) * batch_size


UNBOUNDED = Staleness(None)
"""Fully async: no row is ever too stale."""
