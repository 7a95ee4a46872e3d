"""The trainer's record of a run: what `relax replay` needs to re-execute its side exactly.

A run folder's ``record/`` holds three files, written by the trainer (rank 0) as it goes:

``config.json``
    The cluster config of the run's first start (plain JSON) and the model folder it started
    from.
``batches.bin``
    Each step's rows exactly as the training backend received them (lists of floats that
    float32 holds exactly stored as float32 tensors, read back as the same floats), one frame
    per step:
    ``b"RXB1" | u32 length | u32 crc32 | wire message`` (``relax.transport``'s format: msgpack
    and raw tensors, never pickle). Append-only; a frame torn by a kill is never referenced.
``events.jsonl``
    One JSON line per event, in the order they happened:

    - ``{"event": "start", "version", "checkpoint", "adopted", "weights", "threads",
      "config"}``: a trainer (re)started, with ``config`` (a resumed run may change it) and
      ``threads`` torch threads; it loaded the checkpoint of step ``checkpoint`` (or none: a
      fresh model seeded by ``trainer.seed``), then continued from the published weights of
      version ``adopted`` (or not); ``weights`` is the digest of what it then held.
    - ``{"event": "step", "step", "applied", "batch", "metrics", "weights"}``: one step: the
      offset of its frame in ``batches.bin`` (which rows they were, ``[uid, attempt]``, is
      the trainer's ledger's to say: ``trainer-ledger.jsonl``),
      the backend's metrics (timings left out) and, applied, the digest of the new weights.
    - ``{"event": "checkpoint", "step"}``: a checkpoint of that version was saved.

    Written (and fsynced) before the step's publish, like the trainer's ledger; on a restart
    the lines of applied steps above the published version are removed (that update never
    happened: its rows went back to the bus), so the file is the lineage of the final weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax.errors import RecordError
from relax.transport import dumps, loads

RECORD_DIR = "record"
CONFIG_FILE = "config.json"
BATCHES_FILE = "batches.bin"
EVENTS_FILE = "events.jsonl"

_FRAME = struct.Struct("<4sII")
_MAGIC = b"RXB1"


def is_timing(name: str) -> bool:
    """Whether a metric measures time (``*_time_s``), not the computation: a replay never
    compares it."""
    return name.endswith("_time_s")


def weights_digest(state: Mapping[str, Any]) -> str:
    """A digest of a state dict's names, dtypes, shapes and bytes (order-free): each tensor's
    bytes by crc32 (about 3 GB/s on one core, several times blake2b's), those and the names
    through blake2b. For verification, not security: a replay that differs in one bit differs."""
    import torch  # only a trainer or a replay digests weights

    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        tensor = state[name].detach()
        flat = tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|{zlib.crc32(flat)}|".encode())
    return h.hexdigest()


def comparable_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """A step's metrics as plain floats, timings left out (JSON keeps every float's bits)."""
    return {k: float(v) for k, v in metrics.items() if not is_timing(k)}


def drop_unpublished(path: Path, published: int) -> int:
    """Rewrite the JSON-lines file ``path`` without lines of applied steps above the
    ``published`` version (and without a line torn by a kill); returns the lines dropped."""
    if not path.exists():
        return 0
    text = path.read_text()
    lines = text.splitlines()
    keep = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by the kill
        if not (record.get("applied") and record.get("step", 0) > published):
            keep.append(line)
    if len(keep) != len(lines) or (text and not text.endswith("\n")):
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write("".join(line + "\n" for line in keep))
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    return len(lines) - len(keep)


_PACKED = "_float32_lists"
"""A recorded row's list of the keys whose float lists travel as float32 tensors."""
_PACK_AT_LEAST = 32
"""Shorter lists stay lists: a tensor's header and 64-byte alignment outweigh the saving."""


