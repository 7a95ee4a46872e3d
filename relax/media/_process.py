"""One chat prompt with images, audio and video → token ids and the model's media tensors.

``process_prompt`` is where a record's media is decoded, once, within ``MediaLimits``: every
``image``/``audio``/``video`` part goes through ``load_image`` / ``load_audio`` /
``load_video_clip``, the chat template is rendered with ``add_generation_prompt=True``, and the
processor runs once on the text and the decoded items. What comes out (``ProcessedPrompt``)
is what the model forward takes for this prompt: ``prompt_ids`` (media placeholders expanded)
and ``mm_inputs`` (``pixel_values``, ``image_grid_thw``, ``input_features``, ...), CPU tensors
that travel over the wire as they are (``relax.transport.dumps``); ``mm_from_wire`` turns what
the bus hands back into torch tensors again.

A part that cannot be used (missing file, corrupt bytes, audio at a rate that cannot be
resampled, too many frames with truncation off, an unknown part type, a modality the
processor lacks) raises ``MediaError`` naming the record, the message and part, and why; the
caller skips that prompt. A processor that cannot serve the limits at all (its feature
extractor wants another sample rate, it has no chat template) is a ``ConfigError``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from relax.errors import ConfigError
from relax.media._audio import load_audio
from relax.media._image import load_image
from relax.media._limits import MediaError, MediaLimits, describe
from relax.media._video import load_video_clip

MEDIA_KINDS = ("image", "audio", "video")
"""Part types that carry media, in the order their counts are reported."""

_TOKENIZER_OUTPUTS = frozenset({"input_ids", "attention_mask", "token_type_ids"})
_SUB_PROCESSOR = {
    "image": "image_processor",
    "audio": "feature_extractor",
    "video": "video_processor",
}
_PART_RATE_KEYS = ("sampling_rate", "sample_rate")
_SECONDS_PER_GRID_KEYS = ("video_second_per_grid", "second_per_grid_ts")


@dataclasses.dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt ready for the model: ids with placeholders expanded, and its media tensors."""

    prompt_ids: list[int]
    """Token ids of the rendered prompt, each media item expanded to its placeholder tokens."""
    mm_inputs: dict[str, torch.Tensor]
    """Every processor output but the tokenizer's (``input_ids``/``attention_mask``), as
    contiguous CPU tensors for a batch of this one prompt: exactly the extra keyword arguments
    of the model forward. ``{}`` for a text-only prompt."""
    text: str
    """The rendered prompt (chat template applied, one media token per item, not expanded)."""
    media_tokens: int
    """How many of ``prompt_ids`` are image/audio/video placeholders."""
    counts: dict[str, int]
    """Media items by kind: ``{"image": n, "audio": n, "video": n}``."""


def media_limits(cfg_media: Any = None) -> MediaLimits:
    """``MediaLimits`` from ``[data.media]``: a ``relax.config.MediaConfig``, a dict of its
    fields (a partial one keeps the defaults of the others) or ``None`` (all defaults)."""
    names = [field.name for field in dataclasses.fields(MediaLimits)]
    if cfg_media is None:
        return MediaLimits()
    if isinstance(cfg_media, Mapping):
        unknown = sorted(set(cfg_media) - set(names))
        if unknown:
            raise ValueError(f"unknown [data.media] keys {unknown}; known: {names}")
        return MediaLimits(**{name: cfg_media[name] for name in names if name in cfg_media})
    return MediaLimits(**{name: getattr(cfg_media, name) for name in names})


def has_media(prompt: Any) -> bool:
    """Whether a record's prompt needs the media path: a list of chat messages with any content
    part whose type is not ``"text"`` (an image, audio or video; an unknown type counts too, so
    that ``process_prompt`` refuses it instead of a text path dropping it). A string is text."""
    if isinstance(prompt, str) or not isinstance(prompt, (list, tuple)):
        return False
    for message in prompt:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, (list, tuple)):
            for part in content:
                if not (isinstance(part, Mapping) and part.get("type") == "text"):
                    return True
    return False


