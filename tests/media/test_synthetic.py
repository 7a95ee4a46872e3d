"""Synthetic media: same seed, same media; the answers in ``info`` are read back from the pixels
and samples themselves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relax.media import PALETTE, draw_shapes, moving_square, tones


def _components(mask: np.ndarray) -> int:
    """4-connected components of a boolean mask (a small flood fill)."""
    seen = np.zeros_like(mask)
    count = 0
    for y, x in zip(*np.nonzero(mask), strict=True):
        if seen[y, x]:
            continue
        count += 1
        stack = [(y, x)]
        seen[y, x] = True
        while stack:
            cy, cx = stack.pop()
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if (
                    0 <= ny < mask.shape[0]
                    and 0 <= nx < mask.shape[1]
                    and mask[ny, nx]
                    and not seen[ny, nx]
                ):
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return count


@pytest.mark.parametrize("seed", range(6))
def test_shapes_are_counted_back_from_the_pixels(seed: int) -> None:
    image, info = draw_shapes(seed)
    assert image.dtype == torch.uint8 and image.shape == (64, 64, 3)
    pixels = image.numpy()
    for name, rgb in PALETTE.items():
        found = _components((pixels == rgb).all(-1))
        assert found == info["color_counts"].get(name, 0), (name, info)
    background = (pixels == 255).all(-1)
    assert _components(~background) == info["count"] == len(info["items"])
    assert 1 <= info["count"] <= 5


def test_shapes_determinism_and_options() -> None:
    a, info_a = draw_shapes(3)
    b, info_b = draw_shapes(3)
    assert torch.equal(a, b) and info_a == info_b
    assert not torch.equal(a, draw_shapes(4)[0])
    image, info = draw_shapes(
        5, count=3, one_color=True, colors=("blue", "red"), shapes=("square",)
    )
    assert info["count"] == 3 and info["shape_counts"] == {"square": 3}
    assert info["color_counts"] == {info["color"]: 3}
    assert _components((image.numpy() == PALETTE[info["color"]]).all(-1)) == 3
    # A square fills its whole box; a circle does not reach the box's corners.
    it = info["items"][0]
    (cy, cx), r = it["center"], it["radius"]
    assert (image.numpy()[cy - r : cy + r + 1, cx - r : cx + r + 1] == PALETTE[it["color"]]).all()
    with pytest.raises(ValueError, match="cannot place"):
        draw_shapes(0, count=40, size=32)


def _peak_hz(audio: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(audio * np.hanning(len(audio))))
    return float(np.argmax(spectrum) * rate / len(audio))


@pytest.mark.parametrize("seed", range(4))
def test_tone_pair_answer_matches_the_spectrum(seed: int) -> None:
    audio, info = tones(seed)
    assert audio.dtype == torch.float32 and audio.shape == (16_000,)
    first, second = audio[:8000].numpy(), audio[8000:].numpy()
    assert abs(_peak_hz(first, 16_000) - info["first_hz"]) <= 2
    assert abs(_peak_hz(second, 16_000) - info["second_hz"]) <= 2
    higher = "first" if _peak_hz(first, 16_000) > _peak_hz(second, 16_000) else "second"
    assert higher == info["higher"]
    assert torch.equal(audio, tones(seed)[0])


@pytest.mark.parametrize("seed", range(4))
def test_beeps_are_counted_back(seed: int) -> None:
    audio, info = tones(seed, kind="beeps", seconds=2.0, sample_rate=8_000)
    loud = np.abs(audio.numpy()) > 0.05
    # A beep is one run of loud samples once gaps shorter than a period are bridged.
    envelope = np.convolve(loud, np.ones(40), mode="same") > 0
    runs = int(np.sum(envelope[1:] & ~envelope[:-1]) + envelope[0])
    assert runs == info["count"]
    assert torch.equal(audio, tones(seed, kind="beeps", seconds=2.0, sample_rate=8_000)[0])


@pytest.mark.parametrize("seed", range(8))
def test_moving_square_direction_is_read_back(seed: int) -> None:
    video, info = moving_square(seed)
    assert video.dtype == torch.uint8 and video.shape == (8, 32, 32, 3)
    centres = []
    for frame in video.numpy():
        ys, xs = np.nonzero((frame == PALETTE[info["color"]]).all(-1))
        assert len(ys) == 36  # the whole 6x6 square is always inside the frame
        centres.append((ys.mean(), xs.mean()))
    dy, dx = np.subtract(centres[-1], centres[0])
    direction = (
        ("down" if dy > 0 else "up") if abs(dy) > abs(dx) else ("right" if dx > 0 else "left")
    )
    assert direction == info["direction"]
    assert torch.equal(video, moving_square(seed)[0])
    assert {moving_square(s)[1]["direction"] for s in range(20)} == {"left", "right", "up", "down"}
