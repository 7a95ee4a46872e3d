"""A Qwen2-VL video processor in NumPy + Pillow, for machines without torchvision.

In transformers 5.x every video processor (``BaseVideoProcessor``, ``Qwen2VLVideoProcessor``,
``AutoVideoProcessor``) requires torchvision, and ``transformers.VideoProcessorMixin`` is only
exported when torchvision is installed. ``ProcessorMixin`` type-checks each sub-processor
against that export, so without torchvision a ``Qwen2_5OmniProcessor`` (or
``Qwen2_5_VLProcessor``) cannot even be built, for images and audio alone.

``enable_video_without_torchvision()`` fixes both, only when torchvision is missing: it exports
``VideoProcessorMixin`` (the class itself needs no torchvision) and registers
``NumpyQwen2VLVideoProcessor`` as what ``AutoVideoProcessor`` loads for a saved
``"Qwen2VLVideoProcessor"``. After it, ``AutoProcessor.from_pretrained`` loads a Qwen2.5-Omni
or Qwen2.5-VL folder as usual. The processor saves itself as ``Qwen2VLVideoProcessor``, so a
machine with torchvision loads the folder with the genuine class.

Frames are resized with Pillow bicubic from ``uint8`` (as ``Qwen2VLImageProcessorPil`` does for
images), rescaled, normalised and cut into the same flattened patches as
``Qwen2VLVideoProcessor``: ``pixel_values_videos [sum(t*h*w), 3*temporal*patch*patch]`` and
``video_grid_thw [videos, 3]``. A frame count that is not a multiple of the temporal patch is
padded by repeating the last frame. Frames are not sampled here (``load_video`` already did).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from PIL import Image
from transformers.feature_extraction_utils import BatchFeature
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.utils import is_torchvision_available
from transformers.video_processing_utils import VideoProcessorMixin

GENUINE_NAME = "Qwen2VLVideoProcessor"
"""The class name written to (and read from) a saved config."""


class NumpyQwen2VLVideoProcessor(VideoProcessorMixin):
    """``Qwen2VLVideoProcessor``'s output without torchvision (see the module docstring)."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(
        self,
        size: dict[str, int] | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        patch_size: int = 14,
        temporal_patch_size: int = 2,
        merge_size: int = 2,
        image_mean: list[float] | tuple[float, ...] = OPENAI_CLIP_MEAN,
        image_std: list[float] | tuple[float, ...] = OPENAI_CLIP_STD,
        do_resize: bool = True,
        do_rescale: bool = True,
        rescale_factor: float = 1 / 255,
        do_normalize: bool = True,
        resample: int = 3,
        **kwargs: Any,
    ) -> None:
        # Keys of a genuine config that only matter for its own decoding/sampling are dropped.
        for key in ("video_processor_type", "image_processor_type", "processor_class"):
            kwargs.pop(key, None)
        size = (
            dict(size) if size else {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}
        )
        if min_pixels is not None:
            size["shortest_edge"] = int(min_pixels)
        if max_pixels is not None:
            size["longest_edge"] = int(max_pixels)
        self.size = {
            "shortest_edge": int(size["shortest_edge"]),
            "longest_edge": int(size["longest_edge"]),
        }
        self.patch_size = int(patch_size)
        self.temporal_patch_size = int(temporal_patch_size)
        self.merge_size = int(merge_size)
        self.image_mean = [float(x) for x in image_mean]
        self.image_std = [float(x) for x in image_std]
        self.do_resize = bool(do_resize)
        self.do_rescale = bool(do_rescale)
        self.rescale_factor = float(rescale_factor)
        self.do_normalize = bool(do_normalize)
        self.resample = int(resample)
        self.do_sample_frames = False
        self._extra = kwargs  # kept so a genuine config round-trips

    def to_dict(self) -> dict[str, Any]:
        """A config ``Qwen2VLVideoProcessor`` loads (with torchvision) and this class loads back."""
        out = dict(self._extra)
        out.update(
            {
                "video_processor_type": GENUINE_NAME,
                "size": dict(self.size),
                "patch_size": self.patch_size,
                "temporal_patch_size": self.temporal_patch_size,
                "merge_size": self.merge_size,
                "image_mean": list(self.image_mean),
                "image_std": list(self.image_std),
                "do_resize": self.do_resize,
                "do_rescale": self.do_rescale,
                "rescale_factor": self.rescale_factor,
                "do_normalize": self.do_normalize,
                "do_convert_rgb": True,
                "resample": self.resample,
                "do_sample_frames": False,
            }
        )
        return out

    def preprocess(self, videos: Any, return_tensors: Any = None, **kwargs: Any) -> BatchFeature:
        """Videos (each ``[T, H, W, 3]`` ``uint8``, or a list of frames) → flattened patches.

        Call-time ``size``/``min_pixels``/``max_pixels``/``patch_size``/... override the saved
        values, as in the genuine class. ``Qwen2_5OmniProcessor`` passes its own default
        ``size`` (128..768 x 28 x 28 pixels per frame) unless ``videos_kwargs["size"]`` is given.
        """
        if kwargs.get("do_sample_frames"):
            raise ValueError(
                "NumpyQwen2VLVideoProcessor does not sample frames; decode with load_video"
            )
        size = dict(kwargs.get("size") or self.size)
        if kwargs.get("min_pixels") is not None:
            size["shortest_edge"] = kwargs["min_pixels"]
        if kwargs.get("max_pixels") is not None:
            size["longest_edge"] = kwargs["max_pixels"]
        patch = int(kwargs.get("patch_size") or self.patch_size)
        temporal = int(kwargs.get("temporal_patch_size") or self.temporal_patch_size)
        merge = int(kwargs.get("merge_size") or self.merge_size)
        mean = np.asarray(kwargs.get("image_mean") or self.image_mean, np.float32)[:, None, None]
        std = np.asarray(kwargs.get("image_std") or self.image_std, np.float32)[:, None, None]
        do_resize = kwargs.get("do_resize", self.do_resize)
        do_rescale = kwargs.get("do_rescale", self.do_rescale)
        do_normalize = kwargs.get("do_normalize", self.do_normalize)
        factor = float(kwargs.get("rescale_factor") or self.rescale_factor)
        resample = int(kwargs.get("resample") or self.resample)

        patches, grids = [], []
        for video in _as_video_list(videos):
            frames = _as_uint8_frames(video)
            height, width = frames.shape[1:3]
            if do_resize:
                height, width = smart_resize(
                    height,
                    width,
                    factor=patch * merge,
                    min_pixels=size["shortest_edge"],
                    max_pixels=size["longest_edge"],
                )
                frames = np.stack(
                    [
                        np.asarray(Image.fromarray(f).resize((width, height), resample))
                        for f in frames
                    ]
                )
            pixels = frames.transpose(0, 3, 1, 2)  # [T, C, H, W]
            # The image processor's arithmetic exactly: rescale in float64, then float32.
            pixels = (pixels * factor if do_rescale else pixels).astype(np.float32)
            if do_normalize:
                pixels = (pixels - mean) / std
            if pad := -len(pixels) % temporal:
                pixels = np.concatenate([pixels, np.repeat(pixels[-1:], pad, axis=0)])
            grid_t, grid_h, grid_w = len(pixels) // temporal, height // patch, width // patch
            channels = pixels.shape[1]
            x = pixels.reshape(
                grid_t,
                temporal,
                channels,
                grid_h // merge,
                merge,
                patch,
                grid_w // merge,
                merge,
                patch,
            )
            # → (t, h-block, w-block, h-in-block, w-in-block, C, temporal, patch, patch)
            x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
            patches.append(x.reshape(grid_t * grid_h * grid_w, channels * temporal * patch * patch))
            grids.append([grid_t, grid_h, grid_w])
        data = {
            "pixel_values_videos": np.concatenate(patches).astype(np.float32),
            "video_grid_thw": np.asarray(grids, dtype=np.int64),
        }
        return BatchFeature(data=data, tensor_type=return_tensors)


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen2-VL's target size: sides multiples of ``factor``, pixels within the bounds."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"aspect ratio must be below 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _as_video_list(videos: Any) -> list[Any]:
    """One video or a list of videos → a list of videos."""
    if isinstance(videos, (list, tuple)):
        if videos and _is_frame(videos[0]):
            return [videos]  # a single video given as a list of frames
        return list(videos)
    return [videos]


