"""load_audio: WAV files at 8k/16k/44.1k (resampled), other encodings and arrays; bad items
raise MediaError naming the problem."""

from __future__ import annotations

import io
import math
import struct
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from relax.media import MediaError, MediaLimits, load_audio, resample


def _sine(hz: float, rate: int, seconds: float = 1.0) -> np.ndarray:
    return 0.5 * np.sin(2 * math.pi * hz * np.arange(round(rate * seconds)) / rate)


def _wav(samples: np.ndarray, rate: int, channels: int = 1, width: int = 2) -> bytes:
    """PCM WAV through the standard library (``samples`` in [-1, 1], ``[n]`` or ``[n, ch]``)."""
    if width == 1:
        data = np.round(samples * 127 + 128).astype(np.uint8).tobytes()
    else:
        data = np.round(samples * 32767).astype("<i2").tobytes()
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(width)
        out.setframerate(rate)
        out.writeframes(data)
    return buffer.getvalue()


def _float_wav(samples: np.ndarray, rate: int) -> bytes:
    """IEEE float32 WAV (format tag 3), which the ``wave`` module cannot write."""
    data = samples.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    body = (
        b"WAVE"
        + b"fmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"data"
        + struct.pack("<I", len(data))
        + data
    )
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _peak_hz(audio: torch.Tensor, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(audio.numpy() * np.hanning(len(audio))))
    return float(np.argmax(spectrum) * rate / len(audio))


def test_16k_wav_round_trips_exactly(tmp_path: Path) -> None:
    ints = np.random.default_rng(0).integers(-32768, 32767, 1600).astype("<i2")
    path = tmp_path / "a.wav"
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16_000)
        out.writeframes(ints.tobytes())
    audio = load_audio(path)
    assert audio.dtype == torch.float32 and audio.shape == (1600,)
    assert torch.equal(audio, torch.from_numpy(ints.astype(np.float32) / 32768))
    assert torch.equal(load_audio(path.read_bytes()), audio)
    assert torch.equal(load_audio({"bytes": path.read_bytes()}), audio)


@pytest.mark.parametrize("rate", [8_000, 44_100])
def test_wav_is_resampled_to_16k(tmp_path: Path, rate: int) -> None:
    path = tmp_path / f"{rate}.wav"
    path.write_bytes(_wav(_sine(440, rate), rate))
    audio = load_audio(path)
    assert audio.shape == (16_000,)
    assert abs(_peak_hz(audio, 16_000) - 440) <= 1.5
    # Amplitude is kept (away from the edges, where the filter sees padding).
    assert abs(float(audio[1000:-1000].abs().max()) - 0.5) < 0.01


def test_downsampling_filters_out_what_cannot_be_represented() -> None:
    # 10 kHz is above 16 kHz's Nyquist (8 kHz): linear interpolation would alias it to 6 kHz.
    tone = torch.from_numpy(_sine(10_000, 44_100).astype(np.float32))
    out = resample(tone, 44_100, 16_000)
    assert out.shape == (math.ceil(44_100 * 160 / 441),)
    assert float(out[500:-500].abs().max()) < 0.01


def test_upsampling_keeps_length_and_pitch() -> None:
    tone = torch.from_numpy(_sine(1000, 8_000).astype(np.float32))
    out = resample(tone, 8_000, 16_000)
    assert out.shape == (16_000,)
    assert abs(_peak_hz(out, 16_000) - 1000) <= 1.5
    # Every other output sample is an input sample (the filter interpolates between them).
    assert torch.allclose(out[200:-200:2], tone[100:-100], atol=2e-3)


def test_other_encodings(tmp_path: Path) -> None:
    signal = _sine(300, 16_000, 0.1)
    stereo = np.stack([signal, np.zeros_like(signal)], 1)
    assert torch.allclose(
        load_audio(_wav(stereo, 16_000, channels=2)),
        torch.from_numpy(signal / 2).float(),
        atol=1e-4,
    )
    assert torch.allclose(
        load_audio(_wav(signal, 16_000, width=1)), torch.from_numpy(signal).float(), atol=1e-2
    )
    assert torch.allclose(
        load_audio(_float_wav(signal, 16_000)), torch.from_numpy(signal).float(), atol=1e-7
    )


