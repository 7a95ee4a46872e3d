"""Prompt sources: JSONL and Parquet files (epochs, shuffling, ids), length limits."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from relax.errors import ConfigError
from relax.models import build_byte_tokenizer
from relax.roles._prompts import file_prompts, prompt_row, prompt_stream

RECORDS = [{"id": f"q{i}", "question": f"{i}+1=", "solution": i + 1} for i in range(5)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
    return path


def write_parquet(path: Path, records: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet])
def test_a_file_is_served_epoch_after_epoch_with_unique_ids(tmp_path: Path, writer) -> None:
    path = writer(tmp_path / ("data.jsonl" if writer is write_jsonl else "data.parquet"), RECORDS)
    items = list(itertools.islice(file_prompts(str(path), "question", "solution"), 12))
    assert [i["id"] for i in items[:6]] == ["q0@0", "q1@0", "q2@0", "q3@0", "q4@0", "q0@1"]
    assert items[1]["prompt"] == "1+1=" and items[1]["answer"] == "2"
    assert len({i["id"] for i in items}) == 12


def test_shuffling_is_per_epoch_and_reproducible(tmp_path: Path) -> None:
    path = str(write_jsonl(tmp_path / "d.jsonl", [{"p": str(i)} for i in range(20)]))

    def epochs(seed: int) -> list[list[str]]:
        items = list(itertools.islice(file_prompts(path, "p", "a", shuffle=True, seed=seed), 40))
        return [[i["prompt"] for i in items[:20]], [i["prompt"] for i in items[20:]]]

    first, again, other = epochs(0), epochs(0), epochs(1)
    assert first == again and first != other
    assert first[0] != first[1]  # each epoch has its own order
    assert sorted(first[0]) == sorted(first[1]) == sorted(str(i) for i in range(20))


def test_bad_files_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        next(file_prompts(str(tmp_path / "missing.jsonl"), "p", "a"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"p": "x"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"line 2 of .* is not JSON"):
        next(file_prompts(str(bad), "p", "a"))
    with pytest.raises(ConfigError, match=r"data.prompt_key: record 0 .* has no 'question'"):
        next(file_prompts(str(write_jsonl(tmp_path / "d.jsonl", [{"p": 1}])), "question", "a"))


def test_the_stream_follows_the_data_config(tmp_path: Path) -> None:
    path = str(write_jsonl(tmp_path / "d.jsonl", RECORDS))
    data = {"path": path, "prompt_key": "question", "answer_key": "solution", "shuffle": False}
    assert next(prompt_stream(data))["id"] == "q0@0"
    builtin = next(prompt_stream({}))
    assert builtin["prompt"].endswith("=") and builtin["answer"].isdigit()


def test_prompts_over_the_token_limit_are_skipped_not_cut() -> None:
    tokenizer = build_byte_tokenizer()
    item = {"id": "x", "prompt": "12345", "answer": "1"}
    assert prompt_row(item, tokenizer, 4) is None
    row = prompt_row(item, tokenizer, 5)
    assert row is not None and len(row["columns"]["prompt_ids"]) == 5
