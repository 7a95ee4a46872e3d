"""The supervisor's side of an actor hosted in its own OS process.

The child is ``relax.actors._host`` run as a module, with this process's ``sys.path`` appended
to its own (never in front of the standard library and site-packages); it dials a PAIR socket this side listens on
(IPC in a private directory by default, TCP on loopback on request), proves itself with a
one-time token, and then serves calls. This side watches three things and turns each into an
``Exit``: the process's own end (exit code or signal), the child's last word (an exception
with traceback, sent before it exits), and its heartbeats (a child whose event loop hangs is
killed and reported as ``heartbeat``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import pynng

from relax.actors._cell import await_reply, fail
from relax.actors._exit import Exit
from relax.actors._protocol import (
    ENV_ADDR,
    ENV_PRELOAD,
    ENV_TOKEN,
    STACKS_SIGNAL,
    Channel,
    exit_from_wire,
)
from relax.errors import ActorDead, RelaxError, StartFailed, TransportError, error_from_dict
from relax.log import ENV_LOG_DIR, child_log_dir, get_logger

log = get_logger("relax.actors")

ORPHAN_GRACE = 60.0
"""Seconds a child whose watcher was cancelled (its supervisor's event loop torn down) is
given to be stopped by the tree's teardown before it is killed."""

ENV_SYS_PATH = "RELAX_SYS_PATH"
"""The parent's ``sys.path``, which a child appends (missing entries only) to its own."""

_CHILD_BOOT = (
    "import os, sys, runpy\n"
    # `python -c` puts the working folder first; the child does not want it there.
    "sys.path[:] = [p for p in sys.path if p]\n"
    f"extra = os.environ.pop({ENV_SYS_PATH!r}, '').split(os.pathsep)\n"
    "sys.path += [p for p in dict.fromkeys(extra) if p and p not in sys.path]\n"
    "runpy.run_module('relax.actors._host', run_name='__main__', alter_sys=True)\n"
)
"""What a child process runs (``python -c``): the parent's path after its own standard
library and site-packages, then ``python -m relax.actors._host``."""


@dataclass(frozen=True)
class ProcessOptions:
    """How a process child is run and watched (the ``Process`` placement extends this)."""

    transport: Literal["ipc", "tcp"] = "ipc"
    """``ipc`` (a Unix socket in a private directory) or ``tcp`` (on ``host``)."""
    host: str = "127.0.0.1"
    """Where this side listens for a ``tcp`` child, which dials it: loopback for a child of
    this machine; for a Ray child on another node an address of this machine that node
    reaches (``relax.cluster`` passes ``[cluster] host``). The child proves itself with a
    one-time token before it is sent anything."""
    heartbeat_interval: float = 0.5
    """Seconds between heartbeats the child's event loop sends."""
    heartbeat_timeout: float = 10.0
    """Silence after which the child counts as hung and is killed (and restarted)."""
    start_timeout: float = 60.0
    """Seconds the child gets from spawn to the end of ``on_start``."""
    max_message_bytes: int = 1 << 30
    """Largest message accepted from the child (NNG drops larger ones; we set it explicitly)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment variables for the child."""

    def __post_init__(self) -> None:
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError("heartbeat_timeout must be longer than heartbeat_interval")


class ProcessMember:
    """One child process hosting one actor (one member of a gang)."""

    placement_kind = "process"
    """What the actor sees as ``ActorContext.placement``."""

    def __init__(
        self,
        *,
        actor_id: str,
        target: str,
        args: Any,
        kwargs: dict[str, Any],
        rank: int,
        size: int,
        options: ProcessOptions,
        gang_env: dict[str, str],
    ) -> None:
        self.actor_id = actor_id
        self.rank = rank
        self._target, self._args, self._kwargs = target, list(args), dict(kwargs)
        self._size = size
        self._options = options
        self._gang_env = gang_env
        self.done: asyncio.Future[Exit] = asyncio.get_running_loop().create_future()
        self.pid: int | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._channel: Channel | None = None
        self._dir: str | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._cause: Exit | None = None
        self._last_seen = time.monotonic()
        self._tasks: list[asyncio.Task[None]] = []
        self._stats = {"calls": 0, "casts": 0, "heartbeats": 0, "bad_frames": 0}
        self._address: str | None = None  # where the child dials this side

    # ------------------------------------------------------------------ start

    async def start(self) -> None:
        """Spawn the child and start the actor in it (``prepare``, then ``begin``)."""
        await self.prepare()
        await self.begin()

    async def prepare(self, preload: bool = False) -> None:
        """Spawn the child and wait for its hello; it then waits for its actor (``begin``).
        With ``preload`` the child imports the actor's module first, so a spare prepared in
        advance (``Process(standby=True)``) starts its actor with nothing left to import."""
        opts = self._options
        sock = pynng.Pair0(recv_max_size=opts.max_message_bytes)
        if opts.transport == "ipc":
            self._dir = tempfile.mkdtemp(prefix="relax-")  # 0700: only this user can dial
            addr = f"ipc://{self._dir}/{self.rank}.sock"
            sock.listen(addr)
        else:
            host = f"[{opts.host}]" if ":" in opts.host else opts.host  # an IPv6 literal
            sock.listen(f"tcp://{host}:0")
            # str() and not .port: pynng 0.9 reports .port in network byte order.
            port = str(sock.listeners[0].local_address).rsplit(":", 1)[1]
            addr = f"tcp://{host}:{port}"
        self._address = addr
        self._channel = Channel(sock, f"supervisor->{self.actor_id}/{self.rank}")
        token = secrets.token_hex(16)
        env = {**self._gang_env, **dict(opts.env)}
        # This run's log folder, not whatever a concurrent run in this process set last.
        log_dir = child_log_dir()
        if log_dir is not None and ENV_LOG_DIR not in opts.env:
            env[ENV_LOG_DIR] = log_dir
        env[ENV_ADDR], env[ENV_TOKEN] = addr, token
        if preload:
            env[ENV_PRELOAD] = self._target
        # The child must import what this process can import (tests, user modules), but a
        # folder of ours must never shadow the standard library or an installed package in
        # it (a json.py next to a config): it gets our path *appended* to its own.
        env[ENV_SYS_PATH] = os.pathsep.join(p for p in sys.path if p)
        await self._spawn(env)
        self._tasks.append(asyncio.create_task(self._watch_process()))
        await self._within_start_timeout(self._hello(token))

    async def begin(self, env: Mapping[str, str] | None = None) -> None:
        """Start the actor in the prepared child; ``env`` is set in the child's environment
        first (a spare learns its gang's ``RANK``/``MASTER_PORT``/… only now)."""
        await self._within_start_timeout(self._init(dict(env or {})))
        self._last_seen = time.monotonic()
        self._tasks.append(asyncio.create_task(self._read()))
        self._tasks.append(asyncio.create_task(self._watchdog()))

    async def _within_start_timeout(self, step: Any) -> None:
        """Run a start step; if it fails, times out or the child dies meanwhile, kill the
        child and raise ``StartFailed`` with why."""
        opts = self._options
        task = asyncio.create_task(step)
        try:
            await asyncio.wait(
                {task, self.done}, timeout=opts.start_timeout, return_when=asyncio.FIRST_COMPLETED
            )
        except BaseException:  # cancelled (a spare discarded): the step goes too
            task.cancel()
            raise
        if task.done() and not task.cancelled() and task.exception() is None:
            return
        if not task.done():
            task.cancel()
            if not self.done.done():
                self._cause = Exit("start", f"did not start within {opts.start_timeout}s")
        elif task.exception() is not None and self._cause is None:
            self._cause = Exit.from_exception(task.exception(), "start")  # type: ignore[arg-type]
        self._kill()
        exit_ = await self.done
        raise StartFailed(
            f"{self.actor_id}: {exit_.describe()}", actor_id=self.actor_id, cause=exit_
        )

    async def _hello(self, token: str) -> None:
        assert self._channel is not None
        hello = await self._channel.recv()
        if hello.get("t") != "hello" or not secrets.compare_digest(str(hello.get("token")), token):
            log.warning("refused a child that did not present its token", actor=self.actor_id)
            raise TransportError("child failed the token handshake")

    async def _init(self, env: dict[str, str]) -> None:
        assert self._channel is not None
        await self._channel.send(
            "init",
            target=self._target,
            args=self._args,
            kwargs=self._kwargs,
            id=self.actor_id,
            rank=self.rank,
            size=self._size,
            hb=self._options.heartbeat_interval,
            placement=self.placement_kind,
            env=env,
        )
        reply = await self._channel.recv()
        if reply.get("t") == "start_failed":
            self._cause = exit_from_wire(reply.get("exit"))
            raise StartFailed(self._cause.describe(), actor_id=self.actor_id, cause=self._cause)
        if reply.get("t") != "started":
            raise TransportError(f"unexpected {reply.get('t')!r} during start")

    # ------------------------------------------------------------------ watching

    async def _read(self) -> None:
        # Like the watcher, the reader outlives a cancel from outside while the child runs:
        # a child that stops says its last word and waits for our "bye" before it exits.
        while True:
            try:
                return await self._read_messages()
            except asyncio.CancelledError:
                if self.done.done():  # _finish: the child has ended
                    raise
                _uncancel()

    async def _read_messages(self) -> None:
        assert self._channel is not None
        while True:
            try:
                msg = await self._channel.recv()
            except TransportError as exc:
                if self.done.done() or isinstance(exc.__cause__, pynng.Closed):
                    return
                self._stats["bad_frames"] += 1
                log.warning("dropped a bad frame from a child", actor=self.actor_id, error=str(exc))
                continue
            self._last_seen = time.monotonic()
            kind = msg["t"]
            if kind == "hb":
                self._stats["heartbeats"] += 1
            elif kind == "reply":
                self._on_reply(msg)
            elif kind == "exit":
                self._cause = self._cause or exit_from_wire(msg.get("exit"))
                with contextlib.suppress(RelaxError):
                    await self._channel.send("bye")

    def _on_reply(self, msg: dict[str, Any]) -> None:
        fut = self._pending.pop(msg.get("id", -1), None)
        if fut is None or fut.done():
            return  # the caller timed out already
        if msg.get("ok"):
            fut.set_result(msg.get("value"))
        else:
            error = msg.get("error")
            fut.set_exception(error_from_dict(error if isinstance(error, dict) else {}))

    async def _watchdog(self) -> None:
        opts = self._options
        while not self.done.done():
            await asyncio.sleep(opts.heartbeat_interval)
            silent = time.monotonic() - self._last_seen
            if silent > opts.heartbeat_timeout:
                self._cause = self._cause or Exit(
                    "heartbeat",
                    f"no heartbeat for {silent:.1f}s (timeout {opts.heartbeat_timeout}s)",
                )
                log.warning(
                    "child missed its heartbeats; killing it", actor=self.actor_id, pid=self.pid
                )
                self._kill()
                return

    async def _spawn(self, env: dict[str, str]) -> None:
        """Start ``python -c _CHILD_BOOT`` with ``env`` over this process's environment and
        set ``pid`` (a placement that runs the child elsewhere overrides this)."""
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _CHILD_BOOT,
            env={**os.environ, **env},
            stdin=asyncio.subprocess.DEVNULL,
        )
        self.pid = self._proc.pid

    async def _process_end(self) -> Exit:
        """Wait until the child's process has ended; how it ended (overridable, as ``_spawn``)."""
        assert self._proc is not None
        return Exit.from_returncode(await self._proc.wait())

    async def _watch_process(self) -> None:
        try:
            by_process = await self._process_end()
        except asyncio.CancelledError:
            # Only this task sees the process end, and every stop waits on ``done``: when
            # the loop is torn down under us (an exception escaped ``asyncio.run``, whose
            # ``_cancel_all_tasks`` cancels every task at once), the tree's teardown still
            # runs and waits here. So keep watching until the process ends; the teardown
            # stops it in order, and one nobody stops within ``ORPHAN_GRACE`` is killed.
            _uncancel()
            self._finish(await self._end_after_cancel())
            raise
        self._finish(by_process)

    async def _end_after_cancel(self) -> Exit:
        end = asyncio.ensure_future(self._process_end())
        with contextlib.suppress(asyncio.TimeoutError):
            return await asyncio.wait_for(asyncio.shield(end), ORPHAN_GRACE)
        self.kill(f"its watcher was cancelled and nothing stopped it within {ORPHAN_GRACE}s")
        return await end

    def _finish(self, by_process: Exit) -> None:
        """The process has ended: settle ``done`` and fail every pending call."""
        exit_ = self._cause or by_process
        if self._cause is not None and by_process.signal and not exit_.signal:
            exit_ = Exit(
                **{**exit_.__dict__, "signal": by_process.signal, "exit_code": by_process.exit_code}
            )
        dead = ActorDead(
            f"actor {self.actor_id!r} {exit_.describe()}", actor_id=self.actor_id, cause=exit_
        )
        # Mark this member dead before waking its callers, so a caller that retries at once
        # sees the death and waits for the restart instead of calling the corpse.
        if not self.done.done():
            self.done.set_result(exit_)
        for fut in self._pending.values():
            fail(fut, dead)
        self._pending.clear()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        if self._channel is not None:
            self._channel.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------------ stop

    def kill(self, why: str) -> None:
        """SIGKILL the child now (from sync code too: a discarded spare)."""
        self._cause = self._cause or Exit("shutdown", why, signal="SIGKILL")
        self._kill()

    def _kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGKILL)

    async def shutdown(self, timeout: float) -> Exit:
        """Ask the child to stop; SIGKILL it after ``timeout`` (0: at once)."""
        if self.done.done():
            return self.done.result()
        if timeout > 0 and self._channel is not None:
            with contextlib.suppress(RelaxError):
                await self._channel.send("stop")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    asyncio.shield(self.done), None if timeout == float("inf") else timeout
                )
        if not self.done.done():
            why = "brutal kill" if timeout <= 0 else f"did not stop within {timeout}s; killed"
            if timeout > 0:
                await self._dump_stacks()
                why += " (its threads' stacks are in its log)"
            self._cause = Exit("shutdown", why, signal="SIGKILL")
            self._kill()
        return await asyncio.shield(self.done)

    async def _dump_stacks(self) -> None:
        """Have a child that ignored a stop write where each of its threads is (the host
        registers ``faulthandler`` for ``STACKS_SIGNAL``), before it is killed."""
        if self._proc is None or self._proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self._proc.send_signal(STACKS_SIGNAL)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.done), 0.5)  # the dump is written

    # ------------------------------------------------------------------ messages

    def _check_alive(self) -> None:
        if self.done.done():
            exit_ = self.done.result()
            raise ActorDead(
                f"actor {self.actor_id!r} {exit_.describe()}", actor_id=self.actor_id, cause=exit_
            )

    async def call(
        self, method: str, args: Any, kwargs: dict[str, Any], timeout: float | None
    ) -> Any:
        self._check_alive()
        assert self._channel is not None
        call_id = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = fut
        self._stats["calls"] += 1
        try:
            await self._channel.send("call", id=call_id, m=method, a=list(args), k=kwargs)
            return await await_reply(fut, timeout, f"{self.actor_id}.{method}")
        except TransportError:
            self._check_alive()
            raise
        finally:
            self._pending.pop(call_id, None)

    async def cast(self, method: str, args: Any, kwargs: dict[str, Any]) -> None:
        self._check_alive()
        assert self._channel is not None
        self._stats["casts"] += 1
        await self._channel.send("cast", m=method, a=list(args), k=kwargs)

    def statistics(self) -> dict[str, Any]:
        return {**self._stats, "pending_calls": len(self._pending), "address": self._address}


def _uncancel() -> None:
    """Take back the current task's cancellation request (3.11+): a task that goes on after a
    cancel must, or ``TaskGroup`` and ``asyncio.timeout`` take it for one still cancelled."""
    uncancel = getattr(asyncio.current_task(), "uncancel", None)
    if uncancel is not None:
        uncancel()
