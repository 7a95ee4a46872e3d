"""NumpyQwen2VLVideoProcessor: the same patches as the image processor for a still video, the
Qwen2-VL layout, and a config that round-trips under the genuine class name."""

from __future__ import annotations

import numpy as np
import torch
from transformers import Qwen2VLImageProcessorPil

from relax.models import NumpyQwen2VLVideoProcessor, enable_video_without_torchvision

PIXELS = {"min_pixels": 56 * 56, "max_pixels": 112 * 112}


def _frame(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (70, 90, 3), dtype=np.uint8)


def test_still_video_equals_the_image_processor() -> None:
    images = Qwen2VLImageProcessorPil(**PIXELS)
    videos = NumpyQwen2VLVideoProcessor(**PIXELS)
    frame = _frame()
    image_out = images(images=[frame], return_tensors="pt")
    video_out = videos(videos=[np.stack([frame, frame])], return_tensors="pt")
    assert video_out["video_grid_thw"].tolist() == image_out["image_grid_thw"].tolist()
    assert torch.equal(video_out["pixel_values_videos"], image_out["pixel_values"])


def test_patch_layout_and_temporal_padding() -> None:
    videos = NumpyQwen2VLVideoProcessor(
        **PIXELS, do_normalize=False, do_rescale=False, do_resize=False
    )
    frames = np.stack([np.full((28, 56, 3), 10 * t, np.uint8) for t in range(3)])
    out = videos(videos=[torch.from_numpy(frames)], return_tensors="pt")
    # 3 frames pad to 4 (the last repeats): grid t=2, h=2, w=4 patches of 14.
    assert out["video_grid_thw"].tolist() == [[2, 2, 4]]
    patches = out["pixel_values_videos"].reshape(
        2, 2 * 4, 3, 2, 14, 14
    )  # [t, hw, C, temporal, p, p]
    assert patches.shape[0] * patches.shape[1] == 16
    for t, firsts in enumerate((0, 20)):
        assert bool((patches[t, :, :, 0] == firsts).all())
    assert bool((patches[0, :, :, 1] == 10).all()) and bool((patches[1, :, :, 1] == 20).all())


def test_config_saves_as_the_genuine_class_and_loads_back(tmp_path) -> None:
    videos = NumpyQwen2VLVideoProcessor(**PIXELS)
    config = videos.to_dict()
    assert config["video_processor_type"] == "Qwen2VLVideoProcessor"
    assert config["size"] == {"shortest_edge": 3136, "longest_edge": 12544}
    again = NumpyQwen2VLVideoProcessor(**config)
    assert again.to_dict() == config
    assert enable_video_without_torchvision() in (True, False)  # idempotent either way
    assert enable_video_without_torchvision() in (True, False)
