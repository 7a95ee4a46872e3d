"""The actor surface users subclass: handlers are ordinary async methods."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from relax.log import get_logger

# Names on the base class that are lifecycle, not handlers: callers may not invoke them.
RESERVED = frozenset({"on_start", "on_stop", "on_failure", "run", "stop", "context", "log"})


@dataclass
class ActorContext:
    """What the runtime tells an actor about itself; set before ``on_start``."""

    id: str
    rank: int = 0
    """Rank inside its gang (0 for a plain child)."""
    size: int = 1
    """Number of members in its gang (1 for a plain child)."""
    pid: int = field(default_factory=os.getpid)
    placement: str = "inproc"
    stop_requested: bool = False


class Actor:
    """Base class for every Relax service.

    Public methods (sync or async, not starting with ``_``) are handlers that
    ``ActorRef.call`` / ``ActorRef.cast`` invoke by name. Messages are handled one at a time
    in arrival order unless ``max_concurrency`` allows more. The mailbox holds at most
    ``mailbox_size`` messages; senders wait for space (backpressure), they are never dropped.

    Failure semantics (pykka's, with Erlang's "let it crash" for what nobody awaits):

    - a handler that raises inside a ``call`` sends the exception to the caller; the actor
      lives on;
    - a handler that raises inside a ``cast``, an exception in ``run`` or in ``on_start``
      crashes the actor: ``on_failure`` runs, every waiting caller gets ``ActorDead``, and the
      supervisor decides what happens next.

    Define ``async def run(self)`` for a main loop that runs beside the mailbox; when it
    returns the actor ends normally (a ``transient`` child is then not restarted).
    """

    mailbox_size: ClassVar[int] = 128
    """Messages that may wait in the mailbox before senders block."""
    max_concurrency: ClassVar[int] = 1
    """Handlers that may run at once (1: strictly one message at a time)."""
    private_api: ClassVar[frozenset[str]] = frozenset()
    """Public methods that are local API, not handlers callers may invoke by name."""
    warm_imports: ClassVar[tuple[str, ...]] = ()
    """Modules a warm spare (``Process(standby=True)``) imports in advance besides the actor's
    own: those its ``on_start`` imports lazily, which a restart would otherwise wait for."""

    context: ActorContext

    @property
    def log(self) -> Any:
        """A structlog logger bound to this actor's id and rank."""
        ctx = getattr(self, "context", None)
        if ctx is None:
            return get_logger()
        return get_logger(actor=ctx.id, rank=ctx.rank) if ctx.size > 1 else get_logger(actor=ctx.id)

    async def on_start(self) -> None:
        """Called once before the first message; raising here is a start failure."""

    async def on_stop(self) -> None:
        """Called on a normal end (``run`` returned, ``stop()``, or a supervisor's shutdown)."""

    async def on_failure(self, exc: BaseException) -> None:
        """Called instead of ``on_stop`` when the actor crashed with ``exc``."""

    async def run(self) -> None:  # pragma: no cover - replaced by subclasses that need a loop
        """Optional main loop; the base class has none."""

    def stop(self) -> None:
        """Ask the runtime to end this actor normally after the current message."""
        self.context.stop_requested = True
        stopper = getattr(self, "_relax_stopper", None)
        if stopper is not None:
            stopper()


def has_run_loop(actor: Actor) -> bool:
    return type(actor).run is not Actor.run
