"""Audio decoding: WAV (any PCM or float layout), ``.npy``/``.npz`` or an array → mono
``float32 [samples]`` at ``limits.sample_rate``.

Resampling is band-limited: a Hann-windowed sinc filter applied as a strided ``conv1d``
(polyphase form, the method of ``torchaudio.functional.resample``). It low-pass filters at
0.99 x the lower Nyquist frequency, so downsampling does not alias and upsampling does not
image, unlike linear interpolation.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from relax.media._arrays import load_npy, load_npz
from relax.media._limits import MediaError, MediaLimits, describe, read_source

AudioSource = Any
"""A path or bytes of a WAV file, of a ``.npy`` file, or of a ``.npz`` file (an array under
``audio``/``array``/the first key, and optionally ``sample_rate``/``sampling_rate``); an array or
tensor of samples ``[samples]`` or ``[samples, channels]`` / ``[channels, samples]``; or a
Hugging Face datasets-style dict ``{"array": ..., "sampling_rate": ...}`` or
``{"bytes": ..., "path": ...}``."""

_KIND = "audio"
_LOWPASS_WIDTH = 6
_ROLLOFF = 0.99
_MAX_PHASES = 4096  # reduced rates above this need a filter bank too large to be worth building


def load_audio(
    src: AudioSource,
    limits: MediaLimits | None = None,
    *,
    sample_rate: int | None = None,
    item: str | None = None,
) -> torch.Tensor:
    """Decode one audio clip to mono ``float32 [samples]`` at ``limits.sample_rate``.

    ``sample_rate`` is the rate of a source that does not carry one (a raw array, a ``.npy``
    file); a source with its own rate (WAV header, ``.npz`` entry, datasets dict) uses that.
    Channels are averaged. Clips longer than ``limits.max_audio_seconds`` are cut (or refused
    when ``limits.truncate`` is off); a rate other than ``limits.sample_rate`` is resampled (or
    refused when ``limits.resample`` is off). Raises ``MediaError`` naming the problem.
    """
    limits = limits if limits is not None else MediaLimits()
    name = describe(src, item)
    samples, rate = _decode(src, sample_rate, limits, name)
    if samples.size == 0:
        raise MediaError(_KIND, name, "has no samples (zero length)")
    if not np.all(np.isfinite(samples)):
        raise MediaError(_KIND, name, "contains NaN or infinite samples")
    if rate is None:
        raise MediaError(
            _KIND, name, "a raw array needs its sample rate: pass sample_rate=<Hz> to load_audio"
        )
    if isinstance(rate, (float, np.floating)) and float(rate).is_integer():
        rate = int(rate)
    if not (isinstance(rate, (int, np.integer)) and rate > 0):
        raise MediaError(_KIND, name, f"invalid sample rate {rate!r}")
    rate = int(rate)
    seconds = samples.size / rate
    if seconds > limits.max_audio_seconds:
        if not limits.truncate:
            raise MediaError(
                _KIND,
                name,
                f"too long: {seconds:.2f} s, limit {limits.max_audio_seconds:g} s "
                "(truncation is disabled)",
            )
        samples = samples[: max(1, math.floor(limits.max_audio_seconds * rate))]
    wave = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))
    if rate != limits.sample_rate:
        if not limits.resample:
            raise MediaError(
                _KIND,
                name,
                f"sample rate is {rate} Hz, expected {limits.sample_rate} Hz "
                "(resampling is disabled)",
            )
        wave = resample(wave, rate, limits.sample_rate, name=name)
    return wave.contiguous()


def resample(
    wave: torch.Tensor, orig_rate: int, new_rate: int, *, name: str = "<audio>"
) -> torch.Tensor:
    """Band-limited resampling of a 1-D float tensor from ``orig_rate`` to ``new_rate`` Hz.

    Output length is ``ceil(len(wave) * new_rate / orig_rate)``. Raises ``MediaError`` when the
    two rates share no small common factor (e.g. 44101 Hz → 16000 Hz), which would need a
    filter bank with one row per output phase.
    """
    if orig_rate == new_rate:
        return wave
    gcd = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // gcd, new_rate // gcd
    if max(orig, new) > _MAX_PHASES:
        raise MediaError(
            _KIND,
            name,
            f"cannot resample {orig_rate} Hz to {new_rate} Hz: the rates reduce to {orig}:{new}, "
            f"more than {_MAX_PHASES} filter phases",
        )
    kernel, width = _sinc_kernel(orig, new)
    length = wave.shape[-1]
    padded = F.pad(wave.reshape(1, 1, length).to(torch.float32), (width, width + orig))
    out = F.conv1d(padded, kernel.to(torch.float32), stride=orig)  # [1, new, frames]: phase-major
    out = out.transpose(1, 2).reshape(-1)
    return out[: math.ceil(new * length / orig)].to(wave.dtype)


def _sinc_kernel(orig: int, new: int) -> tuple[torch.Tensor, int]:
    """Hann-windowed sinc filter bank ``[new, 1, taps]`` for the reduced ratio ``orig:new``."""
    cutoff = min(orig, new) * _ROLLOFF
    width = math.ceil(_LOWPASS_WIDTH * orig / cutoff)
    taps = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    phases = torch.arange(0, -new, -1, dtype=torch.float64)[:, None, None] / new
    t = ((phases + taps) * cutoff).clamp(-_LOWPASS_WIDTH, _LOWPASS_WIDTH)
    window = torch.cos(t * math.pi / _LOWPASS_WIDTH / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / torch.where(t == 0, 1.0, t))
    return sinc * window * (cutoff / orig), width


# --------------------------------------------------------------------------- decoding


def _decode(
    src: AudioSource, sample_rate: int | None, limits: MediaLimits, name: str
) -> tuple[np.ndarray, int | None]:
    """Source → (mono float samples, rate or None when the source has none)."""
    if isinstance(src, dict):
        if src.get("array") is not None:
            rate = src.get("sampling_rate", src.get("sample_rate", sample_rate))
            return _mono(src["array"], limits, name), rate
        if src.get("bytes") is not None:
            src = src["bytes"]
        elif src.get("path"):
            src = src["path"]
        else:
            raise MediaError(_KIND, name, "dict source has none of 'array', 'bytes', 'path'")
    if isinstance(src, (np.ndarray, torch.Tensor)):
        return _mono(src, limits, name), sample_rate
    if isinstance(src, (str, Path, bytes, bytearray, memoryview)):
        data = read_source(src, _KIND, name, limits)
        if data[:4] in (b"RIFF", b"RF64"):
            return _parse_wav(data, name)
        if data[:6] == b"\x93NUMPY":
            return _mono(load_npy(data, _KIND, name), limits, name), sample_rate
        if data[:4] == b"PK\x03\x04":
            array, rate = load_npz(
                data, _KIND, name, ("audio", "array", "samples"), ("sample_rate", "sampling_rate")
            )
            rate = sample_rate if rate is None else int(rate)
            return _mono(array, limits, name), rate
        suffix = Path(src).suffix.lower() if isinstance(src, (str, Path)) else ""
        if suffix == ".wav":
            raise MediaError(_KIND, name, "corrupt WAV file: no RIFF/WAVE header")
        raise MediaError(_KIND, name, "unsupported audio format (expected WAV, .npy or .npz data)")
    raise MediaError(_KIND, name, f"unsupported source type {type(src).__name__}")


def _mono(array: Any, limits: MediaLimits, name: str) -> np.ndarray:
    """An array of samples (1-D, or 2-D with a channel axis of at most 16) averaged to mono."""
    if isinstance(array, torch.Tensor):
        array = array.detach().cpu().numpy()
    array = np.asarray(array)
    if array.dtype.kind not in "fiu":
        raise MediaError(_KIND, name, f"samples must be numbers, got dtype {array.dtype}")
    if array.nbytes > limits.max_bytes:
        raise MediaError(
            _KIND, name, f"too large: {array.nbytes} bytes of samples, limit {limits.max_bytes}"
        )
    if array.dtype.kind in "iu":
        array = _int_to_float(array)
    if array.ndim == 2:
        channel_axis = 1 if array.shape[1] <= array.shape[0] else 0
        if array.shape[channel_axis] > 16:
            raise MediaError(
                _KIND, name, f"cannot tell samples from channels in shape {list(array.shape)}"
            )
        array = array.mean(axis=channel_axis)
    elif array.ndim != 1:
        raise MediaError(
            _KIND,
            name,
            f"samples must be [samples] or [samples, channels], got {list(array.shape)}",
        )
    return array.astype(np.float32, copy=False)


def _int_to_float(array: np.ndarray) -> np.ndarray:
    """Integer PCM → float in [-1, 1)."""
    info = np.iinfo(array.dtype)
    if info.min == 0:  # unsigned: centred on the midpoint
        half = (int(info.max) + 1) / 2
        return (array.astype(np.float64) - half) / half
    return array.astype(np.float64) / -float(info.min)


def _parse_wav(data: bytes, name: str) -> tuple[np.ndarray, int]:
    """RIFF/WAVE bytes → (mono samples, rate): PCM 8/16/24/32-bit, float 32/64, extensible."""
    if len(data) < 12 or data[8:12] != b"WAVE":
        raise MediaError(_KIND, name, "corrupt WAV file: no RIFF/WAVE header")
    fmt: tuple[int, int, int, int] | None = None
    pcm: bytes | None = None
    pos = 12
    while pos + 8 <= len(data):
        chunk_id = data[pos : pos + 4]
        size = int.from_bytes(data[pos + 4 : pos + 8], "little")
        body = data[pos + 8 : pos + 8 + size]
        if chunk_id == b"fmt ":
            if len(body) < 16:
                raise MediaError(_KIND, name, "corrupt WAV file: short fmt chunk")
            tag, channels, rate, _, _, bits = struct.unpack("<HHIIHH", body[:16])
            if tag == 0xFFFE and len(body) >= 26:  # WAVE_FORMAT_EXTENSIBLE: the real tag follows
                tag = struct.unpack("<H", body[24:26])[0]
            fmt = (tag, channels, rate, bits)
        elif chunk_id == b"data":
            if len(body) < size and size != 0xFFFFFFFF:
                raise MediaError(
                    _KIND, name, f"truncated WAV file: data chunk has {len(body)} of {size} bytes"
                )
            pcm = body
            break
        pos += 8 + size + (size & 1)
    if fmt is None:
        raise MediaError(_KIND, name, "corrupt WAV file: no fmt chunk before the data")
    if pcm is None:
        raise MediaError(_KIND, name, "corrupt WAV file: no data chunk")
    tag, channels, rate, bits = fmt
    if channels < 1:
        raise MediaError(_KIND, name, f"corrupt WAV file: {channels} channels")
    width = bits // 8
    frame = width * channels
    if frame == 0:
        raise MediaError(_KIND, name, f"corrupt WAV file: {bits} bits per sample")
    pcm = pcm[: len(pcm) - len(pcm) % frame]
    if tag == 1 and bits == 8:
        samples = (np.frombuffer(pcm, np.uint8).astype(np.float64) - 128.0) / 128.0
    elif tag == 1 and bits == 16:
        samples = np.frombuffer(pcm, "<i2") / 32768.0
    elif tag == 1 and bits == 24:
        raw = np.frombuffer(pcm, np.uint8).reshape(-1, 3).astype(np.int32)
        ints = raw[:, 0] | (raw[:, 1] << 8) | (raw[:, 2] << 16)
        samples = np.where(ints >= 1 << 23, ints - (1 << 24), ints) / float(1 << 23)
    elif tag == 1 and bits == 32:
        samples = np.frombuffer(pcm, "<i4") / float(1 << 31)
    elif tag == 3 and bits in (32, 64):
        samples = np.frombuffer(pcm, "<f4" if bits == 32 else "<f8").astype(np.float64)
    else:
        raise MediaError(
            _KIND, name, f"unsupported WAV encoding (format tag {tag}, {bits} bits per sample)"
        )
    samples = samples.reshape(-1, channels).mean(axis=1)
    return samples.astype(np.float32), rate
