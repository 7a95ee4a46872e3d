"""Where prompts come from: a JSONL or Parquet file, a user's generator, or the built-in arithmetic task.

Each prompt is a dict with a stable ``id`` (the group id of its samples, so a retried prompt
regenerates the same uids and the bus deduplicates), the ``prompt`` (text, or chat messages
whose content parts may hold images, audio and video) and the ``answer``.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from relax.agents import prompt_ids as agent_prompt_ids
from relax.agents import render
from relax.errors import ConfigError
from relax.media import MediaError, has_media, process_prompt
from relax.rewards import json_fields
from relax.schema import MEDIA_TOKENS, MM_INPUTS, PROMPT_IDS, TEXT


def arithmetic_task(seed: int = 0, *, max_operand: int = 9) -> Iterator[dict[str, Any]]:
    """An endless stream of one-digit additions: small models learn the format in minutes."""
    rng = random.Random(seed)
    index = 0
    while True:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        yield {"id": f"arith-{seed}-{index}", "prompt": f"{a}+{b}=", "answer": str(a + b)}
        index += 1


def file_records(path: str) -> list[dict[str, Any]]:
    """Every record of a JSON Lines (``.jsonl``/``.json``) or Parquet (``.parquet``) file."""
    file = Path(path)
    if not file.exists():
        raise ConfigError(f"data.path: no such file {path!r}")
    if file.suffix.lower() == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(
                f"data.path: reading {path!r} needs pyarrow (pip install 'relax-rl[parquet]')"
            ) from None
        return pq.read_table(file).to_pylist()
    records = []
    with file.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"data.path: line {line_no} of {path} is not JSON: {exc}"
                ) from None
    return records


_MEDIA_PARTS = ("image", "audio", "video")


def anchored(prompt: Any, folder: Path) -> Any:
    """``prompt`` with relative media file paths made relative to the data file's ``folder``
    (where a dataset keeps its images), not to wherever the run was started."""
    if not isinstance(prompt, list):
        return prompt
    out = []
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                source = part.get(kind) if kind in _MEDIA_PARTS else None
                if isinstance(source, str) and not source.startswith(("data:", "file://", "/")):
                    part = {**part, kind: str(folder / source)}
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out


def file_prompts(
    path: str, prompt_key: str, answer_key: str, *, shuffle: bool = False, seed: int = 0
) -> Iterator[dict[str, Any]]:
    """The file's prompts forever, epoch after epoch (reshuffled each epoch when ``shuffle``).

    A record's id is its ``id`` field, or its position in the file; the epoch is appended, so
    every prompt served has a unique, reproducible id.
    """
    records = file_records(path)
    items = []
    for index, record in enumerate(records):
        if prompt_key not in record:
            raise ConfigError(f"data.prompt_key: record {index} of {path} has no {prompt_key!r}")
        answer = record.get(answer_key, "")
        items.append(
            {
                "id": str(record.get("id", f"{Path(path).stem}-{index}")),
                "prompt": anchored(record[prompt_key], Path(path).resolve().parent),
                "answer": "" if answer is None else str(answer),
                # The row's own fields, JSON-typed, for reward functions (relax.rewards.Sample).
                "fields": json_fields(record, skip=(prompt_key,)),
            }
        )
    if not items:
        raise ConfigError(f"data.path: {path} has no records")
    for epoch in itertools.count():
        order = list(range(len(items)))
        if shuffle:
            random.Random(f"{seed}:{epoch}").shuffle(order)
        for i in order:
            yield {**items[i], "id": f"{items[i]['id']}@{epoch}"}


def prompt_stream(data: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Prompts as the ``[data]`` config section says (a finite file repeats forever)."""
    if data.get("path"):
        yield from file_prompts(
            data["path"],
            data["prompt_key"],
            data["answer_key"],
            shuffle=data.get("shuffle", False),
            seed=data.get("seed", 0),
        )
        return
    if data.get("generator"):
        from relax.importpath import load

        yield from load(data["generator"])(seed=data.get("seed", 0))
        return
    yield from arithmetic_task(data.get("seed", 0))


def prompt_row(
    item: dict[str, Any],
    tokenizer: Any,
    max_prompt_tokens: int,
    *,
    processor: Any = None,
    limits: Any = None,
) -> dict[str, Any] | None:
    """A stream item as a prompt-bus row; ``None`` when the prompt is longer than
    ``max_prompt_tokens`` (skipped: a cut prompt would ask a different question).

    The prompt is text (encoded as is) or chat messages (rendered with the chat template). A
    prompt with images, audio or video is decoded once, within ``limits``, and run through the
    model's ``processor`` once: the row carries its ``prompt_ids`` (media placeholders
    included, so they count against ``max_prompt_tokens``) and the processed ``mm_inputs`` the
    rollout generates with and the trainer trains with. Bad media raise ``MediaError``.
    """
    prompt = item["prompt"]
    columns: dict[str, Any] = {"answer": item["answer"]}
    # What reward functions see besides the response: the row's other fields (a file's record,
    # a generator's item) with their JSON types, and the chat messages of a conversation.
    fields = item.get("fields")
    columns["fields"] = (
        json_fields(fields)
        if isinstance(fields, dict)
        else json_fields(item, skip=("id", "prompt"))
    )
    if isinstance(prompt, list):
        columns["messages"] = plain_messages(prompt)
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        columns[TEXT] = prompt
    elif has_media(prompt) or processor is not None:
        if processor is None:
            raise MediaError(
                "prompt", item["id"], "it has media, but the model has no processor for them"
            )
        processed = process_prompt(processor, prompt, limits, item=str(item["id"]))
        ids = processed.prompt_ids
        columns[TEXT] = processed.text
        if processed.mm_inputs:
            columns[MM_INPUTS] = processed.mm_inputs
            columns[MEDIA_TOKENS] = processed.media_tokens
    else:
        ids = agent_prompt_ids(tokenizer, prompt)
        columns[TEXT] = render(tokenizer, prompt)
    if len(ids) > max_prompt_tokens:
        return None
    columns[PROMPT_IDS] = list(ids)
    return {"uid": item["id"], "group": item["id"], "version": 0, "columns": columns}


def plain_messages(prompt: list[Any]) -> list[Any]:
    """Chat messages as small plain data: inline media (bytes, arrays) become ``"<bytes>"``;
    paths and text stay (the processed media travel separately, as ``mm_inputs``)."""

    def plain(value: Any, depth: int) -> Any:
        if isinstance(value, (bytes, bytearray, memoryview)) or hasattr(value, "tolist"):
            return "<bytes>"
        if depth < 16 and isinstance(value, dict):
            return {str(k): plain(v, depth + 1) for k, v in value.items()}
        if depth < 16 and isinstance(value, (list, tuple)):
            return [plain(v, depth + 1) for v in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        return str(value)

    return plain(prompt, 0)
