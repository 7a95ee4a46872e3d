"""What a run leaves on Ray, found by name: ``relax down``'s check that none of it is left.

Every Ray object a run creates carries a name the run can be found by: each launcher is a
named actor ``relax:<child>:<rank>:<id>`` in the run's Ray namespace (``relax-<run folder>``
when ``relax up`` connects), and each gang's placement group is named
``relax:<namespace>:<child>:<id>`` (Ray lists placement groups across namespaces). Ray's
owner rule cleans up after a driver that died (its actors and groups go with it), but
asynchronously, and not at all after one that hangs: ``ray_sweep`` waits for the first and
removes what the second left, then says what is left, if anything.
"""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

NAME_PREFIX = "relax:"
"""The first part of every Ray object name a run gives."""


def run_namespace(run_name: str) -> str:
    """The Ray namespace of the run in folder ``run_name``."""
    return f"relax-{run_name}"


def actor_name(child: str, rank: int) -> str:
    """A fresh name for one start of member ``rank`` of ``child`` (restarts overlap a moment)."""
    return f"{NAME_PREFIX}{child}:{rank}:{uuid.uuid4().hex[:8]}"


def group_name(namespace: str, child: str) -> str:
    """A fresh name for one start of gang ``child``'s placement group."""
    return f"{NAME_PREFIX}{namespace}:{child}:{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class Leftovers:
    """A run's Ray objects still there: launcher actor names, placement group names."""

    actors: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.actors or self.groups)

    def describe(self) -> str:
        parts = [f"actor {name}" for name in self.actors]
        parts += [f"placement group {name}" for name in self.groups]
        return ", ".join(parts)


def connected_to() -> tuple[str, str]:
    """``(gcs_address, namespace)`` of this process's Ray connection."""
    import ray

    context = ray.get_runtime_context()
    return context.gcs_address, context.namespace


@contextlib.contextmanager
def ray_connection(gcs_address: str, namespace: str) -> Iterator[None]:
    """This process connected to the Ray cluster at ``gcs_address`` in ``namespace`` for the
    block (``relax down``'s: it checks ``reachable`` first, ``ray.init`` would wait)."""
    import ray

    ray.init(address=gcs_address, namespace=namespace, logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()


def ray_leftovers(namespace: str) -> Leftovers:
    """The run's named actors and live placement groups (this process connected to Ray)."""
    import ray

    actors = [
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["namespace"] == namespace
    ]
    groups = [
        info.get("name") or ""
        for info in ray.util.placement_group_table().values()
        if info.get("state") != "REMOVED"
    ]
    return Leftovers(
        actors=sorted(n for n in actors if n.startswith(NAME_PREFIX)),
        groups=sorted(n for n in groups if n.startswith(f"{NAME_PREFIX}{namespace}:")),
    )


def ray_sweep(namespace: str, *, settle: float = 10.0) -> tuple[Leftovers, Leftovers]:
    """Give Ray ``settle`` seconds to clean up after the run's driver, remove whatever of the
    run is still there, and return ``(removed, left)``."""
    import ray

    deadline = time.monotonic() + settle
    found = ray_leftovers(namespace)
    while found and time.monotonic() < deadline:  # Ray's own cleanup of a dead driver's objects
        time.sleep(0.2)
        found = ray_leftovers(namespace)
    for name in found.actors:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:  # gone between the listing and the kill
            pass
    for name in found.groups:
        try:  # a group's name is looked up in this process's namespace: the run's
            ray.util.remove_placement_group(ray.util.get_placement_group(name))
        except ValueError:
            pass
    deadline = time.monotonic() + settle
    left = ray_leftovers(namespace)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = ray_leftovers(namespace)
    return found, left


def reachable(gcs_address: str, timeout: float = 2.0) -> bool:
    """Whether Ray's control store answers at ``host:port`` (before ``ray.init`` would wait)."""
    host, _, port = gcs_address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


__all__ = [
    "NAME_PREFIX",
    "Leftovers",
    "actor_name",
    "connected_to",
    "group_name",
    "ray_connection",
    "ray_leftovers",
    "ray_sweep",
    "reachable",
    "run_namespace",
]
