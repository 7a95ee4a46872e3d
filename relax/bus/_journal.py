"""The bus's memory of finished uids and dropped groups, kept beside its log, not in it.

A finished row leaves the table, but its uid is remembered (up to ``dedup_window`` of them) so
a retried put of it is ignored: nothing is trained twice. Compaction deletes the log segments
whose acks finished those rows, so the memory must survive elsewhere. It used to ride in every
compaction's state record — at a full window (a million uids, ~40 MB) every 4,096 records,
serialised on the event loop. Here each compaction appends only what finished since the last
one (``KeyJournal``: one for uids, one for dropped groups), and a journal drops its records
once newer ones hold a full window.

Order, which makes a kill anywhere harmless: the log's batch with the state record is written
first, then this delta, then the log's old segments are released. Killed before the delta, the
log still holds every op since the previous compaction and replaying it re-finds those uids;
the delta never holds a uid whose finishing op is not in the log.
"""

from __future__ import annotations

import os
from pathlib import Path

from relax.bus._log import FsyncPolicy, SegmentLog
from relax.transport import dumps, loads


class KeyJournal:
    """Append-only records, each a list of keys (uids, or group names), pruned to the newest
    records that hold ``window`` keys."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        window: int,
        segment_bytes: int | None = None,
        fsync: FsyncPolicy = "checkpoint",
    ) -> None:
        self.window = window
        # Whole segments are what can be deleted: a few per window (a uid takes ~10-40 bytes).
        size = segment_bytes if segment_bytes is not None else max(1024, 8 * window)
        self._log = SegmentLog(Path(directory), segment_bytes=size, fsync=fsync)
        self._sizes: list[tuple[int, int]] = []  # (seq, keys) per record held

    def load(self) -> list[str]:
        """Every key held, oldest first (what a restarted bus remembers)."""
        keys: list[str] = []
        for seq, payload in self._log.replay():
            record = loads(payload)
            keys.extend(record)
            self._sizes.append((seq, len(record)))
        return keys

    def append(self, keys: list[str]) -> None:
        if not keys:
            return
        seq = self._log.append_many([dumps(keys)])
        self._sizes.append((seq, len(keys)))
        held, keep_from = 0, seq
        for at, n in reversed(self._sizes):
            if held >= self.window:
                break
            held, keep_from = held + n, at
        if keep_from > self._sizes[0][0]:
            self._log.release_before(keep_from)  # whole segments only: some older may stay
            self._sizes = [s for s in self._sizes if s[0] >= keep_from]

    def sync(self) -> None:
        self._log.sync()

    def statistics(self) -> dict[str, int]:
        return {"records": len(self._sizes), "keys": sum(n for _, n in self._sizes)}

    def close(self) -> None:
        self._log.close()
