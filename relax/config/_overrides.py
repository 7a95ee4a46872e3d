"""``key.path=value`` overrides on parsed TOML, for `relax up --set` and `relax validate --set`."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from typing import Any

from relax.config._base import format_path, show
from relax.errors import ConfigError, ConfigIssue

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

PathPart = str | int

_SEGMENT = re.compile(r"([A-Za-z0-9_-]+)((?:\[\d+\])*)")


def override_path(key: str) -> tuple[PathPart, ...] | None:
    """``actors[0].placement`` -> ``("actors", 0, "placement")``; None when malformed."""
    parts: list[PathPart] = []
    for segment in key.split("."):
        match = _SEGMENT.fullmatch(segment)
        if match is None:
            return None
        parts.append(match.group(1))
        parts += [int(index) for index in re.findall(r"\[(\d+)\]", match.group(2))]
    return tuple(parts)


def _override_value(text: str) -> Any:
    """A TOML value (``2``, ``inf``, ``true``, ``["a"]``), else the text as a bare string."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def _set_path(data: dict[str, Any], path: tuple[PathPart, ...]) -> tuple[Any, PathPart]:
    """The container holding ``path``'s last part (creating tables on the way) and that part."""
    node: Any = data
    for depth, part in enumerate(path[:-1]):
        where = format_path(path[: depth + 1])
        if isinstance(part, int):
            if not isinstance(node, list):
                raise LookupError(f"{format_path(path[:depth])} is not an array")
            if part >= len(node):
                raise LookupError(f"{where} does not exist ({len(node)} items)")
            node = node[part]
        else:
            if not isinstance(node, dict):
                raise LookupError(f"{format_path(path[:depth])} is {show(node)}, not a table")
            if part not in node:
                if isinstance(path[depth + 1], int):
                    raise LookupError(f"{where} does not exist")
                node[part] = {}
            node = node[part]
    last = path[-1]
    if isinstance(last, int):
        if not isinstance(node, list):
            raise LookupError(f"{format_path(path[:-1])} is not an array")
        if last >= len(node):
            raise LookupError(f"{format_path(path)} does not exist ({len(node)} items)")
    elif not isinstance(node, dict):
        raise LookupError(f"{format_path(path[:-1])} is {show(node)}, not a table")
    return node, last


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of ``data`` with each ``key.path=value`` override applied, in order.

    Keys are dotted, with ``[i]`` for array items (``actors[0].placement=process``); missing
    tables are created. The value is read as a TOML value (``2``, ``inf``, ``true``,
    ``"text"``, ``[1, 2]``) and otherwise taken as a bare string (``model.path=/models/qwen``).
    Raises ``ConfigError`` naming every malformed override.
    """
    result = copy.deepcopy(dict(data))
    issues: list[ConfigIssue] = []
    for override in overrides:
        key, sep, raw = override.partition("=")
        key, raw = key.strip(), raw.strip()
        path = override_path(key) if key else None
        if not sep or path is None:
            issues.append(
                ConfigIssue(
                    path=key if sep else "",
                    message=f"malformed override {override!r}: expected KEY=VALUE"
                    " with KEY like rollout.replicas or actors[0].placement",
                )
            )
            continue
        if not raw:
            issues.append(
                ConfigIssue(
                    path=key,
                    message=f"override {override!r} has no value",
                    hint=f'write {key}="" for an empty string',
                )
            )
            continue
        try:
            container, last = _set_path(result, path)
        except LookupError as exc:
            issues.append(
                ConfigIssue(path=key, message=f"cannot apply override {override!r}: {exc}")
            )
            continue
        container[last] = _override_value(raw)
    if issues:
        raise ConfigError(issues, source="overrides")
    return result


__all__ = ["apply_overrides", "override_path"]
