"""Log files of Ray children, relayed to the run folder on the supervisor's machine.

A Ray node need not share a file system with the head: a child there writes its per-actor
JSON log files (``relax.log``) into a folder of its launcher's on its own node, and the
supervisor's side of the member pulls what is new, in whole lines, every ``RELAY_INTERVAL``
seconds and appends it to the same file names in ``RUN_DIR/logs/`` — where `relax logs` reads,
whichever node wrote. The last lines of a child that died (a crash's traceback) are pulled once
more after its end, before its launcher goes.

The folders a launcher makes on its node carry its pid (``relax-logs-<pid>-...``): a launcher
Ray killed outright (``ray.kill``, a lost raylet) cannot remove its own, so the next launcher
on that node removes those whose launcher is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

RELAY_INTERVAL = 0.5
"""Seconds between two pulls of a Ray child's new log lines."""

PULL_LIMIT = 4 << 20
"""Bytes one pull returns at most (the rest comes with the next)."""

_OWNED = re.compile(r"^relax-(?:gang|logs)-(\d+)-")


def node_folder(kind: str) -> str:
    """A fresh folder on this node for this launcher (``kind``: ``gang`` or ``logs``)."""
    return tempfile.mkdtemp(prefix=f"relax-{kind}-{os.getpid()}-")


def remove_orphans() -> list[str]:
    """Remove this node's launcher folders whose launcher process is gone; returns them."""
    removed = []
    base = Path(tempfile.gettempdir())
    for path in base.glob("relax-*-*-*"):
        owner = _OWNED.match(path.name)
        if owner is None or _running(int(owner.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: not ours to judge
        return True
    return True


def read_new(folder: str, offsets: dict[str, int], limit: int = PULL_LIMIT) -> dict[str, bytes]:
    """The whole lines each log file of ``folder`` has past ``offsets`` (by file name), at
    most ``limit`` bytes in all; a line still being written waits for the next read."""
    chunks: dict[str, bytes] = {}
    left = limit
    for path in sorted(Path(folder).glob("*.jsonl")):
        start = offsets.get(path.name, 0)
        with contextlib.suppress(OSError), path.open("rb") as f:
            f.seek(start)
            data = f.read(left)
            whole = data[: data.rfind(b"\n") + 1]
            if whole:
                chunks[path.name] = whole
                left -= len(whole)
        if left <= 0:
            break
    return chunks


class LogSink:
    """The supervisor's side: appends pulled lines to the run's log folder, keeping offsets."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        self.offsets: dict[str, int] = {}
        self.lines = 0

    def write(self, chunks: dict[str, bytes]) -> int:
        """Append ``chunks`` (file name -> whole lines); returns the bytes written."""
        written = 0
        for name, data in chunks.items():
            if Path(name).name != name or not name.endswith(".jsonl"):
                continue  # only plain file names of log files, never a path elsewhere
            self.folder.mkdir(parents=True, exist_ok=True)
            # One append per chunk of whole lines: the lines of local processes writing the
            # same file (another member, the next incarnation) never tear into these.
            fd = os.open(self.folder / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            self.offsets[name] = self.offsets.get(name, 0) + len(data)
            self.lines += data.count(b"\n")
            written += len(data)
        return written


__all__ = ["PULL_LIMIT", "RELAY_INTERVAL", "LogSink", "node_folder", "read_new", "remove_orphans"]
