"""Video decoding: frames from a folder, a list of images, an array, an animated GIF/WebP/PNG,
``.npy``/``.npz``, or (when OpenCV is installed) a container such as MP4 → ``uint8 [T, H, W, 3]``
sampled at ``limits.video_fps`` and thinned to ``limits.max_frames``."""

from __future__ import annotations

import io
import math
import os
import re
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageSequence, UnidentifiedImageError

from relax.media._arrays import load_npy, load_npz
from relax.media._image import array_to_pil, open_image, pil_to_array, to_rgb
from relax.media._limits import MediaError, MediaLimits, describe, fit_size, read_source

VideoSource = Any
"""A folder of image frames (sorted by name, numbers in natural order); a list or tuple of
image sources; a ``uint8`` array or tensor ``[T, H, W, 3]`` (or ``[T, H, W]``); a path or bytes
of an animated GIF/WebP/PNG, a ``.npy`` file or a ``.npz`` file (frames under
``frames``/``video``/the first key, optionally ``fps``); a path or bytes of an MP4/WebM/MKV/AVI/MOV
file when OpenCV (``cv2``) is installed; or a dict ``{"frames": ..., "fps": ...}`` /
``{"bytes": ..., "path": ...}``."""

_KIND = "video"
_FRAME_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
_CONTAINER_SUFFIXES = {".mp4", ".m4v", ".webm", ".mkv", ".avi", ".mov", ".mpg", ".mpeg"}
_GIF_DEFAULT_MS = 100  # what browsers show a GIF frame with no (or a zero) delay for


@dataclass(frozen=True)
class VideoClip:
    """Decoded frames and the rate they were sampled at."""

    frames: torch.Tensor
    """``uint8 [T, H, W, 3]``."""
    fps: float
    """Frames per second of ``frames`` (``limits.video_fps`` when the source rate is unknown)."""


def load_video(
    src: VideoSource,
    limits: MediaLimits | None = None,
    *,
    fps: float | None = None,
    item: str | None = None,
) -> torch.Tensor:
    """Decode one video to ``uint8 [T, H, W, 3]``; see ``load_video_clip``."""
    return load_video_clip(src, limits, fps=fps, item=item).frames


def load_video_clip(
    src: VideoSource,
    limits: MediaLimits | None = None,
    *,
    fps: float | None = None,
    item: str | None = None,
) -> VideoClip:
    """Decode one video, sample it at ``limits.video_fps`` and bound it by ``limits``.

    ``fps`` is the frame rate of a source that does not carry one (a folder, a list, an array,
    a ``.npy`` file); without it such frames are taken as already sampled. A source's own rate
    (GIF frame delays, an ``.npz``/dict ``fps`` entry, a container's header) wins over it. Sampling picks the
    frame at the middle of each output interval. More than ``limits.max_frames`` frames are
    thinned evenly over the whole clip (or refused when ``limits.truncate`` is off). Every
    frame is resized to fit ``max_pixels``/``min_pixels``; frames must share one size.
    """
    limits = limits if limits is not None else MediaLimits()
    name = describe(src, item)
    if fps is not None and not (math.isfinite(fps) and fps > 0):
        raise MediaError(_KIND, name, f"invalid frame rate {fps!r}")
    reader = _reader(src, fps, limits, name)
    try:
        indices, out_fps = _sample(reader.count, reader.fps, limits, name)
        frames = reader.read(indices)
    finally:
        reader.close()
    return VideoClip(_stack(frames, limits, name), out_fps)


# --------------------------------------------------------------------------- sampling


def _sample(
    count: int, src_fps: float | None, limits: MediaLimits, name: str
) -> tuple[list[int], float]:
    """Indices of the frames to keep, and the rate they represent."""
    if count <= 0:
        raise MediaError(_KIND, name, "has no frames")
    if src_fps is None:
        wanted, fps = count, limits.video_fps
    elif src_fps > limits.video_fps:
        wanted = max(1, round(count * limits.video_fps / src_fps))
        fps = src_fps * wanted / count
    else:
        wanted, fps = count, src_fps
    if wanted > limits.max_frames:
        if not limits.truncate:
            raise MediaError(
                _KIND,
                name,
                f"too many frames: {wanted} after sampling, limit {limits.max_frames} "
                "(truncation is disabled)",
            )
        fps = fps * limits.max_frames / wanted
        wanted = limits.max_frames
    indices = [min(count - 1, math.floor((i + 0.5) * count / wanted)) for i in range(wanted)]
    return indices, fps


