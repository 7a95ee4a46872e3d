"""The trainer's record (and its ledger and metrics) reconciled on a restart, its frames checked,
its weights digest bit-exact."""

from __future__ import annotations

import json

import pytest
import torch

from relax.replay import Record, RecordError, RecordWriter, drop_unpublished, weights_digest
from relax.replay._record import BATCHES_FILE, RECORD_DIR


def test_unpublished_steps_and_a_torn_line_leave_the_file(tmp_path) -> None:
    path = tmp_path / "trainer-ledger.jsonl"
    lines = [
        {"step": 1, "applied": True, "items": [["a", 1]]},
        {"step": 1, "applied": False, "items": [["b", 1]]},  # a skipped step: consumed, kept
        {"event": "checkpoint", "step": 1},  # not a step: kept
        {"step": 2, "applied": True, "items": [["c", 1]]},  # recorded, never published
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 3, "app')
    assert drop_unpublished(path, published=1) == 2
    text = path.read_text()
    assert text.endswith("\n")  # the next append starts a line of its own
    assert [json.loads(x) for x in text.splitlines()] == lines[:3]
    assert drop_unpublished(path, published=1) == 0  # idempotent


def _write(tmp_path) -> tuple[RecordWriter, list[dict]]:
    writer = RecordWriter(tmp_path)
    writer.config({"trainer": {"lr": 0.1}}, "model")
    writer.start(version=0, checkpoint=None, adopted=None, weights="w0", threads=2, config={"a": 1})
    rows = [
        {"group": "g", "uid": "u1", "reward": 0.5, "response_ids": [1, 2], "logprobs": [-0.1]},
        {"group": "g", "uid": "u2", "reward": 1.0, "routed": torch.arange(6).reshape(1, 2, 3)},
    ]
    writer.step(
        step=1,
        applied=True,
        rows=rows,
        metrics={"loss": 0.25, "step_time_s": 0.1},
        weights="w1",
    )
    return writer, rows


def test_a_record_reads_back_with_its_rows_exactly(tmp_path) -> None:
    _write(tmp_path)
    record = Record.read(tmp_path)
    assert record.config == {"trainer": {"lr": 0.1}} and record.model_dir == "model"
    assert [e["event"] for e in record.events] == ["start", "step"]
    step = record.events[1]
    assert step["metrics"] == {"loss": 0.25}  # timings are not part of the computation
    rows = record.rows(step["batch"])
    assert rows[0] == {
        "group": "g",
        "uid": "u1",
        "reward": 0.5,
        "response_ids": [1, 2],
        "logprobs": [-0.1],
    }
    assert torch.equal(rows[1]["routed"], torch.arange(6).reshape(1, 2, 3))


def test_float_lists_travel_as_float32_and_come_back_as_the_same_floats(tmp_path) -> None:
    writer = RecordWriter(tmp_path)
    logprobs = torch.randn(1000).tolist()  # float32 values, as a bus column gives them
    odd = [0.1, 1 / 3]  # not float32 values: kept as they are
    rows = [{"uid": "u", "logprobs": logprobs, "odd": odd, "ids": list(range(1000))}]
    writer.step(step=1, applied=True, rows=rows, metrics={}, weights=None)
    got = Record(tmp_path / RECORD_DIR, {}, "", []).rows(0)
    assert got == rows and all(type(v) is float for v in got[0]["logprobs"])
    assert (tmp_path / RECORD_DIR / BATCHES_FILE).stat().st_size < 1000 * 4 + 1000 * 3 + 600


def test_a_damaged_frame_is_refused_not_trained(tmp_path) -> None:
    _write(tmp_path)
    path = tmp_path / RECORD_DIR / BATCHES_FILE
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # one flipped bit in the last row's bytes
    path.write_bytes(bytes(data))
    record = Record.read(tmp_path)
    with pytest.raises(RecordError, match="damaged"):
        record.rows(record.events[1]["batch"])


def test_a_folder_without_a_record_says_so(tmp_path) -> None:
    with pytest.raises(RecordError, match=r"trainer\.record"):
        Record.read(tmp_path)


def test_the_weights_digest_sees_one_bit_and_not_the_order() -> None:
    a = {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}
    same = {"b": a["b"].clone(), "w": a["w"].clone()}
    assert weights_digest(a) == weights_digest(same)
    flipped = {k: v.clone() for k, v in a.items()}
    flipped["w"].view(torch.int32)[1, 2] ^= 1
    assert weights_digest(flipped) != weights_digest(a)
    retyped = {"w": a["w"], "b": a["b"].float()}
    assert weights_digest(retyped) != weights_digest(a)
