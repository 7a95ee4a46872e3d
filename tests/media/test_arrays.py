"""NumPy payloads of media items: read without ever unpickling, bad ones named."""

from __future__ import annotations

import io

import numpy as np
import pytest

from relax.media import MediaError
from relax.media._arrays import load_npy, load_npz


def npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array, allow_pickle=True)
    return out.getvalue()


def npz(**arrays: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def test_npy_round_trip_and_refusals() -> None:
    frames = np.arange(24, dtype=np.uint8).reshape(2, 2, 2, 3)
    assert np.array_equal(load_npy(npy(frames), "video", "v1"), frames)
    with pytest.raises(MediaError, match=r"video v1.*corrupt \.npy"):
        load_npy(npy(frames)[:40], "video", "v1")
    # An object array would need unpickling: refused, never loaded.
    with pytest.raises(MediaError, match=r"corrupt \.npy"):
        load_npy(npy(np.array([{"x": 1}], dtype=object)), "audio", "a1")


def test_npz_picks_the_array_and_the_rate() -> None:
    clip = np.zeros(160, dtype=np.float32)
    data = npz(samples=clip, sampling_rate=np.array(8000))
    array, rate = load_npz(data, "audio", "a", ("audio", "array", "samples"), ("sampling_rate",))
    assert np.array_equal(array, clip) and rate == 8000
    array, rate = load_npz(npz(other=clip), "audio", "a", ("audio",), ("sample_rate",))
    assert np.array_equal(array, clip) and rate is None  # the one non-rate entry
    with pytest.raises(MediaError, match="holds no frames/video array"):
        load_npz(npz(fps=np.array(2.0)), "video", "v", ("frames", "video"), ("fps",))
    with pytest.raises(MediaError, match=r"corrupt \.npz"):
        load_npz(data[:30], "audio", "a", ("audio",), ("sample_rate",))
