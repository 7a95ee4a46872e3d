"""The trainer's ledger is reconciled on restart like its metrics: lines of applied steps above
the published version (updates that never happened) and a line torn by a kill go."""

from __future__ import annotations

import json

from relax.roles._trainer import LEDGER, TrainerRole


def test_unpublished_steps_and_a_torn_line_leave_the_ledger(tmp_path) -> None:
    path = tmp_path / LEDGER
    lines = [
        {"step": 1, "applied": True, "items": [["a", 1]]},
        {"step": 1, "applied": False, "items": [["b", 1]]},  # a skipped step: consumed, kept
        {"step": 2, "applied": True, "items": [["c", 1]]},  # recorded, never published
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 3, "app')
    trainer = object.__new__(TrainerRole)  # only the file logic, no model
    trainer._published = 1
    assert trainer._forget_unpublished_in(path) == 2
    text = path.read_text()
    assert text.endswith("\n")  # the next append starts a line of its own
    assert [json.loads(x) for x in text.splitlines()] == lines[:2]
    assert trainer._forget_unpublished_in(path) == 0  # idempotent
