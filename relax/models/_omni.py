"""A tiny random-init omni-modal model (image + audio + video → text), built offline.

``build_tiny_model(ModelInitConfig(arch="qwen2_5_omni", ...), folder)`` (→ ``build_tiny_omni``)
saves a Qwen2.5-Omni *thinker* (``Qwen2_5OmniThinkerForConditionalGeneration``: vision tower,
audio tower, text decoder; no talker / speech output) with one vision block and one audio layer
(``TOWER_WIDTH`` wide) and a text decoder sized by ``[model.init]``, next to its processor.
``arch="qwen3_omni_moe"`` saves a Qwen3-Omni-MoE thinker instead
(``Qwen3OmniMoeThinkerForConditionalGeneration``): the same tiny towers (the vision one with
Qwen3's 16-pixel patches and one deepstack layer) and a mixture-of-experts text decoder
(``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size`` of ``[model.init]``; every
layer sparse), whose routers R3 records and replays like any other (``relax.models._moe``).
The parts, for both:

- tokenizer: the byte tokenizer (``relax.models._tokenizers.build_byte_tokenizer``) plus the seven
  Qwen2.5-Omni media tokens (ids 261-267), named on the tokenizer as the processor expects
  (``image_token``, ``audio_bos_token``, ...), with an omni ChatML chat template;
- image processor: ``Qwen2VLImageProcessorPil`` (Pillow; no torchvision);
- feature extractor: ``WhisperFeatureExtractor`` (NumPy; 128 mel bins, 16 kHz);
- video processor: ``NumpyQwen2VLVideoProcessor`` (saved as ``Qwen2VLVideoProcessor``; see
  ``relax.models._video_processor``).

The folder loads like a real checkpoint: ``load_processor(folder)`` (=
``AutoProcessor.from_pretrained`` after ``enable_video_without_torchvision()``) and
``load_policy(folder)`` (= ``Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained``, as
``AutoModelForImageTextToText`` also picks). Nothing is downloaded.
``build_tiny_omni_model(folder, seed)`` is the first, fixed shape (2 layers, 64 wide, 4 s audio).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoProcessor,
    GenerationConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2_5OmniProcessor,
    Qwen2_5OmniThinkerConfig,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Qwen3OmniMoeProcessor,
    Qwen3OmniMoeThinkerConfig,
    Qwen3OmniMoeThinkerForConditionalGeneration,
    WhisperFeatureExtractor,
)

from relax.config import ModelInitConfig
from relax.errors import ConfigError, ConfigIssue
from relax.models._build import one_build_at_a_time
from relax.models._tokenizers import BOS, EOS, PAD, build_byte_tokenizer, stop_token_ids
from relax.models._video_processor import (
    NumpyQwen2VLVideoProcessor,
    enable_video_without_torchvision,
)

__all__ = [
    "OMNI_ARCHS",
    "OMNI_AUDIO_SECONDS",
    "OMNI_CHAT_TEMPLATE",
    "OMNI_TOKENS",
    "TOWER_WIDTH",
    "build_omni_tokenizer",
    "build_tiny_omni",
    "build_tiny_omni_model",
    "load_omni_processor",
    "media_token_ids",
    "omni_processor",
    "tiny_omni_config",
]

OMNI_TOKENS: dict[str, str] = {
    "audio_token": "<|AUDIO|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
}
"""Qwen2.5-Omni's media tokens, by the tokenizer attribute the processor reads; ids 261-267
after the byte tokenizer's 256 bytes and 5 specials."""

OMNI_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] or [] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_bos|><|IMAGE|><|vision_eos|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_bos|><|VIDEO|><|vision_eos|>' }}"
    "{% elif part['type'] == 'audio' %}{{ '<|audio_bos|><|AUDIO|><|audio_eos|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML whose ``content`` is a string or a list of parts ``{"type": "text", "text": ...}``,
``{"type": "image"}``, ``{"type": "audio"}``, ``{"type": "video"}``; each media part becomes
``<|vision_bos|><|IMAGE|><|vision_eos|>`` (etc.), which the processor expands to one
placeholder per embedding."""

IMAGE_PIXELS = (56 * 56, 112 * 112)
"""(min, max) pixels the tiny model's processor resizes an image to: 4 to 16 image tokens."""

VIDEO_PIXELS = (56 * 56, 112 * 112)
"""(min, max) pixels per video frame: 4 to 16 tokens per 2 frames."""


def build_omni_tokenizer(model_max_length: int = 4096) -> PreTrainedTokenizerFast:
    """The byte tokenizer plus ``OMNI_TOKENS`` (special, ids 261-267) and the omni template."""
    base = build_byte_tokenizer(model_max_length)
    core = base.backend_tokenizer
    core.add_special_tokens(list(OMNI_TOKENS.values()))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        extra_special_tokens=dict(OMNI_TOKENS),
        padding_side="left",
        model_max_length=model_max_length,
        chat_template=OMNI_CHAT_TEMPLATE,
    )
    for offset, token in enumerate(OMNI_TOKENS.values()):
        assert tokenizer.convert_tokens_to_ids(token) == 261 + offset, token
    return tokenizer


