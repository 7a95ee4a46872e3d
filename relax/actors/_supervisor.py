"""Supervisors with Erlang/OTP semantics.

A supervisor is itself an actor. It starts its children in order, restarts them by its
strategy when they end (``one_for_one``, ``rest_for_one``, ``one_for_all``) and their restart
type (``permanent``, ``transient``, ``temporary``), and gives up when more than ``intensity``
restarts happen within ``period`` seconds: it then stops every child in reverse start order
and crashes with ``SupervisorGaveUp``, which its own supervisor sees as a child crash
(escalation). Children stop in reverse start order, each within its shutdown timeout.

It keeps, per child: state, pids, restart count, uptime and the last crash cause, and returns
the whole tree as a JSON-ready snapshot (what ``relax status`` draws).

``ChildSpec`` lives here with the ``Supervisor``: a supervisor runs child specs, and a child
spec can describe a nested supervisor (``ChildSpec.supervisor``), so the two share a module
rather than import each other. The flags both use are in ``_flags``.
"""

from __future__ import annotations

import asyncio
import collections
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from relax.actors._actor import Actor, ActorContext
from relax.actors._cell import Cell
from relax.actors._exit import Exit
from relax.actors._flags import (
    BRUTAL_KILL,
    DEFAULT_INTENSITY,
    DEFAULT_PERIOD,
    DEFAULT_SHUTDOWN,
    Restart,
    Strategy,
)
from relax.actors._placement import Incarnation, InProc, Placement
from relax.actors._ref import ActorRef
from relax.errors import ActorDead, CallTimeout, StartFailed, SupervisorGaveUp
from relax.log import configure_logging, get_logger

log = get_logger("relax.supervisor")

_ID = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class ChildSpec:
    """How a supervisor starts, restarts and stops one child.

    ``start`` makes the actor: a class or factory function called with ``args``/``kwargs``,
    or an import path ``"package.module:Name"``. A child placed in another process must be
    importable there and its arguments must cross the wire (no pickling, ever).
    """

    id: str
    start: Callable[..., Any] | str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    restart: Restart = Restart.PERMANENT
    shutdown: float | Literal["brutal_kill"] = DEFAULT_SHUTDOWN
    """Seconds a child gets to stop before it is killed; ``"brutal_kill"`` kills at once."""
    placement: Placement = field(default_factory=InProc)
    gang: int = 1
    """Members that start, stop and restart as a unit (e.g. the ranks of a trainer)."""
    start_group: str | None = None
    """Neighbours in the child list with the same ``start_group`` start at once, as one step of
    the start order (the replicas of a role: none waits for another, so N of them start in one
    start's time, not N). If one fails, the whole group and everything before it stop, as in a
    failed start of a single child. The stop order stays the reverse of the list."""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not _ID.match(self.id):
            raise ValueError(f"child id {self.id!r} must be non-empty and use only [A-Za-z0-9_.-]")
        object.__setattr__(self, "restart", Restart(self.restart))
        object.__setattr__(self, "args", tuple(self.args))
        if self.shutdown != BRUTAL_KILL and not (
            isinstance(self.shutdown, (int, float)) and self.shutdown > 0
        ):
            raise ValueError(f"child {self.id!r}: shutdown must be seconds > 0 or 'brutal_kill'")
        if not isinstance(self.gang, int) or self.gang < 1:
            raise ValueError(f"child {self.id!r}: gang must be an integer >= 1")
        self.placement.check(self)

    @property
    def shutdown_timeout(self) -> float:
        """Seconds to wait before killing; 0 for a brutal kill, ``inf`` to wait forever."""
        return 0.0 if self.shutdown == BRUTAL_KILL else float(self.shutdown)

    @classmethod
    def supervisor(
        cls,
        id: str,
        children: Sequence[ChildSpec],
        *,
        strategy: Strategy | str = Strategy.ONE_FOR_ONE,
        intensity: int = DEFAULT_INTENSITY,
        period: float = DEFAULT_PERIOD,
        restart: Restart | str = Restart.PERMANENT,
    ) -> ChildSpec:
        """A nested supervisor as a child (OTP: shutdown ``infinity`` for supervisors)."""
        return cls(
            id=id,
            start=Supervisor,
            kwargs={
                "children": tuple(children),
                "strategy": strategy,
                "intensity": intensity,
                "period": period,
                "name": id,
            },
            restart=Restart(restart),
            shutdown=math.inf,
        )


