"""Where an evaluation record ([eval], ``RUN_DIR/eval.jsonl``) shows up: the Prometheus gauges,
`relax status` (plain text; the TUI uses the same line), and `relax plot`'s ``eval.png``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.cli._status_text import eval_summary, plain_snapshot
from relax.observe import EVAL_FILE, last_eval, render
from relax.plot import matplotlib_available, write_plots

RECORDS = [
    {"step": 0, "version": 0, "eval/mean_reward": 0.1, "eval/pass@1": 0.1, "eval/pass@k": 0.3,
     "eval/k": 4.0, "eval/skipped_versions": 0.0},
    {"step": 10, "version": 10, "eval/mean_reward": 0.9, "eval/pass@1": 0.85, "eval/pass@k": 1.0,
     "eval/k": 4.0, "eval/skipped_versions": 2.0},
]  # fmt: skip


def run_folder(tmp_path: Path, *, torn: bool = False) -> Path:
    lines = [json.dumps(r) for r in RECORDS]
    text = "\n".join(lines) + "\n" + ('{"step": 2' if torn else "")
    (tmp_path / EVAL_FILE).write_text(text)
    return tmp_path


def test_last_eval_is_the_newest_whole_record(tmp_path) -> None:
    assert last_eval(tmp_path) is None  # no evaluation yet
    assert last_eval(run_folder(tmp_path, torn=True)) == RECORDS[-1]


def test_prometheus_serves_the_newest_evaluation(tmp_path) -> None:
    text = render({"run_dir": str(run_folder(tmp_path)), "cluster": "c"}).decode()
    assert "relax_eval_version 10.0" in text
    assert "relax_eval_mean_reward 0.9" in text
    assert "relax_eval_pass_k 1.0" in text
    assert "relax_eval_skipped_versions 2.0" in text


def test_status_shows_the_newest_evaluation(tmp_path) -> None:
    line = eval_summary(RECORDS[-1])
    assert line == "eval version 10 · reward 0.9 · pass@1 0.85 · pass@4 1 · 2 due versions skipped"
    assert line in plain_snapshot({"run_dir": str(run_folder(tmp_path))}).splitlines()
    assert "eval version" not in plain_snapshot({"run_dir": str(tmp_path / "none")})


@pytest.mark.skipif(not matplotlib_available(), reason="matplotlib is not installed")
def test_plot_draws_the_eval_chart(tmp_path) -> None:
    run = run_folder(tmp_path)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    assert run / "plots" / "eval.png" in write_plots(run)
