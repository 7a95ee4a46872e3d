"""Where log lines go while `relax up` runs in this process: through :class:`StderrPump` to
above the progress bar, or to whatever ``sys.stderr`` is at the time (:class:`CurrentStderr`)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable

from relax.log import CurrentStderr


class StderrPump:
    """While a progress bar is drawn, everything written to file descriptor 2 — this process's
    structured logs and those of its child processes, which inherit the descriptor — goes
    through a pipe and is printed readably above the bar (warnings and errors only, unless
    ``verbose``) instead of tearing it."""

    def __init__(self, show: Callable[[str], None], *, verbose: bool) -> None:
        self.show, self.verbose = show, verbose
        self.saved: int | None = None
        self.thread: threading.Thread | None = None

    def __enter__(self) -> StderrPump:
        sys.stderr.flush()
        self.saved = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self.thread = threading.Thread(target=self._pump, args=(read,), daemon=True)
        self.thread.start()
        return self

    def _pump(self, fd: int) -> None:
        from relax.cli._logs import format_record, level_rank, parse_line

        with os.fdopen(fd, "rb") as lines:
            for raw in lines:
                text = raw.decode("utf-8", "replace").rstrip("\n")
                record = parse_line(text)
                try:
                    if record is None:
                        if text.strip():
                            self.show(text)
                    elif self.verbose or level_rank(record.get("level")) >= 2:
                        self.show(format_record(record))
                except Exception:  # never let a display problem block the writers
                    continue

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        if self.saved is not None:
            os.dup2(self.saved, 2)  # closes our end of the pipe: the pump reads to the end
            os.close(self.saved)
        if self.thread is not None:
            self.thread.join(timeout=2)  # a child still holding the pipe must not hang us


class Descriptor2(CurrentStderr):
    """File descriptor 2 itself: past any ``sys.stderr`` replacement (rich's, while the
    progress bar is drawn), into the pipe of :class:`StderrPump`."""

    def write(self, text: str) -> int:
        os.write(2, text.encode("utf-8", "replace"))
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False