def _pack(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with each list of floats that float32 holds exactly (log-probs, values: they
    came from float32 tensors) as a float32 tensor: 4 bytes a value instead of msgpack's 9.
    ``_unpack`` gives back the very same Python floats."""
    import numpy as np
    import torch

    packed, names = dict(row), []
    for name, value in row.items():
        if not (
            isinstance(value, list)
            and len(value) >= _PACK_AT_LEAST
            and all(type(v) is float for v in value)
        ):
            continue
        wide = np.asarray(value, dtype=np.float64)
        narrow = wide.astype(np.float32)
        if np.array_equal(narrow.astype(np.float64), wide, equal_nan=True):
            packed[name], names = torch.from_numpy(narrow), [*names, name]
    if names:
        packed[_PACKED] = names
    return packed


def _unpack(row: dict[str, Any]) -> dict[str, Any]:
    for name in row.pop(_PACKED, ()):
        row[name] = row[name].tolist()
    return row


def _append_durably(path: Path, data: bytes) -> int:
    """Append ``data`` to ``path``, fsynced; returns the offset it starts at."""
    with open(path, "ab") as f:
        offset = f.tell()
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return offset


class RecordWriter:
    """Appends a trainer's events and batches to ``run_dir/record`` (rank 0 only)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.folder = Path(run_dir) / RECORD_DIR
        self.folder.mkdir(parents=True, exist_ok=True)
        self.events_file = self.folder / EVENTS_FILE
        self.batches_file = self.folder / BATCHES_FILE

    def config(self, config: Mapping[str, Any], model_dir: str) -> None:
        """Keep the config of the run's first start (a restart runs the same one)."""
        path = self.folder / CONFIG_FILE
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"config": config, "model_dir": model_dir}, indent=1))
            tmp.replace(path)

    def forget_unpublished(self, published: int) -> int:
        return drop_unpublished(self.events_file, published)

    def start(
        self,
        *,
        version: int,
        checkpoint: int | None,
        adopted: int | None,
        weights: str,
        threads: int,
        config: Mapping[str, Any],
    ) -> None:
        self._event(
            event="start",
            version=version,
            checkpoint=checkpoint,
            adopted=adopted,
            weights=weights,
            threads=threads,
            config=config,
        )

    def step(
        self,
        *,
        step: int,
        applied: bool,
        rows: list[dict[str, Any]],
        metrics: Mapping[str, Any],
        weights: str | None,
    ) -> None:
        """Record one step: its rows first (durably), then the line that points at them."""
        message = dumps({"rows": [_pack(row) for row in rows]})
        frame = _FRAME.pack(_MAGIC, len(message), zlib.crc32(message)) + message
        offset = _append_durably(self.batches_file, frame)
        self._event(
            event="step",
            step=step,
            applied=applied,
            batch=offset,
            metrics=comparable_metrics(metrics),
            weights=weights,
        )

    def checkpoint(self, step: int) -> None:
        self._event(event="checkpoint", step=step)

    def _event(self, **event: Any) -> None:
        _append_durably(self.events_file, (json.dumps(event) + "\n").encode())


@dataclass(frozen=True)
class Record:
    """A run's record, read back (see the module docstring)."""

    folder: Path
    config: dict[str, Any]
    model_dir: str
    events: list[dict[str, Any]]

    @classmethod
    def read(cls, run_dir: str | Path) -> Record:
        folder = Path(run_dir) / RECORD_DIR
        try:
            head = json.loads((folder / CONFIG_FILE).read_text())
            text = (folder / EVENTS_FILE).read_text()
        except FileNotFoundError as exc:
            raise RecordError(
                f"{run_dir} holds no complete trainer record ({exc.filename} is missing): "
                "the run did not train a step, or ran with trainer.record = false"
            ) from None
        events, lines = [], text.splitlines()
        for number, line in enumerate(lines, 1):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                if number != len(lines):  # only the last line may be torn
                    raise RecordError(f"{folder / EVENTS_FILE}: line {number} is damaged") from None
        if not events or events[0].get("event") != "start":
            raise RecordError(f"{folder / EVENTS_FILE}: does not begin with a trainer start")
        return cls(folder, head["config"], head["model_dir"], events)

    def rows(self, offset: int) -> list[dict[str, Any]]:
        """The rows of the step whose frame starts at ``offset``, checked against its crc."""
        path = self.folder / BATCHES_FILE
        with open(path, "rb") as f:
            f.seek(offset)
            prefix = f.read(_FRAME.size)
            if len(prefix) == _FRAME.size:
                magic, length, crc = _FRAME.unpack(prefix)
                message = f.read(length)
                if magic == _MAGIC and len(message) == length and zlib.crc32(message) == crc:
                    return [_unpack(row) for row in loads(message)["rows"]]
        raise RecordError(f"{path}: the frame at offset {offset} is damaged or missing")
