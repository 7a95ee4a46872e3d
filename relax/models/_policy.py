"""Loading a policy: any local Hugging Face model folder (a tiny one, a real checkpoint, a
multimodal one) with its tokenizer, in the dtype the config names."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from relax.errors import ConfigError, ConfigIssue
from relax.models._build import load_pretrained
from relax.models._multimodal import policy_class
from relax.models._tokenizers import check_vocab, load_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"``/``"bfloat16"``/``"float16"`` (the config's ``Dtype``) as a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ConfigError([ConfigIssue("model.dtype", f"unknown dtype {dtype!r}")]) from None


def resolve_device(spec: str = "auto") -> torch.device:
    """A config's device (``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"``) as a torch device;
    ``"auto"`` is this process's current GPU when it sees one, else the CPU."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(spec)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def load_policy(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    *,
    tokenizer: str | Path | None = None,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a local HF causal-LM folder and its tokenizer, in eval mode.

    A multimodal folder loads with the class its ``config.json`` names (an omni checkpoint as its
    text thinker; see ``policy_class``); its processor comes from ``load_processor``.

    ``tokenizer`` overrides where the tokenizer comes from (a folder or ``"byte"``); by default
    it is the model folder. Raises ``ConfigError`` when the folder is missing or the model's
    vocabulary cannot hold the tokenizer's ids.
    """
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ConfigError(
            [ConfigIssue("model.path", f"{str(folder)!r} is not a model folder (no config.json)")]
        )
    tok = load_tokenizer(
        tokenizer if tokenizer is not None else folder, trust_remote_code=trust_remote_code
    )
    model = load_pretrained(
        policy_class(folder), folder, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code
    )
    check_vocab(model.get_input_embeddings().num_embeddings, tok, key="model.path")
    model.eval()
    return model, tok
