"""What every role shares: its slice of the config, and its bus connections."""

from __future__ import annotations

import hashlib
import os
from typing import Any

from relax.bus import BusClient
from relax.config import ClusterConfig
from relax.errors import BusError
from relax.media import mm_from_wire


def cluster_config(config: dict[str, Any]) -> ClusterConfig:
    """Roles receive the validated config as plain data (it crosses process boundaries)."""
    return ClusterConfig.model_validate(config)


def cluster_secret(cfg: ClusterConfig) -> str | None:
    """The shared secret: from the config, or from the environment variable it names."""
    if cfg.cluster.secret_env:
        return os.environ.get(cfg.cluster.secret_env)
    return cfg.cluster.secret.get_secret_value() if cfg.cluster.secret else None


async def connect_bus(url: str, cfg: ClusterConfig, name: str) -> BusClient:
    return await BusClient.connect(
        url, secret=cluster_secret(cfg), client_id=name, connect_timeout=60
    )


def as_list(value: Any) -> list[Any]:
    """A column as a plain list (columns may arrive as tensors)."""
    return value.tolist() if hasattr(value, "tolist") else list(value)


def training_row(row: dict[str, Any], columns: tuple[str, ...]) -> dict[str, Any]:
    """A bus row as a training backend's ``Row``: its ``columns``, its ``loss_mask`` when it
    has one (multi-turn rows: observations are conditioned on, never trained on) and its
    ``mm_inputs`` when its prompt has media."""
    cols = row["columns"]
    out: dict[str, Any] = {"group": row["group"], "uid": row["uid"]}
    for name in columns:
        out[name] = float(cols[name]) if name == "reward" else as_list(cols[name])
    if cols.get("loss_mask") is not None:
        out["loss_mask"] = as_list(cols["loss_mask"])
    if cols.get("mm_inputs") is not None:  # the prompt's media, as the rollout saw them
        out["mm_inputs"] = mm_from_wire(cols["mm_inputs"])
    return out


def prompt_seed(seed: int | None, uid: str) -> int | None:
    """The sampling seed of one prompt: stable across processes, retries and batchings."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{uid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


async def write_once(bus: BusClient, items: list[tuple[str, dict[str, Any]]]) -> int:
    """Write many rows' columns in one request, treating "already written" as done; returns
    how many were already written.

    A role restarted with rows still leased retakes them once their lease expires; what its
    earlier incarnation wrote stands (columns are write-once), even if a recompute would
    differ in the last bit. Any other refusal (a row gone from the bus) is an error.
    """
    errors = await bus.add_columns_many(items)
    already = [e for e in errors if e is not None and e.startswith("ColumnConflict")]
    other = [e for e in errors if e is not None and not e.startswith("ColumnConflict")]
    if other:
        raise BusError(f"{len(other)} column writes refused, e.g. {other[0]}")
    return len(already)
