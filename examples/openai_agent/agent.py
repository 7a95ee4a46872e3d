"""An agent that knows nothing of Relax: it only talks to an OpenAI-compatible endpoint.

It asks a sum; when the reply is not a number it asks again (a second turn in the same
conversation). Its reward: 0.5 for answering with a number, 0.5 more when the number is right.
Relax trains the model behind ``base_url`` from the calls this agent makes (see cluster.toml).
"""

from __future__ import annotations

import asyncio
import re
import weakref

import httpx
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

NUMBER = re.compile(r"^\s*(\d+)")

# One connection pool per event loop, shared by every episode: a new OpenAI client builds its
# own (an SSL context and all, ~60 ms of CPU) — more than a short episode's generation.
_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
    weakref.WeakKeyDictionary()
)


def _pool() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    if loop not in _POOLS:
        _POOLS[loop] = DefaultAsyncHttpxClient()
    return _POOLS[loop]


async def solve(base_url: str, api_key: str, task: dict, max_turns: int = 2) -> float:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=_pool())
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(max_turns):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=3, temperature=1.0
        )
        text = reply.choices[0].message.content or ""
        answer = NUMBER.match(text)
        if answer is not None:
            return 0.5 + (0.5 if answer.group(1) == task["answer"] else 0.0)
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Answer with a number."},
        ]
    return 0.0
