"""Where prompts come from: a JSONL file, a user's generator, or the built-in arithmetic task.

Each prompt is a dict with a stable ``id`` (the group id of its samples, so a retried prompt
regenerates the same uids and the bus deduplicates), the ``prompt`` text and the ``answer``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from relax.errors import ConfigError


def arithmetic_task(seed: int = 0, *, max_operand: int = 9) -> Iterator[dict[str, Any]]:
    """An endless stream of one-digit additions: small models learn the format in minutes."""
    rng = random.Random(seed)
    index = 0
    while True:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        yield {"id": f"arith-{seed}-{index}", "prompt": f"{a}+{b}=", "answer": str(a + b)}
        index += 1


def jsonl_prompts(path: str, prompt_key: str, answer_key: str) -> Iterator[dict[str, Any]]:
    file = Path(path)
    if not file.exists():
        raise ConfigError(f"data.path: no such file {path!r}")
    with file.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if prompt_key not in record:
                raise ConfigError(
                    f"data.prompt_key: line {line_no} of {path} has no {prompt_key!r}"
                )
            yield {
                "id": str(record.get("id", f"{file.stem}-{line_no}")),
                "prompt": record[prompt_key],
                "answer": str(record.get(answer_key, "")),
            }


def prompt_stream(data: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Prompts as the ``[data]`` config section says, repeating a finite source forever."""
    if data.get("path"):
        epoch = 0
        while True:
            for item in jsonl_prompts(data["path"], data["prompt_key"], data["answer_key"]):
                yield {**item, "id": f"{item['id']}@{epoch}"}
            epoch += 1
    if data.get("generator"):
        from relax.actors._build import resolve

        yield from resolve(data["generator"])(seed=data.get("seed", 0))
        return
    yield from arithmetic_task(data.get("seed", 0))


def prompt_row(item: dict[str, Any], tokenizer: Any, max_prompt_tokens: int) -> dict[str, Any]:
    """A stream item as a prompt-bus row (``prompt_ids`` truncated to ``max_prompt_tokens``)."""
    ids = tokenizer.encode(item["prompt"], add_special_tokens=False)[:max_prompt_tokens]
    return {
        "uid": item["id"],
        "group": item["id"],
        "version": 0,
        "columns": {"prompt_ids": ids, "answer": item["answer"], "text": item["prompt"]},
    }
