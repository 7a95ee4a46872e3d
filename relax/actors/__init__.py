"""The actor runtime: asyncio actors under Erlang/OTP-style supervisors.

- ``Actor``: subclass it; public async methods are handlers; ``on_start``/``on_stop``/
  ``on_failure`` hooks; optional ``run()`` main loop; bounded mailbox (backpressure).
- ``ActorRef``: ``call`` (request/reply with timeout) and ``cast`` (fire-and-forget); when
  an actor dies every pending call fails with ``ActorDead`` at once.
- ``Supervisor`` and ``ChildSpec``: strategies, restart types, intensity/period, nested
  supervisors, gangs, snapshots.
- Placements: ``InProc`` (a task here), ``Process`` (its own OS process over NNG, with
  heartbeats) and ``Ray`` (the same child process, started by a Ray actor on a Ray node;
  ``ray_session`` connects to Ray; ray is imported only when a Ray child starts). A run's
  Ray objects are named after it: ``ray_sweep`` finds and removes what is left of one.
"""

from relax.actors._actor import Actor, ActorContext
from relax.actors._exit import Exit
from relax.actors._flags import (
    BRUTAL_KILL,
    DEFAULT_INTENSITY,
    DEFAULT_PERIOD,
    DEFAULT_SHUTDOWN,
    Restart,
    Strategy,
)
from relax.actors._placement import InProc, Placement, Process
from relax.actors._ray import RAY_INSTALL_HINT, Ray, ray_session
from relax.actors._ray_run import (
    Leftovers,
    connected_to,
    ray_connection,
    ray_leftovers,
    ray_sweep,
    reachable,
    run_namespace,
)
from relax.actors._ref import DEFAULT_CALL_TIMEOUT, ActorRef
from relax.actors._supervisor import ChildSpec, ChildState, Supervisor

__all__ = [
    "BRUTAL_KILL",
    "DEFAULT_CALL_TIMEOUT",
    "DEFAULT_INTENSITY",
    "DEFAULT_PERIOD",
    "DEFAULT_SHUTDOWN",
    "RAY_INSTALL_HINT",
    "Actor",
    "ActorContext",
    "ActorRef",
    "ChildSpec",
    "ChildState",
    "Exit",
    "InProc",
    "Leftovers",
    "Placement",
    "Process",
    "Ray",
    "Restart",
    "Strategy",
    "Supervisor",
    "connected_to",
    "ray_connection",
    "ray_leftovers",
    "ray_session",
    "ray_sweep",
    "reachable",
    "run_namespace",
]
