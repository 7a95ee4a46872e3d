"""Turn pydantic's ``ValidationError`` into problems a person can act on.

Each pydantic error becomes ``(path, message, hint)``: the path as a tuple of keys and indices,
a message phrased in TOML terms ("expected an integer ≥ 1, got -2", "unknown key 'replica'"),
and, where we can guess, a hint ("did you mean 'replicas'?"). To phrase messages we look up the
field the error is about (its type and bounds) by walking the model classes along the path.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterator
from typing import Annotated, Any, Literal, Union

import annotated_types
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from relax.config._base import RELAX_CONFIG_ERROR, RELAX_VALUE_ERROR, format_path, show

PathPart = str | int
Problem = tuple[tuple[PathPart, ...], str, str | None]


# --------------------------------------------------------------------------- walking the models


def _strip(tp: Any) -> Any:
    """Drop ``Annotated`` and ``None`` from a type: ``Annotated[X | None, ...]`` -> ``X``."""
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (Union, types.UnionType):
            members = [arg for arg in typing.get_args(tp) if arg is not type(None)]
            if len(members) != 1:
                return tp
            tp = members[0]
        else:
            return tp


def _step(tp: Any, part: PathPart) -> tuple[Any, FieldInfo | None]:
    """The type one step below ``tp`` along ``part`` (and the field, for model keys)."""
    tp = _strip(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel) and isinstance(part, str):
        field = tp.model_fields.get(part)
        return (field.annotation, field) if field is not None else (None, None)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (tuple, list) and isinstance(part, int) and args:
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return (args[part] if part < len(args) else None), None
        return args[0], None
    if origin is dict and len(args) == 2:
        return args[1], None
    return None, None


def _walk(root: type[BaseModel], path: tuple[PathPart, ...]) -> tuple[Any, FieldInfo | None]:
    """Type found at ``path`` below ``root``, and the innermost model field on the way."""
    tp: Any = root
    field: FieldInfo | None = None
    for part in path:
        tp, step_field = _step(tp, part)
        if step_field is not None:
            field = step_field
        if tp is None:
            return None, None
    return tp, field


def _keys_of(tp: Any) -> list[str]:
    tp = _strip(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return list(tp.model_fields)
    return []


def _literal_values(tp: Any) -> list[Any]:
    tp = _strip(tp)
    if typing.get_origin(tp) is Literal:
        return list(typing.get_args(tp))
    values: list[Any] = []
    if typing.get_origin(tp) in (Union, types.UnionType):
        for member in typing.get_args(tp):
            values += _literal_values(member)
    return values


# --------------------------------------------------------------------------- phrasing


def _kind(tp: Any, value: Any = None) -> str:
    """ "an integer" or "a number", by the field's type (or the offending bound)."""
    base = _strip(tp)
    if base is int or (base is None and isinstance(value, int)):
        return "an integer"
    return "a number"


def _bounds(tp: Any, field: FieldInfo | None, ctx: dict[str, Any], own_field: bool) -> str:
    """``≥ 1``, ``between 0 and 1``: the declared bounds of the value, else those in the error."""
    metadata: list[Any] = list(field.metadata) if field is not None and own_field else []
    if not own_field and typing.get_origin(tp) is Annotated:
        # An array item such as one of `betas`: its bounds sit in the item type's Annotated.
        for meta in typing.get_args(tp)[1:]:
            metadata += meta.metadata if isinstance(meta, FieldInfo) else [meta]
    found: dict[str, Any] = {}
    for meta in metadata:
        if isinstance(meta, annotated_types.BaseMetadata):
            for name in ("ge", "gt", "le", "lt"):
                value = getattr(meta, name, None)
                if value is not None:
                    found[name] = value
    for name in ("ge", "gt", "le", "lt"):
        if name in ctx:
            found[name] = ctx[name]
    shown = {name: _number(value) for name, value in found.items()}
    if "ge" in shown and "le" in shown:
        return f"between {shown['ge']} and {shown['le']}"
    symbols = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤"}
    return " and ".join(f"{symbols[name]} {shown[name]}" for name in symbols if name in shown)


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _did_you_mean(word: Any, choices: list[Any]) -> str | None:
    if not isinstance(word, str):
        return None
    names = [str(choice) for choice in choices]
    close = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    if not close:
        lowered = {name.lower(): name for name in names}
        if word.lower() in lowered:
            close = [lowered[word.lower()]]
    return f"did you mean '{close[0]}'?" if close else None


