"""Files that parts of Relax on different floors share, kept free of heavy imports:
``relax status`` and the control endpoint use them without importing torch.

``PAUSE_FILE``: present while generation is paused. The control endpoint writes it before it
tells the rollouts, and a rollout reads it when it starts, so one restarted while the run is
paused comes back paused.

``CONTROL_FILE``: how to reach a running cluster's control endpoint (written by
``relax.control``); ``read_control`` is its one reader, for the endpoint's clients and for the
command line's "is a cluster running here?".
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

PAUSE_FILE = "paused"
"""A run folder's pause flag: present while generation is paused (see the module docstring)."""


def pause_requested(run_dir: str | Path | None) -> bool:
    """Whether the run in ``run_dir`` is paused (its ``PAUSE_FILE`` exists)."""
    return run_dir is not None and (Path(run_dir) / PAUSE_FILE).exists()


def set_pause_requested(run_dir: str | Path, paused: bool) -> None:
    """Record the run's pause state where a restarted rollout reads it."""
    path = Path(run_dir) / PAUSE_FILE
    if not paused:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(PAUSE_FILE + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"paused": True}, f)
    tmp.replace(path)


GANG_RENDEZVOUS_ENV = "RELAX_GANG_RENDEZVOUS"
"""Names a folder (one per start of a gang, removed with it) where the gang's rank 0 writes
the port of the store it listens on — bound to port 0, the kernel's pick, so no other process
can take it first — and where the other ranks read it. Set by the process placement
(``relax.actors``), read by ``relax.transport``'s ``init_world``."""


GANG_PORT_FILE = "port"
"""The file of a gang's rendezvous folder that holds its rank 0's store port (written
atomically: rank 0, or on Ray the member's launcher relaying it from rank 0's node)."""


CONTROL_FILE = "control.json"
"""Name of the file in a run folder that says how to reach its running cluster."""


@dataclass(frozen=True)
class ControlInfo:
    """What a run's ``CONTROL_FILE`` says: where its cluster's control endpoint listens."""

    pid: int
    """The cluster's process (the file outlives it when that process is killed)."""
    url: str
    token: str
    """The secret that authenticates control clients."""
    cluster: str | None = None
    started_at: float | None = None
    metrics_url: str | None = None


def read_control(run_dir: str | Path) -> ControlInfo | None:
    """The run's ``CONTROL_FILE``, or None when there is none or it cannot be used: unreadable,
    not JSON, or without a positive integer ``pid``. The cluster writes it whole and renames it
    into place, so a reader never sees half of one; whether its pid still runs is the caller's
    question."""
    try:
        data = json.loads((Path(run_dir) / CONTROL_FILE).read_text())
    except (OSError, ValueError):  # missing, unreadable, or not JSON
        return None
    if not isinstance(data, dict):
        return None
    pid = data.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    started_at = data.get("started_at")
    return ControlInfo(
        pid=pid,
        url=str(data.get("url") or ""),
        token=str(data.get("token") or ""),
        cluster=data["cluster"] if isinstance(data.get("cluster"), str) else None,
        started_at=float(started_at) if isinstance(started_at, (int, float)) else None,
        metrics_url=data["metrics_url"] if isinstance(data.get("metrics_url"), str) else None,
    )


RAY_FILE = "ray.json"
"""Name of the file in a run folder that says which Ray cluster and namespace the run used
(written by ``relax.cluster`` once it connected; read by ``relax down``)."""


@dataclass(frozen=True)
class RayInfo:
    """What a run's ``RAY_FILE`` says."""

    gcs_address: str
    """``host:port`` of the Ray cluster's control store (what ``ray.init(address=)`` takes)."""
    namespace: str
    """The Ray namespace the run's actors were created in."""
    local: bool
    """Whether the run started a private Ray instance (``address = "local"``), which ends
    with it."""


def write_ray_info(run_dir: str | Path, info: RayInfo) -> None:
    path = Path(run_dir) / RAY_FILE
    tmp = path.with_name(RAY_FILE + ".tmp")
    tmp.write_text(json.dumps(info.__dict__))
    tmp.replace(path)  # whole or not at all


def read_ray_info(run_dir: str | Path) -> RayInfo | None:
    """The run's ``RAY_FILE``, or None when it has none (it used no Ray) or it is unusable."""
    try:
        data = json.loads((Path(run_dir) / RAY_FILE).read_text())
        return RayInfo(str(data["gcs_address"]), str(data["namespace"]), bool(data["local"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
