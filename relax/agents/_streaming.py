"""Streaming one reply as it is sampled: incremental text, and what to hold back.

A streamed reply must add up to the reply the same call returns unstreamed: the text cut
before the first ``stop`` string (OpenAI's rule) and, when tools are on, without the
``<tool_call>`` blocks the reply's message turns into ``tool_calls``. So a piece of text goes
out only when nothing later can take it back:

- text is decoded incrementally (vLLM's offsets: a window of the last tokens is re-decoded,
  so a multi-byte character split over tokens waits for its last byte, and the work per token
  stays constant);
- the longest end of the text that could still grow into a stop string (or ``<tool_call>``)
  is held back until it either does — then the reply's text ends before it — or cannot;
- with tools, leading and trailing whitespace is held back too (a message's content is
  stripped when it carries tool calls), and once a ``<tool_call>`` opens, nothing more of the
  text streams: the calls go out as one ``tool_calls`` delta at the end.

Each piece carries the tokens sampled since the last piece (for their logprobs), so the
logprobs streamed are exactly those of the tokens the reply keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from relax.engines import TokenEvent

TOOL_OPEN = "<tool_call>"


class ChoiceStream:
    """One choice of a streamed call: its tokens so far and how much of them was sent."""

    def __init__(
        self, decode: Callable[[list[int]], str], stops: Sequence[str], tools: bool = False
    ) -> None:
        self._decode = decode
        self._stops = [s for s in stops if s]
        self._tools = tools
        self._markers = [*self._stops, TOOL_OPEN] if tools else list(self._stops)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[tuple[tuple[int, float], ...]] = []
        self._text = ""
        self._prefix = 0
        self._read = 0
        self.sent = ""
        """The text sent so far."""
        self.sent_tokens = 0
        """How many tokens the pieces sent so far covered."""
        self._frozen = False

    def add(self, event: TokenEvent) -> tuple[str, int, int] | None:
        """Take the next token; returns ``(piece, first token, end token)`` to send now."""
        self.ids.append(event.token_id)
        self.logprobs.append(event.logprob)
        self.tops.append(event.top_logprobs)
        if self._frozen:
            return None
        view = self._advance()
        if self._tools:
            view = view.lstrip()
        hits = [view.find(s) for s in self._stops if s in view]
        if hits:
            limit, self._frozen = min(hits), True
        else:
            limit = len(view) - _held(view, self._markers)
        if self._tools:
            at = view.find(TOOL_OPEN)
            if at >= 0:
                limit, self._frozen = min(limit, at), True
            limit = len(view[:limit].rstrip())
        if limit <= len(self.sent) or not view.startswith(self.sent):
            return None
        piece = view[len(self.sent) : limit]
        self.sent += piece
        first, self.sent_tokens = self.sent_tokens, len(self.ids)
        return piece, first, self.sent_tokens

    def finish(self, text: str, kept: int) -> tuple[str, int, int]:
        """What is left to send once the reply is final (``text``, ``kept`` tokens)."""
        rest = text[len(self.sent) :] if text.startswith(self.sent) else ""
        first = self.sent_tokens
        self.sent += rest
        self.sent_tokens = max(kept, first)
        return rest, first, self.sent_tokens

    def _advance(self) -> str:
        """The text of every token so far, decoded incrementally."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
        return self._text


def _held(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that begins one of ``markers`` (and may grow
    into it)."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best
