"""load_image: real PNG/JPEG/GIF files and in-memory sources round-trip; bad items raise MediaError."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from relax.errors import RelaxError
from relax.media import MediaError, MediaLimits, load_image


def _pixels(height: int = 48, width: int = 64, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _smooth(height: int = 48, width: int = 64) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    return np.stack(
        [x * 255 // width, y * 255 // height, (x + y) * 255 // (width + height)], -1
    ).astype(np.uint8)


def _png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def test_png_round_trips_from_every_source(tmp_path: Path) -> None:
    pixels = _pixels()
    path = tmp_path / "a.png"
    path.write_bytes(_png(pixels))
    for src in (
        path,
        str(path),
        path.read_bytes(),
        {"bytes": path.read_bytes()},
        {"path": str(path)},
        Image.fromarray(pixels),
        pixels,
        torch.from_numpy(pixels),
    ):
        image = load_image(src)
        assert image.dtype == torch.uint8 and image.shape == (48, 64, 3)
        assert torch.equal(image, torch.from_numpy(pixels)), type(src)


def test_jpeg_decodes_close_to_the_original(tmp_path: Path) -> None:
    pixels = _smooth()
    path = tmp_path / "a.jpg"
    Image.fromarray(pixels).save(path, quality=95)
    image = load_image(path)
    assert image.shape == (48, 64, 3)
    assert (image.float() - torch.from_numpy(pixels).float()).abs().mean() < 3


def test_large_image_is_scaled_down_keeping_aspect_ratio() -> None:
    image = load_image(_smooth(300, 600), MediaLimits(max_pixels=20_000))
    height, width = image.shape[:2]
    assert height * width <= 20_000 and height * width > 19_000
    assert abs(width / height - 2) < 0.05


def test_tiny_image_is_scaled_up_to_min_pixels() -> None:
    image = load_image(np.zeros((4, 8, 3), np.uint8), MediaLimits(min_pixels=28 * 28))
    assert image.shape[0] * image.shape[1] >= 28 * 28
    assert image.shape[1] == 2 * image.shape[0]


def test_grey_and_transparent_images_become_rgb(tmp_path: Path) -> None:
    grey = load_image(np.full((5, 6), 77, np.uint8), MediaLimits(min_pixels=1))
    assert grey.shape == (5, 6, 3) and bool((grey == 77).all())
    rgba = np.zeros((30, 30, 4), np.uint8)
    rgba[..., 0] = 200  # red where opaque
    rgba[0, 0, 3] = 255  # only one opaque pixel; the rest is fully transparent
    path = tmp_path / "t.png"
    Image.fromarray(rgba, "RGBA").save(path)
    image = load_image(path)
    assert image[0, 0].tolist() == [200, 0, 0]
    assert image[1, 1].tolist() == [255, 255, 255]  # transparent → white


def test_animated_gif_gives_its_first_frame(tmp_path: Path) -> None:
    frames = [Image.new("RGB", (8, 8), color) for color in ((255, 0, 0), (0, 0, 255))]
    path = tmp_path / "a.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100)
    assert load_image(path)[0, 0].tolist() == [255, 0, 0]


def test_missing_file() -> None:
    with pytest.raises(MediaError, match="does not exist") as info:
        load_image("/no/such/picture.png", item="row 7")
    assert str(info.value).startswith("image row 7:")
    assert isinstance(info.value, RelaxError) and isinstance(info.value, ValueError)


def test_truncated_png(tmp_path: Path) -> None:
    data = _png(_pixels(64, 64))
    path = tmp_path / "cut.png"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(MediaError, match="corrupt or truncated") as info:
        load_image(path)
    assert str(path) in str(info.value)


def test_corrupt_png_body() -> None:
    data = bytearray(_png(_pixels(32, 32)))
    data[60:200] = bytes(140)  # zero out part of the compressed pixel data
    with pytest.raises(MediaError, match="corrupt or truncated"):
        load_image(bytes(data))


def test_non_image_bytes() -> None:
    with pytest.raises(MediaError, match="not an image"):
        load_image(b"this is plain text, not a picture")


def test_empty_bytes() -> None:
    with pytest.raises(MediaError, match="empty"):
        load_image(b"")


def test_file_over_max_bytes(tmp_path: Path) -> None:
    path = tmp_path / "big.png"
    path.write_bytes(_png(_pixels(64, 64)))
    with pytest.raises(MediaError, match="too large"):
        load_image(path, MediaLimits(max_bytes=1000))


def test_small_file_that_decodes_too_large() -> None:
    data = _png(np.zeros((1000, 1000, 3), np.uint8))  # a few KB that decode to 3 MB
    assert len(data) < 100_000
    with pytest.raises(MediaError, match="too large: 1000x1000"):
        load_image(data, MediaLimits(max_bytes=1_000_000))


def test_bad_arrays() -> None:
    with pytest.raises(MediaError, match="uint8"):
        load_image(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(MediaError, match=r"\[H, W, 3\]"):
        load_image(np.zeros((3, 4, 4, 3), np.uint8))
    with pytest.raises(MediaError, match="unsupported source type"):
        load_image(12345)
