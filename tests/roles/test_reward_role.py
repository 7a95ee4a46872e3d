"""The reward role's parts: what a dataset row becomes for a reward function, the circuit
breaker, the warning throttle, and the per-component metrics the trainer logs."""

from __future__ import annotations

import json
from pathlib import Path

from relax.errors import RewardFailing, Unrecoverable
from relax.models import build_byte_tokenizer
from relax.rewards import RewardResult
from relax.roles._prompts import file_prompts, prompt_row
from relax.roles._reward import (
    CircuitBreaker,
    WarningThrottle,
    component_metrics,
    reward_columns,
    reward_sample,
)
from relax.roles._rollout import PROMPT_FOR_REWARD

RECORDS = [
    {
        "id": "q0",
        "question": "2+2=",
        "solution": {"value": 4, "unit": None},
        "level": 3,
        "tags": ["easy"],
        "weight": 0.5,
    },
    {"id": "q1", "question": [{"role": "user", "content": "hi"}], "solution": 7, "level": 1},
]


def sample_row(prompt: dict, j: int, response_ids: list[int]) -> dict:
    """A sample-bus row as the rollout builds it from a prompt row."""
    cols = prompt["columns"]
    columns = {
        "prompt_ids": cols["prompt_ids"],
        "response_ids": response_ids,
        "logprobs": [0.0] * len(response_ids),
        "answer": cols["answer"],
        **{name: cols[src] for src, name in PROMPT_FOR_REWARD.items() if src in cols},
    }
    return {"uid": f"{prompt['uid']}/{j}", "group": prompt["uid"], "columns": columns}


def test_a_dataset_row_reaches_the_reward_function_with_its_json_types(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    tok = build_byte_tokenizer()
    items = file_prompts(str(path), "question", "solution")
    text_item, chat_item = next(items), next(items)
    prompt = prompt_row(text_item, tok, 64)
    assert prompt is not None
    sample = reward_sample(sample_row(prompt, 2, tok.encode("4 cm")), tok, "solution")
    assert sample.answer == {"value": 4, "unit": None}  # a dict, not its repr
    assert sample.fields == {
        "id": "q0",
        "solution": {"value": 4, "unit": None},
        "level": 3,
        "tags": ["easy"],
        "weight": 0.5,
    }
    assert sample["level"] == 3 and sample.messages is None
    assert (sample.prompt, sample.response) == ("2+2=", "4 cm")
    assert sample.prompt_ids == tok.encode("2+2=", add_special_tokens=False)
    assert sample.response_ids == tok.encode("4 cm") and sample.response_tokens == 4
    assert (sample.uid, sample.group) == ("q0@0/2", "q0@0")

    chat = prompt_row(chat_item, tok, 256)
    assert chat is not None
    s = reward_sample(sample_row(chat, 0, [65]), tok, "solution")
    assert s.messages == [{"role": "user", "content": "hi"}]
    assert s.answer == 7 and s.fields["level"] == 1
    assert "hi" in s.prompt  # the chat-rendered prompt text


def test_generator_items_and_old_rows_still_make_samples() -> None:
    tok = build_byte_tokenizer()
    # A generator's item: its keys other than id and prompt are the fields.
    row = prompt_row({"id": "g0", "prompt": "1+1=", "answer": "2", "source": "gen"}, tok, 64)
    assert row is not None and row["columns"]["fields"] == {"answer": "2", "source": "gen"}
    # A row from before this contract (no fields, no prompt text): the answer column serves.
    old = {"uid": "a/0", "group": "a", "columns": {"response_ids": [50], "answer": "2"}}
    s = reward_sample(old, tok, "answer")
    assert s.answer == "2" and s.fields == {} and s.prompt == "" and s.response == "2"


def ok(reward: float = 1.0) -> RewardResult:
    return RewardResult(True, reward, {"f": reward})


def failed(error: BaseException | None = None) -> RewardResult:
    errors = {"f": error} if error is not None else {}
    return RewardResult(
        False, None, {}, "python 'f': raised ValueError: boom", {"f": "error"}, errors
    )


def rows(*groups: str) -> list[dict]:
    return [{"uid": f"{g}/{i}", "group": g} for i, g in enumerate(groups)]


def test_circuit_breaker_counts_consecutive_failed_groups() -> None:
    breaker = CircuitBreaker(3)
    # Two groups of two: group a fails (one bad sample is enough), group b is whole.
    breaker.record(rows("a", "a", "b", "b"), [ok(), failed(), ok(), ok()])
    assert breaker.in_a_row == 0 and not breaker.tripped  # b, scored whole, came last
    breaker.record(rows("c", "c", "d", "d"), [failed(), ok(), failed(), failed()])
    assert breaker.in_a_row == 2 and not breaker.tripped
    breaker.record(rows("e"), [ok()])
    assert breaker.in_a_row == 0
    try:
        raise ValueError("boom")
    except ValueError as exc:
        error = exc
    for g in "fgh":
        breaker.record(rows(g, g), [failed(error), failed(error)])
    assert breaker.tripped
    fatal = breaker.error()
    assert isinstance(fatal, RewardFailing) and isinstance(fatal, Unrecoverable)
    assert fatal.failed_groups == 3 and fatal.__cause__ is error
    assert "3 groups in a row" in str(fatal) and "max_failed_groups = 3" in str(fatal)
    assert "raised ValueError: boom" in str(fatal)


def test_circuit_breaker_of_zero_never_trips() -> None:
    breaker = CircuitBreaker(0)
    for _ in range(100):
        breaker.record(rows("a"), [failed()])
    assert breaker.in_a_row == 100 and not breaker.tripped


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []  # warnings
        self.debugs: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields) -> None:
        self.lines.append((event, fields))

    def debug(self, event: str, **fields) -> None:
        self.debugs.append((event, fields))


