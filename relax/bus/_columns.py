"""The bus's row format and the declared types of the columns every role agrees on.

Rows are checked where they enter the bus (a put, a column write), so a malformed row is
refused with an error naming its uid and the bad field, and nothing of that request is applied.
A column not declared here (a user's own, ``answer``) passes through unchecked. The column
names are ``relax.schema``'s (every floor uses them); their types are declared here.

Columns arrive in wire form: plain msgpack values, or tensors as ``RawTensor`` (dtype, shape,
bytes) — or, over ``inproc://``, as the sender's torch tensors. Checks read only dtype names
and shapes, never import torch, and cost one C-level pass over a list: ``sum`` of a list is an
``int`` exactly when every item is one (a float makes it a float, anything that is not a
number raises ``TypeError``).

``check_rows``/``check_columns`` raise ``BadRow``/``BadColumn``; ``column_problem`` returns
what is wrong with one row's columns as text (for a role that meets a row an older bus let in).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import relax.schema as names
from relax.errors import BadColumn, BadRow


@dataclass(frozen=True)
class Column:
    """What one column holds."""

    kind: str
    """``"int"`` or ``"float"`` (numbers; an int is a float too), ``"str"`` or ``"dict"``."""
    rank: int = 0
    """0: one value (a number, or a 0-d tensor); 1: a sequence (a list, or a 1-D tensor);
    above 1: a tensor of that many dimensions only."""
    finite: bool = False
    """NaN and ±inf are refused (a reward: one NaN would void a whole training step)."""
    per_token: bool = False
    """One entry per response token: as long as ``response_ids`` when the row has both."""
    per_sequence_token: bool = False
    """One entry per token of prompt and response: as long as both together."""


SCHEMA: Mapping[str, Column] = {
    names.PROMPT_IDS: Column("int", 1),
    names.RESPONSE_IDS: Column("int", 1),
    # Log-probs and values are computed by our own roles; a non-finite one is the training
    # step's to skip (it guards non-finite losses), not a reason to refuse the row.
    names.LOGPROBS: Column("float", 1, per_token=True),
    names.REF_LOGPROBS: Column("float", 1, per_token=True),
    names.VALUES: Column("float", 1, per_token=True),
    names.LOSS_MASK: Column("int", 1, per_token=True),
    names.TOKEN_VERSIONS: Column("int", 1, per_token=True),
    names.REWARD: Column("float", 0, finite=True),
    names.SUCCESS: Column("float", 0, finite=True),
    names.TURNS: Column("int", 0),
    names.MEDIA_TOKENS: Column("int", 0),
    names.EPISODE_END: Column("str"),
    names.EPISODE_REASON: Column("str"),
    names.SESSION: Column("str"),
    names.TEXT: Column("str"),
    names.MM_INPUTS: Column("dict"),
    names.ROUTED_EXPERTS: Column("int", 3, per_sequence_token=True),
}
"""The declared columns. Anything else on a row is the user's and is not checked."""

_INT_DTYPES = frozenset({"int64", "int32", "int16", "int8", "uint8", "bool"})
_FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
_SCALAR = {"float64": "<d", "float32": "<f", "float16": "<e"}


def _dtype(value: Any) -> str:
    # RawTensor names its dtype "int64"; a torch tensor (inproc://) says "torch.int64".
    return str(value.dtype).removeprefix("torch.")


def _tensor_problem(col: Column, value: Any) -> str | None:
    dtype, shape = _dtype(value), list(value.shape)
    allowed = _INT_DTYPES if col.kind == "int" else _INT_DTYPES | _FLOAT_DTYPES
    if dtype not in allowed:
        return f"is a {dtype} tensor, not {col.kind}s"
    if len(shape) != col.rank:
        return (
            f"is a tensor of shape {shape}, not {col.rank}-D"
            if col.rank > 1
            else (f"is a tensor of shape {shape}, not {'1-D' if col.rank else '0-d'}")
        )
    if col.finite and dtype in _FLOAT_DTYPES and not math.isfinite(_scalar(value, dtype)):
        return "is not finite"
    return None


def _scalar(value: Any, dtype: str) -> float:
    data = getattr(value, "data", None)
    if isinstance(data, memoryview):  # a RawTensor: read the bytes, no torch
        raw = data.cast("B").tobytes()
        if dtype == "bfloat16":  # the top half of a float32
            return struct.unpack("<f", b"\0\0" + raw)[0]
        return struct.unpack(_SCALAR[dtype], raw)[0]
    return float(value)


