"""``[eval.data]`` is checked before anything starts, like ``[data]``, at its own key path."""

from __future__ import annotations

from pathlib import Path

from relax.config import parse_config
from relax.preflight import preflight

MODEL = "[model.init]\n"


def test_a_missing_held_out_file_or_generator_is_named_at_eval_data(tmp_path: Path) -> None:
    missing = tmp_path / "held_out.jsonl"
    on = f'[eval]\nevery_steps = 5\n[eval.data]\npath = "{missing}"\n'
    issues = {i.path: i for i in preflight(parse_config(MODEL + on))}
    assert set(issues) == {"eval.data.path"}, issues
    assert "no such file" in issues["eval.data.path"].message
    missing.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert preflight(parse_config(MODEL + on)) == []
    # Off, the held-out table is not read, so not checked.
    off = on.replace("every_steps = 5", "every_steps = 0")
    missing.unlink()
    assert preflight(parse_config(MODEL + off)) == []

    generator = '[eval]\nevery_steps = 5\n[eval.data]\ngenerator = "no_such_module_x:make"\n'
    issues = {i.path: i for i in preflight(parse_config(MODEL + generator))}
    assert set(issues) == {"eval.data.generator"}, issues
