"""Turning a child spec's ``start`` into an actor: a callable, or an import path (which is how a
child in another process names it; see ``relax.importpath``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relax.actors._actor import Actor
from relax.importpath import load


def build_actor(target: Callable[..., Any] | str, args: Any, kwargs: dict[str, Any]) -> Actor:
    """Call the factory (loaded first if ``target`` is an import path) and check that it made
    an actor."""
    factory = load(target) if isinstance(target, str) else target
    actor = factory(*args, **kwargs)
    if not isinstance(actor, Actor):
        raise TypeError(f"{target!r} returned {type(actor).__name__}, not a relax Actor")
    return actor
