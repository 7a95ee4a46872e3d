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
from relax.replay import GENERATIONS_DIR, RECORD_DIR, Record, RecordError, replay

pytestmark = [pytest.mark.anyio]
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "digits" / "cluster.toml"
STEPS = 8


async def _run(run_dir: Path, *overrides: str) -> Path:
    cfg = load_config(RECIPE, overrides=[f"trainer.steps={STEPS}", *overrides])
    await cluster.run(cfg, run_dir)
    return run_dir


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("staleness", "extra"),
    [("0", []), ("1", []), ('"inf"', []), ("1", ['rollout.stop=["7", "+"]'])],
    ids=["0", "1", "inf", "1-stop-strings"],
)
async def test_a_run_replays_bit_for_bit(tmp_path: Path, staleness: str, extra: list) -> None:
    run = await _run(tmp_path / "run", f"staleness={staleness}", *extra)
    report = replay(run, regenerate=True)
    assert report.identical, report.divergences[:3]
    assert report.steps == report.applied == STEPS and report.restarts == 0
    # Every trained row (32 a step) generated again from its seed, in its decode batch, on
    # the replay's weights of each version it was generated with: the same tokens, the same
    # logprobs' bits.
    regen = report.regenerated
    assert regen is not None and regen.rows == regen.identical == 32 * STEPS, regen
    assert regen.unrecorded == 0
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


async def test_a_generation_the_engine_does_not_reproduce_is_caught_at_its_rows(
    tmp_path: Path,
) -> None:
    run = await _run(tmp_path / "run", "staleness=0")
    log = next((run / RECORD_DIR / GENERATIONS_DIR).glob("*.jsonl"))
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(calls) >= STEPS and all(set(c["chunks"][0]) == {i} for i, c in enumerate(calls))
    calls[2]["seeds"][1] += 1  # prompt 1 of the call trained at step 3: other samples
    calls[5]["chunks"][0] = [4] * len(calls[5]["chunks"][0])  # step 6's rows: older weights
    log.write_text("".join(json.dumps(c) + "\n" for c in calls))
    report = replay(run, regenerate=True)
    assert not report.identical and report.regenerated is not None
    differ = {(d.step, d.what.split()[0].rpartition("/")[0]) for d in report.divergences}
    assert differ == {(3, calls[2]["uids"][1])} | {(6, uid) for uid in calls[5]["uids"]}
    # Other weights change every row's logprobs (8 samples of 4 prompts); another seed
    # changes the sampled tokens of most of its prompt's 8.
    assert sum(d.step == 6 for d in report.divergences) == 32
    assert sum(d.step == 3 for d in report.divergences) >= 4
    assert report.regenerated.identical == 32 * STEPS - len(report.divergences)
    with pytest.raises(RecordError, match="counterfactual"):
        replay(run, regenerate=True, overrides=["trainer.lr=0.05"])
    # What cannot be regenerated bit for bit is refused, with its reason, before anything runs.
    refused = [
        ("device", "cuda:0", "HF regenerates CPU runs"),
        ("seeds", [None] * 4, "unseeded"),
        ("engine", "vllm", "several engines"),
    ]
    for key, value, reason in refused:
        log.write_text(
            "".join(
                json.dumps(c | {key: value} if i == 1 else c) + "\n" for i, c in enumerate(calls)
            )
        )
        with pytest.raises(RecordError, match=reason):
            replay(run, regenerate=True)


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
