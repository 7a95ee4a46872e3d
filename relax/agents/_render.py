"""The agent endpoint's answers in OpenAI's shapes: response bodies and Server-Sent Events.

``relax.agents._server`` is the HTTP side (routes, auth, errors, sessions, sampling); this
module turns a call's generations into what OpenAI's API returns for it: each generation cut
at the request's stop strings and (chat, tools on) parsed into tool calls (``Render.choices``),
then one JSON body for the whole call (``Render.response``) or, streamed, one chunk per piece
of text as tokens are sampled (``SseStream``; what may be sent when is
``relax.agents._streaming``'s). Chat and completions differ only in a few fields (``message``
vs ``text``, the logprobs' layout, the object names); both routes share one path here.

Beyond OpenAI's shapes, a body carries ``relax: {"version", "session"}``, the
``prompt_token_ids`` it was sampled from and, per choice, the kept ``token_ids`` and their
``token_versions``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from aiohttp import web

from relax.agents._chat import cut_at_stop, parse_tool_calls
from relax.agents._protocol import ChatRequest, CompletionRequest
from relax.agents._sessions import Choice
from relax.agents._streaming import ChoiceStream
from relax.engines import Generation, SamplingParams, TokenEvent

TopLogprobs = list[list[tuple[int, float]]]


@dataclass
class Call:
    """One generation call as the routes, the renderer and the stream see it."""

    kind: Literal["chat", "completions"]
    body: ChatRequest | CompletionRequest
    logprobs: bool
    """Whether the answer carries logprobs."""
    top: int
    """How many most likely tokens each logprob entry lists."""
    tools: bool
    """Whether tool calls are parsed out of the replies."""
    prompt: list[int] = field(default_factory=list)
    params: SamplingParams | None = None
    """What is sampled (set once the prompt, and so the token budget, is known)."""
    param: str = "messages"
    """The request field an engine's refusal of the prompt is blamed on."""

    @property
    def chat(self) -> bool:
        return self.kind == "chat"

    @property
    def n(self) -> int:
        return self.body.n or 1


