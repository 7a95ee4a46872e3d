"""LoRA adapters on a policy (``[model.lora]``), through ``peft``.

``apply_lora(model, cfg)`` injects the adapters into the Hugging Face model *in place* (peft's
``get_peft_model``, whose wrapper is dropped): the model keeps its class, its ``forward`` and
everything the engines and the trainer call on it, its base weights are frozen and only the
adapters require gradients. Both sides of the weights channel build the same model this way
from the same ``[model.lora]``, so the trainer's forward and the rollout's are the same
computation (base output + the scaled low-rank path), not a merged approximation of it.

Adapter tensors travel under *adapter names*: the module path of the injected parameter
without peft's adapter-name segment, e.g. ``model.layers.0.self_attn.q_proj.lora_A.weight``.
Every adapter name ends in ``.lora_A.weight`` or ``.lora_B.weight``; no weight of a plain
Hugging Face model does, so a state dict is recognisably either an adapter or full weights
(``is_adapter_name``), never a mix: a receiver cannot mistake one for the other.

On disk an adapter is peft's own layout (``adapter_model.safetensors`` with peft's
``base_model.model.`` key prefix, plus ``adapter_config.json``), so
``peft.PeftModel.from_pretrained(base, folder)`` reads a Relax checkpoint as it is, and
``merge_lora`` turns one into a plain model folder (``merge_and_unload``).

``peft`` is imported only when an adapter is used: it is an optional extra (``pip install
'relax-rl[lora]'``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from relax.config import LoraConfig
from relax.errors import ConfigError, ConfigIssue

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
"""What peft puts before a module path in its adapter files."""
INSTALL_HINT = "pip install 'relax-rl[lora]' (or: pip install peft)"
INIT_SEED = 0
"""Seed of the adapters' initial A matrices (B starts at zero, so any A is an identity
update); fixed so every process that builds version 0 builds the same one."""

_ADAPTER = re.compile(r"\.lora_[AB]\.weight$")
_ATTR = "_relax_lora"  # the LoraConfig an injected model was built with


def import_peft() -> Any:
    """``peft``, or a ``ConfigError`` at ``model.lora`` saying how to install it."""
    try:
        import peft
    except ImportError as exc:
        raise ConfigError(
            [ConfigIssue("model.lora", f"needs the 'peft' package ({exc})", hint=INSTALL_HINT)]
        ) from exc
    return peft


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` is an adapter tensor's (``….lora_A.weight`` / ``….lora_B.weight``)."""
    return _ADAPTER.search(name) is not None


def lora_config(model: torch.nn.Module) -> LoraConfig | None:
    """The ``[model.lora]`` ``model`` was injected with by ``apply_lora``; ``None`` for a
    model without adapters."""
    found = getattr(model, _ATTR, None)
    return found if isinstance(found, LoraConfig) else None


def peft_config(cfg: LoraConfig, base: str | None = None) -> Any:
    """peft's ``LoraConfig`` for ``[model.lora]`` (``base``: the base model's folder)."""
    peft = import_peft()
    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
    )


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """Inject ``cfg``'s adapters into ``model`` in place and return it.

    The base weights stop requiring gradients; every adapter requires them. The adapters start
    as peft starts them (A random, B zero: the model's outputs are unchanged), A seeded by
    ``INIT_SEED`` without touching the global RNG. A ``target_modules`` name that matches no
    module is a ``ConfigError`` at ``model.lora.target_modules``.
    """
    if lora_config(model) is not None:
        raise ValueError("the model already has LoRA adapters")
    peft = import_peft()
    base = getattr(model, "name_or_path", None) or None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_SEED)
        try:
            # No float32 upcast of bf16/fp16 adapters: they take the model's dtype, so the
            # trainer (which casts the whole model to trainer.dtype) and the engine agree.
            wrapper = peft.get_peft_model(
                model, peft_config(cfg, base), autocast_adapter_dtype=False
            )
        except ValueError as exc:
            if "target modules" not in str(exc).lower():
                raise
            names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if _linear(m)})
            raise ConfigError(
                [
                    ConfigIssue(
                        "model.lora.target_modules",
                        f"{list(cfg.target_modules)} match no module of {type(model).__name__}",
                        hint=f"its linear layers are named {names}",
                    )
                ]
            ) from None
    injected = wrapper.base_model.model
    assert injected is model  # peft replaced the layers inside the model we hold
    setattr(model, _ATTR, cfg)
    if not adapter_parameters(model):  # pragma: no cover - peft found targets but made nothing
        raise RuntimeError("peft injected no adapter")
    return model


