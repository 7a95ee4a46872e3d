"""Import paths, ``"package.module:attr.path"``: how a config or a child spec names user code
(a reward function, a prompt generator, an environment, an agent program, an actor).

Everything done with one is here, so every user words a failure the same way:
``import_path_problem`` (is the text one?), ``import_path`` (the path of a callable another
process can import) and ``load`` (the callable a path names; ``ImportPathError`` says why not).
The config checks the form, ``relax validate`` (the preflight) loads each path before anything
starts, and the reward set, the roles and the actor runtime load theirs where they run.

Standard library only, on the ground floor: every actor process imports it.
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Callable
from typing import Any

IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
"""The form of an import path: dotted module names, a colon, dotted attribute names."""

IMPORT_HINT = "modules are found in installed packages and in the config file's folder"
"""The hint of a path whose module does not import."""


class ImportPathError(ImportError):
    """An import path that names no callable: the message says why, ``hint`` (or None) what to
    try. An ``ImportError``, as Python's own ``from module import name`` raises."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


def _quoted(value: str) -> str:
    # As TOML writes a string: the path is usually a value of the config file.
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def import_path_problem(value: str) -> tuple[str, str | None] | None:
    """(message, hint) when ``value`` is not ``"package.module:name"``; None when it is."""
    if IMPORT_PATH.match(value):
        return None
    hint = None
    if ":" not in value and "." in value:
        module, _, name = value.rpartition(".")
        hint = f'did you mean "{module}:{name}"?'
    return f'must be an import path like "package.module:name", got {_quoted(value)}', hint


def import_path(obj: Callable[..., Any] | str) -> str:
    """``module:qualname`` for a class or function that another process can import (a string
    is checked to be an import path); ``ValueError`` if there is none."""
    if isinstance(obj, str):
        problem = import_path_problem(obj)
        if problem is not None:
            message, hint = problem
            raise ValueError(f"{message} ({hint})" if hint else message)
        return obj
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"{obj!r} cannot be started in another process: define it at the top level of an "
            "importable module (not __main__, a lambda or a nested function), or pass "
            "'package.module:Name'"
        )
    return f"{module}:{qualname}"


def load(target: str) -> Callable[..., Any]:
    """The callable at ``target`` (importing its module); ``ImportPathError`` if there is none:
    not an import path, a module that does not import (any exception its code raises counts),
    a missing attribute (with the closest name as the hint), or something not callable."""
    problem = import_path_problem(target)
    if problem is not None:
        raise ImportPathError(*problem)
    module_name, _, attr_path = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # any failure of user code at import time is the path's problem
        message = f"cannot import {module_name!r}: {type(exc).__name__}: {exc}"
        raise ImportPathError(message, IMPORT_HINT) from exc
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(attr, names, n=1)
            hint = f"did you mean {module_name}:{close[0]}?" if close else None
            raise ImportPathError(f"{module_name!r} has no attribute {attr!r}", hint) from None
    if not callable(obj):
        kind = type(obj).__name__
        raise ImportPathError(f"{target!r} is not callable: it is {kind}, not a function or class")
    return obj
