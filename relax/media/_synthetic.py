"""Synthetic media with known answers, deterministic by seed: for recipes and tests.

- ``draw_shapes``: coloured circles/squares on a plain background (how many? which colour?).
- ``tones``: two tones (which is higher?) or a run of beeps (how many?).
- ``moving_square``: a square crossing the frame (which way does it move?).

Every generator draws with ``numpy.random.default_rng(seed)`` and Pillow without
anti-aliasing, so shapes are exact palette colours that a test can count back.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 200, 20),
    "purple": (150, 50, 180),
    "orange": (245, 130, 20),
}
"""Colour names used by the generators and their exact RGB values."""

SHAPES = ("circle", "square")
DIRECTIONS = ("left", "right", "up", "down")


def draw_shapes(
    seed: int,
    *,
    size: int = 64,
    count: int | None = None,
    max_count: int = 5,
    shapes: tuple[str, ...] = SHAPES,
    colors: tuple[str, ...] = ("red", "green", "blue"),
    one_color: bool = False,
    background: tuple[int, int, int] = (255, 255, 255),
) -> tuple[torch.Tensor, dict[str, Any]]:
    """An RGB ``uint8 [size, size, 3]`` image of ``count`` (default: 1..``max_count``) shapes.

    Shapes never touch (at least 2 background pixels apart) and never cross the border. With
    ``one_color`` every shape has the same colour. Returns ``(image, info)`` with ``info``:
    ``count``, ``color`` (the one colour, or ``None``), ``color_counts`` and ``shape_counts``
    (name → number), and ``items`` (``shape``, ``color``, ``center`` (y, x), ``radius``; a
    square's radius is half its side).
    """
    rng = np.random.default_rng(seed)
    for name in colors:
        if name not in PALETTE:
            raise ValueError(f"unknown colour {name!r}; choose from {sorted(PALETTE)}")
    for shape in shapes:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; choose from {SHAPES}")
    if count is None:
        count = int(rng.integers(1, max_count + 1))
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    radius_lo, radius_hi = max(2, size // 14), max(3, size // 8)
    items: list[dict[str, Any]] = []
    shared = str(rng.choice(list(colors)))
    for _ in range(count):
        for _attempt in range(1000):
            radius = int(rng.integers(radius_lo, radius_hi + 1))
            cy = int(rng.integers(radius + 1, size - radius - 1))
            cx = int(rng.integers(radius + 1, size - radius - 1))
            # Bounding boxes at least 2 pixels apart (a circle's box is its square's box).
            if all(
                abs(cy - o["center"][0]) > radius + o["radius"] + 2
                or abs(cx - o["center"][1]) > radius + o["radius"] + 2
                for o in items
            ):
                break
        else:
            raise ValueError(f"cannot place {count} shapes on a {size}x{size} image")
        items.append(
            {
                "shape": str(rng.choice(list(shapes))),
                "color": shared if one_color else str(rng.choice(list(colors))),
                "center": (cy, cx),
                "radius": radius,
            }
        )
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    for it in items:
        (cy, cx), r = it["center"], it["radius"]
        box = (cx - r, cy - r, cx + r, cy + r)
        if it["shape"] == "circle":
            draw.ellipse(box, fill=PALETTE[it["color"]])
        else:
            draw.rectangle(box, fill=PALETTE[it["color"]])
    info = {
        "count": count,
        "color": shared if one_color and count else None,
        "color_counts": _tally(it["color"] for it in items),
        "shape_counts": _tally(it["shape"] for it in items),
        "items": items,
    }
    return torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()), info


def tones(
    seed: int,
    *,
    kind: str = "pair",
    sample_rate: int = 16_000,
    seconds: float = 1.0,
    max_beeps: int = 5,
    amplitude: float = 0.5,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Mono ``float32 [samples]`` audio at ``sample_rate``, ``seconds`` long.

    ``kind="pair"``: two tones, each half the clip, at least a major third apart (220-880 Hz);
    ``info``: ``first_hz``, ``second_hz``, ``higher`` (``"first"``/``"second"``).
    ``kind="beeps"``: 1..``max_beeps`` beeps of 80 ms at one pitch, evenly spread with silence
    between; ``info``: ``count``, ``hz``. Tone edges are faded over 5 ms (no clicks).
    """
    rng = np.random.default_rng(seed)
    total = round(seconds * sample_rate)
    audio = np.zeros(total, dtype=np.float64)
    if kind == "pair":
        while True:
            first, second = (float(f) for f in np.round(rng.uniform(220.0, 880.0, size=2)))
            if max(first, second) / min(first, second) >= 1.25:
                break
        half = total // 2
        audio[:half] = _tone(first, half, sample_rate, amplitude)
        audio[half : 2 * half] = _tone(second, half, sample_rate, amplitude)
        info: dict[str, Any] = {
            "first_hz": first,
            "second_hz": second,
            "higher": "first" if first > second else "second",
        }
    elif kind == "beeps":
        count = int(rng.integers(1, max_beeps + 1))
        hz = float(np.round(rng.uniform(440.0, 880.0)))
        beep = round(0.08 * sample_rate)
        slot = total // count
        if slot < beep * 2:
            raise ValueError(f"{count} beeps do not fit in {seconds} s")
        for i in range(count):
            start = i * slot + (slot - beep) // 2
            audio[start : start + beep] = _tone(hz, beep, sample_rate, amplitude)
        info = {"count": count, "hz": hz}
    else:
        raise ValueError(f"kind must be 'pair' or 'beeps', got {kind!r}")
    return torch.from_numpy(audio.astype(np.float32)), info


def moving_square(
    seed: int,
    *,
    frames: int = 8,
    size: int = 32,
    square: int = 6,
    color: str | None = None,
    background: tuple[int, int, int] = (0, 0, 0),
) -> tuple[torch.Tensor, dict[str, Any]]:
    """A ``uint8 [frames, size, size, 3]`` video of a square crossing the frame in a straight
    line, the same number of pixels each frame.

    ``info``: ``direction`` (``left``/``right``/``up``/``down``), ``color``, ``step`` (pixels
    per frame) and ``positions`` (top-left ``(y, x)`` per frame).
    """
    if frames < 2:
        raise ValueError("a moving square needs at least 2 frames")
    travel = size - square
    step = travel // (frames - 1)
    if step < 1:
        raise ValueError(
            f"a {square}-pixel square cannot move across {size} pixels in {frames} frames"
        )
    rng = np.random.default_rng(seed)
    direction = str(rng.choice(list(DIRECTIONS)))
    color = color if color is not None else str(rng.choice(list(PALETTE)))
    if color not in PALETTE:
        raise ValueError(f"unknown colour {color!r}; choose from {sorted(PALETTE)}")
    across = int(rng.integers(0, size - square + 1))
    start = int(rng.integers(0, travel - step * (frames - 1) + 1))
    video = np.empty((frames, size, size, 3), dtype=np.uint8)
    video[:] = np.asarray(background, dtype=np.uint8)
    positions = []
    for t in range(frames):
        along = start + t * step
        if direction in ("left", "up"):
            along = travel - along
        y, x = (along, across) if direction in ("up", "down") else (across, along)
        video[t, y : y + square, x : x + square] = PALETTE[color]
        positions.append((y, x))
    info = {"direction": direction, "color": color, "step": step, "positions": positions}
    return torch.from_numpy(video), info


def _tone(hz: float, length: int, sample_rate: int, amplitude: float) -> np.ndarray:
    t = np.arange(length) / sample_rate
    wave = amplitude * np.sin(2 * math.pi * hz * t)
    fade = min(length // 2, round(0.005 * sample_rate))
    if fade:
        ramp = np.linspace(0.0, 1.0, fade)
        wave[:fade] *= ramp
        wave[-fade:] *= ramp[::-1]
    return wave


def _tally(names: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return counts