def _is_frame(value: Any) -> bool:
    return isinstance(value, Image.Image) or (hasattr(value, "shape") and len(value.shape) == 3)


def _as_uint8_frames(video: Any) -> np.ndarray:
    """A video (tensor/array ``[T, H, W, C]`` or ``[T, C, H, W]``, or a list of frames) →
    ``uint8 [T, H, W, 3]``."""
    if isinstance(video, (list, tuple)):
        video = np.stack(
            [np.asarray(f.convert("RGB") if isinstance(f, Image.Image) else f) for f in video]
        )
    if hasattr(video, "detach"):
        video = video.detach().cpu().numpy()
    video = np.asarray(video)
    if video.ndim != 4:
        raise ValueError(f"a video must be [T, H, W, 3], got shape {list(video.shape)}")
    if video.shape[-1] not in (1, 3) and video.shape[1] in (1, 3):
        video = video.transpose(0, 2, 3, 1)
    if video.shape[-1] == 1:
        video = np.repeat(video, 3, axis=-1)
    if video.dtype != np.uint8:
        if video.dtype.kind == "f" and video.size and float(video.max()) <= 1.0:
            video = video * 255.0
        video = np.clip(np.round(video), 0, 255).astype(np.uint8)
    return np.ascontiguousarray(video)


_enabled = False


def enable_video_without_torchvision() -> bool:
    """Let transformers build and load Qwen-VL/Omni processors without torchvision.

    Does nothing when torchvision is installed (returns ``False``). Otherwise, once per
    process: exports ``transformers.VideoProcessorMixin`` and registers
    ``NumpyQwen2VLVideoProcessor`` for configs that name ``Qwen2VLVideoProcessor``; returns
    ``True``.
    """
    global _enabled
    if is_torchvision_available():
        return False
    if not _enabled:
        import transformers
        from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING

        if not hasattr(transformers, "VideoProcessorMixin"):
            transformers.VideoProcessorMixin = VideoProcessorMixin
        # ``_load_backend_class`` picks the registered dict whose values name the saved class, then
        # the entry for the requested backend. The key is any non-transformers class (a native
        # config would be refused), so no model's own mapping changes.
        VIDEO_PROCESSOR_MAPPING.register(
            NumpyQwen2VLVideoProcessor,
            {
                "torchvision": NumpyQwen2VLVideoProcessor,
                "pil": NumpyQwen2VLVideoProcessor,
                "name": GENUINE_NAME,
            },
        )
        _enabled = True
    return True
