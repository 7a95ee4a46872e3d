"""`relax replay` re-executes a run's trainer from its record bit for bit, at every staleness;
a record that does not match what the trainer computes is caught at its first differing value;
`--set` trains the recorded data another way into a folder of its own.

(Runs whose roles were SIGKILLed replay identically too: ``tests/e2e/test_faults.py``; a
stopped and resumed run: ``tests/e2e/test_up.py``.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from relax import cluster
from relax.config import load_config
from relax.replay import RECORD_DIR, Record, RecordError, replay

pytestmark = [pytest.mark.anyio]
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "digits" / "cluster.toml"
STEPS = 8


async def _run(run_dir: Path, *overrides: str) -> Path:
    cfg = load_config(RECIPE, overrides=[f"trainer.steps={STEPS}", *overrides])
    await cluster.run(cfg, run_dir)
    return run_dir


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("staleness", ["0", "1", '"inf"'])
async def test_a_run_replays_bit_for_bit(tmp_path: Path, staleness: str) -> None:
    run = await _run(tmp_path / "run", f"staleness={staleness}")
    report = replay(run)
    assert report.identical, report.divergences[:3]
    assert report.steps == report.applied == STEPS and report.restarts == 0
    # Every step's loss, grad norm, other metrics and weights digest, and each start's.
    assert report.compared > STEPS * 10
    replayed, original = _metrics(report.out_dir), _metrics(run)
    assert [r["loss"] for r in replayed] == [r["loss"] for r in original]
    assert [r["grad_norm"] for r in replayed] == [r["grad_norm"] for r in original]
    assert report.out_dir == run / "replays" / "replay-1"
    assert json.loads((report.out_dir / "replay.json").read_text())["identical"] is True


async def test_a_record_the_trainer_does_not_reproduce_is_caught_where_it_differs(
    tmp_path: Path,
) -> None:
    run = await _run(tmp_path / "run")
    events = run / RECORD_DIR / "events.jsonl"
    lines = [json.loads(x) for x in events.read_text().splitlines()]
    third = next(e for e in lines if e["event"] == "step" and e["step"] == 3)
    third["metrics"]["loss"] = third["metrics"]["loss"] + 1e-12  # one value, a hair off
    fifth = next(e for e in lines if e["event"] == "step" and e["step"] == 5)
    fifth["weights"] = "0" * 32
    events.write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = replay(run)
    assert not report.identical
    assert [(d.step, d.what) for d in report.divergences] == [(3, "loss"), (5, "weights")]
    assert report.steps == STEPS  # it goes on, counting every difference


async def test_set_trains_the_recorded_data_another_way(tmp_path: Path) -> None:
    run = await _run(tmp_path / "run")
    report = replay(run, overrides=["trainer.lr=0.05"], until=5, out_dir=tmp_path / "lr")
    assert report.counterfactual and not report.identical and report.compared == 0
    assert report.steps == 5 and report.out_dir == tmp_path / "lr"
    other, original = _metrics(tmp_path / "lr"), _metrics(run)[:5]
    # The same first batch on the same weights; after one step at another rate, other weights.
    assert other[0]["grad_norm"] == original[0]["grad_norm"]
    assert [r["lr"] for r in other] == [0.05] * 5
    changed = [
        a["grad_norm"] != b["grad_norm"] for a, b in zip(other[1:4], original[1:4], strict=True)
    ]
    assert changed == [True] * 3  # (step 5's batch has no reward signal: both 0)
    with pytest.raises(RecordError, match="only how it is trained"):
        replay(run, overrides=["rollout.temperature=0.5"])


def test_a_folder_without_a_record_is_refused_by_the_command_line(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "relax.cli", "replay", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "no complete trainer record" in done.stderr
    with pytest.raises(RecordError):
        Record.read(tmp_path)