def _linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear)


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The live adapter parameters of ``model`` by adapter name, in the model's order."""
    out = {}
    for name, param in model.named_parameters():
        for part in (".lora_A.default.", ".lora_B.default."):
            if part in name:
                out[name.replace(part, part.removesuffix("default."))] = param
    return out


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached, contiguous CPU copy of every adapter tensor, by adapter name."""
    return {
        name: p.detach().to("cpu", copy=True).contiguous()
        for name, p in adapter_parameters(model).items()
    }


def adapter_problems(
    model: torch.nn.Module, items: Iterable[tuple[str, torch.Tensor]]
) -> list[str]:
    """Why ``items`` cannot replace ``model``'s adapters (empty: they can): full weights
    instead of an adapter, unknown or missing adapter tensors, wrong shapes."""
    own = adapter_parameters(model)
    problems = []
    names = []
    for name, tensor in items:
        names.append(name)
        if name not in own:
            continue
        if tuple(tensor.shape) != tuple(own[name].shape):
            problems.append(
                f"{name!r} has shape {tuple(tensor.shape)}, the adapter's is {tuple(own[name].shape)}"
            )
    full = [n for n in names if not is_adapter_name(n)]
    if full:
        problems.insert(
            0,
            f"{len(full)} of {len(names)} tensors are not adapter tensors (e.g. {full[0]!r}):"
            " full weights cannot replace a LoRA adapter",
        )
        return problems
    unknown = sorted(set(names) - set(own))
    missing = sorted(set(own) - set(names))
    if unknown:
        problems.append(
            f"{len(unknown)} adapter tensors this model has no place for, e.g. {unknown[:2]}"
            " (another [model.lora] target_modules?)"
        )
    if missing:
        problems.append(f"{len(missing)} adapter tensors missing, e.g. {missing[:2]}")
    return problems


def load_adapter_state(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Replace ``model``'s adapters by ``state`` (adapter names), all or nothing: every
    problem is a ``ValueError`` raised before any tensor is copied."""
    items = list(state.items()) if isinstance(state, Mapping) else list(state)
    problems = adapter_problems(model, items)
    if problems:
        raise ValueError("; ".join(problems))
    own = adapter_parameters(model)
    with torch.no_grad():
        for name, tensor in items:
            own[name].copy_(tensor)


# --------------------------------------------------------------------------- files


def save_adapter(
    directory: str | Path, cfg: LoraConfig, state: Mapping[str, torch.Tensor], base: str | None
) -> list[str]:
    """Write ``state`` (adapter names) as a peft adapter folder; returns the files written.

    ``base`` (the base model's folder) goes into ``adapter_config.json`` as peft's
    ``base_model_name_or_path``: ``relax ckpt export`` merges onto it.
    """
    from safetensors.torch import save_file

    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    peft_config(cfg, base).save_pretrained(str(folder))
    save_file(
        {PEFT_PREFIX + name: t.contiguous() for name, t in state.items()},
        str(folder / ADAPTER_WEIGHTS),
        metadata={"format": "pt"},
    )
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]


def is_adapter_folder(directory: str | Path) -> bool:
    """Whether ``directory`` holds a saved adapter (``save_adapter``'s files)."""
    folder = Path(directory)
    return (folder / ADAPTER_CONFIG).is_file() and (folder / ADAPTER_WEIGHTS).is_file()


def read_adapter(directory: str | Path) -> tuple[dict[str, torch.Tensor], LoraConfig, str | None]:
    """A saved adapter: its tensors by adapter name, its ``[model.lora]`` and its base model
    folder (as written; ``None`` when unknown)."""
    from safetensors.torch import load_file

    folder = Path(directory)
    raw = json.loads((folder / ADAPTER_CONFIG).read_text())
    cfg = LoraConfig(
        rank=raw["r"],
        alpha=raw["lora_alpha"],
        # peft keeps them as a set: sorted, so a saved adapter always reads the same.
        target_modules=sorted(raw["target_modules"])
        if isinstance(raw["target_modules"], list)
        else [raw["target_modules"]],
        dropout=raw.get("lora_dropout", 0.0),
    )
    state = {
        name.removeprefix(PEFT_PREFIX): tensor
        for name, tensor in load_file(str(folder / ADAPTER_WEIGHTS)).items()
    }
    return state, cfg, raw.get("base_model_name_or_path")


def merge_lora(base: str | Path, adapter: str | Path, out: str | Path) -> list[str]:
    """Write ``base`` with the adapter saved in ``adapter`` merged into its weights
    (``W + alpha/r · B·A``, peft's ``merge_and_unload``) as a plain Hugging Face model folder
    at ``out`` (weights, ``config.json``, ``generation_config.json``; no tokenizer). Returns
    the file names written."""
    from relax.models._build import load_pretrained, one_build_at_a_time
    from relax.models._multimodal import policy_class

    peft = import_peft()
    model = load_pretrained(policy_class(Path(base)), str(base), dtype=torch.float32)
    with one_build_at_a_time():
        merged = peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(target))
    return sorted(p.name for p in target.iterdir() if p.suffix in (".safetensors", ".json"))
