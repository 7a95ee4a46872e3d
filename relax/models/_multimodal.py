"""Multimodal policies: loading them and their processors, and the media a prompt carries.

A multimodal prompt is its token ids — the processor's ``input_ids``, placeholders expanded to
one token per embedding — plus the processor's other outputs (``mm_inputs``: ``pixel_values``,
``image_grid_thw``, ``input_features``, ``feature_attention_mask``, ``pixel_values_videos``,
``video_grid_thw``, ``video_second_per_grid``, ...). Generation and training run the same
forward on the same tensors, so:

- ``collate_mm_inputs`` batches several prompts' media the one way both sides use;
- ``suppressed_token_ids`` are the ids a policy never samples (the media placeholders): the
  engine masks them in sampling and in its logprobs, and the trainer must mask them too;
- ``MediaSpec`` checks that a prompt's placeholders match its media before anything runs.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from relax.errors import ConfigError, ConfigIssue, EngineError
from relax.models._video_processor import enable_video_without_torchvision

_PADDED_FRAMES = {"input_features": 0.0, "feature_attention_mask": 0}
"""Keys whose last axis (audio frames) may differ between prompts: padded to the longest, with
this value (the mask's zeros tell the model which frames are padding)."""

_TOKEN_KEYS = ("input_ids", "attention_mask")
"""The processor outputs that are the prompt itself, not its media."""

_THINKERS = {
    "Qwen2_5OmniForConditionalGeneration": "Qwen2_5OmniThinkerForConditionalGeneration",
    "Qwen3OmniMoeForConditionalGeneration": "Qwen3OmniMoeThinkerForConditionalGeneration",
}
"""Omni checkpoints with a speech talker: RL trains and samples their text *thinker* only."""

_MULTIMODAL_CONFIG_KEYS = ("vision_config", "audio_config", "thinker_config")


# --------------------------------------------------------------------------- batching


def collate_mm_inputs(
    items: Sequence[Mapping[str, torch.Tensor] | None],
) -> dict[str, torch.Tensor]:
    """Several prompts' media as one forward's keyword arguments, in order.

    Each key's tensors are concatenated along dim 0 (prompts without that key, or ``None``
    entries, contribute nothing); ``input_features`` / ``feature_attention_mask`` are first
    padded along their last (frame) axis to the longest. Returns ``{}`` when there is no media.
    ``input_ids`` / ``attention_mask`` are not media and are left out.
    """
    keys: list[str] = []
    for item in items:
        for key in item or {}:
            if key not in keys and key not in _TOKEN_KEYS:
                keys.append(key)
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        tensors = [item[key] for item in items if item is not None and key in item]
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or tensor.ndim == 0:
                raise EngineError(
                    f"media {key!r} must be a tensor with a leading item axis, got"
                    f" {_describe(tensor)}"
                )
        if key in _PADDED_FRAMES and len({t.shape[-1] for t in tensors}) > 1:
            longest = max(t.shape[-1] for t in tensors)
            tensors = [
                F.pad(t, (0, longest - t.shape[-1]), value=_PADDED_FRAMES[key]) for t in tensors
            ]
        if len({tuple(t.shape[1:]) for t in tensors}) > 1:
            shapes = sorted({tuple(t.shape) for t in tensors})
            raise EngineError(f"media {key!r} cannot be batched: shapes {shapes[:4]} differ")
        out[key] = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    return out


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.ndim}-d tensor"
    return type(value).__name__


# --------------------------------------------------------------------------- models


def suppressed_token_ids(model: Any) -> list[int]:
    """Ids the policy never samples: its generation config's ``suppress_tokens`` (for the tiny
    omni model the media placeholders and their brackets, PAD and BOS; usually none for a text
    model). A trainer recomputing the engine's logprobs masks the same ids to ``-inf``."""
    config = getattr(model, "generation_config", None)
    ids = getattr(config, "suppress_tokens", None) or []
    return sorted({int(t) for t in ids})


def _config_dict(path: str | Path) -> dict[str, Any]:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ConfigError(
            [ConfigIssue("model.path", f"{str(path)!r} is not a model folder (no config.json)")]
        )
    return json.loads(file.read_text())


