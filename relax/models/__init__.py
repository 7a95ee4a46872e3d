"""Models, tokenizers and processors: building tiny ones offline, loading any local one, and
batching a prompt's media the one way generation and training both use.

    init = ModelInitConfig(arch="qwen2", hidden_size=64, num_layers=2, vocab_size=512)
    folder = build_tiny_model(init, "runs/model")      # a normal HF folder, tokenizer included
    model, tokenizer = load_policy(folder, "float32")   # the same call for a real checkpoint
    stop = stop_token_ids(tokenizer)                    # EOS and the chat end-of-turn

Multimodal (``ModelInitConfig(arch="qwen2_5_omni")`` or a Qwen2.5-Omni/-VL folder):
``load_processor(folder)`` turns text + media into ``input_ids`` and media tensors
(``processor_kwargs`` keeps its saved video size); ``collate_mm_inputs`` batches several
prompts' media for one forward; ``suppressed_token_ids(model)`` are the ids a policy never
samples (the media placeholders), masked by the engine and the trainer alike; ``MediaSpec``
checks a prompt's placeholders against its media. ``build_tiny_omni_model`` / ``omni_processor``
build the tiny Qwen2.5-Omni thinker and its offline processor directly;
``enable_video_without_torchvision`` lets ``AutoProcessor`` load video processors without
torchvision.

LoRA (``[model.lora]``, needs ``peft``): ``apply_lora(model, cfg)`` injects adapters in place
(base frozen); ``adapter_state_dict`` / ``load_adapter_state`` move only the adapter tensors,
named so they are never mistaken for full weights (``is_adapter_name``); ``save_adapter`` /
``read_adapter`` use peft's folder layout and ``merge_lora`` writes a merged plain model folder.

transformers builds a model with process-wide patches, so two threads building at once break
every later load in the process: everything here builds under ``one_build_at_a_time()`` (also
for code outside Relax sharing the process), and ``load_pretrained`` takes it and refuses a
model left with weights on the meta device (``check_materialised``).

Generation lives in ``relax.engines``, which loads its models through this package. This
package imports torch, transformers, tokenizers, NumPy, Pillow and ``relax.errors`` /
``relax.config`` only (and ``peft`` when an adapter is used).
"""

from __future__ import annotations

from relax.errors import EngineError
from relax.models._build import check_materialised, load_pretrained, one_build_at_a_time
from relax.models._lora import (
    adapter_parameters,
    adapter_problems,
    adapter_state_dict,
    apply_lora,
    is_adapter_folder,
    is_adapter_name,
    load_adapter_state,
    lora_config,
    merge_lora,
    read_adapter,
    save_adapter,
)
from relax.models._moe import (
    MoeShape,
    ReplayStats,
    RoutingRecorder,
    check_replayable,
    expert_dtype,
    moe_shape,
    router_layers,
    routing,
)
from relax.models._multimodal import (
    MediaSpec,
    collate_mm_inputs,
    is_multimodal,
    load_processor,
    processor_kwargs,
    reset_rope_deltas,
    rope_deltas,
    suppressed_token_ids,
    uses_mrope,
)
from relax.models._omni import (
    OMNI_ARCHS,
    OMNI_TOKENS,
    build_omni_tokenizer,
    build_tiny_omni_model,
    load_omni_processor,
    media_token_ids,
    omni_processor,
)
from relax.models._policy import load_policy, resolve_device, torch_dtype
from relax.models._tiny import build_tiny_model
from relax.models._tokenizers import (
    BYTE_TOKENIZER,
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_byte_tokenizer,
    check_vocab,
    load_tokenizer,
    pad_token_id,
    stop_token_ids,
)
from relax.models._video_processor import (
    NumpyQwen2VLVideoProcessor,
    enable_video_without_torchvision,
)

__all__ = [
    "BYTE_TOKENIZER",
    "CHAT_TEMPLATE",
    "OMNI_ARCHS",
    "OMNI_TOKENS",
    "SPECIAL_TOKENS",
    "EngineError",
    "MediaSpec",
    "MoeShape",
    "NumpyQwen2VLVideoProcessor",
    "ReplayStats",
    "RoutingRecorder",
    "adapter_parameters",
    "adapter_problems",
    "adapter_state_dict",
    "apply_lora",
    "build_byte_tokenizer",
    "build_omni_tokenizer",
    "build_tiny_model",
    "build_tiny_omni_model",
    "check_materialised",
    "check_replayable",
    "check_vocab",
    "collate_mm_inputs",
    "enable_video_without_torchvision",
    "expert_dtype",
    "is_adapter_folder",
    "is_adapter_name",
    "is_multimodal",
    "load_adapter_state",
    "load_omni_processor",
    "load_policy",
    "load_pretrained",
    "load_processor",
    "load_tokenizer",
    "lora_config",
    "media_token_ids",
    "merge_lora",
    "moe_shape",
    "omni_processor",
    "one_build_at_a_time",
    "pad_token_id",
    "processor_kwargs",
    "read_adapter",
    "reset_rope_deltas",
    "resolve_device",
    "rope_deltas",
    "router_layers",
    "routing",
    "save_adapter",
    "stop_token_ids",
    "suppressed_token_ids",
    "torch_dtype",
    "uses_mrope",
]
