"""Shared pieces of the observability tests: the tiny cluster config, a fake W&B run."""

from __future__ import annotations

from typing import Any

from relax.cluster import plain_config
from relax.config import ClusterConfig, parse_config

TOML = """
staleness = 1
[cluster]
name = "obs"
[model.init]
hidden_size = 32
num_layers = 1
num_heads = 2
num_kv_heads = 1
intermediate_size = 64
vocab_size = 261
[data]
n_samples_per_prompt = 4
[rollout]
max_new_tokens = 4
batch_size = 2
[bus]
lease_timeout = 5
[trainer]
steps = 100000
global_batch_size = 8
micro_batch_size = 8
"""


def config(extra: str = "") -> ClusterConfig:
    """The tiny test cluster, with ``extra`` TOML appended (e.g. a [logging] table)."""
    return parse_config(TOML + extra)


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