def _one_of(values: list[Any]) -> str:
    shown = [show(value) for value in values]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]


def _phrase(root: type[BaseModel], error: dict[str, Any]) -> tuple[str, str | None]:
    """Message and hint for one ordinary pydantic error."""
    kind: str = error["type"]
    loc: tuple[PathPart, ...] = tuple(error["loc"])
    ctx: dict[str, Any] = error.get("ctx") or {}
    value = error.get("input")
    tp, field = _walk(root, loc)
    own_field = bool(loc) and isinstance(loc[-1], str)
    got = f", got {show(value)}"

    if kind == "extra_forbidden":
        key = loc[-1] if loc else "?"
        keys = _keys_of(_walk(root, loc[:-1])[0])
        hint = _did_you_mean(key, keys)
        if hint is None and keys:
            hint = "expected one of: " + ", ".join(keys)
        what = (
            f"unknown table [{format_path(loc)}]"
            if isinstance(value, dict)
            else f"unknown key '{key}'"
        )
        return what, hint
    if kind == "missing":
        if loc and isinstance(loc[-1], int):
            return f"missing item {loc[-1] + 1} of the array", None
        base = _strip(tp)
        if isinstance(base, type) and issubclass(base, BaseModel):
            return f"missing table [{format_path(loc)}]", field.description if field else None
        return f"missing required key '{loc[-1] if loc else '?'}'", None
    if kind == "literal_error":
        values = _literal_values(tp)
        if values:
            return f"must be one of {_one_of(values)}{got}", _did_you_mean(value, values)
        return f"must be {ctx.get('expected', 'one of the allowed values')}{got}", None
    if kind in ("int_type", "int_parsing", "int_from_float"):
        bounds = _bounds(tp, field, ctx, own_field)
        return f"expected an integer{' ' + bounds if bounds else ''}{got}", None
    if kind in ("float_type", "float_parsing"):
        bounds = _bounds(tp, field, ctx, own_field)
        return f"expected a number{' ' + bounds if bounds else ''}{got}", None
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return f"expected {_kind(tp, value)} {_bounds(tp, field, ctx, own_field)}{got}", None
    if kind == "finite_number":
        return f"expected a finite number{got}", None
    if kind in ("bool_type", "bool_parsing"):
        return f"expected true or false{got}", None
    if kind in ("string_type", "str_type"):
        return f"expected a string{got}", None
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"expected a table{got}", None
    if kind in ("tuple_type", "list_type"):
        return f"expected an array{got}", None
    if kind == "too_short":
        return (
            f"expected at least {ctx.get('min_length')} items, got {ctx.get('actual_length')}",
            None,
        )
    if kind == "too_long":
        return (
            f"expected at most {ctx.get('max_length')} items, got {ctx.get('actual_length')}",
            None,
        )
    if kind == "string_too_short":
        minimum = ctx.get("min_length", 1)
        return (
            "must not be empty" if minimum == 1 else f"must be at least {minimum} characters"
        ), None
    if kind == "value_error":
        return str(error["msg"]).removeprefix("Value error, "), None
    message = str(error["msg"])
    return message[:1].lower() + message[1:], None


def problems_from(exc: ValidationError, root: type[BaseModel]) -> Iterator[Problem]:
    """Every problem in ``exc`` (raised validating ``root``), with its full path."""
    for error in exc.errors(include_url=False):
        loc = tuple(error["loc"])
        ctx = error.get("ctx") or {}
        if error["type"] == RELAX_CONFIG_ERROR:
            for sub_path, message, hint in ctx.get("issues", ()):
                yield (*loc, *sub_path), message, hint
        elif error["type"] == RELAX_VALUE_ERROR:
            yield loc, str(ctx.get("message", error["msg"])), ctx.get("hint")
        else:
            message, hint = _phrase(root, error)
            yield loc, message, hint


__all__ = ["Problem", "problems_from"]
