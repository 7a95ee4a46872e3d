"""Ctrl-C and SIGTERM while `relax up` runs the cluster in this process.

Levels: the first signal asks for a clean stop (the tree stops in reverse start order and the
trainer saves a checkpoint, as with ``relax down``), the next leaves the run (cancels it), the
next exits at once; a SIGTERM counts one level more than a Ctrl-C. Only ``relax up`` sees a
Ctrl-C: its children start with SIGINT blocked (:class:`SignalRouting`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Coroutine
from typing import Any

EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C: 128 + SIGINT, as shells report it."""


class SignalRouting:
    """SIGINT blocked in this (main) thread while the cluster runs, and received on a helper
    thread instead (Python still runs the handler on the main thread's event loop).

    Why: a child process inherits the signal mask of the thread that starts it, so the
    actors' processes start with SIGINT blocked. A Ctrl-C in a terminal goes to the whole
    foreground process group; this way only ``relax up`` sees it and stops the tree in order,
    instead of every child dying at once of a KeyboardInterrupt (and being restarted).
    """

    def __init__(self) -> None:
        self._blocked = False
        self._release = threading.Event()

    def __enter__(self) -> SignalRouting:
        if threading.current_thread() is threading.main_thread() and hasattr(
            signal, "pthread_sigmask"
        ):
            # Started before the mask changes, so it can still take a SIGINT.
            threading.Thread(target=self._release.wait, name="relax-sigint", daemon=True).start()
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            self._blocked = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        self._release.set()


class StopLevels:
    """SIGINT and SIGTERM handlers on the running event loop, for as long as the ``async with``
    lasts, escalating with each signal (see the module's docstring).

    ``stop_cleanly`` makes the coroutine of a clean stop (run as a task; cancelled if still
    running at the end), ``leave`` cancels the run, ``note`` tells the user, ``resume_text``
    gives the last thing said before exiting at once (asked then: empty while no step was
    trained, as such a run has nothing to resume).
    """

    def __init__(
        self,
        *,
        note: Callable[[str], None],
        stop_cleanly: Callable[[], Coroutine[Any, Any, None]],
        leave: Callable[[], object],
        resume_text: Callable[[], str],
    ) -> None:
        self.note, self.stop_cleanly, self.leave = note, stop_cleanly, leave
        self.resume_text = resume_text
        self.received: list[int] = []
        """The signals seen, in order."""
        self._stopping: set[asyncio.Task[None]] = set()
        self._handled: list[int] = []

    def on_signal(self, signum: int) -> None:
        self.received.append(signum)
        level = len(self.received) + (1 if signum == signal.SIGTERM else 0)
        if level == 1:
            self.note(
                "stopping: the tree stops in reverse order and the trainer saves a checkpoint "
                "(Ctrl-C again to stop faster)"
            )
            # A handler runs as a callback of the loop: there is a running loop.
            self._stopping.add(asyncio.get_running_loop().create_task(self.stop_cleanly()))
        elif level == 2:
            self.note("stopping faster: leaving the run (Ctrl-C again to exit at once)")
            self.leave()
        else:
            text = self.resume_text()
            self.note(f"exiting at once; {text}" if text else "exiting at once")
            os._exit(EXIT_INTERRUPTED)

    async def __aenter__(self) -> StopLevels:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.add_signal_handler(signum, self.on_signal, signum)
                self._handled.append(signum)
        return self

    async def __aexit__(self, *exc: object) -> None:
        loop = asyncio.get_running_loop()
        for signum in self._handled:
            loop.remove_signal_handler(signum)
        for task in self._stopping:
            task.cancel()
        await asyncio.gather(*self._stopping, return_exceptions=True)
