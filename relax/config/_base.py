"""Building blocks of the config models: the shared base class, value types, error helpers.

Errors raised from validators here are ``PydanticCustomError`` s of two kinds that
``relax.config`` turns into ``ConfigIssue`` s:

- ``relax_value``: one problem with the value at the error's own location
  (context: ``message``, ``hint``);
- ``relax_config``: one or more problems *below* the model being validated, each with its own
  sub-path — how a cross-field check points at the exact key instead of the whole table
  (context: ``issues`` = ``[(sub_path, message, hint), ...]``).

Both render readably even when someone calls ``ClusterConfig.model_validate`` directly and gets
pydantic's ``ValidationError``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal, NoReturn, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    WithJsonSchema,
)
from pydantic_core import PydanticCustomError

from relax.importpath import IMPORT_PATH, import_path_problem
from relax.schema import Staleness, StalenessWire, staleness_problem

PathPart = str | int

RELAX_VALUE_ERROR = "relax_value"
RELAX_CONFIG_ERROR = "relax_config"


class ConfigModel(BaseModel):
    """Base of every config table: unknown keys are errors, values never change after loading.

    ``strict``: TOML values are already typed, so ``replicas = "2"`` or ``replicas = 2.5`` is a
    mistake worth reporting rather than silently coercing (and ``true`` is not the integer 1).
    Every field carries an attribute docstring; those are the user documentation.
    """

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        use_attribute_docstrings=True,
        validate_default=False,
        # Fields like `model_path` are ours; pydantic < 2.10 would warn about the `model_` prefix.
        protected_namespaces=(),
    )


# --------------------------------------------------------------------------- raising errors


def value_error(message: str, hint: str | None = None) -> PydanticCustomError:
    """An error about the value being validated, with a message meant for a person."""
    return PydanticCustomError(RELAX_VALUE_ERROR, "{message}", {"message": message, "hint": hint})


class Problems:
    """Collects cross-field problems under one model, then raises them all at once."""

    def __init__(self) -> None:
        self.items: list[tuple[tuple[PathPart, ...], str, str | None]] = []

    def add(self, path: Sequence[PathPart] | str, message: str, hint: str | None = None) -> None:
        parts = (path,) if isinstance(path, str) else tuple(path)
        self.items.append((parts, message, hint))

    def raise_if_any(self) -> None:
        if self.items:
            raise_problems(self.items)


def raise_one(path: PathPart, message: str, hint: str | None = None) -> NoReturn:
    """Raise a single problem at ``path`` below the model being validated."""
    raise_problems([((path,), message, hint)])


def raise_problems(items: Sequence[tuple[tuple[PathPart, ...], str, str | None]]) -> NoReturn:
    text = "; ".join(f"{format_path(sub) or '<table>'}: {message}" for sub, message, _ in items)
    raise PydanticCustomError(
        RELAX_CONFIG_ERROR, "{text}", {"text": text, "issues": [list(item) for item in items]}
    )


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def format_path(parts: Sequence[PathPart]) -> str:
    """``("actors", 1, "placement")`` -> ``actors[1].placement``; odd keys are quoted."""
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
            continue
        key = part if _BARE_KEY.match(part) else '"' + part.replace('"', '\\"') + '"'
        text += f".{key}" if text else key
    return text


def show(value: Any) -> str:
    """Render a value the way it would be written in TOML, for error messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list | tuple):
        return "an array"
    return repr(value)


# --------------------------------------------------------------------------- value types

T = TypeVar("T")


def _list_to_tuple(value: Any) -> Any:
    # TOML arrays arrive as lists; config models keep tuples so frozen really means frozen.
    return tuple(value) if isinstance(value, list) else value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _staleness(value: Any) -> Staleness:
    problem = staleness_problem(value, show)
    if problem is not None:
        raise value_error(*problem)
    return Staleness.parse(value)


def _shutdown(value: Any) -> float | Literal["brutal_kill"]:
    expected = 'must be a number of seconds > 0 or "brutal_kill"'
    if value == "brutal_kill" and isinstance(value, str):
        return "brutal_kill"
    if _is_number(value) and value > 0 and not math.isinf(value) and not math.isnan(value):
        return float(value)
    hint = 'write "brutal_kill"' if isinstance(value, str) and "kill" in value.lower() else None
    raise value_error(f"{expected}, got {show(value)}", hint)


def _import_path(value: Any) -> str:
    if not isinstance(value, str):
        raise value_error(f'expected an import path like "package.module:name", got {show(value)}')
    problem = import_path_problem(value)
    if problem is not None:
        raise value_error(*problem)
    return value


_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def _safe_name(value: Any) -> str:
    if not isinstance(value, str):
        raise value_error(f"expected a string, got {show(value)}")
    if not value:
        raise value_error("must not be empty")
    if not _SAFE_NAME.match(value):
        raise value_error(
            f"may only contain letters, digits, '_', '.' and '-', got {show(value)}",
            "it names files and metrics, so keep it simple",
        )
    return value


StalenessSetting = Annotated[
    Staleness,
    PlainValidator(_staleness),
    PlainSerializer(lambda value: value.wire, return_type=StalenessWire),
    WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 0}, {"const": "inf"}]}),
]
"""``0``, a positive integer, or ``"inf"`` (TOML's bare ``inf`` is accepted and normalised),
read into a ``relax.schema.Staleness`` and dumped in its wire form (``k`` or ``"inf"``)."""

Shutdown = Annotated[
    float | Literal["brutal_kill"],
    PlainValidator(_shutdown),
    WithJsonSchema(
        {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"const": "brutal_kill"}]}
    ),
]
"""Seconds a child gets to stop cleanly before it is killed, or ``"brutal_kill"``."""

ImportPath = Annotated[
    str,
    PlainValidator(_import_path),
    WithJsonSchema({"type": "string", "pattern": IMPORT_PATH.pattern}),
]
"""``"package.module:attribute"``, resolved only when the cluster starts."""

SafeName = Annotated[
    str,
    PlainValidator(_safe_name),
    WithJsonSchema({"type": "string", "pattern": _SAFE_NAME.pattern}),
]
"""A non-empty name of letters, digits, ``_``, ``.`` and ``-``."""

Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""A positive, finite duration in seconds (integers are fine)."""

Port = Annotated[int, Field(ge=0, le=65535)]
"""A TCP port; ``0`` lets the operating system pick a free one."""

PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]
OpenFraction = Annotated[float, Field(gt=0, le=1)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]


AsTuple = BeforeValidator(_list_to_tuple)
"""Annotate a fixed-length ``tuple[...]`` field with this so TOML arrays are accepted."""

FrozenList = Annotated[tuple[T, ...], BeforeValidator(_list_to_tuple)]
"""``FrozenList[X]``: a tuple of ``X`` that accepts TOML arrays (which arrive as lists)."""


Placement = Literal["inproc", "process", "ray"]
Restart = Literal["permanent", "transient", "temporary"]
Dtype = Literal["float32", "bfloat16", "float16"]


__all__ = [
    "AsTuple",
    "ConfigModel",
    "Dtype",
    "Fraction",
    "FrozenList",
    "ImportPath",
    "NonNegativeFloat",
    "NonNegativeInt",
    "OpenFraction",
    "Placement",
    "Port",
    "PositiveFloat",
    "PositiveInt",
    "Problems",
    "Restart",
    "SafeName",
    "Seconds",
    "Shutdown",
    "StalenessSetting",
    "format_path",
    "import_path_problem",
    "raise_one",
    "raise_problems",
    "show",
    "value_error",
]
