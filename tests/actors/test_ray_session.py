"""Ray sessions one after another in one process: the first leaves nothing that breaks the next.

A local ``ray.init`` turns Ray's token auth on in this process (its environment and its cached
C++ config) and leaves it on after ``ray.shutdown``; a later cluster without auth in the same
process then had every actor die unscheduled ("child waits for resources", then a start
timeout: CI's failure when a file with a local session ran before the Ray placement's tests in
the same worker).
"""

from __future__ import annotations

import os

import pytest

from relax.actors import RAY_INSTALL_HINT, ray_session
from relax.actors._ray import WORKER_NICENESS_ENV
from tests.optional import require
from tests.ray_nodes import loopback_cluster

pytestmark = pytest.mark.slow

_WATCHED = ("RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", WORKER_NICENESS_ENV)


def _node_of_a_new_actor(**options: object) -> str:
    """The node a new actor runs on; its worker must run at nice 0, not Ray's 15 (a Ray
    worker at 15 beside busy processes starved: a gang's start ran past two minutes)."""
    import ray

    @ray.remote
    class Where:
        def node(self) -> tuple[str, int]:
            return ray.get_runtime_context().get_node_id(), os.getpriority(os.PRIO_PROCESS, 0)

    actor = Where.options(num_cpus=0.1, **options).remote()
    try:
        node, nice = ray.get(actor.node.remote(), timeout=60)
    finally:
        ray.kill(actor)
    assert nice == os.getpriority(os.PRIO_PROCESS, 0), "a Ray worker at another nice value"
    return node


def test_a_cluster_after_a_local_session_in_the_same_process_runs_actors() -> None:
    require("ray", "RELAX_REQUIRE_RAY", RAY_INSTALL_HINT)
    before = {name: os.environ.get(name) for name in _WATCHED}
    with ray_session("local", num_cpus=1) as owned:
        assert owned  # this block connected: the run owns its namespace
        assert _node_of_a_new_actor()
    assert {name: os.environ.get(name) for name in _WATCHED} == before
    with loopback_cluster(1, node_b={"num_cpus": 1, "resources": {"node-b": 1}}) as cluster:
        assert _node_of_a_new_actor(resources={"node-b": 0.1}) == cluster.node_b.node_id
        import ray

        with ray_session("local", namespace="relax-x") as owned:
            # Already connected (an application's own ray.init): left as it is, not owned.
            assert not owned and ray.get_runtime_context().namespace != "relax-x"
    assert {name: os.environ.get(name) for name in _WATCHED} == before
    # And the other way round: after the cluster without auth, a local session with it.
    with ray_session("local", num_cpus=1):
        assert _node_of_a_new_actor()
