"""Supervision flags, with Erlang/OTP's names and defaults: restart types, restart strategies,
restart intensity and period, shutdown times. ``ChildSpec`` and ``Supervisor`` both use them."""

from __future__ import annotations

from enum import Enum


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
