"""Synthetic omni-modal tasks with one-character answers, deterministic by seed.

Each function is a ``[data] generator``: ``fn(seed=0, **kw)`` yields records ``{"id", "prompt",
"answer"}`` forever, the prompt a list of chat messages whose media parts hold raw arrays
(nothing is read from disk)::

    [data]
    generator = "relax.media.recipes:mixed"

- ``shape_colors``: one large red, green or blue shape; answer ``r``/``g``/``b``.
- ``higher_tone``: two tones, one after the other; answer ``1``/``2`` (the higher one).
- ``motion``: a square moving left or right over 4 frames; answer ``l``/``r``.
- ``arithmetic``: ``a+b=`` with a one-digit sum, text only; answer the digit.
- ``mixed``: the four in turn, so one run mixes text, image, audio and video.
- ``bad_media``: ``mixed`` with every ``every``-th record broken (a truncated PNG, a missing
  audio file, audio at a rate that cannot be resampled, frames of different sizes, an unknown
  part type), for testing per-sample errors; broken records carry ``"fault"``.

Media is tiny (56x56 images, 1 s of 16 kHz audio, 4 frames of 56x56), so a prompt is about 100
tokens with the tiny omni processor, and answers are single characters, so even a random tiny
model stumbles on the format.
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from relax.media._synthetic import PALETTE, tones

Record = dict[str, Any]

SHAPE_QUESTION = "Colour? r, g or b"
TONE_QUESTION = "Which tone is higher, 1 or 2?"
MOTION_QUESTION = "Moving left or right? l or r"

SHAPE_COLORS = {"r": "red", "g": "green", "b": "blue"}
"""Answer letter → ``PALETTE`` colour of the shape."""

FAULTS = ("corrupt_image", "missing_audio", "unresamplable_audio", "ragged_video", "unknown_part")
"""What ``bad_media`` breaks, in turn."""

MISSING_DIR = "/nonexistent/relax-bad-media"
"""Folder of the audio paths ``bad_media`` points at; it never exists."""

_TAGS = {"shape_colors": 1, "higher_tone": 2, "motion": 3, "arithmetic": 4, "bad_media": 5}


def shape_colors(seed: int = 0, *, size: int = 56) -> Iterator[Record]:
    """An image of one large circle or square, red, green or blue on white; answer its letter."""
    for index in itertools.count():
        yield _shape_record(f"shape_colors-{seed}-{index}", _rng("shape_colors", seed, index), size)


def higher_tone(
    seed: int = 0, *, seconds: float = 1.0, sample_rate: int = 16_000
) -> Iterator[Record]:
    """Two tones (220-880 Hz, at least a major third apart), each half the clip; answer ``1``
    when the first is higher, else ``2``."""
    for index in itertools.count():
        rng = _rng("higher_tone", seed, index)
        yield _tone_record(f"higher_tone-{seed}-{index}", rng, seconds, sample_rate)


def motion(seed: int = 0, *, frames: int = 4, size: int = 56, square: int = 14) -> Iterator[Record]:
    """A ``[frames, size, size, 3]`` video of a coloured square on black crossing the frame
    left or right, the same number of pixels each frame; answer ``l`` or ``r``."""
    for index in itertools.count():
        rng = _rng("motion", seed, index)
        yield _motion_record(f"motion-{seed}-{index}", rng, frames, size, square)


def arithmetic(seed: int = 0) -> Iterator[Record]:
    """``a+b=`` with ``a + b <= 9`` as a chat message (no media); answer the digit."""
    for index in itertools.count():
        yield _arith_record(f"arithmetic-{seed}-{index}", _rng("arithmetic", seed, index))


def mixed(
    seed: int = 0,
    *,
    size: int = 56,
    seconds: float = 1.0,
    sample_rate: int = 16_000,
    frames: int = 4,
) -> Iterator[Record]:
    """Image, audio, video and text records in turn (``shape_colors``, ``higher_tone``,
    ``motion``, ``arithmetic``), each drawn from its own seeded stream."""
    makers: list[tuple[str, Callable[[str, np.random.Generator], Record]]] = [
        ("shape", lambda rid, rng: _shape_record(rid, rng, size)),
        ("tone", lambda rid, rng: _tone_record(rid, rng, seconds, sample_rate)),
        ("motion", lambda rid, rng: _motion_record(rid, rng, frames, size, size // 4)),
        ("arith", _arith_record),
    ]
    tags = ("shape_colors", "higher_tone", "motion", "arithmetic")
    for index in itertools.count():
        turn, slot = index // len(makers), index % len(makers)
        name, make = makers[slot]
        yield make(f"mixed-{seed}-{index}-{name}", _rng(tags[slot], seed, turn))


def bad_media(seed: int = 0, *, every: int = 3, **kw: Any) -> Iterator[Record]:
    """``mixed`` (same keyword arguments) where record ``every-1``, ``2*every-1``, ... is
    broken, through ``FAULTS`` in turn; a broken record keeps its answer and gets ``"fault"``.

    - ``corrupt_image``: PNG bytes cut in half;
    - ``missing_audio``: a WAV path under ``MISSING_DIR``;
    - ``unresamplable_audio``: audio at 44101 Hz (no small common factor with 16 kHz);
    - ``ragged_video``: frames of two different sizes;
    - ``unknown_part``: a part of type ``"smell"``.
    """
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    for index, record in enumerate(mixed(seed, **kw)):
        record = {**record, "id": record["id"].replace("mixed-", "bad_media-", 1)}
        if index % every == every - 1:
            fault = FAULTS[(index // every) % len(FAULTS)]
            rng = _rng("bad_media", seed, index)
            record = {
                **record,
                "id": f"{record['id']}-{fault}",
                "prompt": _user([_BROKEN[fault](record["id"], rng), _text("?")]),
                "fault": fault,
            }
        yield record


# --------------------------------------------------------------------------- records


def _shape_record(rid: str, rng: np.random.Generator, size: int) -> Record:
    letter = str(rng.choice(list(SHAPE_COLORS)))
    radius = int(rng.integers(size // 4, size * 3 // 8 + 1))
    cy, cx = (int(v) for v in rng.integers(radius, size - radius, size=2))
    image = Image.new("RGB", (size, size), (255, 255, 255))
    box = (cx - radius, cy - radius, cx + radius - 1, cy + radius - 1)
    draw = ImageDraw.Draw(image)
    fill = PALETTE[SHAPE_COLORS[letter]]
    if rng.integers(2):
        draw.ellipse(box, fill=fill)
    else:
        draw.rectangle(box, fill=fill)
    pixels = np.asarray(image, dtype=np.uint8).copy()
    return {
        "id": rid,
        "prompt": _user([{"type": "image", "image": pixels}, _text(SHAPE_QUESTION)]),
        "answer": letter,
    }


def _tone_record(rid: str, rng: np.random.Generator, seconds: float, sample_rate: int) -> Record:
    audio, info = tones(
        int(rng.integers(2**31)), kind="pair", sample_rate=sample_rate, seconds=seconds
    )
    clip = {"array": audio.numpy(), "sampling_rate": sample_rate}
    return {
        "id": rid,
        "prompt": _user([{"type": "audio", "audio": clip}, _text(TONE_QUESTION)]),
        "answer": "1" if info["higher"] == "first" else "2",
    }


def _motion_record(
    rid: str, rng: np.random.Generator, frames: int, size: int, square: int
) -> Record:
    step = (size - square) // (frames - 1) if frames >= 2 else 0
    if step < 1:
        raise ValueError(f"a {square}-pixel square cannot cross {size} pixels in {frames} frames")
    letter = str(rng.choice(["l", "r"]))
    color = PALETTE[str(rng.choice(list(PALETTE)))]
    top = int(rng.integers(0, size - square + 1))
    video = np.zeros((frames, size, size, 3), dtype=np.uint8)
    for t in range(frames):
        left = t * step if letter == "r" else (frames - 1 - t) * step
        video[t, top : top + square, left : left + square] = color
    return {
        "id": rid,
        "prompt": _user([{"type": "video", "video": video}, _text(MOTION_QUESTION)]),
        "answer": letter,
    }


def _arith_record(rid: str, rng: np.random.Generator) -> Record:
    a = int(rng.integers(0, 10))
    b = int(rng.integers(0, 10 - a))
    return {"id": rid, "prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}


# --------------------------------------------------------------------------- faults


def _corrupt_image(rid: str, rng: np.random.Generator) -> dict[str, Any]:
    image = Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    data = buffer.getvalue()
    return {"type": "image", "image": data[: len(data) // 2]}


def _missing_audio(rid: str, rng: np.random.Generator) -> dict[str, Any]:
    return {"type": "audio", "audio": f"{MISSING_DIR}/{rid}.wav"}


def _unresamplable_audio(rid: str, rng: np.random.Generator) -> dict[str, Any]:
    wave = (0.1 * rng.standard_normal(4410)).astype(np.float32)
    return {"type": "audio", "audio": {"array": wave, "sampling_rate": 44_101}}


def _ragged_video(rid: str, rng: np.random.Generator) -> dict[str, Any]:
    frames = [np.zeros((56, 56, 3), np.uint8), np.zeros((28, 56, 3), np.uint8)]
    return {"type": "video", "video": frames}


def _unknown_part(rid: str, rng: np.random.Generator) -> dict[str, Any]:
    return {"type": "smell", "smell": "roses"}


_BROKEN: dict[str, Callable[[str, np.random.Generator], dict[str, Any]]] = {
    "corrupt_image": _corrupt_image,
    "missing_audio": _missing_audio,
    "unresamplable_audio": _unresamplable_audio,
    "ragged_video": _ragged_video,
    "unknown_part": _unknown_part,
}


# --------------------------------------------------------------------------- helpers


def _rng(task: str, seed: int, index: int) -> np.random.Generator:
    """One stream per (task, seed, record): records do not depend on what came before."""
    return np.random.default_rng([_TAGS[task], seed & (2**64 - 1), index])


def _user(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": parts}]


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def first_char_reward(response: str, sample: dict[str, Any], **_: Any) -> float:
    """The recipes' reward (``kind = "python"``): 1.0 when the reply starts with the
    one-character answer, else 0.0."""
    return 1.0 if response.strip()[:1] == str(sample["answer"]) else 0.0
