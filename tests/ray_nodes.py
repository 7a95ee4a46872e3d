"""A multi-node Ray cluster on this machine for the Ray tests: ``ray.cluster_utils.Cluster``
with a head and further raylets, every node on 127.0.0.1 (tests send traffic to loopback only),
no token auth, this process connected as the driver; torn down when the block ends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

LOOPBACK = {"node_ip_address": "127.0.0.1"}
"""Per-node arguments that keep a raylet (and its workers) on loopback."""


@contextlib.contextmanager
def loopback_cluster(head_cpus: float, **nodes: dict[str, Any]) -> Iterator[Any]:
    """A connected ``Cluster``; each keyword adds a node (``num_cpus``, ``resources``, ...)
    kept as an attribute of that name (``node_b=...`` -> ``cluster.node_b``)."""
    import ray
    from ray.cluster_utils import Cluster

    from relax.actors._ray import WORKER_NICENESS_ENV, ray_process_env

    # Every raylet on loopback (else Ray's control store binds eth0), no token auth, and
    # workers at the nice value `relax up` gives a local instance (Ray's 15 starved the
    # launchers beside CI's other test worker: a gang's start ran past two minutes).
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    with ray_process_env({**env, WORKER_NICENESS_ENV: "0"}):
        cluster = Cluster(
            initialize_head=True,
            connect=True,
            head_node_args={"num_cpus": head_cpus, "include_dashboard": False, **LOOPBACK},
        )
        try:
            for name, args in nodes.items():
                setattr(cluster, name, cluster.add_node(**args, **LOOPBACK))
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()


def add_node(cluster: Any, **args: Any) -> Any:
    """One more node of ``cluster``, on loopback."""
    return cluster.add_node(**args, **LOOPBACK)
