"""The weights channel's store: the latest committed policy versions, in buckets.

Latest-value and versioned: the trainer opens a version, sends its tensors in buckets and
commits; only a committed version is ever visible, so a subscriber never sees a mix of two.
The newest ``keep`` versions stay readable so a subscriber part-way through version ``v`` can
finish it even if ``v+1`` lands meanwhile; an older one is gone (``VersionGone``: start over
with the latest).

With a directory, a commit is three moves, and the bus's log decides between the first two
(``BusService._op_w_commit``): ``seal`` + ``stage`` write the version under a temporary name
(``.v<N>.staged``, all bytes on disk), the bus logs ONE commit record (version, publish id and
the ack of the rows it was trained on), then ``promote`` renames the file to its final name
and makes the version visible. ``recover`` is given the newest version the log committed: a
staged file the log knows is promoted, one it does not know is deleted, and so is a final file
above it — a restarted bus never serves weights whose commit (and ack) it did not log.

A version whose bytes travel over the weight plane's tensor group (``meta["via"] ==
"group"``, ``_plane``) still has its bytes here, for late joiners, receivers whose transfer
failed, the evaluator and a restarted trainer, but not through the bus's RPC: the trainer
writes the staged file itself (``meta["store"] == "file"``, :meth:`staged_path`; committed
``stored="file"``), and ``get_bucket`` reads that version's buckets from its file. A trainer
that cannot reach the directory (another machine, no shared file system) puts the buckets as
usual. Only the legacy group publish (no ``store``) holds just the layout.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from relax.errors import BusError, UploadLost, VersionGone  # re-exported here
from relax.transport import RawTensor


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

    def begin(self, version: int, meta: dict[str, Any], publish: str | None = None) -> None:
        if version <= self.current:
            raise BusError(f"weight version {version} is not newer than the current {self.current}")
        buckets = int(meta.get("buckets", 0))
        if buckets < 1:
            raise BusError("a weight version needs at least one bucket")
        # A legacy group publish (nccl://, no store) holds only its layout here.
        fill = {} if meta.get("via") == "group" and not meta.get("store") else None
        entry = {"meta": dict(meta), "buckets": [fill] * buckets, "publish": publish}
        self.open = {version: entry}  # one at a time

    def pending_after(self, after: int, skip: str | None = None) -> dict[str, Any] | None:
        """The version being published over a tensor group, if above ``after`` and not the
        publish ``skip`` (one already taken part in: a restarted trainer publishes the same
        version again under a new id): its receivers join the transfer before the commit, and
        switch to it only once it is committed."""
        for version, entry in self.open.items():
            if (
                version > after
                and version > self.current
                and entry["meta"].get("via") == "group"
                and (skip is None or entry["publish"] != skip)
            ):
                head = {"version": version, "meta": entry["meta"], "buckets": len(entry["buckets"])}
                return {**head, "committed": False, "publish": entry["publish"]}
        return None

    def staged_path(self, version: int) -> Path | None:
        """Where the publisher of ``version`` writes its bytes itself (``store = "file"``)."""
        return self._staged(version) if self.directory is not None else None

    def put_bucket(self, version: int, index: int, tensors: dict[str, Any]) -> None:
        pending = self.open.get(version)
        if pending is None:
            raise UploadLost(f"weight version {version} was not begun (or was replaced)")
        if not 0 <= index < len(pending["buckets"]):
            raise BusError(f"bucket {index} out of range for version {version}")
        pending["buckets"][index] = tensors
        self.stats["buckets_in"] += 1
        self.stats["bytes_in"] += sum(_nbytes(t) for t in tensors.values())

    def seal(self, version: int, stored: str = "put") -> dict[str, Any]:
        """Close the open upload of ``version`` (every bucket must be there) for ``stage``;
        ``stored="file"``: the publisher wrote the staged file itself."""
        pending = self.open.get(version)
        if pending is None:
            raise UploadLost(f"weight version {version} was not begun")
        if stored == "file":
            path = self.staged_path(version)
            if path is None or not path.exists():
                del self.open[version]  # the retry begins again, and writes it again
                raise UploadLost(f"weight version {version}: the publisher's file is missing")
            pending["file"] = True
            del self.open[version]
            return pending
        missing = [i for i, b in enumerate(pending["buckets"]) if b is None]
        if missing:
            raise BusError(f"weight version {version} is missing buckets {missing}")
        del self.open[version]
        return pending

    def stage(self, version: int, entry: dict[str, Any]) -> None:
        """Write a sealed version under its temporary name (a thread may run this)."""
        if self.directory is not None and not entry.get("file") and not _layout_only(entry):
            self._write(version, entry, self._staged(version))

    def promote(self, version: int, entry: dict[str, Any], *, prune: bool = True) -> None:
        """The log holds the commit: the version becomes the current one (file renamed);
        older files are deleted now, or (``prune=False``) when the caller calls
        ``prune_files``."""
        if self.directory is not None and not _layout_only(entry):
            os.replace(self._staged(version), self._final(version))
            if prune:
                self.prune_files()
        self.committed[version] = entry
        for old in sorted(self.committed)[: -self.keep]:
            del self.committed[old]
        self.stats["published"] += 1

    def discard(self, version: int) -> None:
        """The commit was not logged after all: its staged file must never be served."""
        if self.directory is not None:
            self._staged(version).unlink(missing_ok=True)

    def commit(self, version: int) -> None:
        """Seal, stage and promote at once: for a store whose commits nothing else logs."""
        entry = self.seal(version)
        self.stage(version, entry)
        self.promote(version, entry)

    def latest_after(self, after: int) -> dict[str, Any] | None:
        if self.current <= after:
            return None
        entry = self.committed[self.current]
        head = {"version": self.current, "meta": entry["meta"], "buckets": len(entry["buckets"])}
        if self.directory is not None and not _layout_only(entry):
            # Where its bytes are: a receiver that can read this folder (the same machine, a
            # shared file system) reads them there, checked against the publisher's checksums.
            head["file"] = str(self._final(self.current).resolve())
        return head

    def get_bucket(self, version: int, index: int) -> dict[str, Any]:
        entry = self.committed.get(version)
        if entry is None:
            raise VersionGone(f"weight version {version} is gone; the latest is {self.current}")
        if _layout_only(entry):
            raise BusError(f"weight version {version} travels over a tensor group, not the bus")
        if not 0 <= index < len(entry["buckets"]):
            raise BusError(f"bucket {index} out of range for version {version}")
        tensors = entry["buckets"][index]
        if tensors is None:  # written by its publisher: read from the file, held by nobody
            tensors = self._read_bucket(version, index)
        self.stats["buckets_out"] += 1
        self.stats["bytes_out"] += sum(_nbytes(t) for t in tensors.values())
        return {"version": version, "index": index, "tensors": tensors}

    def statistics(self) -> dict[str, Any]:
        return {**self.stats, "current": self.current, "versions": sorted(self.committed)}

    # ------------------------------------------------------------------ on disk

    def _staged(self, version: int) -> Path:
        assert self.directory is not None
        return self.directory / f".v{version:012d}.staged"

    def _final(self, version: int) -> Path:
        assert self.directory is not None
        return self.directory / f"v{version:012d}.safetensors"

    def _write(self, version: int, entry: dict[str, Any], path: Path) -> None:
        """Straight from the tensors' bytes (wire-form tensors are never turned into torch
        tensors here); ``safetensors`` reads it back in ``recover``."""
        write_version_file(path, version, entry["meta"], entry["buckets"], fsync=self.fsync)

    def _read_bucket(self, version: int, index: int) -> dict[str, Any]:
        prefix = f"{index}/"
        try:
            _, tensors = read_version_file(self._final(version), prefix)
        except FileNotFoundError:
            raise VersionGone(
                f"weight version {version} is gone; the latest is {self.current}"
            ) from None
        return {key[len(prefix) :]: t for key, t in tensors.items()}

    def prune_files(self) -> None:
        """Delete the version files older than the newest ``keep``."""
        if self.directory is None:
            return
        for old in sorted(self.directory.glob("v*.safetensors"))[: -self.keep]:
            old.unlink(missing_ok=True)

    def recover(self, committed: int | None = None, *, trust_final: bool = False) -> None:
        """Load the newest version written before a restart.

        ``committed``: the newest version the bus log committed (-1: none). A staged file at or
        below it was committed (the bus died before the rename) and is promoted; anything above
        it — staged or final — was never logged and is deleted, never served. ``None``, or
        ``trust_final`` (a log from before commit records), keeps the final files as they are.
        """
        if self.directory is None or not self.directory.exists():
            return
        known = -1 if committed is None else committed
        for tmp in self.directory.glob(".v*.tmp"):  # both .v<N>.tmp and .v<N>.staged.tmp
            tmp.unlink(missing_ok=True)  # a write torn by the kill
        for staged in sorted(self.directory.glob(".v*.staged")):
            version = int(staged.name[2:].split(".")[0])
            if version <= known:
                os.replace(staged, self._final(version))
            else:
                staged.unlink(missing_ok=True)
        files = []
        for path in sorted(self.directory.glob("v*.safetensors")):
            unknown = int(path.name[1:].split(".")[0]) > known
            if unknown and committed is not None and not trust_final:
                path.unlink(missing_ok=True)
            else:
                files.append(path)
        if not files:
            return
        self.prune_files()
        meta, tensors = read_version_file(files[-1])
        info = json.loads(meta["meta"])
        buckets: list[dict[str, Any]] = [{} for _ in range(int(info["buckets"]))]
        for key, tensor in tensors.items():
            index, name = key.split("/", 1)
            buckets[int(index)][name] = tensor
        self.committed[int(meta["version"])] = {"meta": info, "buckets": buckets}


def _layout_only(entry: dict[str, Any]) -> bool:
    """A legacy group publish: the bus holds its layout, not its bytes."""
    return entry["meta"].get("via") == "group" and not entry["meta"].get("store")


def write_version_file(
    path: Path, version: int, meta: dict[str, Any], buckets: list[dict[str, Any]], *, fsync: bool
) -> None:
    """Write a weight version as one safetensors file at ``path`` (via a ``.tmp``: a torn write
    never carries the name); what the bus and the weight plane's publisher both write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header: dict[str, Any] = {"__metadata__": {"version": str(version), "meta": json.dumps(meta)}}
    views, offset = [], 0
    for i, bucket in enumerate(buckets):
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
    tmp = path.with_name(f"{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for view in views:
            f.write(view)
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)


