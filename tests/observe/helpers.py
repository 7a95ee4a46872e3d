"""Shared pieces of the observability tests: the tiny cluster config, a fake W&B run."""

from __future__ import annotations

from typing import Any

from relax.cluster import plain_config
from relax.config import ClusterConfig, parse_config
from tests.tiny import tiny_toml


def toml(**options: str) -> str:
    """The tiny test cluster's text; ``options`` go to ``tests.tiny.tiny_toml`` (extra lines)."""
    return tiny_toml("obs", **options)


def config(extra: str = "") -> ClusterConfig:
    """The tiny test cluster, with ``extra`` TOML appended (e.g. a [logging] table)."""
    return parse_config(toml(extra=extra))


def plain(cfg: ClusterConfig) -> dict[str, Any]:
    return plain_config(cfg)


class FakeRun:
    def __init__(self, **init: Any) -> None:
        self.init = init
        self.logged: list[tuple[dict[str, float], int | None]] = []
        self.finished = False

    def log(self, data: dict[str, float], step: int | None = None) -> None:
        self.logged.append((dict(data), step))

    def finish(self) -> None:
        self.finished = True
