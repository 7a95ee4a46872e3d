"""The weights channel's store: the latest committed policy versions, in buckets.

Latest-value and versioned: the trainer opens a version, sends its tensors in buckets and
commits; only a committed version is ever visible, so a subscriber never sees a mix of two.
The newest ``keep`` versions stay readable so a subscriber part-way through version ``v`` can
finish it even if ``v+1`` lands meanwhile; an older one is gone (``VersionGone``: start over
with the latest). With a directory, each committed version is also written as one safetensors
file (write, fsync, rename), so a restarted bus serves the current weights at once.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from relax.errors import BusError
from relax.transport import RawTensor


class VersionGone(BusError):
    """That weight version was superseded and dropped; poll for the latest and start over."""


class WeightStore:
    def __init__(
        self, directory: Path | None = None, *, keep: int = 2, fsync: bool = False
    ) -> None:
        self.directory = directory
        self.fsync = fsync
        self.keep = max(1, keep)
        self.committed: dict[int, dict[str, Any]] = {}  # version -> {"meta", "buckets"}
        self.open: dict[int, dict[str, Any]] = {}
        self.stats = {
            "published": 0,
            "buckets_in": 0,
            "buckets_out": 0,
            "bytes_in": 0,
            "bytes_out": 0,
        }

    @property
    def current(self) -> int:
        return max(self.committed, default=-1)

    def begin(self, version: int, meta: dict[str, Any]) -> None:
        if version <= self.current:
            raise BusError(f"weight version {version} is not newer than the current {self.current}")
        buckets = int(meta.get("buckets", 0))
        if buckets < 1:
            raise BusError("a weight version needs at least one bucket")
        # A version whose bytes travel over a tensor group (nccl://) holds only its layout here.
        fill = {} if meta.get("via") == "group" else None
        self.open = {version: {"meta": dict(meta), "buckets": [fill] * buckets}}  # one at a time

    def put_bucket(self, version: int, index: int, tensors: dict[str, Any]) -> None:
        pending = self.open.get(version)
        if pending is None:
            raise BusError(f"weight version {version} was not begun (or was replaced)")
        if not 0 <= index < len(pending["buckets"]):
            raise BusError(f"bucket {index} out of range for version {version}")
        pending["buckets"][index] = tensors
        self.stats["buckets_in"] += 1
        self.stats["bytes_in"] += sum(_nbytes(t) for t in tensors.values())

    def commit(self, version: int) -> None:
        pending = self.open.pop(version, None)
        if pending is None:
            raise BusError(f"weight version {version} was not begun")
        missing = [i for i, b in enumerate(pending["buckets"]) if b is None]
        if missing:
            raise BusError(f"weight version {version} is missing buckets {missing}")
        if self.directory is not None and pending["meta"].get("via") != "group":
            self._persist(version, pending)
        self.committed[version] = pending
        for old in sorted(self.committed)[: -self.keep]:
            del self.committed[old]
        self.stats["published"] += 1

    def latest_after(self, after: int) -> dict[str, Any] | None:
        if self.current <= after:
            return None
        entry = self.committed[self.current]
        return {"version": self.current, "meta": entry["meta"], "buckets": len(entry["buckets"])}

    def get_bucket(self, version: int, index: int) -> dict[str, Any]:
        entry = self.committed.get(version)
        if entry is None:
            raise VersionGone(f"weight version {version} is gone; the latest is {self.current}")
        if entry["meta"].get("via") == "group":
            raise BusError(f"weight version {version} travels over a tensor group, not the bus")
        tensors = entry["buckets"][index]
        self.stats["buckets_out"] += 1
        self.stats["bytes_out"] += sum(_nbytes(t) for t in tensors.values())
        return {"version": version, "index": index, "tensors": tensors}

    def statistics(self) -> dict[str, Any]:
        return {**self.stats, "current": self.current, "versions": sorted(self.committed)}

    # ------------------------------------------------------------------ on disk

    def _persist(self, version: int, entry: dict[str, Any]) -> None:
        """Write the version as one safetensors file (tmp, then rename: all or nothing).

        The file is written straight from the tensors' bytes (wire-form tensors are never
        turned into torch tensors here); ``safetensors`` reads it back in ``recover``.
        """
        assert self.directory is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        header: dict[str, Any] = {
            "__metadata__": {"version": str(version), "meta": json.dumps(entry["meta"])}
        }
        views, offset = [], 0
        for i, bucket in enumerate(entry["buckets"]):
            for name, tensor in bucket.items():
                view, dtype, shape = _raw(tensor)
                header[f"{i}/{name}"] = {
                    "dtype": _ST_DTYPES[dtype],
                    "shape": shape,
                    "data_offsets": [offset, offset + view.nbytes],
                }
                views.append(view)
                offset += view.nbytes
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * ((-len(head)) % 8)  # safetensors aligns the data to 8 bytes
        tmp = self.directory / f".v{version}.tmp"
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for view in views:
                f.write(view)
            if self.fsync:
                os.fsync(f.fileno())
        os.replace(tmp, self.directory / f"v{version:012d}.safetensors")
        for old in sorted(self.directory.glob("v*.safetensors"))[: -self.keep]:
            old.unlink(missing_ok=True)

    def recover(self) -> None:
        """Load the newest committed version written before a restart."""
        if self.directory is None or not self.directory.exists():
            return
        files = sorted(self.directory.glob("v*.safetensors"))
        if not files:
            return
        from safetensors import safe_open

        with safe_open(str(files[-1]), framework="pt") as f:
            meta = f.metadata()
            info = json.loads(meta["meta"])
            buckets: list[dict[str, Any]] = [{} for _ in range(int(info["buckets"]))]
            for key in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                index, name = key.split("/", 1)
                buckets[int(index)][name] = f.get_tensor(key)
        self.committed[int(meta["version"])] = {"meta": info, "buckets": buckets}


def _nbytes(tensor: Any) -> int:
    return (
        tensor.nbytes if isinstance(tensor, RawTensor) else tensor.numel() * tensor.element_size()
    )


# safetensors' names for our wire dtypes.
_ST_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def _raw(tensor: Any) -> tuple[memoryview, str, list[int]]:
    """A tensor's bytes, wire dtype name and shape, without a copy where possible."""
    if isinstance(tensor, RawTensor):
        return tensor.data, tensor.dtype, tensor.shape
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    view = memoryview(flat.view(torch.uint8).numpy()).cast("B") if flat.numel() else memoryview(b"")
    return view, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)