def test_arrays_npy_and_npz(tmp_path: Path) -> None:
    signal = _sine(500, 8_000, 0.5).astype(np.float32)
    expected = load_audio(signal, sample_rate=8_000)
    assert expected.shape == (8_000,)
    assert torch.equal(load_audio(torch.from_numpy(signal), sample_rate=8_000), expected)
    assert torch.equal(load_audio({"array": signal, "sampling_rate": 8_000}), expected)
    np.save(tmp_path / "a.npy", signal)
    assert torch.equal(load_audio(tmp_path / "a.npy", sample_rate=8_000), expected)
    np.savez(tmp_path / "a.npz", audio=signal, sample_rate=8_000)
    assert torch.equal(load_audio(tmp_path / "a.npz"), expected)
    ints = (signal * 32767).astype(np.int16)
    assert torch.allclose(load_audio(ints, sample_rate=8_000), expected, atol=1e-4)


def test_long_audio_is_cut_or_refused() -> None:
    signal = _sine(440, 16_000, 3.0)
    assert load_audio(signal, MediaLimits(max_audio_seconds=2), sample_rate=16_000).shape == (
        32_000,
    )
    with pytest.raises(
        MediaError, match=r"too long: 3\.00 s, limit 2 s \(truncation is disabled\)"
    ):
        load_audio(signal, MediaLimits(max_audio_seconds=2, truncate=False), sample_rate=16_000)


def test_wrong_rate_with_resampling_disabled(tmp_path: Path) -> None:
    path = tmp_path / "8k.wav"
    path.write_bytes(_wav(_sine(440, 8_000), 8_000))
    with pytest.raises(
        MediaError, match=r"sample rate is 8000 Hz, expected 16000 Hz \(resampling is disabled\)"
    ) as info:
        load_audio(path, MediaLimits(resample=False))
    assert str(path) in str(info.value)


def test_rate_that_cannot_be_resampled() -> None:
    with pytest.raises(MediaError, match="cannot resample 44101 Hz to 16000 Hz"):
        load_audio(_wav(_sine(440, 44_101, 0.1), 44_101))
    with pytest.raises(MediaError, match="invalid sample rate"):
        load_audio(np.zeros(10, np.float32), sample_rate=0)


def test_raw_array_needs_a_rate() -> None:
    with pytest.raises(MediaError, match="sample_rate"):
        load_audio(np.zeros(100, np.float32))


def test_zero_length() -> None:
    with pytest.raises(MediaError, match="zero length"):
        load_audio(_wav(np.zeros(0), 16_000))
    with pytest.raises(MediaError, match="zero length"):
        load_audio(np.zeros(0, np.float32), sample_rate=16_000)


def test_missing_truncated_and_corrupt_files(tmp_path: Path) -> None:
    with pytest.raises(MediaError, match=r"audio /no/such\.wav: file does not exist"):
        load_audio("/no/such.wav")
    data = _wav(_sine(440, 16_000, 0.1), 16_000)
    with pytest.raises(MediaError, match="truncated WAV"):
        load_audio(data[: len(data) - 500])
    with pytest.raises(MediaError, match="corrupt WAV"):
        load_audio(b"RIFF\x00\x00\x00\x00JUNKJUNK")
    path = tmp_path / "fake.wav"
    path.write_bytes(b"definitely not audio")
    with pytest.raises(MediaError, match="corrupt WAV file: no RIFF/WAVE header"):
        load_audio(path)
    with pytest.raises(MediaError, match="unsupported audio format"):
        load_audio(b"ID3\x03mp3 data we do not decode")
    with pytest.raises(MediaError, match="NaN"):
        load_audio(np.array([0.0, np.nan], np.float32), sample_rate=16_000)
    with pytest.raises(MediaError, match="too large"):
        load_audio(data, MediaLimits(max_bytes=100))
