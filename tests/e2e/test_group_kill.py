"""The whole `relax up` process group SIGKILLed mid-run (the machine's view of a power cut:
every role, both buses and the supervisor at once), then `relax up --resume` in the same run
folder. Over the whole run, before and after the kill: every step 1..N applied once, every row
put was trained exactly once or dropped with a counted reason or still queued — by the bus's
own log and the trainer's ledger — and the trainer replays bit for bit from its record."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.audit import applied_steps, check_stopped_run
from tests.polling import poll_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "digits" / "cluster.toml"
STEPS = 30


@pytest.mark.parametrize(
    ("staleness", "placement"),
    [("0", "inproc"), ("1", "process"), ('"inf"', "inproc")],
)
def test_a_run_sigkilled_as_a_whole_resumes_losing_and_repeating_nothing(
    tmp_path: Path, staleness: str, placement: str
) -> None:
    run = tmp_path / "run"
    up = [sys.executable, "-m", "relax.cli", "up", str(RECIPE), "--run-dir", str(run)]
    for key in (
        f"trainer.steps={STEPS}",
        f"staleness={staleness}",
        "checkpoint.every_steps=4",
        *(f'{role}.placement="{placement}"' for role in ("rollout", "reward", "trainer")),
    ):
        up += ["--set", key]
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(up, stdout=log, stderr=log, start_new_session=True)
        try:
            poll_until(
                lambda: len(applied_steps(run)) >= 10 or first.poll() is not None,
                timeout=240,
                what="10 applied steps",
            )
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        finally:
            os.killpg(first.pid, signal.SIGKILL)  # every process of the run, at once
            first.wait()
    killed_at = len(applied_steps(run))
    assert killed_at < STEPS
    again = subprocess.run([*up, "--resume"], capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, (again.stdout[-2000:], again.stderr[-3000:])
    # Steps 1..30 each applied once, exactly once by the bus log and the trainer's ledger,
    # and the trainer's side replays bit for bit across the kill.
    assert check_stopped_run(run) == STEPS
    print(f"\nkilled at {killed_at} applied steps; resumed to {STEPS}")
