"""`relax plot` and ``relax.plot``: PNG charts from metrics.jsonl, and a clear error without
matplotlib."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from relax.cli import app
from relax.plot import PlotError, phase_keys, series, staleness, write_plots

PNG = b"\x89PNG\r\n\x1a\n"


def make_run(tmp_path: Path, *, kl: bool = True, phases: bool = True, steps: int = 12) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    records = []
    for step in range(1, steps + 1):
        record = {
            "step": step,
            "applied": step != 5,
            "trainer_version_at_take": step - 1,
            "oldest_row_version": max(0, step - 1 - step % 3),
            "wall_s": 0.5 + 0.01 * step,
            "reward_mean": step / steps,
            "loss": 1.0 / step,
            "policy_loss": 0.5 / step,
            "entropy": 5.0 - step * 0.1,
        }
        if kl:
            record |= {"kl": 0.01 * step, "approx_kl": 0.001 * step}
        if phases:
            record |= {"step_time_s": 0.2, "generate_time_s": 0.25}
        records.append(record)
    records[3]["loss"] = float("nan")  # a non-finite value is left out, not plotted
    text = "\n".join(json.dumps(r) for r in records) + "\n" + '{"step": 13, "appl'
    (run / "metrics.jsonl").write_text(text)
    return run


def test_every_chart_is_written(tmp_path) -> None:
    run = make_run(tmp_path)
    (run / "critic.jsonl").write_text(json.dumps({"applied": True, "value_loss": 0.3}) + "\n")
    written = write_plots(run)
    names = {p.name for p in written}
    assert names == {
        "reward.png",
        "loss.png",
        "kl.png",
        "entropy.png",
        "staleness.png",
        "step_time.png",
        "critic.png",
    }
    for path in written:
        assert path.parent == run / "plots"
        assert path.read_bytes().startswith(PNG) and path.stat().st_size > 5000


def test_charts_only_for_what_the_metrics_hold(tmp_path) -> None:
    run = make_run(tmp_path, kl=False, phases=False)
    names = {p.name for p in write_plots(run, tmp_path / "out")}
    assert "kl.png" not in names and "critic.png" not in names
    assert {"reward.png", "step_time.png", "staleness.png"} <= names
    assert (tmp_path / "out" / "reward.png").exists()


def test_helpers(tmp_path) -> None:
    run = make_run(tmp_path)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()[:12]]
    xs, ys = series(records, "loss")
    assert 4.0 not in xs and len(ys) == 11  # the NaN is skipped
    assert staleness(records[2]) == 0 and staleness(records[4]) == 2
    assert staleness({"step": 1}) is None
    assert phase_keys(records) == ["step_time_s", "generate_time_s"]


def test_no_metrics_is_an_error(tmp_path) -> None:
    run = tmp_path / "empty"
    run.mkdir()
    with pytest.raises(PlotError, match="no metrics"):
        write_plots(run)


def test_without_matplotlib_the_error_names_the_extra(tmp_path, monkeypatch) -> None:
    run = make_run(tmp_path)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    with pytest.raises(PlotError, match=r"relax-rl\[plot\]"):
        write_plots(run)
    result = CliRunner().invoke(app, ["plot", str(run)])
    assert result.exit_code == 1 and "relax-rl[plot]" in result.stderr
    from relax.plot import matplotlib_available

    assert not matplotlib_available()


def test_plot_command(tmp_path) -> None:
    run = make_run(tmp_path)
    runner = CliRunner()
    result = runner.invoke(app, ["plot", str(run), "--out", str(tmp_path / "charts")])
    assert result.exit_code == 0, result.output
    assert "wrote 6 plots" in result.stdout and "reward.png" in result.stdout
    assert (tmp_path / "charts" / "staleness.png").exists()
    missing = runner.invoke(app, ["plot", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "not a run folder" in missing.stderr


def test_compare_draws_another_run_on_the_same_charts(tmp_path) -> None:
    run = make_run(tmp_path)
    alone = {p.name: p.read_bytes() for p in write_plots(run, tmp_path / "alone")}
    other = tmp_path / "counterfactual"
    other.mkdir()
    lines = [{"step": s, "applied": True, "loss": 2.0 / s, "grad_norm": 0.1 * s} for s in (1, 2, 3)]
    (other / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    both = {p.name: p.read_bytes() for p in write_plots(run, tmp_path / "both", compare=[other])}
    assert both["loss.png"] != alone["loss.png"]  # the other run's loss is drawn too
    assert both["staleness.png"] == alone["staleness.png"]  # a histogram: this run only
    result = CliRunner().invoke(
        app, ["plot", str(run), "--out", str(tmp_path / "cli"), "--compare", str(other)]
    )
    assert result.exit_code == 0, result.output
    with pytest.raises(PlotError, match="nowhere has no metrics"):
        write_plots(run, tmp_path / "x", compare=[tmp_path / "nowhere"])