def is_multimodal(path_or_model: str | Path | Any) -> bool:
    """Whether a model (or a model folder) takes media: its config has a vision, audio or
    thinker sub-config."""
    if isinstance(path_or_model, (str, Path)):
        config = _config_dict(path_or_model)
        return any(config.get(key) for key in _MULTIMODAL_CONFIG_KEYS)
    config = getattr(path_or_model, "config", path_or_model)
    return any(getattr(config, key, None) is not None for key in _MULTIMODAL_CONFIG_KEYS)


def policy_class(path: str | Path) -> Any:
    """The transformers class ``load_policy`` loads a folder with: the multimodal class its
    ``config.json`` names (an omni checkpoint's thinker), else ``AutoModelForCausalLM``."""
    import transformers
    from transformers.models.auto import modeling_auto

    config = _config_dict(path)
    if not any(config.get(key) for key in _MULTIMODAL_CONFIG_KEYS):
        return transformers.AutoModelForCausalLM
    multimodal = {
        *modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values(),
        *getattr(modeling_auto, "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", {}).values(),
    }
    for name in config.get("architectures") or []:
        name = _THINKERS.get(name, name)
        if (name in multimodal or name in _THINKERS.values()) and hasattr(transformers, name):
            return getattr(transformers, name)
    model_type = config.get("model_type")
    if model_type in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return transformers.AutoModelForImageTextToText
    raise ConfigError(
        [
            ConfigIssue(
                "model.path",
                f"{str(path)!r} holds a multimodal model ({config.get('architectures')},"
                f" model_type {model_type!r}) that no transformers class for text generation"
                " loads",
            )
        ]
    )


def load_processor(path: str | Path, *, trust_remote_code: bool = False) -> Any | None:
    """The processor saved with a multimodal model folder (``AutoProcessor``, made to work
    without torchvision), or ``None`` for a text-only folder."""
    if not is_multimodal(path):
        return None
    from transformers import AutoProcessor

    folder = Path(path)
    names = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
    if not any((folder / name).is_file() for name in names):
        raise ConfigError(
            [
                ConfigIssue(
                    "model.path",
                    f"{str(folder)!r} holds a multimodal model but no processor"
                    f" ({' / '.join(names)})",
                    hint="save the processor next to the model (processor.save_pretrained)",
                )
            ]
        )
    enable_video_without_torchvision()
    return AutoProcessor.from_pretrained(folder, trust_remote_code=trust_remote_code)


def processor_kwargs(processor: Any, *, fps: float | None = None) -> dict[str, Any]:
    """Keyword arguments for ``processor(...)`` that keep the processor's own video size.

    ``Qwen2_5OmniProcessor`` otherwise sends its class default (128..768 x 28 x 28 pixels per
    frame) to the video processor, whatever the saved config says. ``fps`` is the rate of the
    frames (``VideoClip.fps``); it sets ``video_second_per_grid`` and so the temporal positions.
    """
    videos: dict[str, Any] = {}
    video_processor = getattr(processor, "video_processor", None)
    if video_processor is not None and getattr(video_processor, "size", None):
        videos["size"] = dict(video_processor.size)
    if fps is not None:
        videos["fps"] = float(fps)
    return {"videos_kwargs": videos} if videos else {}


def uses_mrope(model: Any) -> bool:
    """Whether the model places tokens with multimodal (3-D) rotary positions that it computes
    itself from the prompt and its media (Qwen2-VL, Qwen2.5-VL, Qwen2.5-Omni, ...)."""
    return any(
        callable(getattr(module, "get_rope_index", None))
        for module in (model, getattr(model, "model", None))
        if module is not None
    )


def reset_rope_deltas(model: Any) -> None:
    """Forget the ``rope_deltas`` an M-RoPE model keeps from its last forward pass."""
    for module in (model, getattr(model, "model", None)):
        if module is not None and hasattr(module, "rope_deltas"):
            module.rope_deltas = None


