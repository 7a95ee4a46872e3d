"""An actor whose module says when it was imported: a spare (``Process(standby=True)``)
imports it before it is told to start the actor, a cold start only then."""

from __future__ import annotations

import os
import time

import torch  # the weight a real role's module carries: what a spare imports in advance

from relax.actors import Actor

IMPORTED_AT = time.time()
assert torch.__version__


class Imported(Actor):
    warm_imports = ("tests.actors.standby_lazy",)

    def __init__(self) -> None:
        self.started_at = self.lazy_at = 0.0

    async def on_start(self) -> None:
        self.started_at = time.time()
        from tests.actors import standby_lazy  # lazily, as a role imports its heavy parts

        self.lazy_at = standby_lazy.IMPORTED_AT

    def facts(self) -> dict[str, object]:
        return {
            "pid": os.getpid(),
            "imported_at": IMPORTED_AT,
            "lazy_at": self.lazy_at,
            "started_at": self.started_at,
            "rank": [self.context.rank, os.environ.get("RANK"), os.environ.get("WORLD_SIZE")],
        }
