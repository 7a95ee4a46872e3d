"""Images, audio and video for omni-modal RL: decode once, within limits, into tensors.

- ``MediaLimits``: the bounds from the config (pixels, frames, fps, audio length and rate,
  bytes); ``MediaError``: one item refused, with what, which and why.
- ``load_image`` → ``uint8 [H, W, 3]``; ``load_audio`` → mono ``float32 [samples]`` at
  ``limits.sample_rate``; ``load_video`` / ``load_video_clip`` → ``uint8 [T, H, W, 3]``
  (and its fps). Sources: paths, raw bytes, arrays/tensors, Hugging Face datasets-style dicts.
  Only Pillow, NumPy and torch are needed (MP4 and other containers need OpenCV, optionally).
- ``process_prompt``: chat messages with media parts → ``prompt_ids`` and the processor's
  ``mm_inputs`` (any processor; the model's own from ``relax.models.load_processor``).
- ``draw_shapes``, ``tones``, ``moving_square``: synthetic media with known answers.

Models and their processors (the tiny Qwen2.5-Omni thinker, ``processor_kwargs``, the
torchvision-free video processor) live in ``relax.models``; this package needs none of them and
does not import transformers.
"""

from __future__ import annotations

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

__all__ = [
    "MEDIA_KINDS",
    "PALETTE",
    "MediaError",
    "MediaLimits",
    "ProcessedPrompt",
    "VideoClip",
    "draw_shapes",
    "has_media",
    "load_audio",
    "load_image",
    "load_video",
    "load_video_clip",
    "media_limits",
    "mm_from_wire",
    "moving_square",
    "placeholder_ids",
    "process_prompt",
    "resample",
    "tones",
]
