"""The daemon thread a tensor group runs its blocking collectives on, in submission order."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any

GRACE_S = 5.0
"""Extra time the event loop gives a backend (or the worker thread) before declaring it stuck."""


class Worker:
    """One daemon thread that runs a group's blocking calls in submission order.

    Not a ``ThreadPoolExecutor``: its threads are joined at interpreter exit, so a backend
    stuck in C++ would hang the process on the way out.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((fn, future))
        return future

    def stop(self) -> None:
        self._jobs.put(None)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            # Drop our references before publishing the outcome: a job may hold the backend
            # (and through it rank 0's store), which must be gone once aclose returns.
            del job
            if future.set_running_or_notify_cancel():
                try:
                    result = fn()
                except BaseException as exc:  # handed to the awaiting coroutine
                    del fn
                    future.set_exception(exc)
                else:
                    del fn
                    future.set_result(result)
                    del result
            del future


def consume(future: asyncio.Future[Any]) -> None:
    """Read a finished job's outcome, so a caller that was cancelled leaves no "never
    retrieved" warning behind."""
    if not future.cancelled():
        future.exception()
