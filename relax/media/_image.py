"""Image decoding: a path, encoded bytes, a PIL image or an array → ``uint8 [H, W, 3]``."""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from relax.media._limits import MediaError, MediaLimits, describe, fit_size, read_source

ImageSource = Any
"""A path (``str``/``Path``), encoded bytes (PNG, JPEG, GIF, WebP, BMP, ...), a PIL image, a
``uint8`` array or tensor ``[H, W, 3]`` / ``[H, W, 4]`` / ``[H, W]``, or a Hugging Face
datasets-style ``{"bytes": ..., "path": ...}`` dict."""


def load_image(
    src: ImageSource, limits: MediaLimits | None = None, *, item: str | None = None
) -> torch.Tensor:
    """Decode one image to an RGB ``uint8`` tensor ``[H, W, 3]`` that fits ``limits``.

    Images above ``max_pixels`` (or below ``min_pixels``) are resized with bicubic filtering,
    aspect ratio kept. Transparent pixels are composited onto white; an animated image gives
    its first frame. ``item`` names the item in a ``MediaError`` (default: the path or a
    summary of the source).
    """
    limits = limits if limits is not None else MediaLimits()
    name = describe(src, item)
    image = open_image(src, limits, name)
    return torch.from_numpy(pil_to_array(image, limits))


def open_image(
    src: ImageSource, limits: MediaLimits, name: str, kind: str = "image"
) -> Image.Image:
    """The source as a fully loaded RGB PIL image (not yet resized)."""
    if isinstance(src, dict):
        src = _from_dict(src, kind, name)
    if isinstance(src, Image.Image):
        _check_decoded_size(src.width, src.height, limits, kind, name)
        return to_rgb(src)
    if isinstance(src, (np.ndarray, torch.Tensor)):
        return array_to_pil(src, limits, kind, name)
    if isinstance(src, (str, Path, bytes, bytearray, memoryview)):
        data = read_source(src, kind, name, limits)
        return decode_image_bytes(data, limits, kind, name)
    raise MediaError(kind, name, f"unsupported source type {type(src).__name__}")


def decode_image_bytes(data: bytes, limits: MediaLimits, kind: str, name: str) -> Image.Image:
    """Encoded image bytes → loaded RGB PIL image (the first frame of an animation)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                _check_decoded_size(image.width, image.height, limits, kind, name)
                image.load()
                return to_rgb(image)
    except MediaError:
        raise
    except UnidentifiedImageError:
        raise MediaError(kind, name, "not an image (format not recognised)") from None
    except Image.DecompressionBombError as exc:
        raise MediaError(kind, name, f"too large: {exc}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise MediaError(kind, name, f"corrupt or truncated image data ({exc})") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB copy of a PIL image; transparency is composited onto white."""
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def array_to_pil(array: Any, limits: MediaLimits, kind: str, name: str) -> Image.Image:
    """A ``uint8`` array or tensor ``[H, W]``, ``[H, W, 3]`` or ``[H, W, 4]`` as an RGB image."""
    if isinstance(array, torch.Tensor):
        array = array.detach().cpu().numpy()
    array = np.asarray(array)
    if array.dtype != np.uint8:
        raise MediaError(kind, name, f"pixel arrays must be uint8, got {array.dtype}")
    if not (array.ndim == 2 or (array.ndim == 3 and array.shape[-1] in (1, 3, 4))):
        raise MediaError(
            kind,
            name,
            f"pixel arrays must be [H, W], [H, W, 3] or [H, W, 4], got {list(array.shape)}",
        )
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise MediaError(kind, name, f"image has no pixels (shape {list(array.shape)})")
    _check_decoded_size(array.shape[1], array.shape[0], limits, kind, name)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    return to_rgb(Image.fromarray(np.ascontiguousarray(array)))


def pil_to_array(image: Image.Image, limits: MediaLimits) -> np.ndarray:
    """RGB PIL image → ``uint8 [H, W, 3]``, resized to fit ``limits``."""
    height, width = fit_size(image.height, image.width, limits)
    if (height, width) != (image.height, image.width):
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    return np.array(image, dtype=np.uint8)  # a writable copy


def _check_decoded_size(width: int, height: int, limits: MediaLimits, kind: str, name: str) -> None:
    if width <= 0 or height <= 0:
        raise MediaError(kind, name, f"image has no pixels ({width}x{height})")
    decoded = width * height * 3
    if decoded > limits.max_bytes:
        raise MediaError(
            kind,
            name,
            f"too large: {width}x{height} decodes to {decoded} bytes, limit {limits.max_bytes}",
        )


def _from_dict(src: dict, kind: str, name: str) -> Any:
    """``{"bytes": ..., "path": ...}`` (Hugging Face datasets) → the bytes, else the path."""
    if src.get("bytes") is not None:
        return src["bytes"]
    if src.get("path"):
        return src["path"]
    raise MediaError(kind, name, "dict source has neither 'bytes' nor 'path'")
