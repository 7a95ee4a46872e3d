"""``Sample``: everything a reward function may look at for one generated response.

A reward function is called as ``fn(response, sample, **options)`` (or, batched,
``fn(responses, samples, **options)``); ``sample`` is one of these. It is a ``dict`` with typed
read-only properties, so both styles work, and old functions that index it keep working::

    def score(response: str, sample: Sample) -> float:
        return float(response.strip() == sample.answer)      # typed attributes
        return float(response.strip() == sample["answer"])   # or keys, as before

Its keys are the dataset row's own fields (``sample["difficulty"]``, with their JSON types),
then the standard keys ``STANDARD_KEYS``, which win over a row field of the same name
(``sample.fields`` keeps the row as it was). Each call gets its own copy: a function may edit
it without another function (or the next sample) seeing the edit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

STANDARD_KEYS: tuple[str, ...] = (
    "answer",
    "response",
    "response_ids",
    "response_tokens",
    "prompt",
    "messages",
    "prompt_ids",
    "uid",
    "group",
)
"""The keys every ``Sample`` has, besides its row's fields."""


class Sample(dict[str, Any]):
    """One generated response and what it answers (a ``dict``; see the module docstring)."""

    def __init__(
        self,
        *,
        response: str = "",
        answer: Any = None,
        fields: Mapping[str, Any] | None = None,
        prompt: str = "",
        messages: list[dict[str, Any]] | None = None,
        prompt_ids: list[int] | None = None,
        response_ids: list[int] | None = None,
        response_tokens: int | None = None,
        uid: str = "",
        group: str = "",
    ) -> None:
        row = dict(fields or {})
        super().__init__(row)
        self.update(
            answer=answer,
            response=response,
            response_ids=list(response_ids or []),
            response_tokens=response_tokens,
            prompt=prompt,
            messages=messages,
            prompt_ids=list(prompt_ids or []),
            uid=uid,
            group=group,
        )
        self._fields = row

    @property
    def response(self) -> str:
        """The generated text (special tokens removed)."""
        return self["response"]

    @property
    def answer(self) -> Any:
        """The reference answer: the row's ``[data] answer_key`` field with its JSON type (a
        dict answer is a dict), or None when the row has none."""
        return self["answer"]

    @property
    def fields(self) -> dict[str, Any]:
        """Every field of the dataset row except the prompt, with its JSON type (a value JSON
        has no type for, such as a Parquet timestamp, arrives as a string). A generator's items
        give their keys other than ``id`` and ``prompt``."""
        return self._fields

    @property
    def prompt(self) -> str:
        """The prompt as the model saw it: the text, or the chat messages rendered by the chat
        template."""
        return self["prompt"]

    @property
    def messages(self) -> list[dict[str, Any]] | None:
        """The prompt's chat messages when it is a conversation (media parts keep their paths;
        inline media data is replaced by ``"<bytes>"``), else None."""
        return self["messages"]

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt's token ids."""
        return self["prompt_ids"]

    @property
    def response_ids(self) -> list[int]:
        """The response's token ids, exactly as sampled."""
        return self["response_ids"]

    @property
    def response_tokens(self) -> int | None:
        """``len(response_ids)``: the response's length in tokens."""
        return self["response_tokens"]

    @property
    def uid(self) -> str:
        """This sample's unique id (``<prompt id>/<index in its group>``)."""
        return self["uid"]

    @property
    def group(self) -> str:
        """Its group's id: the prompt id every sample of the group shares."""
        return self["group"]

    def copy(self) -> Sample:  # type: ignore[override]
        """A copy whose containers (row fields, messages, id lists) are the caller's own."""
        return Sample(**self._arguments(), fields=dict(self._fields))

    def _arguments(self) -> dict[str, Any]:
        args = {key: self.get(key) for key in STANDARD_KEYS}
        if args["messages"] is not None:
            args["messages"] = list(args["messages"])
        return args

    @classmethod
    def of(
        cls, response: str, sample: Mapping[str, Any], response_tokens: int | None = None
    ) -> Sample:
        """``sample`` with this ``response``: a ``Sample`` keeps its fields; a plain mapping's
        keys become the fields (a standard key such as ``answer`` also sets that attribute)."""
        if isinstance(sample, Sample):
            args, fields = sample._arguments(), sample.fields
        else:
            args = {key: sample[key] for key in STANDARD_KEYS if key in sample}
            fields = {k: v for k, v in sample.items() if k not in STANDARD_KEYS}
        args["response"] = response
        if response_tokens is not None:
            args["response_tokens"] = response_tokens
        return cls(**args, fields=fields)


def json_fields(record: Mapping[str, Any], *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A dataset record's fields as plain JSON-typed data (what the bus carries and a reward
    function receives): str/int/float/bool/None, lists and str-keyed dicts of those; bytes stay
    bytes; anything else (a timestamp, a Decimal, a numpy value) becomes ``str(value)``, or a
    list for an array."""
    return {str(k): _json_value(v, 0) for k, v in record.items() if k not in skip}


def _json_value(value: Any, depth: int) -> Any:
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if depth < 32 and isinstance(value, Mapping):
        return {str(k): _json_value(v, depth + 1) for k, v in value.items()}
    if depth < 32 and isinstance(value, (list, tuple)):
        return [_json_value(v, depth + 1) for v in value]
    if depth < 32 and hasattr(value, "tolist"):  # numpy arrays and scalars
        return _json_value(value.tolist(), depth + 1)
    return str(value)
