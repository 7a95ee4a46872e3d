"""Checkpoint files: Hugging Face safetensors weights, optimiser and RNG state, metadata.

Nothing here unpickles arbitrary objects: weights are safetensors, metadata is JSON, and the
optimiser/RNG file is read with ``torch.load(weights_only=True)``, which only rebuilds tensors
and plain containers.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

META_FILE = "relax_trainer.json"
"""JSON metadata: format, backend, version and Python's ``random`` state."""
STATE_FILE = "trainer_state.pt"
"""Optimiser state and torch RNG states (tensors and plain containers only)."""
FORMAT = 1


def write_atomically(directory: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a sibling temp dir, then rename it to ``directory``.

    A crash mid-write leaves at most a stray ``.tmp`` folder, never a half-written
    checkpoint under the real name. An existing checkpoint of that name is replaced.
    """
    target = Path(directory).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        write(tmp)
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def load_model_weights(model: torch.nn.Module, directory: Path) -> None:
    """Copy the ``*.safetensors`` weights in ``directory`` into ``model`` in place.

    Hugging Face drops tied duplicates (e.g. ``lm_head.weight`` tied to the embeddings) when it
    saves, so a parameter may be missing from the files as long as it shares storage with one
    that is present. Anything else missing or unexpected is an error.
    """
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {directory}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    own = model.state_dict()
    unexpected = sorted(set(state) - set(own))
    if unexpected:
        raise ValueError(f"checkpoint has weights the model lacks: {unexpected[:5]}")
    loaded_ptrs = {own[name].data_ptr() for name in state}
    missing = [n for n in own if n not in state and own[n].data_ptr() not in loaded_ptrs]
    if missing:
        raise ValueError(f"checkpoint lacks weights of the model: {missing[:5]}")
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor)


def rng_state() -> dict[str, Any]:
    """Torch RNG states (CPU and every CUDA device) as tensors, for ``STATE_FILE``."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured (CUDA only when both sides have it)."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def python_random_state() -> list[Any]:
    """Python's ``random`` state as JSON-able lists."""
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def set_python_random_state(state: list[Any]) -> None:
    """Restore :func:`python_random_state`'s output."""
    version, internal, gauss = state
    random.setstate((version, tuple(internal), gauss))


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    """Write the JSON metadata file."""
    (directory / META_FILE).write_text(json.dumps({"format": FORMAT, **meta}))


def read_meta(directory: Path) -> dict[str, Any]:
    """Read and check the JSON metadata file."""
    path = directory / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a trainer checkpoint (no {META_FILE})")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"unsupported checkpoint format {meta.get('format')!r} in {path}")
    return meta
