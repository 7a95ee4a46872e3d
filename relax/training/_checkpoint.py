"""Checkpoint files: Hugging Face safetensors weights (or a LoRA adapter), optimiser and RNG
state, metadata.

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

from relax.config import LoraConfig
from relax.errors import ConfigError, ConfigIssue
from relax.models import adapter_parameters, read_adapter, save_adapter

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


# --------------------------------------------------------------------------- LoRA


def check_only_adapters_train(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> None:
    """``params`` (what requires gradients) must be exactly ``model``'s LoRA adapters."""
    adapters = {id(p) for p in adapter_parameters(model).values()}
    trainable = {id(p) for p in params}
    if trainable != adapters:
        extra = [n for n, p in model.named_parameters() if id(p) in trainable - adapters]
        raise ValueError(
            f"a LoRA model must train its adapters only; also trainable: {extra[:3]}"
            if extra
            else "a LoRA model must train every adapter; some do not require gradients"
        )


def lora_meta(lora: LoraConfig | None) -> dict[str, Any]:
    """What the metadata file says of the adapter (nothing for full weights)."""
    return {} if lora is None else {"lora": lora.model_dump(mode="json")}


def save_lora(
    directory: Path, model: torch.nn.Module, lora: LoraConfig, state: dict[str, torch.Tensor]
) -> None:
    """Write the adapter ``state`` in peft's layout, naming the base model's folder (what
    ``relax ckpt export`` merges it onto)."""
    base = getattr(model, "name_or_path", None) or None
    if base is not None and Path(base).is_dir():
        base = str(Path(base).resolve())
    save_adapter(directory, lora, state, base)


def read_lora(directory: Path) -> dict[str, torch.Tensor]:
    """The adapter tensors (adapter names) a LoRA checkpoint holds."""
    state, _, _ = read_adapter(directory)
    return state


def check_lora_matches(meta: dict[str, Any], lora: LoraConfig | None, path: Path) -> None:
    """``ConfigError`` at ``model.lora`` when the checkpoint at ``path`` and the model disagree
    on LoRA: an adapter cannot resume full weights, nor full weights an adapter, nor an adapter
    of another rank or other target modules."""
    saved = meta.get("lora")
    if saved is None and lora is None:
        return
    if saved is None:
        problem = "is set, but the checkpoint holds full weights (written without [model.lora])"
        hint = "remove [model.lora] to resume it, or start a new run"
    elif lora is None:
        problem = (
            f"is not set, but the checkpoint holds a LoRA adapter (rank {saved['rank']},"
            f" targets {saved['target_modules']})"
        )
        hint = "set [model.lora] as the run that wrote it had it"
    else:
        ours = lora.model_dump(mode="json")

        def shape(c: dict[str, Any]) -> tuple[Any, ...]:
            return c["rank"], float(c["alpha"]), sorted(c["target_modules"])

        if shape(ours) == shape(saved):
            return
        problem = (
            f"(rank {ours['rank']}, alpha {ours['alpha']}, targets {ours['target_modules']})"
            f" differs from the checkpoint's adapter (rank {saved['rank']}, alpha"
            f" {saved['alpha']}, targets {saved['target_modules']})"
        )
        hint = "resume with the [model.lora] the checkpoint was written with"
    raise ConfigError([ConfigIssue("model.lora", f"{problem}: {path}", hint=hint)])