def read_version_file(path: Path, prefix: str = "") -> tuple[dict[str, str], dict[str, RawTensor]]:
    """The metadata and the tensors whose names start with ``prefix`` of a file
    ``write_version_file`` wrote, in wire form (``RawTensor``), in the order written. Without
    torch: a bus serving a version from its file never imports it (a first read used to cost
    its process torch's import, 1.7 s, while a restarted trainer waited for its weights)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        meta = header.pop("__metadata__", {})
        tensors = {}
        for key, info in header.items():
            if not key.startswith(prefix):
                continue
            begin, end = info["data_offsets"]
            f.seek(8 + length + begin)
            data = f.read(end - begin)
            if len(data) != end - begin:
                raise BusError(f"{path.name}: tensor {key!r} is cut short")
            dtype = _WIRE_DTYPES[info["dtype"]]
            tensors[key] = RawTensor(dtype, info["shape"], memoryview(data))
    return meta, tensors


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


_WIRE_DTYPES = {st: wire for wire, st in _ST_DTYPES.items()}


def _raw(tensor: Any) -> tuple[memoryview, str, list[int]]:
    """A tensor's bytes, wire dtype name and shape, without a copy where possible."""
    if isinstance(tensor, RawTensor):
        return tensor.data, tensor.dtype, tensor.shape
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    view = memoryview(flat.view(torch.uint8).numpy()).cast("B") if flat.numel() else memoryview(b"")
    return view, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)
