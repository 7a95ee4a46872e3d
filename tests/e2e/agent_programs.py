"""Agent programs for the e2e tests: they know only the `openai` client."""

from __future__ import annotations

import asyncio
import json
import re
import weakref

from openai import AsyncOpenAI, DefaultAsyncHttpxClient, OpenAI

# A connection pool per event loop, as examples/openai_agent/agent.py keeps (a client of its
# own per episode costs ~60 ms of CPU to build).
_pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _log(path: str, base_url: str, reply) -> None:
    extra = reply.model_extra or {}
    record = {
        "session": base_url.split("/sessions/")[1].split("/v1")[0],
        "token_ids": [c.model_extra["token_ids"] for c in reply.choices],
        "version": extra.get("relax", {}).get("version"),
    }
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


async def ask_twice(base_url: str, api_key: str, task: dict, log: str) -> float:
    """Two turns: ask, then ask to answer with a number; reward for a number."""
    pool = _pools.setdefault(asyncio.get_running_loop(), DefaultAsyncHttpxClient())
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=pool)
    messages = [{"role": "user", "content": task["prompt"]}]
    text = ""
    for _ in range(2):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=3
        )
        _log(log, base_url, reply)
        text = reply.choices[0].message.content or ""
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Answer with a number."},
        ]
    return 1.0 if re.match(r"\s*\d", text) else 0.0


def sync_agent_that_sometimes_fails(base_url: str, api_key: str, task: dict, log: str) -> float:
    """A sync program (run in a thread): one call, then it raises for some tasks."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = client.completions.create(model="policy", prompt=task["prompt"], max_tokens=2)
    _log(log, base_url, reply)
    if task["id"].endswith(("1", "4", "7")):
        raise RuntimeError("the agent tripped")
    return float(bool(re.match(r"\s*\d", reply.choices[0].text)))