def _stack(frames: list[Image.Image], limits: MediaLimits, name: str) -> torch.Tensor:
    first = frames[0]
    for number, frame in enumerate(frames):
        if frame.size != first.size:
            raise MediaError(
                _KIND,
                name,
                f"frame {number} is {frame.width}x{frame.height} but frame 0 is "
                f"{first.width}x{first.height}: all frames must share one size",
            )
    height, width = fit_size(first.height, first.width, limits)
    total = len(frames) * height * width * 3
    if total > limits.max_bytes:
        raise MediaError(
            _KIND,
            name,
            f"too large: {len(frames)} frames of {width}x{height} make {total} bytes, "
            f"limit {limits.max_bytes}",
        )
    arrays = [pil_to_array(frame, limits) for frame in frames]
    return torch.from_numpy(np.ascontiguousarray(np.stack(arrays)))


# --------------------------------------------------------------------------- readers


class _Reader:
    """A source with a frame count and rate, read by index (only the sampled frames)."""

    def __init__(self, count: int, fps: float | None, read: Any, close: Any = None) -> None:
        self.count = count
        self.fps = fps
        self.read = read
        self.close = close if close is not None else (lambda: None)


def _reader(src: VideoSource, fps: float | None, limits: MediaLimits, name: str) -> _Reader:
    if isinstance(src, dict):
        if src.get("frames") is not None:
            return _reader(src["frames"], src.get("fps", fps), limits, name)
        if src.get("bytes") is not None:
            src = src["bytes"]
        elif src.get("path"):
            src = src["path"]
        else:
            raise MediaError(_KIND, name, "dict source has none of 'frames', 'bytes', 'path'")
    if isinstance(src, (np.ndarray, torch.Tensor)):
        return _array_reader(src, fps, limits, name)
    if isinstance(src, (list, tuple)):
        return _list_reader(list(src), fps, limits, name)
    if isinstance(src, (str, Path)) and Path(src).is_dir():
        return _folder_reader(Path(src), fps, limits, name)
    if isinstance(src, (str, Path)) and Path(src).suffix.lower() in _CONTAINER_SUFFIXES:
        if not Path(src).is_file():
            raise MediaError(_KIND, name, "file does not exist")
        return _container_reader(str(src), None, fps, limits, name)
    if isinstance(src, (str, Path, bytes, bytearray, memoryview)):
        data = read_source(src, _KIND, name, limits)
        if data[:6] == b"\x93NUMPY":
            return _array_reader(load_npy(data, _KIND, name), fps, limits, name)
        if data[:4] == b"PK\x03\x04":
            array, file_fps = load_npz(data, _KIND, name, ("frames", "video"), ("fps",))
            return _array_reader(array, file_fps if file_fps is not None else fps, limits, name)
        if data[4:8] == b"ftyp" or data[:4] == b"\x1a\x45\xdf\xa3":  # MP4/MOV, Matroska/WebM
            return _container_reader(None, data, fps, limits, name)
        return _animated_reader(data, fps, limits, name)
    raise MediaError(_KIND, name, f"unsupported source type {type(src).__name__}")


def _array_reader(array: Any, fps: float | None, limits: MediaLimits, name: str) -> _Reader:
    if isinstance(array, torch.Tensor):
        array = array.detach().cpu().numpy()
    array = np.asarray(array)
    if array.ndim not in (3, 4):
        raise MediaError(
            _KIND, name, f"frame arrays must be [T, H, W, 3] or [T, H, W], got {list(array.shape)}"
        )
    if array.nbytes > limits.max_bytes:
        raise MediaError(
            _KIND, name, f"too large: {array.nbytes} bytes of frames, limit {limits.max_bytes}"
        )

    def read(indices: list[int]) -> list[Image.Image]:
        return [array_to_pil(array[i], limits, _KIND, f"{name} frame {i}") for i in indices]

    return _Reader(len(array), fps, read)


def _list_reader(frames: list[Any], fps: float | None, limits: MediaLimits, name: str) -> _Reader:
    def frame_name(i: int) -> str:
        path = frames[i]
        return str(path) if isinstance(path, (str, Path)) else f"{name} frame {i}"

    def read(indices: list[int]) -> list[Image.Image]:
        return [open_image(frames[i], limits, frame_name(i), kind=_KIND) for i in indices]

    return _Reader(len(frames), fps, read)