def process_prompt(
    processor: Any,
    prompt: Any,
    limits: MediaLimits,
    *,
    item: str,
    render: Callable[[list[dict[str, Any]]], str] | None = None,
) -> ProcessedPrompt:
    """Decode the prompt's media once, render the chat template, run the processor once.

    ``prompt`` is a list of chat messages ``{"role": ..., "content": ...}`` whose content is a
    string or a list of parts: ``{"type": "text", "text": str}``, ``{"type": "image", "image":
    SRC}``, ``{"type": "audio", "audio": SRC}``, ``{"type": "video", "video": SRC}``. ``SRC`` is
    a path, raw bytes, a ``data:<mime>;base64,...`` URI, a NumPy array / torch tensor, a list of
    frames (video), or a datasets-style dict (``{"bytes"|"path"}``, audio ``{"array",
    "sampling_rate"}``, video ``{"frames", "fps"}``). An audio part may give the rate of a raw
    array as ``"sampling_rate"``, a video part the rate of its frames as ``"fps"``.

    A plain string is tokenized as it is, without a chat template (as text prompts always
    were). ``processor`` is a multimodal processor (``Qwen2_5OmniProcessor``, a Qwen-VL one, ...)
    or, for prompts without media, a tokenizer. ``item`` (the record id) names the prompt in
    errors. Raises ``MediaError`` for a bad prompt or part, ``ConfigError`` for a processor
    that cannot serve ``limits``.

    ``render`` replaces the chat template's rendering of the whole prompt: it gets the messages
    with each media part reduced to ``{"type": kind}`` and returns the text the processor runs
    on (one media token per part, in order). A multi-turn episode uses it to process only the
    turns that follow the model's reply (``relax.agents``).
    """
    tokenizer = getattr(processor, "tokenizer", None) or processor
    placeholder_ids = _placeholder_ids(processor, tokenizer)
    if isinstance(prompt, str):
        ids = [int(i) for i in tokenizer.encode(prompt, add_special_tokens=False)]
        _check_no_placeholders(ids, placeholder_ids, item)
        return ProcessedPrompt(ids, {}, prompt, 0, dict.fromkeys(MEDIA_KINDS, 0))

    messages = _messages(prompt, item)
    decoded: dict[str, list[Any]] = {kind: [] for kind in MEDIA_KINDS}
    video_fps: list[float] = []
    rendered_messages = []
    for m, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            parts = []
            for p, part in enumerate(content):
                where = f"{item} message {m} part {p}"
                kind = _part_type(part, where)
                if kind == "text":
                    parts.append({"type": "text", "text": part["text"]})
                    continue
                value, fps = _decode_part(processor, kind, part, limits, where)
                decoded[kind].append(value)
                if fps is not None:
                    video_fps.append(fps)
                parts.append({"type": kind})
            content = parts
        rendered_messages.append({**message, "content": content})

    text = (
        _render(processor, rendered_messages, item) if render is None else render(rendered_messages)
    )
    _check_media_tokens(processor, tokenizer, text, decoded, item)
    out = _run(processor, text, decoded, video_fps, limits, item)
    ids = [int(i) for i in _first_row(out["input_ids"], item)]
    mm_inputs = {
        str(key): _cpu_tensor(value, key, item)
        for key, value in out.items()
        if key not in _TOKENIZER_OUTPUTS
    }
    _trim_audio_padding(mm_inputs)
    return ProcessedPrompt(
        prompt_ids=ids,
        mm_inputs=mm_inputs,
        text=text,
        media_tokens=sum(1 for i in ids if i in placeholder_ids),
        counts={kind: len(decoded[kind]) for kind in MEDIA_KINDS},
    )


_AUDIO_FRAME_STEP = 100
"""Audio feature frames are kept in whole multiples of this (one encoder window: 1 s)."""


