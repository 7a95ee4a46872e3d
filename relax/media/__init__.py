"""Images, audio and video for omni-modal RL: decode once, within limits, into tensors.

- ``MediaLimits``: the bounds from the config (pixels, frames, fps, audio length and rate,
  bytes); ``MediaError``: one item refused, with what, which and why.
- ``load_image`` → ``uint8 [H, W, 3]``; ``load_audio`` → mono ``float32 [samples]`` at
  ``limits.sample_rate``; ``load_video`` / ``load_video_clip`` → ``uint8 [T, H, W, 3]``
  (and its fps). Sources: paths, raw bytes, arrays/tensors, Hugging Face datasets-style dicts.
  Only Pillow, NumPy and torch are needed (MP4 and other containers need OpenCV, optionally).
- ``draw_shapes``, ``tones``, ``moving_square``: synthetic media with known answers.
- ``build_tiny_omni_model`` / ``load_omni_processor`` / ``processor_kwargs`` /
  ``media_token_ids`` / ``NumpyQwen2VLVideoProcessor`` / ``enable_video_without_torchvision``:
  a tiny Qwen2.5-Omni thinker with an offline processor (imported on first use: they load
  transformers).
"""

from __future__ import annotations

from typing import Any

from relax.media._audio import load_audio, resample
from relax.media._image import load_image
from relax.media._limits import MediaError, MediaLimits
from relax.media._process import (
    MEDIA_KINDS,
    ProcessedPrompt,
    has_media,
    media_limits,
    mm_from_wire,
    placeholder_ids,
    process_prompt,
)
from relax.media._synthetic import PALETTE, draw_shapes, moving_square, tones
from relax.media._video import VideoClip, load_video, load_video_clip

_LAZY = {
    # The tiny omni model, its processor and the torchvision-free video processor live with the
    # engines (``relax.engines._omni``, ``relax.engines._video_processor``); re-exported here.
    "build_tiny_omni_model": "relax.engines._omni",
    "build_omni_tokenizer": "relax.engines._omni",
    "load_omni_processor": "relax.engines._omni",
    "omni_processor": "relax.engines._omni",
    "media_token_ids": "relax.engines._omni",
    "OMNI_TOKENS": "relax.engines._omni",
    "processor_kwargs": "relax.engines._multimodal",
    "NumpyQwen2VLVideoProcessor": "relax.engines._video_processor",
    "enable_video_without_torchvision": "relax.engines._video_processor",
}

__all__ = [
    "MEDIA_KINDS",
    "ProcessedPrompt",
    "has_media",
    "media_limits",
    "mm_from_wire",
    "placeholder_ids",
    "process_prompt",
    "PALETTE",
    "MediaError",
    "MediaLimits",
    "VideoClip",
    "draw_shapes",
    "load_audio",
    "load_image",
    "load_video",
    "load_video_clip",
    "moving_square",
    "resample",
    "tones",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'relax.media' has no attribute {name!r}")
