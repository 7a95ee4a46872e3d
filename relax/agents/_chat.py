"""Chat turns as token ids, without re-tokenising what the model generated.

The drift problem: render a conversation with the chat template and tokenise it, and the
assistant turns come out as the tokenizer's *canonical* split of their text — not necessarily
the ids the model sampled (a BPE model may sample "ab" as "a"+"b"). Training on the re-tokenised
ids trains on tokens the policy never produced, with log-probs that belong to other tokens.

So a multi-turn trajectory is built token-in/token-out: the first prompt is rendered once; after
that, the model's ids are kept exactly and only the *new* turns (tool results, user replies) are
rendered and tokenised, as the text the template puts between the end of the model's reply and
the start of its next one (:func:`continuation_ids`).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from relax.errors import ChatFormatError

Message = dict[str, Any]

# A stand-in assistant reply: the continuation is rendered after a fixed dummy conversation so
# that templates which restyle earlier turns (thinking blocks, tool-call formats) cannot
# change it; the marker locates where the template closes the assistant turn.
_MARK = "\x00relax-reply\x00"
_DUMMY: list[Message] = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def content_text(content: Any) -> str:
    """A message's content as text: a string, ``None`` (empty) or OpenAI content parts
    (``[{"type": "text", "text": ...}, ...]``, concatenated)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatFormatError(f"content part of type {kind!r} is not supported here")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ChatFormatError(f"message content must be a string or a list of parts, not {content!r}")


def plain_messages(messages: Sequence[Message]) -> list[Message]:
    """Messages with text content, ready for a chat template (tool calls kept)."""
    out = []
    for m in messages:
        plain = {k: v for k, v in m.items() if v is not None}
        plain["content"] = content_text(m.get("content"))
        out.append(plain)
    return out


def render(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The chat template's text for ``messages``."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatFormatError("the tokenizer has no chat template; send a plain-text prompt")
    try:
        return tokenizer.apply_chat_template(
            plain_messages(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    except ChatFormatError:
        raise
    except Exception as exc:  # jinja errors name the template problem
        raise ChatFormatError(f"the chat template cannot render these messages: {exc}") from None


def encode(tokenizer: Any, text: str) -> list[int]:
    """``text`` as ids, with no BOS/EOS added (the template writes the specials it wants)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompt_ids(
    tokenizer: Any, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None
) -> list[int]:
    """The ids the model is prompted with for a fresh conversation."""
    return encode(tokenizer, render(tokenizer, messages, tools=tools))


def continuation_ids(
    tokenizer: Any, reply_ids: Sequence[int], new_messages: Sequence[Message]
) -> list[int]:
    """The ids that follow the model's reply ``reply_ids`` when ``new_messages`` (tool results,
    a user turn) come next, up to the start of the model's next reply.

    That is the rest of the template's closing of the assistant turn (whatever part the model
    did not generate itself, e.g. the newline after ChatML's ``<|im_end|>``, or the whole
    end-of-turn when the reply was cut by ``max_tokens``), the new turns, and the generation
    prompt. The reply's own ids are never re-tokenised.
    """
    generated = tokenizer.decode(list(reply_ids), skip_special_tokens=False)
    text = continuation_text(
        lambda messages, gen: render(tokenizer, messages, add_generation_prompt=gen),
        generated,
        new_messages,
    )
    return encode(tokenizer, text)


def continuation_text(
    render_fn: Callable[[list[Message], bool], str],
    generated: str,
    new_messages: Sequence[Message],
) -> str:
    """The text of :func:`continuation_ids`: ``render_fn(messages, add_generation_prompt)`` is
    the chat template; ``generated`` is the model's reply as text (special tokens kept)."""
    base = render_fn(list(_DUMMY), False)
    full = render_fn([*_DUMMY, *new_messages], True)
    if _MARK not in base or not full.startswith(base):
        raise ChatFormatError("the chat template does not render turns as an append-only log")
    closing = base[base.index(_MARK) + len(_MARK) :]
    # The part of the closing the model already wrote: the longest suffix of its reply that
    # starts the closing (usually its end-of-turn token).
    done = next(
        (
            k
            for k in range(min(len(closing), len(generated)), 0, -1)
            if generated.endswith(closing[:k])
        ),
        0,
    )
    return closing[done:] + full[len(base) :]


@dataclass
class ToolCall:
    """One function call the model wrote, in OpenAI's shape."""

    name: str
    arguments: str
    """JSON text of the arguments (as OpenAI sends them)."""
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split a reply into its text and the tool calls it makes.

    A call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the Hermes/Qwen
    format the byte tokenizer's template also renders). A block that is not valid JSON with a
    string ``name`` stays in the text: the model did not make a call, and the agent sees what
    it wrote.
    """
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            data = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            continue
        arguments = data.get("arguments", {})
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
        calls.append(ToolCall(data["name"], arguments))
        kept.append(text[last : match.start()])
        last = match.end()
    kept.append(text[last:])
    return "".join(kept).strip() if calls else text, calls


def cut_at_stop(tokenizer: Any, ids: Sequence[int], stops: Sequence[str]) -> tuple[int, str, bool]:
    """Where a stop string ends a reply: ``(tokens kept, text before the stop, stopped)``.

    Tokens are kept up to and including the one that completes the first stop string (the
    policy did sample it); the text excludes the stop string, as OpenAI's does.
    """
    text = tokenizer.decode(list(ids), skip_special_tokens=True)
    hits = [(text.find(s), s) for s in stops if s and s in text]
    if not hits:
        return len(ids), text, False
    at, stop = min(hits)
    end = at + len(stop)
    for k in range(1, len(ids) + 1):
        if len(tokenizer.decode(list(ids[:k]), skip_special_tokens=True)) >= end:
            return k, text[:at], True
    return len(ids), text[:at], True