def _trim_audio_padding(mm_inputs: dict[str, torch.Tensor]) -> None:
    """Cut Whisper-style features to the frames the clips use (rounded up to a whole window).

    The feature extractor pads every clip to its full window (30 s = 3000 frames, 1.5 MB of
    float32 for a one-second clip); the audio encoder masks the padding out, so the model's
    outputs are unchanged (checked equal to the last bit in tests/media/test_process.py) while
    the row shrinks by up to 30x on the bus and in every forward.
    """
    mask = mm_inputs.get("feature_attention_mask")
    if mask is None or "input_features" not in mm_inputs or mask.numel() == 0:
        return
    used = int(mask.sum(-1).max())
    keep = max(_AUDIO_FRAME_STEP, -(-used // _AUDIO_FRAME_STEP) * _AUDIO_FRAME_STEP)
    if keep < mask.shape[-1]:
        mm_inputs["feature_attention_mask"] = mask[..., :keep].contiguous()
        mm_inputs["input_features"] = mm_inputs["input_features"][..., :keep].contiguous()


def mm_from_wire(value: Any) -> dict[str, torch.Tensor]:
    """A ``mm_inputs`` column as the bus hands it back → ``{name: torch.Tensor}``.

    Accepts ``None`` (no media: ``{}``), and a dict whose values are torch tensors (what
    ``loads`` gives) or ``RawTensor``s (what ``loads(..., raw_tensors=True)`` gives).
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"mm_inputs must be a dict of tensors, got {type(value).__name__}")
    out = {}
    for key, tensor in value.items():
        if isinstance(tensor, torch.Tensor):
            out[str(key)] = tensor
        elif callable(getattr(tensor, "to_torch", None)):  # relax.transport.RawTensor
            out[str(key)] = tensor.to_torch()
        else:
            raise TypeError(f"mm_inputs[{key!r}] is a {type(tensor).__name__}, not a tensor")
    return out


# --------------------------------------------------------------------------- prompt structure


def _messages(prompt: Any, item: str) -> list[Mapping[str, Any]]:
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise MediaError(
            "prompt",
            item,
            f"must be a string or a non-empty list of chat messages, got {type(prompt).__name__}",
        )
    for m, message in enumerate(prompt):
        if not (isinstance(message, Mapping) and "role" in message and "content" in message):
            raise MediaError(
                "prompt", f"{item} message {m}", "is not a dict with 'role' and 'content'"
            )
        content = message["content"]
        if not (content is None or isinstance(content, (str, list, tuple))):
            raise MediaError(
                "prompt",
                f"{item} message {m}",
                f"content must be a string or a list of parts, got {type(content).__name__}",
            )
    return list(prompt)


def _part_type(part: Any, where: str) -> str:
    if not isinstance(part, Mapping):
        raise MediaError("prompt", where, f"a part must be a dict, got {type(part).__name__}")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise MediaError("prompt", where, "a text part needs a string 'text'")
        return kind
    if kind in MEDIA_KINDS:
        return kind
    raise MediaError(
        "prompt", where, f"unknown part type {kind!r} (expected text, image, audio or video)"
    )


# --------------------------------------------------------------------------- decoding


def _decode_part(
    processor: Any, kind: str, part: Mapping[str, Any], limits: MediaLimits, where: str
) -> tuple[np.ndarray, float | None]:
    """One media part → its decoded array (and a video's fps), through the relax.media loaders."""
    if getattr(processor, _SUB_PROCESSOR[kind], None) is None:
        raise MediaError(
            kind, where, f"the processor ({type(processor).__name__}) takes no {kind} input"
        )
    src = _source(kind, part, where)
    name = f"{where} ({_describe(src)})"
    try:
        if kind == "image":
            return load_image(src, limits, item=name).numpy(), None
        if kind == "audio":
            rate = next((part[k] for k in _PART_RATE_KEYS if part.get(k) is not None), None)
            if rate is None and isinstance(src, (np.ndarray, torch.Tensor, list, tuple)):
                raise MediaError(
                    kind,
                    name,
                    "raw samples need their rate: give the part a 'sampling_rate', or the "
                    "source as {'array': ..., 'sampling_rate': ...}",
                )
            wave = load_audio(src, limits, sample_rate=rate, item=name).numpy()
            return _fit_audio_window(processor, wave, limits, name), None
        clip = load_video_clip(src, limits, fps=part.get("fps"), item=name)
        return clip.frames.numpy(), float(clip.fps)
    except MediaError:
        raise
    except Exception as exc:  # a loader tripped on a source it should have refused
        raise MediaError(kind, name, f"cannot be decoded ({type(exc).__name__}: {exc})") from exc


def _source(kind: str, part: Mapping[str, Any], where: str) -> Any:
    src = part.get(kind)
    if src is None:
        src = next((part[k] for k in ("path", "url") if part.get(k) is not None), None)
    if src is None:
        raise MediaError(kind, where, f"the part has no {kind!r} source")
    if isinstance(src, str):
        if src.startswith("data:"):
            return _data_uri(src, kind, where)
        scheme = urllib.parse.urlsplit(src).scheme.lower()
        if scheme == "file":
            return urllib.parse.unquote(urllib.parse.urlsplit(src).path)
        if scheme in ("http", "https", "ftp", "s3", "gs"):
            raise MediaError(
                kind, where, f"remote sources are not fetched ({src[:80]}): download it first"
            )
    return src


def _data_uri(uri: str, kind: str, where: str) -> bytes:
    """``data:[<mime>][;base64],<data>`` → its bytes."""
    head, comma, payload = uri.partition(",")
    if not comma:
        raise MediaError(kind, where, "malformed data URI (no ',')")
    try:
        if head.endswith(";base64"):
            return base64.b64decode(payload.strip(), validate=True)
        return urllib.parse.unquote_to_bytes(payload)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(kind, where, f"corrupt data URI ({exc})") from None


def _describe(src: Any) -> str:
    if isinstance(src, (bytes, bytearray, memoryview)):
        return f"{len(src)} bytes"
    return describe(src, None).strip("<>")


def _fit_audio_window(processor: Any, wave: np.ndarray, limits: MediaLimits, name: str) -> Any:
    """Audio longer than the feature extractor's window (which it would silently cut) is cut
    here when ``limits.truncate`` allows, else refused."""
    window = getattr(processor.feature_extractor, "n_samples", None)
    if not isinstance(window, int) or window <= 0 or wave.shape[0] <= window:
        return wave
    if not limits.truncate:
        raise MediaError(
            "audio",
            name,
            f"too long for the processor: {wave.shape[0] / limits.sample_rate:.2f} s, its "
            f"window is {window / limits.sample_rate:g} s (truncation is disabled)",
        )
    return wave[:window]


# --------------------------------------------------------------------------- the processor


def _render(processor: Any, messages: list[dict[str, Any]], item: str) -> str:
    if getattr(processor, "chat_template", None) is None:
        raise ConfigError(
            f"{type(processor).__name__} has no chat template: chat-message prompts need one"
        )
    try:
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:
        raise MediaError(
            "prompt", item, f"the chat template failed: {type(exc).__name__}: {exc}"
        ) from exc
    if isinstance(text, list) and len(text) == 1:
        text = text[0]
    if not isinstance(text, str):
        raise MediaError("prompt", item, f"the chat template gave a {type(text).__name__}")
    return text


def _media_token(processor: Any, tokenizer: Any, kind: str) -> str | None:
    token = getattr(processor, f"{kind}_token", None) or getattr(tokenizer, f"{kind}_token", None)
    return token if isinstance(token, str) and token else None


def placeholder_ids(processor: Any) -> set[int]:
    """The ids of the processor's media placeholder tokens (image, audio, video)."""
    return _placeholder_ids(processor, getattr(processor, "tokenizer", None) or processor)


def _placeholder_ids(processor: Any, tokenizer: Any) -> set[int]:
    ids = set()
    unk = getattr(tokenizer, "unk_token_id", None)
    for kind in MEDIA_KINDS:
        token = _media_token(processor, tokenizer, kind)
        if token is None or not hasattr(tokenizer, "convert_tokens_to_ids"):
            continue
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != unk:
            ids.add(token_id)
    return ids


def _check_media_tokens(
    processor: Any, tokenizer: Any, text: str, decoded: dict[str, list[Any]], item: str
) -> None:
    """One media token per media part in the rendered text: a text part spelling out
    ``<|IMAGE|>`` would otherwise take another item's features (or none)."""
    for kind in MEDIA_KINDS:
        token = _media_token(processor, tokenizer, kind)
        if token is None:
            continue
        found, parts = text.count(token), len(decoded[kind])
        if found != parts:
            raise MediaError(
                "prompt",
                item,
                f"the rendered prompt has {found} {token} for {parts} {kind} part(s): a text "
                f"part spells out the media token, or the chat template drops {kind} parts",
            )


def _check_no_placeholders(ids: list[int], placeholder_ids: set[int], item: str) -> None:
    if any(i in placeholder_ids for i in ids):
        raise MediaError(
            "prompt", item, "the text spells out a media placeholder token but carries no media"
        )


def _run(
    processor: Any,
    text: str,
    decoded: dict[str, list[Any]],
    video_fps: list[float],
    limits: MediaLimits,
    item: str,
) -> Any:
    kwargs: dict[str, Any] = {"add_special_tokens": False, "return_tensors": "pt"}
    if decoded["image"]:
        kwargs["images"] = decoded["image"]
    if decoded["audio"]:
        expected = getattr(processor.feature_extractor, "sampling_rate", None)
        if expected is not None and int(expected) != limits.sample_rate:
            raise ConfigError(
                f"[data.media] sample_rate is {limits.sample_rate} Hz but the processor's "
                f"feature extractor expects {expected} Hz: set sample_rate = {expected}"
            )
        kwargs["audio"] = decoded["audio"]
        kwargs["audio_kwargs"] = {"sampling_rate": limits.sample_rate}
    if decoded["video"]:
        kwargs["videos"] = decoded["video"]
        videos_kwargs: dict[str, Any] = {"fps": video_fps[0]}
        size = _size_dict(getattr(processor.video_processor, "size", None))
        if size:  # else Qwen processors send their class default, not the saved size
            videos_kwargs["size"] = size
        kwargs["videos_kwargs"] = videos_kwargs
    try:
        out = processor(text=[text], **kwargs)
    except (MediaError, ConfigError):
        raise
    except Exception as exc:
        raise MediaError(
            "prompt", item, f"the processor refused it: {type(exc).__name__}: {exc}"
        ) from exc
    if len(set(video_fps)) > 1:
        _per_video_seconds(processor, out, video_fps)
    return out


def _size_dict(size: Any) -> dict[str, Any] | None:
    if size is None:
        return None
    try:
        return {k: v for k, v in dict(size).items() if v is not None} or None
    except (TypeError, ValueError):
        return None


def _per_video_seconds(processor: Any, out: Any, video_fps: list[float]) -> None:
    """The processor takes one ``fps`` for all videos; give each its own seconds per grid."""
    temporal = getattr(processor.video_processor, "temporal_patch_size", None)
    if not temporal:
        return
    for key in _SECONDS_PER_GRID_KEYS:
        if key in out:
            old = out[key]
            new = [temporal / fps for fps in video_fps]
            out[key] = torch.tensor(new, dtype=old.dtype) if isinstance(old, torch.Tensor) else new


def _first_row(ids: Any, item: str) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.ndim != 2 or ids.shape[0] != 1:
            raise MediaError("prompt", item, f"input_ids of shape {list(ids.shape)}, not [1, n]")
        return ids[0].tolist()
    return list(ids[0])


def _cpu_tensor(value: Any, key: str, item: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
    else:
        try:
            tensor = torch.as_tensor(np.asarray(value))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise MediaError(
                "prompt", item, f"processor output {key!r} is not a tensor ({exc})"
            ) from exc
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise MediaError("prompt", item, f"processor output {key!r} holds NaN or infinity")
    return tensor.contiguous()
