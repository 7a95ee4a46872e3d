"""Turns with images, audio or video in a token-in/token-out episode.

A media item becomes placeholder tokens in the sequence plus the processor's tensors for it
(``relax.media.process_prompt``); the model reads item ``k``'s features into the ``k``-th run
of placeholders. So an episode keeps one sequence and one growing set of tensors: the opening
is processed as a whole prompt; an observation with media is processed as its continuation only
(the glue after the model's reply, the new turns, the generation prompt — the text
``continuation_ids`` tokenises, with the processor's chat template rendering the media parts)
and its tensors are appended to the episode's (``merge_media``). The model's replies stay the
ids it sampled. Multimodal rotary positions (M-RoPE) need no bookkeeping: the model computes
them from the whole sequence and all its media on every forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from relax.agents._chat import ChatFormatError, Message, continuation_text
from relax.engines import MediaInputs
from relax.media import MediaLimits, ProcessedPrompt, placeholder_ids, process_prompt
from relax.models import collate_mm_inputs


def media_prompt(
    processor: Any, messages: Sequence[Message], limits: MediaLimits, *, item: str
) -> ProcessedPrompt:
    """The opening of an episode, media decoded and processed once."""
    return process_prompt(processor, list(messages), limits, item=item)


def media_continuation(
    processor: Any,
    reply_ids: Sequence[int],
    new_messages: Sequence[Message],
    limits: MediaLimits,
    *,
    item: str,
) -> ProcessedPrompt:
    """What follows the model's reply ``reply_ids`` when ``new_messages`` (with media parts)
    come next: ``prompt_ids`` are the continuation's ids (placeholders expanded, as
    ``continuation_ids`` would give for text), ``mm_inputs`` the new items' tensors only.
    Raises ``relax.media.MediaError`` for a bad item, ``ChatFormatError`` for a template that
    cannot render the turns."""
    tokenizer = getattr(processor, "tokenizer", None) or processor
    generated = tokenizer.decode(list(reply_ids), skip_special_tokens=False)

    def render_fn(messages: list[Message], add_generation_prompt: bool) -> str:
        try:
            text = processor.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as exc:  # jinja errors name the template problem
            raise ChatFormatError(
                f"the processor's chat template cannot render these messages: {exc}"
            ) from None
        if isinstance(text, list) and len(text) == 1:
            text = text[0]
        if not isinstance(text, str):
            raise ChatFormatError(f"the processor's chat template gave a {type(text).__name__}")
        return text

    return process_prompt(
        processor,
        list(new_messages),
        limits,
        item=item,
        render=lambda rendered: continuation_text(render_fn, generated, rendered),
    )


def spelled_placeholders(processor: Any, ids: Sequence[int]) -> int:
    """How many of ``ids`` are media placeholders (text that spells out ``<|IMAGE|>`` gives
    one with no item behind it; the engine would refuse the whole sequence)."""
    if processor is None:
        return 0
    banned = placeholder_ids(processor)
    return sum(1 for i in ids if i in banned)


def merge_media(held: MediaInputs | None, new: MediaInputs | None) -> MediaInputs | None:
    """An episode's media tensors with ``new`` items appended after ``held`` (each key
    concatenated along its item axis, audio frames padded as ``collate_mm_inputs`` does for a
    batch — the one way engine and trainer both read them). ``None`` while there is none."""
    merged = collate_mm_inputs([held, new])
    return merged or None
