"""Where a child runs: in the supervisor's process or in OS processes of its own.

A placement turns a ``ChildSpec`` into an ``Incarnation``: the members (one, or a gang of N)
of one start of that child, which live and die together. Placement is an interface; a Ray
placement (actors on other machines) can be added without touching any actor's code.

A placement sees a child spec as a ``LaunchSpec`` (the few fields it reads), not as the
``ChildSpec`` class: a ``ChildSpec`` holds its placement, so naming the class here would make
the two modules import each other.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from relax.actors._actor import ActorContext
from relax.actors._build import build_actor
from relax.actors._cell import Cell
from relax.actors._exit import Exit
from relax.actors._process import ProcessMember, ProcessOptions
from relax.errors import StartFailed
from relax.importpath import import_path
from relax.log import get_logger
from relax.runfiles import GANG_RENDEZVOUS_ENV

log = get_logger("relax.actors")


class LaunchSpec(Protocol):
    """What a placement reads from a child spec (``relax.actors.ChildSpec`` is one)."""

    @property
    def id(self) -> str: ...
    @property
    def start(self) -> Callable[..., Any] | str: ...
    @property
    def args(self) -> tuple[Any, ...]: ...
    @property
    def kwargs(self) -> Mapping[str, Any]: ...
    @property
    def gang(self) -> int: ...


class Member(Protocol):
    """One running copy of an actor: a ``Cell`` here or a ``ProcessMember`` elsewhere."""

    pid: int | None
    done: asyncio.Future[Exit]

    async def call(
        self, method: str, args: Any, kwargs: dict[str, Any], timeout: float | None
    ) -> Any: ...
    async def cast(self, method: str, args: Any, kwargs: dict[str, Any]) -> None: ...
    async def shutdown(self, timeout: float) -> Exit: ...
    def statistics(self) -> dict[str, Any]: ...


class Placement(Protocol):
    """Where a child runs. A placement whose start can fail for want of resources (``Ray``)
    also has ``async wait_for_resources(spec)``, returning when a start could succeed: the
    supervisor then parks a start that failed with an ``Exit`` of kind ``placement`` as
    ``waiting`` (not a crash, no restart counted) and starts it again when that returns."""

    kind: str

    async def launch(self, spec: LaunchSpec) -> Incarnation: ...

    def check(self, spec: LaunchSpec) -> None:
        """Raise ``ValueError`` if ``spec`` cannot run under this placement."""


@dataclass(frozen=True)
class InProc:
    """Run the actor as a task in the supervisor's own process and event loop."""

    start_timeout: float = 60.0
    kind: Literal["inproc"] = field(default="inproc", init=False)

    def check(self, spec: LaunchSpec) -> None:
        pass

    async def launch(self, spec: LaunchSpec) -> Incarnation:
        async def start(rank: int) -> Member:
            actor = build_actor(spec.start, spec.args, dict(spec.kwargs))
            cell = Cell(actor, ActorContext(id=spec.id, rank=rank, size=spec.gang))
            await cell.start(self.start_timeout)
            return cell

        return await Incarnation.launch(spec.id, [start] * spec.gang)