def _problem(col: Column, value: Any) -> str | None:
    """What is wrong with ``value`` as a ``col`` column, or ``None``."""
    if col.kind == "str":
        return None if isinstance(value, str) else f"is a {type(value).__name__}, not a string"
    if col.kind == "dict":
        return None if isinstance(value, dict) else f"is a {type(value).__name__}, not a dict"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return _tensor_problem(col, value)
    if col.rank > 1:
        return f"is a {type(value).__name__}, not a {col.rank}-D tensor of {col.kind}s"
    if col.rank == 1:
        if not isinstance(value, list):
            return f"is a {type(value).__name__}, not a list of {col.kind}s"
        try:
            total = sum(value)
        except TypeError:
            return f"holds a value that is not a number, not only {col.kind}s"
        if col.kind == "int" and type(total) is not int:
            return "holds a float, not only ints"
        return None
    if isinstance(value, int) and (col.kind == "float" or not isinstance(value, bool)):
        return None
    if col.kind == "float" and isinstance(value, float):
        return None if not col.finite or math.isfinite(value) else f"is {value}, not finite"
    return f"is a {type(value).__name__}, not {'a number' if col.kind == 'float' else 'an int'}"


def _length(value: Any) -> int:
    return int(value.shape[0]) if hasattr(value, "shape") else len(value)


def column_problem(
    columns: Mapping[str, Any], existing: Mapping[str, Any] | None = None
) -> tuple[str, str] | None:
    """``(column, what is wrong)`` for the first declared column of ``columns`` that breaks
    the schema, or ``None``. ``existing``: the row's columns already on the bus, which
    per-token columns must agree with in length."""
    if not isinstance(columns, dict):
        return "columns", f"is a {type(columns).__name__}, not a dict of named columns"
    for name, value in columns.items():
        if not isinstance(name, str):
            return str(name), "is not a string column name"
        col = SCHEMA.get(name)
        if col is not None:
            problem = _problem(col, value)
            if problem is not None:
                return name, problem
    response = columns.get(names.RESPONSE_IDS)
    if response is None and existing is not None:
        response = existing.get(names.RESPONSE_IDS)
    if response is None:
        return None
    n = _length(response)
    for name, col in SCHEMA.items():
        if not col.per_token:
            continue
        value = columns.get(name)
        if value is None and existing is not None and names.RESPONSE_IDS in columns:
            value = existing.get(name)  # response_ids written after a per-token column
        if value is not None and _length(value) != n:
            return name, f"has {_length(value)} entries but response_ids has {n}"
    prompt = columns.get(names.PROMPT_IDS)
    if prompt is None and existing is not None:
        prompt = existing.get(names.PROMPT_IDS)
    if prompt is None:
        return None
    both = n + _length(prompt)
    for name, col in SCHEMA.items():
        value = columns.get(name) if col.per_sequence_token else None
        if value is not None and _length(value) != both:
            return name, (
                f"has {_length(value)} entries but prompt_ids and response_ids have {both}"
            )
    return None


def check_columns(
    uid: str, columns: Mapping[str, Any], existing: Mapping[str, Any] | None = None
) -> None:
    """Raise ``BadColumn`` naming ``uid`` and the column if ``columns`` break the schema
    (``BadRow`` if ``columns`` is not a dict of named columns at all)."""
    if not isinstance(columns, dict):
        raise BadRow(uid, "columns", f"is a {type(columns).__name__}, not a dict of named columns")
    found = column_problem(columns, existing)
    if found is not None:
        raise BadColumn(uid, *found)


def _field_problem(row: dict[str, Any]) -> tuple[str, str] | None:
    for key in ("uid", "group"):
        value = row.get(key)
        if not isinstance(value, str) or not value:
            return key, f"must be a non-empty string, got {value!r:.60}"
    for key, low in (("version", None), ("group_size", 1)):
        if key not in row and key == "group_size":
            continue
        value = row.get(key)
        if type(value) is not int or (low is not None and value < low):
            need = "an integer" if low is None else f"an integer >= {low}"
            return key, f"must be {need}, got {value!r:.60}"
    return None


def check_rows(rows: Any) -> None:
    """Raise ``BadRow`` (or ``BadColumn``) for the first row of a put that is malformed: not a
    dict, a missing or ill-typed ``uid``/``group``/``version``/``group_size``, or ``columns``
    that break the schema. Called on the whole put before any of it is applied."""
    if not isinstance(rows, list):
        raise BadRow("?", "rows", f"a put carries a list of rows, got {type(rows).__name__}")
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise BadRow(f"#{index}", "row", f"is a {type(row).__name__}, not a dict")
        found = _field_problem(row)
        uid = row.get("uid")
        uid = uid if isinstance(uid, str) else f"#{index}"
        if found is not None:
            raise BadRow(uid, *found)
        if "columns" in row:
            check_columns(uid, row["columns"])
