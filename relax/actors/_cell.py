"""A running actor in this process: its mailbox, its tasks and its end.

The same ``Cell`` runs an actor placed ``inproc`` and, inside the child process, an actor
placed ``process`` (the host pumps NNG messages into it), so an actor behaves the same
wherever it is placed.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import os
import time
from dataclasses import dataclass
from typing import Any

from relax.actors._actor import RESERVED, Actor, ActorContext, has_run_loop
from relax.actors._exit import Exit
from relax.errors import ActorDead, CallTimeout, StartFailed
from relax.log import bind_actor

# How long a cancelled actor gets to unwind before it is abandoned.
_KILL_GRACE = 1.0


def fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    """Fail a caller's future, if it is still waiting.

    The exception is marked as retrieved: a caller that already went away (it timed out, or
    its send failed and it raised on its own) must not leave an "exception was never
    retrieved" behind; one still awaiting the future gets it all the same.
    """
    if not fut.done():
        fut.set_exception(exc)
        fut.exception()


def _expire(fut: asyncio.Future[Any], what: str, timeout: float) -> None:
    fail(fut, CallTimeout(f"{what}: no reply within {timeout:g}s"))


async def await_reply(fut: asyncio.Future[Any], timeout: float | None, what: str) -> Any:
    """Await a reply future with a timeout, without the extra task ``wait_for`` costs.

    On timeout the future fails with ``CallTimeout``, so a request still in the mailbox is
    skipped instead of run for nobody.
    """
    if timeout is None:
        return await fut
    handle = asyncio.get_running_loop().call_later(max(timeout, 0.0), _expire, fut, what, timeout)
    try:
        return await fut
    finally:
        handle.cancel()


async def _wait(fut: asyncio.Future[Any], timeout: float | None) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(fut), timeout)


@dataclass(eq=False)
class _Envelope:
    method: str
    args: tuple[Any, ...] | list[Any]
    kwargs: dict[str, Any]
    reply: asyncio.Future[Any] | None  # None for a cast


class Cell:
    """Hosts one actor instance; created by a placement, owned by a supervisor."""

    def __init__(self, actor: Actor, context: ActorContext) -> None:
        self.actor = actor
        self.context = context
        actor.context = context
        actor._relax_stopper = self._request_normal_stop  # type: ignore[attr-defined]
        loop = asyncio.get_running_loop()
        self.done: asyncio.Future[Exit] = loop.create_future()
        self._mailbox: asyncio.Queue[_Envelope] = asyncio.Queue(max(1, actor.mailbox_size))
        self._limit = asyncio.Semaphore(max(1, actor.max_concurrency))
        self._stop = asyncio.Event()
        self._stop_exit: Exit | None = None
        self._crash_exc: BaseException | None = None
        self._closed = False
        self._in_flight: set[_Envelope] = set()
        self._handled = 0
        self._failed = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return os.getpid()

    # ------------------------------------------------------------------ lifecycle

    async def start(self, timeout: float | None = None) -> None:
        """Run ``on_start`` and begin serving; raises ``StartFailed`` with the cause."""
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._main(started), name=f"actor:{self.context.id}")
        try:
            await asyncio.wait_for(asyncio.shield(started), timeout)
        except asyncio.TimeoutError:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            raise StartFailed(
                f"{self.context.id}: on_start did not finish within {timeout}s",
                actor_id=self.context.id,
            ) from None

    async def shutdown(self, timeout: float) -> Exit:
        """Stop normally (``on_stop``); after ``timeout`` seconds cancel it outright.

        ``timeout=0`` is a brutal kill, ``math.inf`` waits as long as it takes.
        """
        if not self.done.done():
            self._request_stop(Exit("shutdown", "stopped by its supervisor"))
            if timeout > 0:
                await _wait(self.done, None if math.isinf(timeout) else timeout)
            if not self.done.done():
                self._kill()
                await _wait(self.done, _KILL_GRACE)
            if not self.done.done():  # a task that swallows cancellation cannot be forced
                self._finish(Exit("shutdown", "abandoned: it ignored cancellation"))
        return self.done.result()

    def _kill(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def _request_normal_stop(self) -> None:
        self._request_stop(Exit("normal", "the actor asked to stop"))

    def _request_stop(self, exit_: Exit) -> None:
        if self._stop_exit is None:
            self._stop_exit = exit_
        self._stop.set()

    async def _main(self, started: asyncio.Future[None]) -> None:
        bind_actor(self.context.id)
        try:
            await self.actor.on_start()
        except asyncio.CancelledError:
            self._finish(Exit("start", "cancelled while starting"))
            raise
        except BaseException as exc:
            exit_ = Exit.from_exception(exc, "start")
            self._finish(exit_)
            started.set_exception(
                StartFailed(
                    f"{self.context.id}: {exit_.describe()}", actor_id=self.context.id, cause=exit_
                )
            )
            return
        started.set_result(None)
        workers = [asyncio.create_task(self._serve_mailbox())]
        if has_run_loop(self.actor):
            workers.append(asyncio.create_task(self._run_loop()))
        for task in workers:  # a bug in the runtime itself must crash the actor, not hang it
            task.add_done_callback(self._worker_ended)
        try:
            await self._stop.wait()
        except asyncio.CancelledError:  # killed before anyone asked it to stop
            self._request_stop(Exit("shutdown", "cancelled"))
        finally:
            for task in workers:
                task.cancel()
            for task in workers:
                with contextlib.suppress(BaseException):
                    await task
        exit_ = self._stop_exit or Exit("normal")
        try:
            if self._crash_exc is not None:
                await self.actor.on_failure(self._crash_exc)
            else:
                await self.actor.on_stop()
        except asyncio.CancelledError:
            pass
        except BaseException as exc:  # a failing on_stop turns a clean end into a crash
            if exit_.normal:
                exit_ = Exit.from_exception(exc)
        self._finish(exit_)

    def _crash(self, exc: BaseException) -> None:
        if self._crash_exc is None and self._stop_exit is None:
            self._crash_exc = exc
            self._request_stop(Exit.from_exception(exc))

    async def _run_loop(self) -> None:
        try:
            await self.actor.run()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._crash(exc)
        else:
            self._request_stop(Exit("normal", "run() returned"))

    def _worker_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._crash(task.exception())  # type: ignore[arg-type]

    def _finish(self, exit_: Exit) -> None:
        """Mark the cell dead and fail everyone still waiting: no caller waits forever."""
        self._closed = True
        dead = ActorDead(
            f"actor {self.context.id!r} {exit_.describe()}", actor_id=self.context.id, cause=exit_
        )
        pending = [env.reply for env in self._in_flight]
        while not self._mailbox.empty():
            pending.append(self._mailbox.get_nowait().reply)
        for reply in pending:
            if reply is not None:
                fail(reply, dead)
        if not self.done.done():
            self.done.set_result(exit_)

    # ------------------------------------------------------------------ messages

    async def submit(
        self, method: str, args: Any, kwargs: dict[str, Any], *, want_reply: bool
    ) -> asyncio.Future[Any] | None:
        """Put a message in the mailbox, waiting for space; returns the reply future."""
        if self._closed:
            raise self._dead()
        reply = asyncio.get_running_loop().create_future() if want_reply else None
        env = _Envelope(method, args, kwargs, reply)
        if self._mailbox.full():
            put = asyncio.ensure_future(self._mailbox.put(env))
            await asyncio.wait({put, self.done}, return_when=asyncio.FIRST_COMPLETED)
            if not put.done():
                put.cancel()
                raise self._dead()
        else:
            self._mailbox.put_nowait(env)
        if self._closed:  # died while we were queueing: nobody will ever handle it
            raise self._dead()
        return reply

    async def call(
        self, method: str, args: Any, kwargs: dict[str, Any], timeout: float | None
    ) -> Any:
        what = f"{self.context.id}.{method}"
        started = time.monotonic()
        if self._mailbox.full():  # rare: only then can the wait for space eat into the timeout
            try:
                submit = self.submit(method, args, kwargs, want_reply=True)
                reply = await asyncio.wait_for(submit, timeout)
            except asyncio.TimeoutError:
                raise CallTimeout(f"{what}: mailbox still full after {timeout}s") from None
        else:
            reply = await self.submit(method, args, kwargs, want_reply=True)
        assert reply is not None
        left = None if timeout is None else timeout - (time.monotonic() - started)
        return await await_reply(reply, left, what)

    async def cast(self, method: str, args: Any, kwargs: dict[str, Any]) -> None:
        await self.submit(method, args, kwargs, want_reply=False)

    def _dead(self) -> ActorDead:
        exit_ = self.done.result() if self.done.done() else None
        why = exit_.describe() if exit_ else "is stopping"
        return ActorDead(f"actor {self.context.id!r} {why}", actor_id=self.context.id, cause=exit_)

    async def _serve_mailbox(self) -> None:
        concurrent = self.actor.max_concurrency > 1
        tasks: set[asyncio.Task[None]] = set()
        try:
            while True:
                env = await self._mailbox.get()
                if env.reply is not None and env.reply.done():
                    continue  # the caller gave up before we got to it
                self._in_flight.add(env)
                if not concurrent:
                    await self._handle(env)
                    continue
                await self._limit.acquire()
                task = asyncio.create_task(self._handle(env))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                task.add_done_callback(lambda _: self._limit.release())
        finally:
            for task in list(tasks):
                task.cancel()

    async def _handle(self, env: _Envelope) -> None:
        try:
            handler = self._resolve(env.method)
            result = handler(*env.args, **env.kwargs)
            if inspect.isawaitable(result):
                result = await result
        except asyncio.CancelledError:
            raise  # still in flight: _finish fails its caller with ActorDead
        except Exception as exc:
            self._in_flight.discard(env)
            self._failed += 1
            if env.reply is None:
                self._crash(exc)  # nobody to tell: let it crash, the supervisor decides
            else:
                fail(env.reply, exc)
        else:
            self._in_flight.discard(env)
            self._handled += 1
            if env.reply is not None and not env.reply.done():
                env.reply.set_result(result)

    def _resolve(self, method: str) -> Any:
        if method.startswith("_") or method in RESERVED or method in self.actor.private_api:
            raise AttributeError(f"{type(self.actor).__name__}.{method} is not a handler")
        handler = getattr(self.actor, method, None)
        if handler is None or not callable(handler):
            raise AttributeError(f"{type(self.actor).__name__} has no handler {method!r}")
        return handler

    def statistics(self) -> dict[str, Any]:
        """Mailbox and handler counters (every queue-like thing has ``statistics()``)."""
        return {
            "queued": self._mailbox.qsize(),
            "capacity": self._mailbox.maxsize,
            "in_flight": len(self._in_flight),
            "handled": self._handled,
            "failed": self._failed,
        }
