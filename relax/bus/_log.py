"""A crash-safe, append-only log of checksummed segment files.

The TransferQueue appends every state change here and replays the log on restart. The log knows
nothing about the bus: a record is opaque ``bytes`` and gets a sequence number.

Layout: a directory of segment files named by the sequence number of their first record,
zero-padded (``00000000000000000042.seg``) so that sorting names sorts segments. A segment is a
run of frames, each::

    magic b"RXL1" | u32 length | u64 seq | u32 crc | payload        (little-endian, 20-byte header)

where ``crc = zlib.crc32(u32 length | u64 seq | payload)``. Sequence numbers start at 0, are
contiguous inside a segment and across segments, and continue across restarts.

Crash semantics:

- Writes are unbuffered ``os.pwritev`` calls at the end of the data: once :meth:`append`
  returns, the record is in the kernel's page cache and survives the death of this process
  (SIGKILL included). Surviving power loss needs an fsync: ``fsync="always"`` after every
  append, ``"checkpoint"`` (default) at :meth:`sync`, :meth:`close` and when a segment is
  sealed, ``"never"`` not at all (not even at :meth:`sync`; for tests and throw-away runs).
- A process killed mid-write leaves at most a torn *last* record in the *last* segment. Opening
  the directory finds it by length and checksum, truncates the file back to the last intact
  record (so new appends follow good data) and counts it in ``statistics()``.
- Anything else that fails to validate — a bad record in an older segment, a bad record in the
  last segment that intact records follow, a gap between segments — raises :class:`LogCorrupt`
  naming the file and offset. Data is never skipped silently; replay yields only whole,
  checksummed records.
- :meth:`append_many` is one write per segment touched, not a transaction: a crash may keep a
  prefix of the batch (each record in it intact). A state change that must apply atomically
  belongs in one record.
- Released segments are *recycled*: up to two are kept as spare files and renamed into place
  when a new segment starts, so appends overwrite pages the kernel already caches instead of
  allocating fresh ones (measured on this kind of machine: ~450 MB/s appending to a new file,
  ~8 GB/s overwriting a cached one). The old records left beyond the end of the data are
  recognised as stale by their lower sequence numbers and cut off when the segment is sealed or
  the log reopened; they are never replayed.
- New and removed segment files are made durable by fsyncing the directory (unless
  ``fsync="never"``), so a segment that was synced cannot vanish with its directory entry.

One :class:`SegmentLog` owns its directory: it holds an exclusive ``flock`` on it, released by
the kernel when the process dies, so a restarted process never waits on a dead one. Methods are
serialised by a lock, so appending from an executor thread is safe.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import os
import re
import struct
import threading
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from relax.errors import BusError, LogCorrupt  # LogCorrupt: re-exported here
from relax.log import get_logger

log = get_logger("relax.bus.log")

FsyncPolicy = Literal["always", "checkpoint", "never"]

MAGIC = b"RXL1"
_HEADER = struct.Struct("<4sIQI")  # magic, payload length, seq, crc
HEADER_SIZE = _HEADER.size
_CRC_FIELDS = struct.Struct("<IQ")  # the header fields the checksum covers
MAX_RECORD = (1 << 32) - 1
_NAME = re.compile(r"^(\d{20})\.seg$")
_SPARE = re.compile(r"^spare-(\d+)\.free$")
_MAX_SPARES = 2
# Small payloads are copied into one buffer (cheaper than an iovec each); large ones are handed
# to writev as they are, so a 1 MB record is never copied in Python.
_COALESCE_BELOW = 64 << 10
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_sync_data = getattr(os, "fdatasync", os.fsync)  # data + file size, without the mtime update


def _crc(length: int, seq: int, payload: Any) -> int:
    return zlib.crc32(payload, zlib.crc32(_CRC_FIELDS.pack(length, seq)))


def _segment_name(first_seq: int) -> str:
    return f"{first_seq:020d}.seg"


def _as_bytes(record: Any) -> bytes | bytearray | memoryview:
    """A record as a flat byte buffer, without copying it."""
    if isinstance(record, (bytes, bytearray)):
        return record
    view = memoryview(record)
    if view.ndim != 1 or view.format not in ("B", "b", "c"):
        view = view.cast("B")  # raises for non-contiguous buffers: copy those yourself
    return view


class _BadRecord(Exception):
    """Internal: a frame that failed to validate. ``hard`` = intact but inconsistent (never a
    torn write, so never discarded)."""

    def __init__(
        self, offset: int, reason: str, *, hard: bool = False, stale: bool = False
    ) -> None:
        super().__init__(reason)
        self.offset = offset
        self.reason = reason
        self.hard = hard
        self.stale = stale  # an intact record older than expected: a recycled file's leftovers


def _frames(path: Path, first_seq: int, end: int) -> Iterator[tuple[int, bytes]]:
    """Yield ``(seq, payload)`` for the frames in ``path[0:end]``; raise ``_BadRecord`` at the
    first one that is short, damaged or out of sequence."""
    with open(path, "rb", buffering=1 << 20) as f:
        offset, seq = 0, first_seq
        while offset < end:
            if end - offset < HEADER_SIZE:
                raise _BadRecord(offset, f"{end - offset} bytes left, a header needs {HEADER_SIZE}")
            head = f.read(HEADER_SIZE)
            if len(head) < HEADER_SIZE:
                raise _BadRecord(offset, "file ends inside a record header")
            magic, length, rseq, crc = _HEADER.unpack(head)
            if magic != MAGIC:
                raise _BadRecord(offset, f"bad magic {magic!r}")
            # Check the length against the file before reading, so a damaged length field never
            # makes us allocate gigabytes.
            if offset + HEADER_SIZE + length > end:
                raise _BadRecord(offset, f"record of {length} bytes runs past the end of data")
            payload = f.read(length)
            if len(payload) < length:
                raise _BadRecord(offset, "file ends inside a record payload")
            if _crc(length, rseq, payload) != crc:
                raise _BadRecord(offset, "checksum mismatch")
            if rseq < seq:
                raise _BadRecord(offset, f"stale record {rseq} (expected {seq})", stale=True)
            if rseq != seq:
                raise _BadRecord(offset, f"sequence number {rseq}, expected {seq}", hard=True)
            yield rseq, payload
            offset += HEADER_SIZE + length
            seq += 1


def _intact_record_within(data: bytes, min_seq: int) -> bool:
    """Whether any complete, checksummed frame numbered ``min_seq`` or later starts in ``data``
    (older ones are a recycled segment's leftovers, not data).

    A torn write leaves nothing intact after the bad record; finding an intact frame after it
    means damage in the middle of the segment, which must not be truncated away.
    """
    pos = data.find(MAGIC)
    while pos >= 0:
        if len(data) - pos >= HEADER_SIZE:
            _, length, rseq, crc = _HEADER.unpack_from(data, pos)
            start = pos + HEADER_SIZE
            if start + length <= len(data):
                payload = memoryview(data)[start : start + length]
                if rseq >= min_seq and _crc(length, rseq, payload) == crc:
                    return True
        pos = data.find(MAGIC, pos + 1)
    return False


@dataclass
class _Segment:
    first: int  # seq of its first record (= its name)
    path: Path
    size: int  # bytes of intact records
    count: int  # records in it


class SegmentLog:
    """An append-only log of opaque records in rotating, checksummed segment files.

    Opening an existing directory validates every record, discards a torn tail and continues
    the sequence; a fresh directory starts at sequence 0. See the module docstring for the
    format and what survives which crash.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        segment_bytes: int = 64 << 20,
        fsync: FsyncPolicy = "checkpoint",
    ) -> None:
        if segment_bytes <= HEADER_SIZE:
            raise ValueError(f"segment_bytes must exceed {HEADER_SIZE}, got {segment_bytes}")
        if fsync not in ("always", "checkpoint", "never"):
            raise ValueError(f"fsync must be 'always', 'checkpoint' or 'never', got {fsync!r}")
        self._dir = Path(directory)
        self._segment_bytes = segment_bytes
        self._fsync_mode: FsyncPolicy = fsync
        self._durable = fsync != "never"
        self._lock = threading.Lock()
        self._closed = False
        self._broken = ""
        self._dirty = False  # written since the last fsync
        self._fd = -1
        self._spares: list[Path] = []  # released segment files kept for reuse
        self._sealer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="relax-log-seal")
        self._sealing: list[concurrent.futures.Future[None]] = []
        self._stats = {
            "appended": 0,
            "fsyncs": 0,
            "torn_tail_discarded": 0,
            "torn_tail_bytes": 0,
            "corrupt_segments": 0,
        }

        created = not self._dir.exists()
        self._dir.mkdir(parents=True, exist_ok=True)
        self._dir_fd = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                fcntl.flock(self._dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise BusError(f"{self._dir} is in use by another SegmentLog") from None
            if created and self._durable:
                self._fsync_dir(self._dir.parent)
            self._spares = sorted(p for p in self._dir.iterdir() if _SPARE.match(p.name))
            self._segments = self._recover()
            if not self._segments:
                self._segments.append(self._create_segment(0))
            active = self._segments[-1]
            self._next_seq = active.first + active.count
            self._fd = os.open(active.path, os.O_WRONLY | os.O_CLOEXEC)
        except BaseException:
            self._release()
            raise

    # ------------------------------------------------------------------ opening

    def _recover(self) -> list[_Segment]:
        """Validate every segment in order; repair a torn tail of the last one."""
        paths = sorted(p for p in self._dir.iterdir() if _NAME.match(p.name))
        segments: list[_Segment] = []
        for i, path in enumerate(paths):
            first = int(path.name[:20])
            last = i == len(paths) - 1
            if segments:
                expected = segments[-1].first + segments[-1].count
                if first != expected:
                    raise LogCorrupt(
                        f"segment starts at seq {first} but the previous one ends before "
                        f"{expected} (missing, empty or overlapping segment)",
                        path=path,
                        offset=0,
                    )
            size = path.stat().st_size
            count = 0
            try:
                for _ in _frames(path, first, size):
                    count += 1
            except _BadRecord as bad:
                if not last or bad.hard:
                    self._stats["corrupt_segments"] += 1
                    raise LogCorrupt(bad.reason, path=path, offset=bad.offset) from None
                if bad.stale:  # the end of the data in a recycled segment: cut the leftovers
                    os.truncate(path, bad.offset)
                else:
                    self._discard_tail(path, bad, size, first + count)
                size = bad.offset
            segments.append(_Segment(first, path, size, count))
        return segments

    def _discard_tail(self, path: Path, bad: _BadRecord, size: int, next_seq: int) -> None:
        with open(path, "rb") as f:
            f.seek(bad.offset + 1)
            rest = f.read(size - bad.offset - 1)
        if _intact_record_within(rest, next_seq):
            self._stats["corrupt_segments"] += 1
            raise LogCorrupt(
                f"{bad.reason}, and intact records follow it: damage inside the segment, "
                "not a torn write",
                path=path,
                offset=bad.offset,
            )
        # Cut back to the last intact record so new appends follow good data.
        os.truncate(path, bad.offset)
        if self._durable:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._stats["fsyncs"] += 1
        self._stats["torn_tail_discarded"] += 1
        self._stats["torn_tail_bytes"] += size - bad.offset
        log.warning(
            "discarded a torn record at the end of the log",
            path=str(path),
            offset=bad.offset,
            bytes=size - bad.offset,
            reason=bad.reason,
        )

    # ------------------------------------------------------------------ files

    def _fsync_dir(self, directory: Path | None = None) -> None:
        """Make created/removed directory entries durable (a new segment's name is not on disk
        until its directory is synced, whatever happened to the file's data)."""
        if directory is None:
            os.fsync(self._dir_fd)
        else:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._stats["fsyncs"] += 1

    def _create_segment(self, first_seq: int) -> _Segment:
        path = self._dir / _segment_name(first_seq)
        if self._spares:  # recycle: its pages are likely still in the page cache
            os.rename(self._spares.pop(0), path)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            os.close(fd)
        if self._durable:
            self._fsync_dir()
        return _Segment(first_seq, path, 0, 0)

    def _rotate(self) -> None:
        # Seal the old segment before its successor fills: after a power loss a later segment
        # should not be present while an earlier one lost its tail. With fsync="always" the
        # seal is synchronous; with "checkpoint" it runs on a background thread, so appends
        # never stall on flushing a whole segment (the next sync() waits for it).
        old_fd, dirty = self._fd, self._dirty
        os.ftruncate(old_fd, self._segments[-1].size)  # a recycled file's leftovers go now
        segment = self._create_segment(self._next_seq)
        self._fd = os.open(segment.path, os.O_WRONLY | os.O_CLOEXEC)
        self._segments.append(segment)
        self._dirty = False
        if not (self._durable and dirty):
            os.close(old_fd)
        elif self._fsync_mode == "always":
            self._seal(old_fd)
        else:
            self._sealing.append(self._sealer.submit(self._seal, old_fd))

    def _seal(self, fd: int) -> None:
        try:
            _sync_data(fd)
            self._stats["fsyncs"] += 1
        finally:
            os.close(fd)

    def _wait_sealed(self) -> None:
        while self._sealing:
            self._sealing.pop(0).result()

    def _write(self, buffers: list[Any], total: int) -> None:
        """Write every buffer, in order, with as few ``writev`` calls as the kernel allows.

        On failure (disk full, ...) the segment is cut back to where it was, so a partial frame
        never precedes the next append; if even that fails, the log refuses further writes.
        """
        start = self._segments[-1].size
        try:
            i, offset = 0, start
            while i < len(buffers):
                n = os.pwritev(self._fd, buffers[i : i + _IOV_MAX], offset)
                offset += n
                total -= n
                # Skip what was written; a short write leaves a partly written buffer to slice.
                while i < len(buffers) and n >= len(buffers[i]):
                    n -= len(buffers[i])
                    i += 1
                if n:
                    buffers[i] = memoryview(buffers[i])[n:]
            assert total == 0, total
        except BaseException as exc:
            try:
                os.ftruncate(self._fd, start)
            except OSError:
                # Unknown bytes at the end of the segment: refuse further writes; the next
                # open repairs or rejects the tail.
                self._broken = f"a failed write could not be undone ({exc!r})"
                self._release()
            raise

    # ------------------------------------------------------------------ appending

    def _check_open(self) -> None:
        if self._closed:
            why = f": {self._broken}" if self._broken else ""
            raise BusError(f"SegmentLog {self._dir} is closed{why}")

    def append(self, record: bytes) -> int:
        """Append one record; return its sequence number. On return the record survives the
        death of this process; with ``fsync="always"`` also a power loss."""
        return self.append_many((record,))

    def append_many(self, records: Iterable[Any]) -> int:
        """Append records in order with one ``writev`` per segment touched; return the last
        sequence number (``next_seq - 1`` if ``records`` is empty).

        Not atomic across a crash: a prefix of the batch may survive. On an error (a record over
        4 GiB, a full disk) some records before the failing one may have been appended — check
        :attr:`next_seq`; the failing record and those after it were not.
        """
        with self._lock:
            self._check_open()
            active = self._segments[-1]
            buffers: list[Any] = []
            small = bytearray()  # consecutive small frames, coalesced
            batch_bytes = 0
            batch_count = 0

            def flush() -> None:
                nonlocal buffers, small, batch_bytes, batch_count, active
                if small:
                    buffers.append(small)
                if buffers:
                    self._write(buffers, batch_bytes)
                    active.size += batch_bytes
                    active.count += batch_count
                    self._next_seq += batch_count
                    self._stats["appended"] += batch_count
                    self._dirty = True
                buffers, small, batch_bytes, batch_count = [], bytearray(), 0, 0

            for raw in records:
                # A record is one buffer, or a list of buffers written back to back (scatter).
                parts = (
                    [_as_bytes(p) for p in raw]
                    if isinstance(raw, (list, tuple))
                    else [_as_bytes(raw)]
                )
                length = sum(memoryview(p).nbytes for p in parts)
                if length > MAX_RECORD:
                    raise ValueError(f"record of {length} bytes exceeds {MAX_RECORD}")
                frame = HEADER_SIZE + length
                used = active.size + batch_bytes
                # Rotate before a frame that would overflow a non-empty segment; a frame larger
                # than segment_bytes thus gets a segment of its own.
                if used and used + frame > self._segment_bytes:
                    flush()
                    self._rotate()
                    active = self._segments[-1]
                seq = self._next_seq + batch_count
                crc = zlib.crc32(_CRC_FIELDS.pack(length, seq))
                for part in parts:
                    crc = zlib.crc32(part, crc)
                header = _HEADER.pack(MAGIC, length, seq, crc)
                if length < _COALESCE_BELOW:
                    small += header
                    for part in parts:
                        small += part
                else:
                    if small:
                        buffers.append(small)
                        small = bytearray()
                    buffers.append(header)
                    buffers.extend(p for p in parts if memoryview(p).nbytes)
                batch_bytes += frame
                batch_count += 1
            flush()
            if self._fsync_mode == "always":
                self._sync_locked()
            return self._next_seq - 1

    # ------------------------------------------------------------------ durability

    def _sync_locked(self) -> None:
        self._wait_sealed()
        if self._durable and self._dirty:
            _sync_data(self._fd)
            self._stats["fsyncs"] += 1
            self._dirty = False

    def sync(self) -> None:
        """Make every appended record durable (fsync the active segment; sealed segments were
        synced when sealed). A no-op with ``fsync="never"`` or when nothing new was written."""
        with self._lock:
            self._check_open()
            self._sync_locked()

    # ------------------------------------------------------------------ reading

    def replay(self) -> Iterator[tuple[int, bytes]]:
        """Yield ``(seq, payload)`` for every record in the log, oldest first.

        Covers the records present when iteration starts (later appends are not included).
        Records are validated again as they are read; damage raises :class:`LogCorrupt`.
        Do not call :meth:`release_before` for segments a running replay has yet to reach.
        """
        with self._lock:
            snapshot = [(s.first, s.path, s.size) for s in self._segments]
        for first, path, size in snapshot:
            try:
                yield from _frames(path, first, size)
            except _BadRecord as bad:
                self._stats["corrupt_segments"] += 1
                raise LogCorrupt(bad.reason, path=path, offset=bad.offset) from None

    # ------------------------------------------------------------------ trimming

    def release_before(self, seq: int) -> int:
        """Delete whole segments whose records all have a sequence number below ``seq``, oldest
        first, never the active segment. Return how many were deleted."""
        with self._lock:
            self._check_open()
            deleted = 0
            # Segment 0 holds only seqs < segments[1].first; delete while that is <= seq.
            while len(self._segments) > 1 and self._segments[1].first <= seq:
                path = self._segments[0].path
                try:
                    if len(self._spares) < _MAX_SPARES:
                        spare = self._dir / f"spare-{self._segments[0].first}.free"
                        os.rename(path, spare)
                        self._spares.append(spare)
                    else:
                        os.unlink(path)
                except FileNotFoundError:
                    pass
                del self._segments[0]
                deleted += 1
            if deleted and self._durable:
                self._fsync_dir()
            return deleted

    # ------------------------------------------------------------------ state

    @property
    def directory(self) -> Path:
        return self._dir

    @property
    def next_seq(self) -> int:
        """The sequence number the next append gets."""
        return self._next_seq

    @property
    def first_seq(self) -> int:
        """The oldest sequence number still in the log (== ``next_seq`` when it is empty)."""
        return self._segments[0].first

    @property
    def closed(self) -> bool:
        return self._closed

    def statistics(self) -> dict[str, Any]:
        """Counters: ``segments``, ``bytes`` (of live segments), ``records`` (live),
        ``first_seq``, ``next_seq``, ``appended`` (by this instance), ``fsyncs`` (file and
        directory), ``torn_tail_discarded`` / ``torn_tail_bytes`` (repaired at open),
        ``corrupt_segments`` (segments found damaged, at open or during replay)."""
        with self._lock:
            return {
                "segments": len(self._segments),
                "spares": len(self._spares),
                "bytes": sum(s.size for s in self._segments),
                "records": self._next_seq - self._segments[0].first,
                "first_seq": self._segments[0].first,
                "next_seq": self._next_seq,
                "fsync": self._fsync_mode,
                **self._stats,
            }

    def close(self) -> None:
        """Sync (unless ``fsync="never"``), close the files and release the directory."""
        with self._lock:
            if self._closed:
                return
            try:
                self._sync_locked()
            finally:
                self._release()

    def _release(self) -> None:
        self._closed = True
        self._sealer.shutdown(wait=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._dir_fd >= 0:
            os.close(self._dir_fd)  # drops the flock
            self._dir_fd = -1

    def __enter__(self) -> SegmentLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"next_seq={self._next_seq}"
        return f"SegmentLog({str(self._dir)!r}, {state})"


__all__ = ["HEADER_SIZE", "MAGIC", "LogCorrupt", "SegmentLog"]