AutoShutdown = Literal["never", "any_significant", "all_significant"]
ChildState = Literal[
    "starting", "running", "exited", "restarting", "waiting", "stopping", "stopped", "crashed"
]
"""``waiting``: no node can host the child right now (its placement said so); it starts as
soon as one can, and that wait is not a restart (it burns no restart intensity)."""
_TERMINAL = ("stopped", "crashed")


@dataclass(eq=False)
class _Child:
    spec: ChildSpec
    significant: bool = False
    state: ChildState = "stopped"
    terminal: bool = True
    incarnation: Incarnation | None = None
    generation: int = 0
    restarts: int = 0
    started_at: float | None = None
    started_mono: float | None = None
    last_exit: Exit | None = None
    last_crash: Exit | None = None
    waiting: str | None = None
    """What it waits for, while ``state == "waiting"``."""
    waiter: asyncio.Task[None] | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def set_state(self, state: ChildState, *, terminal: bool = False) -> None:
        self.state, self.terminal = state, terminal
        self.changed.set()  # wake whoever waits for a live incarnation, then re-arm
        self.changed = asyncio.Event()

    async def live(self, timeout: float | None) -> Incarnation:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.state == "running" and self.incarnation is not None and self.incarnation.alive:
                return self.incarnation
            if self.terminal:
                why = self.last_exit.describe() if self.last_exit else "is not running"
                raise ActorDead(
                    f"actor {self.spec.id!r} {why}", actor_id=self.spec.id, cause=self.last_exit
                )
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise CallTimeout(f"actor {self.spec.id!r} did not come back within {timeout}s")
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                continue