class Render:
    """Renders calls of the model ``model_name`` whose ids ``tokenizer`` decodes."""

    def __init__(self, tokenizer: Any, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name

    # ------------------------------------------------------------------ text

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids]

    def cut(self, gen: Generation, stops: list[str]) -> tuple[list[int], list[float], str, str]:
        """A generation cut at the first stop string: kept ids, logprobs, text, finish reason."""
        ids = gen.response_ids
        if stops:
            kept, text, stopped = cut_at_stop(self.tokenizer, ids, stops)
        else:
            kept, text, stopped = len(ids), self.decode(ids), False
        return ids[:kept], gen.logprobs[:kept], text, "stop" if stopped else gen.finish_reason

    def choices(self, call: Call, gens: list[Generation]) -> tuple[list[Choice], list[str]]:
        """Each generation as the reply it is: cut at stop strings, tool calls parsed."""
        choices, finishes = [], []
        for gen in gens:
            ids, logprobs, text, finish = self.cut(gen, call.body.stop)
            tops = gen.top_logprobs[: len(ids)] if gen.top_logprobs is not None else None
            if call.chat:
                content, calls = parse_tool_calls(text) if call.tools else (text, [])
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    message["content"] = content or None
                    message["tool_calls"] = [c.openai() for c in calls]
                    finish = "tool_calls"
                choices.append(Choice(gen, ids, logprobs, message=message, top_logprobs=tops))
            else:
                choices.append(Choice(gen, ids, logprobs, text=text, top_logprobs=tops))
            finishes.append(finish)
        return choices, finishes

    # ------------------------------------------------------------------ pieces of a body

    def head(self, call: Call) -> dict[str, Any]:
        """The fields every response object (and stream chunk) of one call starts with."""
        return {
            "id": f"{'chatcmpl' if call.chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": self.model_name,
        }

    def logprobs(self, call: Call, choice: Choice, start: int, end: int, offset: int = 0) -> Any:
        """The ``logprobs`` of tokens ``start:end`` of a reply, as the call's route lays them
        out (``None`` when the call asked for none)."""
        if not call.logprobs:
            return None
        if call.chat:
            return {"content": self._chat_logprobs(choice, start, end)}
        return self._completion_logprobs(choice, start, end, call.top, offset)

    def _logprob_entry(self, token: int, logprob: float) -> dict[str, Any]:
        s = self.token_strings([token])[0]
        return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

    def _chat_logprobs(self, choice: Choice, start: int, end: int) -> list[dict[str, Any]]:
        """OpenAI's ``logprobs.content`` of tokens ``start:end`` of a reply."""
        tops = choice.top_logprobs
        out = []
        for t in range(start, end):
            entry = self._logprob_entry(choice.ids[t], choice.logprobs[t])
            entry["top_logprobs"] = (
                [self._logprob_entry(i, v) for i, v in tops[t]] if tops is not None else []
            )
            out.append(entry)
        return out

    def _completion_logprobs(
        self, choice: Choice, start: int, end: int, top: int, offset: int = 0
    ) -> dict[str, Any]:
        """OpenAI's completions ``logprobs`` of tokens ``start:end``: ``top_logprobs`` holds
        the ``top`` most likely tokens and, as OpenAI's does, the sampled one."""
        ids = choice.ids[start:end]
        tokens = self.token_strings(ids)
        offsets = [offset + len(self.decode(ids[:k])) for k in range(len(ids))]
        tops = None
        if top > 0 and choice.top_logprobs is not None:
            tops = []
            for t, (token, lp) in enumerate(zip(tokens, choice.logprobs[start:end], strict=True)):
                entry: dict[str, float] = {}
                for i, v in choice.top_logprobs[start + t]:
                    entry.setdefault(self.token_strings([i])[0], v)
                entry.setdefault(token, lp)
                tops.append(entry)
        return {
            "tokens": tokens,
            "token_logprobs": list(choice.logprobs[start:end]),
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    @staticmethod
    def versions(gen: Generation, kept: int) -> dict[str, Any]:
        """A choice's ``token_versions`` (nothing when the engine does not track them)."""
        if gen.token_versions is None:
            return {}
        return {"token_versions": list(gen.token_versions[:kept])}

    # ------------------------------------------------------------------ whole bodies

    def response(
        self,
        call: Call,
        choices: list[Choice],
        finishes: list[str],
        usage: dict[str, int],
        relax: dict[str, Any],
    ) -> dict[str, Any]:
        """The unstreamed answer of a call: ``chat.completion`` or ``text_completion``."""
        out = []
        for i, (choice, finish) in enumerate(zip(choices, finishes, strict=True)):
            reply = {"message": choice.message} if call.chat else {"text": choice.text}
            out.append(
                {
                    "index": i,
                    **reply,
                    "finish_reason": finish,
                    "logprobs": self.logprobs(call, choice, 0, len(choice.ids)),
                    "token_ids": choice.ids,
                    **self.versions(choice.generation, len(choice.ids)),
                }
            )
        return {
            **self.head(call),
            "object": "chat.completion" if call.chat else "text_completion",
            "choices": out,
            "usage": usage,
            "relax": relax,
            "prompt_token_ids": call.prompt,
        }


def relax_fields(session_id: str | None, gens: list[Generation], serving: int) -> dict[str, Any]:
    """A body's ``relax`` object: the oldest version that sampled it (``serving`` when it has
    no generation) and its session."""
    return {"version": min((g.version for g in gens), default=serving), "session": session_id}


async def send_event(response: web.StreamResponse, data: dict[str, Any] | str) -> None:
    """One Server-Sent Event (``data: ...``; a dict as compact JSON)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    await response.write(f"data: {text}\n\n".encode())


class SseStream:
    """The Server-Sent Events of one streamed call, sent as its tokens are sampled.

    The response opens (``open_response``) with the first token, so a call refused before any
    token is sampled is still an ordinary error answer; ``fail`` after that sends an ``error``
    event (the ``openai`` client raises it) closing the stream.
    """

    def __init__(
        self,
        render: Render,
        call: Call,
        session_id: str | None,
        serving: int,
        open_response: Callable[[], Awaitable[web.StreamResponse]],
    ) -> None:
        self.render, self.call = render, call
        self._open_response = open_response
        self.response: web.StreamResponse | None = None
        """The HTTP response, once the stream has opened."""
        self._streams = [
            ChoiceStream(render.decode, call.body.stop, call.tools) for _ in range(call.n)
        ]
        self._base = {
            **render.head(call),
            "object": "chat.completion.chunk" if call.chat else "text_completion",
            "relax": {"version": serving, "session": session_id},
            "prompt_token_ids": call.prompt,
        }
        options = call.body.stream_options
        self._include_usage = bool(options and options.include_usage)
        if self._include_usage:
            self._base["usage"] = None
        self._offsets = [0] * call.n

    def _chunk(self, i: int, **fields: Any) -> dict[str, Any]:
        choice = {"index": i, "finish_reason": None, "logprobs": None, **fields}
        return {**self._base, "choices": [choice]}

    async def opened(self) -> web.StreamResponse:
        """The HTTP response, opened (with chat's role deltas) on first use."""
        if self.response is None:
            self.response = await self._open_response()
            if self.call.chat:
                for i in range(self.call.n):
                    delta = {"role": "assistant", "content": ""}
                    await send_event(self.response, self._chunk(i, delta=delta))
        return self.response

    def _piece(
        self,
        i: int,
        piece: str,
        start: int,
        end: int,
        ids: list[int],
        lps: list[float],
        tops: TopLogprobs | None,
    ) -> dict[str, Any]:
        """The chunk of choice ``i`` carrying ``piece`` and the logprobs of ``start:end``."""
        partial = Choice(None, ids, lps, top_logprobs=tops)  # type: ignore[arg-type]
        scored = self.render.logprobs(self.call, partial, start, end, self._offsets[i])
        if self.call.chat:
            return self._chunk(i, delta={"content": piece}, logprobs=scored)
        self._offsets[i] += len(piece)
        return self._chunk(i, text=piece, logprobs=scored)

    async def on_event(self, event: TokenEvent) -> None:
        """Hear one sampled token: send the text it completes, if any may go out yet."""
        out = await self.opened()
        state = self._streams[event.sequence]
        sent = state.add(event)
        if sent is not None:
            piece, start, end = sent
            tops = cast(TopLogprobs, state.tops) if self.call.top else None
            data = self._piece(event.sequence, piece, start, end, state.ids, state.logprobs, tops)
            await send_event(out, data)

    async def fail(self, error: dict[str, Any]) -> None:
        """End an opened stream with an ``error`` event (OpenAI's error object)."""
        assert self.response is not None
        await send_event(self.response, {"error": error})
        await self.response.write_eof()

    async def finish(
        self, choices: list[Choice], finishes: list[str], usage: dict[str, int]
    ) -> None:
        """On the opened stream: send what the tokens streamed so far held back, each
        choice's finish, the usage (when asked) and ``[DONE]``."""
        call, out = self.call, self.response
        assert out is not None
        for i, (choice, finish) in enumerate(zip(choices, finishes, strict=True)):
            message = choice.message or {}
            text = (message.get("content") or "") if call.chat else (choice.text or "")
            rest, start, end = self._streams[i].finish(text, len(choice.ids))
            if rest or (call.logprobs and end > start):
                data = self._piece(
                    i, rest, start, end, choice.ids, choice.logprobs, choice.top_logprobs
                )
                await send_event(out, data)
            calls = message.get("tool_calls")
            if calls:
                deltas = [{"index": j, **c} for j, c in enumerate(calls)]
                await send_event(out, self._chunk(i, delta={"tool_calls": deltas}))
            last = {"delta": {}} if call.chat else {"text": ""}
            await send_event(
                out,
                self._chunk(
                    i,
                    **last,
                    finish_reason=finish,
                    token_ids=choice.ids,
                    **self.render.versions(choice.generation, len(choice.ids)),
                ),
            )
        if self._include_usage:
            await send_event(out, {**self._base, "choices": [], "usage": usage})
        await send_event(out, "[DONE]")
        await out.write_eof()