def test_throttle_logs_a_repeated_warning_once_per_interval_with_a_count() -> None:
    now = [0.0]
    log = Log()
    throttle = WarningThrottle(log, interval=30.0, clock=lambda: now[0])
    for i in range(10_000):
        throttle.warning("same reason", "reward failed", uid=f"u{i}")
    assert len(log.lines) == 1 and log.lines[0][1] == {"uid": "u0"}
    # Each held-back one still names its sample, at debug level.
    assert [f["uid"] for _, f in log.debugs] == [f"u{i}" for i in range(1, 10_000)]
    assert all(f["held_back"] is True for _, f in log.debugs)
    now[0] = 31.0
    throttle.warning("same reason", "reward failed", uid="late")
    assert log.lines[-1][1] == {"uid": "late", "repeated": 9_999}


def test_throttle_limits_distinct_warnings_per_interval() -> None:
    now = [0.0]
    log = Log()
    throttle = WarningThrottle(log, interval=30.0, burst=5, clock=lambda: now[0])
    for i in range(1000):  # a message that differs every time
        throttle.warning(f"boom {i}", "reward failed")
    assert len(log.lines) == 5 and len(log.debugs) == 995
    now[0] = 40.0
    throttle.warning("another", "reward failed")
    assert log.lines[-1][1] == {"not_logged": 995}


def test_component_metrics_are_means_per_component() -> None:
    result = RewardResult(True, 1.5, {"judge/correct": 1.0, "judge/format": 0.5})
    cols = reward_columns(result)
    assert cols == {"reward": 1.5, "reward_components": {"judge/correct": 1.0, "judge/format": 0.5}}
    batch = [
        {"columns": cols},
        {"columns": {"reward": 0.0, "reward_components": {"judge/correct": 0.0}}},
        {"columns": {"reward": 1.0}},  # a row from an episode: no components
    ]
    assert component_metrics(batch) == {"reward/judge/correct": 0.5, "reward/judge/format": 0.5}