class Supervisor(Actor):
    """Start, watch and restart children. Use as ``async with Supervisor(children) as sup``."""

    max_concurrency = 16  # a snapshot must not wait behind a slow restart
    private_api: ClassVar[frozenset[str]] = frozenset(
        {"ref", "wait", "child_ids", "start_child", "delete_child"}
    )

    def __init__(
        self,
        children: Sequence[ChildSpec],
        *,
        strategy: Strategy | str = Strategy.ONE_FOR_ONE,
        intensity: int = DEFAULT_INTENSITY,
        period: float = DEFAULT_PERIOD,
        auto_shutdown: AutoShutdown = "never",
        significant: Sequence[str] = (),
        name: str = "root",
    ) -> None:
        ids = [c.id for c in children]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"supervisor {name!r}: duplicate child ids {duplicates}")
        if intensity < 0 or period <= 0:
            raise ValueError("intensity must be >= 0 and period > 0")
        unknown = set(significant) - set(ids)
        if unknown:
            raise ValueError(f"significant children {sorted(unknown)} are not children")
        self.name = name
        self.strategy = Strategy(strategy)
        self.intensity, self.period = intensity, float(period)
        self.auto_shutdown = auto_shutdown
        self._children = [_Child(c, significant=c.id in significant) for c in children]
        self._by_id = {c.spec.id: c for c in self._children}
        # (child, generation, how it ended); ``None``: a waiting child may be placeable now.
        self._events: asyncio.Queue[tuple[str, int, Exit | None]] = asyncio.Queue()
        self._restart_times: collections.deque[float] = collections.deque()
        self._lock = asyncio.Lock()
        self._cell: Cell | None = None
        self.gave_up: SupervisorGaveUp | None = None

    # ------------------------------------------------------------------ as the root

    async def __aenter__(self) -> Supervisor:
        configure_logging()  # no-op when the application configured it already
        self._cell = Cell(self, ActorContext(id=self.name))
        await self._cell.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._cell is not None
        await self._cell.shutdown(math.inf)

    async def wait(self) -> Exit:
        """Until this (root) supervisor ends; raises ``SupervisorGaveUp`` if it gave up."""
        assert self._cell is not None, "use `async with Supervisor(...)` first"
        exit_ = await asyncio.shield(self._cell.done)
        if self.gave_up is not None:
            raise self.gave_up
        return exit_

    def ref(self, path: str, *, timeout: float | None = None) -> ActorRef:
        """A stable ref to a child, or a grandchild through nested supervisors: ``"a/b"``."""
        parts = path.split("/")
        if parts[0] not in self._by_id:
            raise KeyError(f"supervisor {self.name!r} has no child {parts[0]!r}")

        async def resolve(rank: int, left: float | None) -> Any:
            return await self._resolve(parts, rank, left)

        ref = ActorRef(path, resolve)
        return ref.with_timeout(timeout) if timeout is not None else ref

    def child_ids(self) -> list[str]:
        return [c.spec.id for c in self._children]

    async def _resolve(self, parts: list[str], rank: int, left: float | None) -> Any:
        child = self._by_id.get(parts[0])
        if child is None:
            raise ActorDead(f"no child {parts[0]!r} under {self.name!r}", actor_id=parts[0])
        start = time.monotonic()
        incarnation = await child.live(left)
        if len(parts) == 1:
            return incarnation.member(rank)
        nested = _supervisor_in(incarnation)
        if nested is None:
            raise ActorDead(f"{parts[0]!r} is not a supervisor in this process", actor_id=parts[0])
        rest = None if left is None else max(0.0, left - (time.monotonic() - start))
        return await nested._resolve(parts[1:], rank, rest)

    # ------------------------------------------------------------------ lifecycle

    async def on_start(self) -> None:
        started: list[_Child] = []
        for step in _start_steps(self._children):
            outcomes = await asyncio.gather(*(self._start(c) for c in step), return_exceptions=True)
            failed = [
                (c, e) for c, e in zip(step, outcomes, strict=True) if isinstance(e, BaseException)
            ]
            started += [
                c for c, e in zip(step, outcomes, strict=True) if not isinstance(e, BaseException)
            ]
            if not failed:
                continue
            child, exc = failed[0]
            await self._stop_all(reversed(started))
            if not isinstance(exc, StartFailed):
                raise exc  # not a start that failed (cancelled, a bug): as it came
            log.error(
                "child failed to start", supervisor=self.name, child=child.spec.id, error=str(exc)
            )
            raise StartFailed(
                f"supervisor {self.name!r}: child {child.spec.id!r} failed to start: {exc}",
                actor_id=child.spec.id,
                cause=exc.cause,
            ) from exc

    async def run(self) -> None:
        while True:
            event = await self._events.get()
            async with self._lock:
                done = await self._on_exit(*event)
            if done:
                return  # auto_shutdown: a normal end; on_stop stops the rest

    async def on_stop(self) -> None:
        await self._stop_all(reversed(self._children))

    async def on_failure(self, exc: BaseException) -> None:
        await self._stop_all(reversed(self._children))

    # ------------------------------------------------------------------ children

    async def _start(self, child: _Child) -> bool:
        """Start ``child``; False when it was parked as ``waiting`` for resources instead."""
        child.generation += 1
        generation = child.generation
        child.set_state("starting")
        try:
            incarnation = await child.spec.placement.launch(child.spec)
        except StartFailed as exc:
            exit_ = exc.cause if isinstance(exc.cause, Exit) else Exit.from_exception(exc, "start")
            child.incarnation = None
            wait_for = getattr(child.spec.placement, "wait_for_resources", None)
            if exit_.kind == "placement" and wait_for is not None:
                self._park(child, generation, exit_, wait_for)
                return False
            child.last_exit = child.last_crash = exit_
            child.set_state("crashed", terminal=True)
            raise
        child.incarnation = incarnation
        child.started_at, child.started_mono = time.time(), time.monotonic()
        child.set_state("running")
        log.info("child started", supervisor=self.name, child=child.spec.id, pids=incarnation.pids)
        incarnation.done.add_done_callback(lambda fut: self._exited(child, generation, fut))
        return True

    def _park(self, child: _Child, generation: int, why: Exit, wait_for: Any) -> None:
        """No node can host ``child`` now: show it ``waiting`` and try again when its
        placement says one might (a callers' ref waits meanwhile, as during a restart)."""
        child.waiting = f"waiting for resources: {why.message}"
        child.set_state("waiting")
        log.warning(
            "child waits for resources", supervisor=self.name, child=child.spec.id, why=why.message
        )

        async def wait() -> None:
            await wait_for(child.spec)
            self._events.put_nowait((child.spec.id, generation, None))

        child.waiter = asyncio.create_task(wait())

    def _exited(self, child: _Child, generation: int, fut: asyncio.Future[Exit]) -> None:
        if generation != child.generation or child.state != "running":
            return  # we stopped it on purpose, or it belongs to an older incarnation
        exit_ = fut.result()
        child.set_state("exited")  # callers wait for the verdict instead of failing at once
        self._events.put_nowait((child.spec.id, generation, exit_))

    async def _stop(self, child: _Child) -> None:
        if child.waiter is not None:
            child.waiter.cancel()
            child.waiter = None
        incarnation = child.incarnation
        if incarnation is None or incarnation.done.done():
            if not child.terminal and child.state not in ("starting", "restarting", "exited"):
                child.set_state("stopped", terminal=True)
            return
        child.set_state("stopping")
        exit_ = await incarnation.shutdown(child.spec.shutdown_timeout)
        child.last_exit = exit_
        if exit_.signal:  # it ignored the request and had to be killed
            child.last_crash = exit_
        log.info("child stopped", supervisor=self.name, child=child.spec.id, how=exit_.describe())

    async def _stop_all(self, children: Any) -> None:
        for child in children:
            await self._stop(child)
            child.set_state("stopped" if child.state != "crashed" else "crashed", terminal=True)

    async def _on_exit(self, child_id: str, generation: int, exit_: Exit | None) -> bool:
        child = self._by_id.get(child_id)
        if child is None:
            return False  # deleted (``delete_child``) after it ended or while it waited
        if exit_ is None:  # resources may be there now for a waiting child: not a restart
            if generation == child.generation and child.state == "waiting":
                child.waiter = None
                try:
                    await self._start(child)
                except StartFailed as exc:
                    self._failed_restart(child, exc)
            return False
        if generation != child.generation or child.state != "exited":
            return False
        child.last_exit = exit_
        level = log.info if exit_.normal else log.warning
        level("child ended", supervisor=self.name, child=child_id, how=exit_.describe())
        if not exit_.normal:
            child.last_crash = exit_
        if exit_.fatal:  # Unrecoverable: a restart would fail the same way; stop the tree
            child.set_state("crashed", terminal=True)
            self.gave_up = SupervisorGaveUp(
                f"supervisor {self.name!r} stopped: {child_id!r} {exit_.describe()}",
                supervisor_id=self.name,
                cause=exit_,
            )
            log.error("child is unrecoverable; stopping", supervisor=self.name, child=child_id)
            raise self.gave_up
        restart = child.spec.restart is Restart.PERMANENT or (
            child.spec.restart is Restart.TRANSIENT and not exit_.normal
        )
        if not restart:
            child.set_state("stopped" if exit_.normal else "crashed", terminal=True)
            return self._should_auto_shutdown(child)
        self._count_restart(child, exit_)
        await self._restart(child)
        return False

    def _count_restart(self, child: _Child, exit_: Exit) -> None:
        now = time.monotonic()
        self._restart_times.append(now)
        while self._restart_times and now - self._restart_times[0] > self.period:
            self._restart_times.popleft()
        if len(self._restart_times) > self.intensity:
            child.set_state("crashed", terminal=True)
            self.gave_up = SupervisorGaveUp(
                f"supervisor {self.name!r} gave up: more than {self.intensity} restart(s) in "
                f"{self.period:g}s; last: {child.spec.id!r} {exit_.describe()}",
                supervisor_id=self.name,
            )
            log.error(
                "restart intensity exceeded; escalating", supervisor=self.name, child=child.spec.id
            )
            raise self.gave_up

    async def _restart(self, crashed: _Child) -> None:
        index = self._children.index(crashed)
        if self.strategy is Strategy.ONE_FOR_ONE:
            group = [crashed]
        elif self.strategy is Strategy.REST_FOR_ONE:
            group = self._children[index:]
        else:
            group = list(self._children)
        for child in group:
            if child.state == "running" or child is crashed:
                child.set_state("restarting")
        for child in reversed(group):
            if child is not crashed:
                await self._stop(child)
        for child in group:
            if child is not crashed and (child.spec.restart is Restart.TEMPORARY or child.terminal):
                child.set_state("stopped", terminal=True)  # OTP: temporary siblings stay down
                continue
            try:
                await self._start(child)
            except StartFailed as exc:
                self._failed_restart(child, exc)
                return
            child.restarts += 1  # a child parked waiting for resources counts once, here

    def _failed_restart(self, child: _Child, exc: StartFailed) -> None:
        child.set_state("exited")  # a failed restart counts as another crash
        self._events.put_nowait((child.spec.id, child.generation, child.last_exit or Exit("start")))
        log.warning("restart failed", supervisor=self.name, child=child.spec.id, error=str(exc))

    def _should_auto_shutdown(self, child: _Child) -> bool:
        if not child.significant or self.auto_shutdown == "never":
            return False
        if self.auto_shutdown == "any_significant":
            return True
        return all(c.terminal for c in self._children if c.significant)

    # ------------------------------------------------------------------ handlers

    def _child(self, child_id: str) -> _Child:
        child = self._by_id.get(child_id)
        if child is None:
            raise KeyError(f"supervisor {self.name!r} has no child {child_id!r}")
        return child

    async def restart_child(self, child_id: str) -> None:
        """Stop a child (if running) and start it again; an operator's restart, not counted."""
        child = self._child(child_id)
        async with self._lock:
            await self._stop(child)
            await self._start(child)
            child.restarts += 1

    async def terminate_child(self, child_id: str) -> None:
        """Stop a child and leave it stopped until ``restart_child``."""
        child = self._child(child_id)
        async with self._lock:
            await self._stop(child)
            child.set_state("stopped", terminal=True)

    async def start_child(self, spec: ChildSpec) -> None:
        """Add ``spec`` as a new last child and start it (OTP's ``start_child``): it is
        supervised like the others from then on, and stops first (reverse start order).
        ``ValueError`` when its id is taken; a start that fails raises ``StartFailed`` and
        leaves nothing behind."""
        async with self._lock:
            if spec.id in self._by_id:
                raise ValueError(f"supervisor {self.name!r} already has a child {spec.id!r}")
            child = _Child(spec)
            self._children.append(child)
            self._by_id[spec.id] = child
            try:
                await self._start(child)
            except BaseException:
                await self._stop(child)  # a child parked waiting, or a cancelled start
                self._children.remove(child)
                del self._by_id[spec.id]
                raise
        log.info("child added", supervisor=self.name, child=spec.id)

    async def delete_child(self, child_id: str) -> None:
        """Stop a child (within its shutdown timeout) and remove it from this supervisor
        (OTP's ``terminate_child`` then ``delete_child``): callers waiting on its refs get
        ``ActorDead``, and its ended incarnation is no crash to restart."""
        child = self._child(child_id)
        async with self._lock:
            await self._stop(child)
            child.set_state("stopped", terminal=True)
            self._children.remove(child)
            del self._by_id[child_id]
        log.info("child removed", supervisor=self.name, child=child_id)

    async def snapshot(self) -> dict[str, Any]:
        """The subtree as plain data: JSON- and wire-ready."""
        return {
            "id": self.name,
            "kind": "supervisor",
            "strategy": self.strategy.value,
            "intensity": self.intensity,
            "period": self.period,
            "restarts_in_period": len(self._restart_times),
            "pid": os.getpid(),
            "gave_up": str(self.gave_up) if self.gave_up else None,
            "children": [await self._child_snapshot(c) for c in self._children],
        }

    async def _child_snapshot(self, child: _Child) -> dict[str, Any]:
        incarnation = child.incarnation
        live = child.state == "running" and incarnation is not None and not incarnation.done.done()
        state = child.state
        if state == "running" and (incarnation is None or not incarnation.alive):
            # A member has ended and the verdict is a loop turn away: say so, not "running".
            state = "exited"
        nested = _supervisor_in(incarnation) if live and incarnation is not None else None
        data: dict[str, Any] = {
            "id": child.spec.id,
            "kind": "supervisor"
            if nested is not None or _is_supervisor_spec(child.spec)
            else "worker",
            "placement": child.spec.placement.kind,
            "gang": child.spec.gang,
            "restart": child.spec.restart.value,
            "state": state,
            "waiting": child.waiting if state == "waiting" else None,
            "pids": incarnation.pids if live and incarnation is not None else [],
            "spares": _spares(child.spec),
            "restart_count": child.restarts,
            "started_at": child.started_at,
            "uptime_s": round(time.monotonic() - child.started_mono, 3)
            if live and child.started_mono
            else None,
            "last_exit": child.last_exit.to_dict() if child.last_exit else None,
            "last_crash": child.last_crash.to_dict() if child.last_crash else None,
            "stats": incarnation.statistics() if live and incarnation is not None else None,
        }
        if nested is not None:
            data["children"] = (await nested.snapshot())["children"]
            data["strategy"] = nested.strategy.value
        return data


def _start_steps(children: list[_Child]) -> list[list[_Child]]:
    """The start order in steps: each child alone, except neighbours sharing a start group."""
    steps: list[list[_Child]] = []
    for child in children:
        group = child.spec.start_group
        if steps and group is not None and steps[-1][-1].spec.start_group == group:
            steps[-1].append(child)
        else:
            steps.append([child])
    return steps


def _spares(spec: ChildSpec) -> list[int | None]:
    """The pids of the warm spares ready for ``spec`` (``Process(standby=True)``)."""
    spares = getattr(spec.placement, "spares", None)
    return spares(spec) if spares is not None else []


def _is_supervisor_spec(spec: ChildSpec) -> bool:
    return isinstance(spec.start, type) and issubclass(spec.start, Supervisor)


def _supervisor_in(incarnation: Incarnation | None) -> Supervisor | None:
    if incarnation is None:
        return None
    member = incarnation.member(0)
    actor = getattr(member, "actor", None)
    return actor if isinstance(actor, Supervisor) else None