def omni_processor(
    tokenizer: PreTrainedTokenizerFast | None = None,
    *,
    image_pixels: tuple[int, int] = IMAGE_PIXELS,
    video_pixels: tuple[int, int] = VIDEO_PIXELS,
    audio_seconds: int = 4,
    sample_rate: int = 16_000,
    arch: str = "qwen2_5_omni",
) -> Any:
    """A ``Qwen2_5OmniProcessor`` (``arch="qwen3_omni_moe"``: a ``Qwen3OmniMoeProcessor``,
    16-pixel patches) built from its parts with explicit arguments (no torchvision).

    ``audio_seconds`` is the Whisper window every clip is padded (or cut) to: set it to at least
    ``MediaLimits.max_audio_seconds``.
    """
    patch = PATCH_SIZES[arch]
    enable_video_without_torchvision()
    tokenizer = tokenizer if tokenizer is not None else build_omni_tokenizer()
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=image_pixels[0],
        max_pixels=image_pixels[1],
        patch_size=patch,
        temporal_patch_size=2,
        merge_size=2,
    )
    video_processor = NumpyQwen2VLVideoProcessor(
        min_pixels=video_pixels[0],
        max_pixels=video_pixels[1],
        patch_size=patch,
        temporal_patch_size=2,
        merge_size=2,
    )
    feature_extractor = WhisperFeatureExtractor(
        feature_size=128,
        sampling_rate=sample_rate,
        chunk_length=audio_seconds,
        hop_length=160,
        n_fft=400,
        return_attention_mask=True,
    )
    processor_class = Qwen3OmniMoeProcessor if arch == "qwen3_omni_moe" else Qwen2_5OmniProcessor
    return processor_class(
        image_processor=image_processor,
        video_processor=video_processor,
        feature_extractor=feature_extractor,
        tokenizer=tokenizer,
        chat_template=OMNI_CHAT_TEMPLATE,
    )


OMNI_AUDIO_SECONDS = 30
"""Whisper window of ``build_tiny_model``'s processor: clips are padded (or cut) to 30 s, as
with a real Qwen2.5-Omni checkpoint (``MediaConfig.max_audio_seconds``' default). Padding costs
only feature-extraction time: the audio tower reads the unmasked frames alone."""

PATCH_SIZES = {"qwen2_5_omni": 14, "qwen3_omni_moe": 16}
"""Vision patch size (pixels) per omni architecture, as their real checkpoints have it."""

OMNI_ARCHS = tuple(PATCH_SIZES)
"""The ``[model.init] arch`` values that build an omni thinker and its processor."""

TOWER_WIDTH = 64
"""Width of the tiny vision and audio towers, whatever the decoder's ``hidden_size`` (their
outputs are projected to it)."""


def tiny_omni_config(tokenizer: PreTrainedTokenizerBase, init: ModelInitConfig) -> Any:
    """The thinker config: 1 vision block and 1 audio layer (``TOWER_WIDTH`` wide), and a text
    decoder sized by ``init`` (``hidden_size``, ``num_layers``, ``num_heads``,
    ``num_kv_heads``, ``intermediate_size``, ``max_position_embeddings``; for
    "qwen3_omni_moe" also its experts). The vocabulary is the tokenizer's (``init.vocab_size``
    does not apply)."""
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in OMNI_TOKENS.items()}
    head_dim = init.hidden_size // init.num_heads
    if head_dim % 2 or head_dim < 6:
        raise ConfigError(
            [
                ConfigIssue(
                    "model.init.hidden_size",
                    f"gives attention heads of {head_dim} dimensions (hidden_size /"
                    f" num_heads); {init.arch}'s 3-D rotary positions need an even head size"
                    " of at least 6",
                )
            ]
        )
    # M-RoPE splits each head's rotary half (head_dim / 2 frequencies) into t/h/w sections.
    half = head_dim // 2
    mrope = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    width = TOWER_WIDTH
    audio = {
        "num_mel_bins": 128,
        "encoder_layers": 1,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 2 * width,
        "d_model": width,
        "output_dim": init.hidden_size,
        "max_source_positions": 1500,
    }
    vision = {
        "depth": 1,
        "hidden_size": width,
        "intermediate_size": 2 * width,
        "num_heads": 2,
        "patch_size": PATCH_SIZES[init.arch],
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": init.hidden_size,
    }
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": init.hidden_size,
        "intermediate_size": init.intermediate_size,
        "num_hidden_layers": init.num_layers,
        "num_attention_heads": init.num_heads,
        "num_key_value_heads": init.num_kv_heads,
        "max_position_embeddings": init.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope},
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": False,
    }
    if init.arch == "qwen3_omni_moe":
        return _qwen3_omni_moe_config(init, ids, audio, vision, text)
    return Qwen2_5OmniThinkerConfig(
        audio_config={**audio, "n_window": 100},
        vision_config={**vision, "window_size": 112, "fullatt_block_indexes": [0]},
        text_config=text,
        audio_token_index=ids["audio_token"],
        image_token_index=ids["image_token"],
        video_token_index=ids["video_token"],
        audio_start_token_id=ids["audio_bos_token"],
        audio_end_token_id=ids["audio_eos_token"],
        # Read by get_rope_index (not declared fields of the thinker config; kept as extras).
        vision_start_token_id=ids["vision_bos_token"],
        vision_end_token_id=ids["vision_eos_token"],
        user_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),  # unused by the thinker
        tie_word_embeddings=False,
    )


