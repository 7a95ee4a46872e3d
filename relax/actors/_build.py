"""Turning a child spec's ``start`` into an actor: a callable, or an import path for processes."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from relax.actors._actor import Actor


def import_path(obj: Callable[..., Any] | str) -> str:
    """``module:qualname`` for a class or function that another process can import."""
    if isinstance(obj, str):
        if ":" not in obj:
            raise ValueError(f"import path {obj!r} must look like 'package.module:Name'")
        return obj
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"{obj!r} cannot be started in another process: define it at the top level of an "
            "importable module (not __main__, a lambda or a nested function), or pass "
            "'package.module:Name'"
        )
    return f"{module}:{qualname}"


def resolve(target: Callable[..., Any] | str) -> Callable[..., Any]:
    if not isinstance(target, str):
        return target
    module_name, _, attr_path = import_path(target).partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        obj = getattr(obj, attr)
    return obj


def build_actor(target: Callable[..., Any] | str, args: Any, kwargs: dict[str, Any]) -> Actor:
    """Call the factory and check that it made an actor."""
    actor = resolve(target)(*args, **kwargs)
    if not isinstance(actor, Actor):
        raise TypeError(f"{target!r} returned {type(actor).__name__}, not a relax Actor")
    return actor
