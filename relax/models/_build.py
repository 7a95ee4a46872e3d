"""Building Hugging Face models one at a time in a process.

transformers (5.x) builds a model inside context managers that swap class attributes for the
duration: ``PreTrainedModel.tie_weights`` and ``init_weights`` are replaced by no-ops and put
back on exit. Two threads building at once put back each other's replacement, and the process
is left with weight tying (or initialisation) switched off for good: from then on every load of
a model with tied embeddings leaves ``lm_head`` on the meta device, and a model built from a
config keeps uninitialised weights. Roles load their models in worker threads, and several roles
may share a process (an embedded cluster, an in-process test), so every model Relax builds is
built under one lock, and a loaded model is checked for weights left on the meta device — which
is what a model built concurrently by code outside Relax still does to this process.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

from relax.errors import RelaxError

_BUILD_LOCK = threading.RLock()

M = TypeVar("M", bound=torch.nn.Module)


@contextmanager
def one_build_at_a_time() -> Iterator[None]:
    """Hold the process's model-building lock: wrap any ``from_config`` or direct construction
    of a transformers model (``load_pretrained`` takes it itself)."""
    with _BUILD_LOCK:
        yield


def load_pretrained(model_class: Any, folder: str | Path, **kwargs: Any) -> Any:
    """``model_class.from_pretrained(folder, **kwargs)`` under the building lock, refused with a
    ``RelaxError`` naming the weights when any of them is left on the meta device."""
    with _BUILD_LOCK:
        model = model_class.from_pretrained(folder, **kwargs)
    check_materialised(model, str(folder))
    return model


def check_materialised(model: M, source: str) -> M:
    """``model`` when every parameter and buffer holds data; a ``RelaxError`` otherwise."""
    empty = [
        name
        for name, tensor in (
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        )
        if tensor.device.type == "meta"
    ]
    if empty:
        raise RelaxError(
            f"loading {source} left {len(empty)} weight(s) without data (on the meta device):"
            f" {', '.join(empty[:5])}. transformers builds models with process-wide patches,"
            " so a model built in another thread at the same time breaks every later load in"
            " this process: build models outside Relax under"
            " relax.models.one_build_at_a_time(), and restart this process"
        )
    return model