def _folder_reader(folder: Path, fps: float | None, limits: MediaLimits, name: str) -> _Reader:
    files = sorted(
        (p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in _FRAME_SUFFIXES),
        key=_natural_key,
    )
    if not files:
        raise MediaError(
            _KIND, name, f"folder has no image frames ({', '.join(sorted(_FRAME_SUFFIXES))})"
        )
    return _list_reader([str(p) for p in files], fps, limits, name)


def _natural_key(path: Path) -> list[Any]:
    """``frame2`` before ``frame10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def _animated_reader(data: bytes, fps: float | None, limits: MediaLimits, name: str) -> _Reader:
    """An animated GIF/WebP/PNG (a still image is a one-frame video); the rate comes from the
    frame delays."""
    if data[:6] in (b"GIF87a", b"GIF89a") and not data.rstrip(b"\x00").endswith(b";"):
        # Pillow reads a cut GIF as a shorter animation; the trailer byte tells it was cut.
        raise MediaError(_KIND, name, "corrupt or truncated video data (the GIF has no trailer)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            decoded = image.width * image.height * 3
            if decoded > limits.max_bytes:
                raise MediaError(
                    _KIND,
                    name,
                    f"too large: {image.width}x{image.height} frames decode to {decoded} bytes "
                    f"each, limit {limits.max_bytes}",
                )
            count = getattr(image, "n_frames", 1)
            durations = []
            for frame in ImageSequence.Iterator(image):
                durations.append(frame.info.get("duration") or _GIF_DEFAULT_MS)
    except MediaError:
        raise
    except UnidentifiedImageError:
        raise MediaError(
            _KIND, name, "not a video (expected an animated image, .npy, .npz or a frame folder)"
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise MediaError(_KIND, name, f"corrupt or truncated video data ({exc})") from None
    if count > 1:  # the frame delays are the source's own rate
        fps = 1000.0 * count / float(sum(durations))

    def read(indices: list[int]) -> list[Image.Image]:
        frames = []
        try:
            for index in indices:
                image.seek(index)
                image.load()
                frames.append(to_rgb(image))
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            raise MediaError(_KIND, name, f"corrupt or truncated video data ({exc})") from None
        return frames

    return _Reader(count, fps, read)


def _container_reader(
    path: str | None, data: bytes | None, fps: float | None, limits: MediaLimits, name: str
) -> _Reader:
    """MP4 and other containers through OpenCV (``opencv-python-headless``), when installed."""
    try:
        import cv2
    except ImportError:
        raise MediaError(
            _KIND,
            name,
            "decoding MP4/WebM/MKV/AVI/MOV needs OpenCV (pip install opencv-python-headless); "
            "or give frames, a GIF, .npy or .npz",
        ) from None
    if path is not None and os.path.getsize(path) > limits.max_bytes:
        raise MediaError(
            _KIND,
            name,
            f"file is too large: {os.path.getsize(path)} bytes, limit {limits.max_bytes}",
        )
    temp: str | None = None
    if path is None:  # OpenCV reads files only
        with tempfile.NamedTemporaryFile(suffix=".video", delete=False) as handle:
            handle.write(data or b"")
        path = temp = handle.name

    def close() -> None:
        if temp is not None and os.path.exists(temp):
            os.unlink(temp)

    capture = cv2.VideoCapture(path)
    opened = capture.isOpened()
    count = int(capture.get(cv2.CAP_PROP_FRAME_COUNT)) if opened else 0
    file_fps = float(capture.get(cv2.CAP_PROP_FPS)) if opened else 0.0
    capture.release()
    if not opened:
        close()
        raise MediaError(_KIND, name, "corrupt or unsupported video container")

    def read(indices: list[int]) -> list[Image.Image]:
        wanted = set(indices)
        frames: dict[int, Image.Image] = {}
        capture = cv2.VideoCapture(path)
        try:
            index = 0
            while index <= max(indices):
                ok, frame = capture.read()
                if not ok:
                    break
                if index in wanted:
                    frames[index] = Image.fromarray(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
                index += 1
        finally:
            capture.release()
        if not frames:
            raise MediaError(_KIND, name, "corrupt video: no frame could be decoded")
        return [frames[i] for i in indices if i in frames]

    return _Reader(count, file_fps if file_fps > 0 else fps, read, close)
