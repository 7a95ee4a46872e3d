"""Entry point of a child process that hosts one actor: ``python -m relax.actors._host``.

It dials the supervisor, proves itself with its token, builds the actor named in ``init``
(an import path, never an unpickled object), runs it in a ``Cell`` and pumps messages both
ways. Heartbeats come from this event loop, so a blocked loop is a missed heartbeat. If the
supervisor goes away the child exits too: no orphans (PR_SET_PDEATHSIG on Linux, and the
socket's pipe-removed callback everywhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import faulthandler
import importlib
import os
import signal
import sys
from typing import Any

import pynng

from relax.actors._actor import ActorContext
from relax.actors._build import build_actor
from relax.actors._cell import Cell
from relax.actors._exit import Exit
from relax.actors._protocol import (
    ENV_ADDR,
    ENV_PRELOAD,
    ENV_TOKEN,
    STACKS_SIGNAL,
    Channel,
    exit_to_wire,
)
from relax.errors import ActorDead, PeerGone, RelaxError, StartFailed, error_to_dict
from relax.importpath import load
from relax.log import bind_actor, configure_logging, get_logger

_BYE_WAIT = 2.0


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            if os.getppid() == 1:  # the parent died before prctl took effect
                os._exit(1)


class _Host:
    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.cell: Cell | None = None
        self.parent_gone = asyncio.Event()
        self.got_bye = asyncio.Event()
        self.replies: set[asyncio.Task[None]] = set()
        self.stopping: asyncio.Task[Exit] | None = None

    async def start(self, token: str) -> Exit | None:
        await self.channel.send("hello", token=token, pid=os.getpid())
        init = await self.channel.recv()
        if init.get("t") != "init":
            raise RelaxError(f"expected init, got {init.get('t')!r}")
        actor_id = str(init["id"])
        os.environ.update({str(k): str(v) for k, v in (init.get("env") or {}).items()})
        bind_actor(actor_id)
        context = ActorContext(
            id=actor_id,
            rank=int(init["rank"]),
            size=int(init["size"]),
            placement=str(init.get("placement") or "process"),
        )
        try:
            actor = build_actor(init["target"], init.get("args") or [], init.get("kwargs") or {})
            self.cell = Cell(actor, context)
            await self.cell.start()
        except StartFailed as exc:
            exit_ = exc.cause if isinstance(exc.cause, Exit) else Exit.from_exception(exc, "start")
            await self.channel.send("start_failed", exit=exit_to_wire(exit_))
            return exit_
        except Exception as exc:
            exit_ = Exit.from_exception(exc, "start")
            await self.channel.send("start_failed", exit=exit_to_wire(exit_))
            return exit_
        await self.channel.send("started")
        self.heartbeat_interval = float(init.get("hb") or 0.5)
        return None

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            await self.channel.send("hb")

    async def pump(self) -> None:
        assert self.cell is not None
        while True:
            try:
                msg = await self.channel.recv()
            except PeerGone:
                self.parent_gone.set()
                return
            except RelaxError as exc:
                get_logger().warning("dropped a bad frame from the supervisor", error=str(exc))
                continue
            kind = msg["t"]
            if kind in ("call", "cast"):
                await self._deliver(msg)
            elif kind == "stop" and self.stopping is None:
                self.stopping = asyncio.create_task(self.cell.shutdown(float("inf")))
            elif kind == "bye":
                self.got_bye.set()

    async def _deliver(self, msg: dict[str, Any]) -> None:
        assert self.cell is not None
        want_reply = msg["t"] == "call"
        try:
            reply = await self.cell.submit(
                str(msg.get("m")), msg.get("a") or [], msg.get("k") or {}, want_reply=want_reply
            )
        except ActorDead as exc:
            if want_reply:
                await self._send_reply(msg.get("id"), ok=False, error=error_to_dict(exc))
            return
        if reply is not None:
            task = asyncio.create_task(self._reply(msg.get("id"), reply))
            self.replies.add(task)
            task.add_done_callback(self.replies.discard)

    async def _reply(self, call_id: Any, reply: asyncio.Future[Any]) -> None:
        try:
            value = await reply
        except Exception as exc:
            await self._send_reply(call_id, ok=False, error=error_to_dict(exc))
            return
        try:
            await self._send_reply(call_id, ok=True, value=value)
        except TypeError as exc:  # the handler returned something the wire cannot carry
            await self._send_reply(call_id, ok=False, error=error_to_dict(exc))

    async def _send_reply(self, call_id: Any, **fields: Any) -> None:
        with contextlib.suppress(PeerGone):
            await self.channel.send("reply", id=call_id, **fields)


async def _serve(addr: str, token: str) -> int:
    loop = asyncio.get_running_loop()
    sock = pynng.Pair0(recv_max_size=0)
    channel = Channel(sock, f"child-{os.getpid()}")
    host = _Host(channel)
    sock.add_post_pipe_remove_cb(lambda _pipe: loop.call_soon_threadsafe(host.parent_gone.set))
    sock.dial(addr, block=True)
    preload = os.environ.pop(ENV_PRELOAD, "")
    if preload:  # a spare: import the actor's module now, while nothing waits for it
        with contextlib.suppress(Exception):  # building it later reports the failure properly
            for module in getattr(load(preload), "warm_imports", ()):
                importlib.import_module(module)
    exit_ = await host.start(token)
    if exit_ is not None:
        await _await_bye(host)
        return 1
    assert host.cell is not None
    tasks = [asyncio.create_task(host.pump()), asyncio.create_task(host.heartbeat())]
    gone = asyncio.create_task(host.parent_gone.wait())
    await asyncio.wait({host.cell.done, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not host.cell.done.done():  # the supervisor vanished: stop quickly and leave
        await host.cell.shutdown(1.0)
        return 1
    exit_ = host.cell.done.result()
    # Let replies that were already computed leave before the last word.
    if host.replies:
        await asyncio.wait(set(host.replies), timeout=_BYE_WAIT)
    with contextlib.suppress(RelaxError):
        await channel.send("exit", exit=exit_to_wire(exit_))
    await _await_bye(host, tasks[0])
    for task in tasks:
        task.cancel()
    gone.cancel()
    return 0 if exit_.normal else 1


async def _await_bye(host: _Host, pump: asyncio.Task[None] | None = None) -> None:
    """Wait (briefly) until the supervisor has read our last message, then leave."""
    if pump is None:
        pump = asyncio.create_task(_bye_only(host))
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(host.got_bye.wait(), _BYE_WAIT)
    pump.cancel()


async def _bye_only(host: _Host) -> None:
    with contextlib.suppress(RelaxError):
        while (await host.channel.recv()).get("t") != "bye":
            pass
    host.got_bye.set()


def main() -> None:
    _die_with_parent()
    configure_logging()
    # A child that does not stop when asked gets SIGUSR1 before its SIGKILL: every thread's
    # stack goes to stderr (the child's log), so a hang says where it hung.
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    addr, token = os.environ.pop(ENV_ADDR, ""), os.environ.pop(ENV_TOKEN, "")
    if not addr:
        print("relax.actors._host is started by a supervisor, not by hand", file=sys.stderr)
        raise SystemExit(2)
    asyncio.run(_serve_and_exit(addr, token))


async def _serve_and_exit(addr: str, token: str) -> None:
    code = await _serve(addr, token)
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave from inside the loop: asyncio.run's teardown joins the default executor's threads,
    # and one blocked for good (a collective with a dead peer, a hung file system) would keep
    # a finished child alive until its supervisor SIGKILLs it. Nothing is left to flush.
    os._exit(code)


if __name__ == "__main__":
    main()
