"""Files that parts of Relax on different floors share, kept free of heavy imports:
``relax status`` and the control endpoint use them without importing torch.

``PAUSE_FILE``: present while generation is paused. The control endpoint writes it before it
tells the rollouts, and a rollout reads it when it starts, so one restarted while the run is
paused comes back paused.
"""

from __future__ import annotations

import json
import os
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
(``relax.actors``), read by ``relax.training``'s ``init_world``."""