@dataclass(frozen=True)
class Process(ProcessOptions):
    """Run each member in its own OS process, watched by heartbeats, spoken to over NNG."""

    standby: bool = False
    """Keep a spare child per member, started and with the actor's module imported, waiting
    to be told which actor it is: a crashed child's restart takes it instead of starting a
    new interpreter (the imports dominate a restart: seconds for torch and transformers), and
    a new spare is prepared for the next crash. Costs one idle process per member, holding
    its imports' memory. A spare not taken within ``start_timeout`` after its child crashed
    (the supervisor gave up) is killed; a child stopped on purpose or ending normally takes
    its spares along."""
    kind: Literal["process"] = field(default="process", init=False)
    _spares: dict[int, _Spares] = field(
        default_factory=dict, init=False, compare=False, hash=False, repr=False
    )

    def check(self, spec: LaunchSpec) -> None:
        from relax.transport import dumps

        import_path(spec.start)  # type: ignore[arg-type]
        try:
            dumps([list(spec.args), dict(spec.kwargs)])
        except TypeError as exc:
            raise ValueError(
                f"child {spec.id!r}: its args cannot cross a process boundary: {exc}"
            ) from None

    async def launch(self, spec: LaunchSpec) -> Incarnation:
        # A gang meets in a folder of its own (see GANG_RENDEZVOUS_ENV), gone with the gang.
        rendezvous = tempfile.mkdtemp(prefix="relax-gang-") if spec.gang > 1 else None
        try:
            incarnation = await self._launch(spec, _gang_env(spec.gang, rendezvous))
        except BaseException:
            if rendezvous is not None:
                shutil.rmtree(rendezvous, ignore_errors=True)
            raise
        if rendezvous is not None:
            incarnation.done.add_done_callback(
                lambda _: shutil.rmtree(rendezvous, ignore_errors=True)
            )
        return incarnation

    async def _launch(self, spec: LaunchSpec, gang_env: dict[str, str]) -> Incarnation:
        spares = await self._take_spares(spec) if self.standby else None

        def starter(rank: int) -> Any:
            async def start(_: int) -> Member:
                rank_env = {**gang_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                if spares is None:
                    return await start_member(ProcessMember, spec, self, rank, rank_env)
                await spares[rank].begin(rank_env)  # the gang's env reaches it only now
                return spares[rank]

            return start

        incarnation = await Incarnation.launch(spec.id, [starter(r) for r in range(spec.gang)])
        if self.standby:
            self._prepare_spares(spec, incarnation)
        return incarnation

    def _prepare_spares(self, spec: LaunchSpec, incarnation: Incarnation) -> None:
        """Start preparing ``spec``'s spares for when ``incarnation`` crashes."""

        async def prepare() -> list[ProcessMember] | None:
            members = [new_member(ProcessMember, spec, self, rank, {}) for rank in range(spec.gang)]
            try:
                tried = await asyncio.gather(
                    *(m.prepare(preload=True) for m in members), return_exceptions=True
                )
            except BaseException:  # cancelled: its child was stopped on purpose
                await asyncio.gather(*(m.shutdown(0) for m in members))
                raise
            failed = [e for e in tried if isinstance(e, BaseException)]
            if failed:
                log.warning(
                    "a spare did not start; restarts start cold",
                    child=spec.id,
                    error=str(failed[0]),
                )
                await asyncio.gather(*(m.shutdown(0) for m in members))
                return None
            return members

        spares = _Spares(spec, asyncio.create_task(prepare()))
        old = self._spares.pop(id(spec), None)
        if old is not None:
            old.discard()
        self._spares[id(spec)] = spares

        def ended(done: asyncio.Future[Exit]) -> None:
            if self._spares.get(id(spec)) is not spares:
                return  # taken already
            # Stopped on purpose, or finished its work: no restart is coming (a permanent
            # child that ends normally restarts cold: its work ended, not its process).
            if incarnation.stopped or done.result().normal:
                self._spares.pop(id(spec)).discard()
                return

            def expire() -> None:
                if self._spares.get(id(spec)) is spares:
                    self._spares.pop(id(spec)).discard()

            asyncio.get_running_loop().call_later(self.start_timeout, expire)

        incarnation.done.add_done_callback(ended)

    async def _take_spares(self, spec: LaunchSpec) -> list[ProcessMember] | None:
        """``spec``'s spares, every one alive and waiting (``None``: start cold)."""
        spares = self._spares.pop(id(spec), None)
        if spares is None or spares.spec is not spec:
            return None
        members = await asyncio.shield(spares.ready)  # a crash soon after a start: wait for them
        if members is None or any(m.done.done() for m in members):
            spares.discard()
            return None
        return members

    def spares(self, spec: LaunchSpec) -> list[int | None]:
        """The pids of ``spec``'s spares ready now (empty: none, or not ready yet)."""
        spares = self._spares.get(id(spec))
        if spares is None or not spares.ready.done() or spares.ready.cancelled():
            return []
        members = spares.ready.result() or []
        return [m.pid for m in members if not m.done.done()]


class _Spares:
    """A child's spares being prepared (``ready``: the members, ``None`` if they failed)."""

    def __init__(self, spec: LaunchSpec, ready: asyncio.Task[list[ProcessMember] | None]) -> None:
        self.spec, self.ready = spec, ready

    def discard(self) -> None:
        if not self.ready.done():
            self.ready.cancel()  # prepare() kills what it spawned
            return
        if self.ready.cancelled() or self.ready.exception() is not None:
            return
        for member in self.ready.result() or []:
            member.kill("a spare no restart took")  # now: the loop may be closing


async def start_member(
    cls: type[ProcessMember],
    spec: LaunchSpec,
    options: ProcessOptions,
    rank: int,
    gang_env: dict[str, str],
    extra: Mapping[str, Any] | None = None,
) -> Member:
    """Start member ``rank`` of ``spec`` as a ``cls`` (``ProcessMember`` or a subclass, which
    takes ``extra`` as further keyword arguments)."""
    member = new_member(cls, spec, options, rank, gang_env, extra)
    await member.start()
    return member  # type: ignore[return-value]


def new_member(
    cls: type[ProcessMember],
    spec: LaunchSpec,
    options: ProcessOptions,
    rank: int,
    gang_env: dict[str, str],
    extra: Mapping[str, Any] | None = None,
) -> ProcessMember:
    """Member ``rank`` of ``spec`` as a ``cls``, not started."""
    return cls(
        actor_id=spec.id,
        target=import_path(spec.start),  # type: ignore[arg-type]
        args=spec.args,
        kwargs=dict(spec.kwargs),
        rank=rank,
        size=spec.gang,
        options=options,
        gang_env=gang_env,
        **(extra or {}),
    )


def _gang_env(size: int, rendezvous: str | None) -> dict[str, str]:
    """The environment of a gang's members: ``WORLD_SIZE`` and friends, the rendezvous folder,
    and ``MASTER_ADDR``/``MASTER_PORT`` for members' own ``env://`` code. That port was free
    when it was picked here, but another process may take it before rank 0 binds it (bind,
    close, rebind is a race); ``GANG_RENDEZVOUS_ENV`` has none."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(size),
        "LOCAL_WORLD_SIZE": str(size),
    }
    if rendezvous is not None:
        env[GANG_RENDEZVOUS_ENV] = rendezvous
    return env


class Incarnation:
    """One start of a child: its members, which start, stop and end as a unit.

    ``done`` resolves when the unit has ended: when every member ended normally, or as soon
    as one member ends abnormally, after the others were killed (a torch.distributed world
    cannot go on with a rank missing). Its ``Exit`` names the member that ended it.
    """

    def __init__(self, actor_id: str, members: list[Member]) -> None:
        self.actor_id = actor_id
        self.members = members
        self.done: asyncio.Future[Exit] = asyncio.get_running_loop().create_future()
        self._ending = False
        self.stopped = False
        """Whether it was stopped on purpose (``shutdown``), not ended by a crash."""
        self._ender: asyncio.Future[None] | None = None
        for rank, member in enumerate(members):
            member.done.add_done_callback(lambda fut, rank=rank: self._member_done(rank, fut))

    @classmethod
    async def launch(cls, actor_id: str, starters: list[Any]) -> Incarnation:
        tasks = [asyncio.create_task(start(rank)) for rank, start in enumerate(starters)]
        await asyncio.wait(tasks)
        failed = [t for t in tasks if t.exception() is not None]
        if not failed:
            return cls(actor_id, [t.result() for t in tasks])
        for task in tasks:
            if task.exception() is None:
                await task.result().shutdown(0)
        exc = failed[0].exception()
        if isinstance(exc, StartFailed):
            raise exc
        exit_ = Exit.from_exception(exc, "start")  # type: ignore[arg-type]
        raise StartFailed(
            f"{actor_id}: {exit_.describe()}", actor_id=actor_id, cause=exit_
        ) from exc

    @property
    def alive(self) -> bool:
        """False as soon as any member has ended (before the supervisor has heard of it)."""
        return not self.done.done() and not any(m.done.done() for m in self.members)

    @property
    def pids(self) -> list[int | None]:
        return [m.pid for m in self.members]

    def member(self, rank: int = 0) -> Member:
        return self.members[rank]

    def _member_done(self, rank: int, fut: asyncio.Future[Exit]) -> None:
        exit_ = fut.result()
        if len(self.members) > 1 and exit_.member is None:
            exit_ = Exit(**{**exit_.__dict__, "member": rank})
        if self._ending:
            return  # _end_with or shutdown resolves the gang's end with the right cause
        if not exit_.normal:
            self._ending = True
            self._ender = asyncio.ensure_future(self._end_with(exit_))
        elif all(m.done.done() for m in self.members):
            self._resolve(exit_)

    async def _end_with(self, exit_: Exit) -> None:
        # Kill the rest at once; the gang's Exit names the member that ended it.
        await asyncio.gather(*(m.shutdown(0) for m in self.members if not m.done.done()))
        self._resolve(exit_)

    def _resolve(self, exit_: Exit) -> None:
        if not self.done.done():
            self.done.set_result(exit_)

    async def shutdown(self, timeout: float) -> Exit:
        """Stop every member together; each is killed after ``timeout`` (0: at once)."""
        self._ending = self.stopped = True
        exits = await asyncio.gather(*(m.shutdown(timeout) for m in self.members))
        worst = next((e for e in exits if not e.normal), exits[0])
        self._resolve(worst)
        return await asyncio.shield(self.done)

    def statistics(self) -> dict[str, Any]:
        stats = [m.statistics() for m in self.members]
        return stats[0] if len(stats) == 1 else {"members": stats}