def rope_deltas(output: Any, model: Any) -> torch.Tensor | None:
    """The M-RoPE offsets ``[batch, 1]`` of a prefill: a next token's position is its text
    position (real tokens before it) plus this. Read from the output, else from the model."""
    deltas = getattr(output, "rope_deltas", None)
    for module in (model, getattr(model, "model", None)):
        if deltas is None and module is not None:
            deltas = getattr(module, "rope_deltas", None)
    return deltas if isinstance(deltas, torch.Tensor) else None


# --------------------------------------------------------------------------- checking


@dataclass(frozen=True)
class MediaSpec:
    """What a multimodal model expects of a prompt's media: its placeholder ids, how many
    placeholders each item fills, and the keyword arguments its forward takes."""

    image_token_id: int | None
    video_token_id: int | None
    audio_token_id: int | None
    merge_size: int
    accepted: frozenset[str]
    audio_tokens: Callable[[torch.Tensor], torch.Tensor] | None
    """Mel frames per clip → placeholder tokens per clip (None: not checked per clip)."""

    @classmethod
    def from_model(cls, model: Any) -> MediaSpec | None:
        """The spec of a multimodal model, or ``None`` for a text model."""
        if not is_multimodal(model):
            return None
        config = model.config
        vision = getattr(config, "vision_config", None)
        merge = int(getattr(vision, "spatial_merge_size", 1) or 1)
        params = inspect.signature(model.forward).parameters
        accepted = frozenset(
            name
            for name, p in params.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name not in _TOKEN_KEYS
        )
        audio_tokens = None
        tower = getattr(model, "audio_tower", None)
        lengths = getattr(tower, "_get_feat_extract_output_lengths", None)
        if callable(lengths):

            def audio_tokens(frames: torch.Tensor) -> torch.Tensor:
                out = lengths(frames)
                return out[-1] if isinstance(out, tuple) else out

        return cls(
            image_token_id=_token_id(config, "image"),
            video_token_id=_token_id(config, "video"),
            audio_token_id=_token_id(config, "audio"),
            merge_size=merge,
            accepted=accepted,
            audio_tokens=audio_tokens,
        )

    def placeholder_ids(self) -> set[int]:
        return {t for t in (self.image_token_id, self.video_token_id, self.audio_token_id) if t}

    def check(
        self, i: int, prompt: Sequence[int], media: Mapping[str, Any] | None
    ) -> dict[str, torch.Tensor] | None:
        """Prompt ``i``'s media as a dict of CPU tensors (``None`` when it has none), or
        ``EngineError`` saying what does not match its placeholder tokens."""
        if media is not None and not isinstance(media, Mapping):
            raise EngineError(
                f"mm_inputs[{i}] must be a dict of tensors or None, got {type(media).__name__}"
            )
        tensors: dict[str, torch.Tensor] = {}
        for key, value in (media or {}).items():
            if key in _TOKEN_KEYS:
                continue  # the prompt's own ids: given as the prompt
            if key not in self.accepted:
                raise EngineError(
                    f"mm_inputs[{i}] has {key!r}, which the model does not take"
                    f" (it takes {sorted(self.accepted & _KNOWN_MEDIA) or 'no media'})"
                )
            if not isinstance(value, torch.Tensor) or value.ndim == 0:
                raise EngineError(
                    f"mm_inputs[{i}][{key!r}] must be a tensor with a leading item axis, got"
                    f" {_describe(value)}"
                )
            tensors[key] = value.detach().cpu()
        runs = _runs(prompt, self.placeholder_ids())
        self._check_vision(i, tensors, runs, "image")
        self._check_vision(i, tensors, runs, "video")
        self._check_audio(i, tensors, runs)
        return tensors or None

    def _check_vision(
        self, i: int, media: dict[str, torch.Tensor], runs: dict[int, list[int]], kind: str
    ) -> None:
        token = self.image_token_id if kind == "image" else self.video_token_id
        pixels_key = "pixel_values" if kind == "image" else "pixel_values_videos"
        grid_key = f"{kind}_grid_thw"
        pixels, grid = media.get(pixels_key), media.get(grid_key)
        found = runs.get(token, []) if token is not None else []
        if pixels is None and grid is None:
            if found:
                raise EngineError(
                    f"prompt {i} has {sum(found)} {kind} placeholder tokens but its mm_inputs"
                    f" have no {pixels_key}"
                )
            return
        if pixels is None or grid is None:
            missing = grid_key if grid is None else pixels_key
            raise EngineError(f"mm_inputs[{i}] has {kind}s but no {missing!r}")
        if grid.ndim != 2 or grid.shape[1] != 3 or grid.is_floating_point():
            raise EngineError(
                f"mm_inputs[{i}][{grid_key!r}] must be integers [{kind}s, 3] (t, h, w),"
                f" got shape {list(grid.shape)}"
            )
        patches = grid.prod(-1)
        if int(patches.sum()) != pixels.shape[0]:
            raise EngineError(
                f"mm_inputs[{i}]: {pixels_key!r} has {pixels.shape[0]} patches but"
                f" {grid_key!r} {grid.tolist()} gives {int(patches.sum())}"
            )
        if kind == "video" and "video_second_per_grid" in self.accepted:
            seconds = media.get("video_second_per_grid")
            if seconds is None or seconds.shape[0] != grid.shape[0]:
                got = "none" if seconds is None else f"{seconds.shape[0]}"
                raise EngineError(
                    f"mm_inputs[{i}] has {grid.shape[0]} videos but {got}"
                    " 'video_second_per_grid' values (pass the processor's output, with fps)"
                )
        expected = (patches // self.merge_size**2).tolist()
        _match(i, kind, found, expected)

    def _check_audio(
        self, i: int, media: dict[str, torch.Tensor], runs: dict[int, list[int]]
    ) -> None:
        features, mask = media.get("input_features"), media.get("feature_attention_mask")
        token = self.audio_token_id
        found = runs.get(token, []) if token is not None else []
        if features is None and mask is None:
            if found:
                raise EngineError(
                    f"prompt {i} has {sum(found)} audio placeholder tokens but its mm_inputs"
                    " have no input_features"
                )
            return
        if features is None or mask is None:
            missing = "feature_attention_mask" if mask is None else "input_features"
            raise EngineError(f"mm_inputs[{i}] has audio but no {missing!r}")
        if (
            features.ndim != 3
            or mask.ndim != 2
            or features.shape[0] != mask.shape[0]
            or features.shape[-1] != mask.shape[-1]
        ):
            raise EngineError(
                f"mm_inputs[{i}]: 'input_features' {list(features.shape)} (clips, mels, frames)"
                f" and 'feature_attention_mask' {list(mask.shape)} (clips, frames) disagree"
            )
        if self.audio_tokens is None:
            return
        expected = self.audio_tokens(mask.sum(-1)).tolist()
        _match(i, "audio", found, [int(x) for x in expected])


_KNOWN_MEDIA = frozenset(
    {
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
        "video_second_per_grid",
        "input_features",
        "feature_attention_mask",
    }
)


def _token_id(config: Any, kind: str) -> int | None:
    for name in (f"{kind}_token_id", f"{kind}_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _runs(prompt: Sequence[int], tokens: set[int]) -> dict[int, list[int]]:
    """Lengths of the maximal runs of each placeholder token in the prompt, in order."""
    runs: dict[int, list[int]] = {}
    previous = None
    for token in prompt:
        if token in tokens:
            lengths = runs.setdefault(token, [])
            if token == previous:
                lengths[-1] += 1
            else:
                lengths.append(1)
        previous = token
    return runs


def _match(i: int, kind: str, found: list[int], expected: list[int]) -> None:
    """The prompt's runs of ``kind`` placeholders hold the items' tokens in order (adjacent
    items may share a run)."""
    ok = sum(found) == sum(expected)
    if ok:
        items = iter(expected)
        for run in found:
            while run > 0:
                run -= next(items, run + 1)
            ok = ok and run == 0
    if not ok:
        raise EngineError(
            f"prompt {i} has {sum(found)} {kind} placeholder tokens (runs {found[:8]}) but its"
            f" {len(expected)} {kind} item(s) fill {sum(expected)} ({expected[:8]}): process"
            f" the prompt text and its {kind}s together, and keep the processor's input_ids"
        )