def _qwen3_omni_moe_config(
    init: ModelInitConfig,
    ids: dict[str, int],
    audio: dict[str, Any],
    vision: dict[str, Any],
    text: dict[str, Any],
) -> Qwen3OmniMoeThinkerConfig:
    """The Qwen3-Omni-MoE thinker's config from the towers' and decoder's shared settings
    (see ``tiny_omni_config``): Qwen3's audio windows and one deepstack vision layer; every
    decoder layer a sparse MoE block; interleaved M-RoPE, as the real checkpoints."""
    return Qwen3OmniMoeThinkerConfig(
        audio_config={
            **audio,
            "n_window": 50,
            "n_window_infer": 800,
            "conv_chunksize": 500,
            "downsample_hidden_size": TOWER_WIDTH // 2,
        },
        vision_config={**vision, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
        text_config={
            **text,
            "moe_intermediate_size": init.moe_intermediate_size or init.intermediate_size,
            "num_experts": init.num_experts,
            "num_experts_per_tok": init.num_experts_per_tok,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "rope_parameters": {**text["rope_parameters"], "interleaved": True},
        },
        audio_token_id=ids["audio_token"],
        image_token_id=ids["image_token"],
        video_token_id=ids["video_token"],
        audio_start_token_id=ids["audio_bos_token"],
        vision_start_token_id=ids["vision_bos_token"],
        tie_word_embeddings=False,
    )


def media_token_ids(tokenizer: Any) -> list[int]:
    """Ids a policy must never sample: the media placeholders and their brackets.

    A sampled ``<|IMAGE|>`` in a response would be taken for an image placeholder when the
    trainer runs the prompt + response with the prompt's media (the placeholder count would no
    longer match the features), so generation masks these, and the trainer's log-probabilities
    must apply the same mask.
    """
    return [tokenizer.convert_tokens_to_ids(token) for token in OMNI_TOKENS.values()]


def build_tiny_omni(
    init: ModelInitConfig, directory: str | Path, *, audio_seconds: int = OMNI_AUDIO_SECONDS
) -> Path:
    """Build the seeded tiny omni thinker of ``init`` and its processor, save both to
    ``directory`` (``build_tiny_model`` with ``arch = "qwen2_5_omni"`` or ``"qwen3_omni_moe"``).

    The generation config's ``suppress_tokens`` lists the media tokens, PAD and BOS: a policy
    never samples them (see ``media_token_ids``). The same ``init`` (seed included) always gives
    the same weights; the global torch RNG is left untouched.
    """
    processor = omni_processor(
        build_omni_tokenizer(init.max_position_embeddings),
        audio_seconds=audio_seconds,
        arch=init.arch,
    )
    tokenizer = processor.tokenizer
    config = tiny_omni_config(tokenizer, init)
    with torch.random.fork_rng(devices=[]), one_build_at_a_time():
        torch.manual_seed(init.seed)
        model_class = (
            Qwen3OmniMoeThinkerForConditionalGeneration
            if init.arch == "qwen3_omni_moe"
            else Qwen2_5OmniThinkerForConditionalGeneration
        )
        model = model_class(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=stop_token_ids(tokenizer),
        suppress_tokens=[
            *media_token_ids(tokenizer),
            tokenizer.pad_token_id,
            tokenizer.bos_token_id,
        ],
    )
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def build_tiny_omni_model(
    directory: str | Path,
    seed: int = 0,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    audio_seconds: int = 4,
) -> Path:
    """``build_tiny_omni`` with the first tiny omni model's shape: a 2-layer 64-wide decoder
    (4 heads, 2 KV heads, MLP 128, 4096 positions) and a 4 s audio window (≈0.38 M
    parameters)."""
    init = ModelInitConfig(
        arch="qwen2_5_omni",
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=max(2, hidden_size // 16),
        num_kv_heads=max(1, max(2, hidden_size // 16) // 2),
        intermediate_size=2 * hidden_size,
        max_position_embeddings=4096,
        seed=seed,
    )
    return build_tiny_omni(init, directory, audio_seconds=audio_seconds)


def load_omni_processor(directory: str | Path) -> Any:
    """``AutoProcessor.from_pretrained(directory)``, made to work without torchvision."""
    enable_video_without_torchvision()
    return AutoProcessor.from_pretrained(directory)
