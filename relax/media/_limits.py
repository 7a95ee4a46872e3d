"""What a decoder may accept (``MediaLimits``) and what it raises when an item is refused."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax.errors import MediaError


@dataclass(frozen=True)
class MediaLimits:
    """Bounds applied while decoding one image, audio clip or video (from the config).

    Decoding happens once, where a dataset row is read; what comes out already fits these
    limits, so every later stage (the wire, the processor, the model) sees bounded tensors.
    """

    max_pixels: int = 512 * 512
    """Largest image or video frame, in pixels (height x width). Bigger ones are scaled down,
    aspect ratio kept, until they fit."""

    min_pixels: int = 28 * 28
    """Smallest image or video frame, in pixels. Smaller ones are scaled up, aspect ratio kept
    (vision towers need at least one 28x28 patch group)."""

    max_frames: int = 32
    """Most frames a video keeps after sampling at ``video_fps``. A longer clip is sampled
    evenly down to this many frames, or refused when ``truncate`` is off."""

    video_fps: float = 2.0
    """Frames per second sampled from a video whose frame rate is known (GIF timings, an
    ``fps`` entry, a container). Frames without a known rate are taken as already sampled."""

    max_audio_seconds: float = 30.0
    """Longest audio clip, in seconds. A longer one is cut to this length, or refused when
    ``truncate`` is off."""

    sample_rate: int = 16_000
    """Rate, in Hz, every decoded audio clip is resampled to (16 kHz for Whisper-style
    feature extractors)."""

    max_bytes: int = 64 * 1024 * 1024
    """Largest item, in bytes: the encoded source (a file or raw bytes) and the decoded pixels
    of the source are each checked against it before any work is done."""

    resample: bool = True
    """Resample audio whose rate differs from ``sample_rate``; when off, such audio is refused."""

    truncate: bool = True
    """Cut audio longer than ``max_audio_seconds`` and thin videos with more than
    ``max_frames`` frames; when off, such items are refused."""

    def __post_init__(self) -> None:
        positive = {
            "max_pixels": self.max_pixels,
            "min_pixels": self.min_pixels,
            "max_frames": self.max_frames,
            "video_fps": self.video_fps,
            "max_audio_seconds": self.max_audio_seconds,
            "sample_rate": self.sample_rate,
            "max_bytes": self.max_bytes,
        }
        for name, value in positive.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"MediaLimits.{name} must be a positive number, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"MediaLimits.min_pixels ({self.min_pixels}) is above max_pixels ({self.max_pixels})"
            )


def describe(src: Any, item: str | None) -> str:
    """A short name for an item in error messages: the caller's name, a path, or a summary."""
    if item is not None:
        return item
    if isinstance(src, (str, Path)):
        return str(src)
    if isinstance(src, (bytes, bytearray, memoryview)):
        return f"<{len(src)} bytes>"
    shape = getattr(src, "shape", None)
    if shape is not None:
        return f"<{type(src).__name__} of shape {tuple(shape)}>"
    if isinstance(src, dict):
        for key in ("path", "name"):
            if isinstance(src.get(key), str) and src[key]:
                return src[key]
        return f"<dict with keys {sorted(src)}>"
    if isinstance(src, (list, tuple)):
        return f"<{type(src).__name__} of {len(src)} items>"
    return f"<{type(src).__name__}>"


def read_source(
    src: str | Path | bytes | bytearray | memoryview, kind: str, item: str, limits: MediaLimits
) -> bytes:
    """The bytes of a path or a bytes-like source, refusing missing files and oversized ones."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
    else:
        path = Path(src)
        if not path.exists():
            raise MediaError(kind, item, "file does not exist")
        if not path.is_file():
            raise MediaError(kind, item, "is not a file")
        size = path.stat().st_size
        if size > limits.max_bytes:
            raise MediaError(
                kind, item, f"file is too large: {size} bytes, limit {limits.max_bytes}"
            )
        data = path.read_bytes()
    if len(data) > limits.max_bytes:
        raise MediaError(kind, item, f"too large: {len(data)} bytes, limit {limits.max_bytes}")
    if not data:
        raise MediaError(kind, item, "is empty (0 bytes)")
    return data


def fit_size(height: int, width: int, limits: MediaLimits) -> tuple[int, int]:
    """(height, width) scaled, aspect ratio kept, into ``[min_pixels, max_pixels]``."""
    if height * width < limits.min_pixels:
        scale = math.sqrt(limits.min_pixels / (height * width))
        height, width = math.ceil(height * scale), math.ceil(width * scale)
    if height * width > limits.max_pixels:
        scale = math.sqrt(limits.max_pixels / (height * width))
        height, width = max(1, math.floor(height * scale)), max(1, math.floor(width * scale))
        # Floors keep the product within the limit unless a side was raised to 1 pixel; then
        # shrink the long side until it fits.
        while height * width > limits.max_pixels:
            if height >= width:
                height -= 1
            else:
                width -= 1
    return height, width
