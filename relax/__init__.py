"""Relax: asynchronous RL post-training on supervised asyncio actors and a versioned sample bus.

The front door, for a Python program that runs Relax itself (the command line is ``relax``)::

    import relax

    cfg = relax.load_config("cluster.toml", overrides=["trainer.steps=20"])  # a ClusterConfig
    layout = await relax.up(cfg)          # the whole cluster, here, until the trainer is done

    async with relax.embed.start("cluster.toml") as run:  # or a cluster inside your program
        ...

- ``load_config`` / ``ClusterConfig``: the validated ``cluster.toml`` (``relax.config``);
- ``up``: runs a cluster to completion in this process, what ``relax up`` runs in the
  foreground (``relax.cluster.run``; it raises when the tree gives up);
- ``embed``: the module ``relax.embed``, a cluster inside your own asyncio program;
- ``RelaxError``: the root of every error Relax raises on purpose (``relax.errors``).

Each name is imported when first used: ``import relax`` (and so ``import relax.config``, which
imports this package first) does not import torch.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.1.0"

# DeepSpeed is imported by transformers whenever accelerate (a dependency of peft) is installed
# beside it, and when it then auto-detects no accelerator it prints a warning to stdout — a line
# in every program that loads a model (an embedding application's own output included). On a
# machine with no NVIDIA driver, name its own answer there, the CPU, up front: no line. A
# setting of the user's own wins; machines with a driver keep DeepSpeed's auto-detection.
if "DS_ACCELERATOR" not in os.environ and not any(
    os.path.exists(path) for path in ("/proc/driver/nvidia", "/dev/nvidia0")
):
    os.environ["DS_ACCELERATOR"] = "cpu"

_FRONT_DOOR: dict[str, tuple[str, str | None]] = {
    "ClusterConfig": ("relax.config", "ClusterConfig"),
    "RelaxError": ("relax.errors", "RelaxError"),
    "embed": ("relax.embed", None),  # the module itself (it is also the submodule's name)
    "load_config": ("relax.config", "load_config"),
    "up": ("relax.cluster", "run"),
}
"""Each public name: the module it comes from, and its name there (None: the module)."""

__all__ = ["ClusterConfig", "RelaxError", "__version__", "embed", "load_config", "up"]


def __getattr__(name: str) -> Any:  # PEP 562: called only for names not yet set here
    if name not in _FRONT_DOOR:
        raise AttributeError(f"module 'relax' has no attribute {name!r}")
    module_name, attribute = _FRONT_DOOR[name]
    value: Any = importlib.import_module(module_name)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
