"""A reward function that always raises stops the run: exit 1, its traceback printed once,
a bounded log, and quickly (it used to spin for ever, warning 117,376 times in 3 minutes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tiny import tiny_toml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

ALWAYS_RAISES = """
[[reward.functions]]
name = "buggy"
kind = "python"
target = "tests.e2e.contract_rewards:always_raises"
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("placement", ["inproc", "process", "in-rollout"])
def test_a_reward_that_always_raises_stops_the_run_with_its_traceback_once(
    tmp_path, placement: str
) -> None:
    toml = tmp_path / "cluster.toml"
    # The default max_failed_groups (20) is what a user gets: no override here. In its own
    # process the reward role's unrecoverable end crosses the process boundary as such; with
    # [reward] in_rollout the rollout scores and its breaker stops the run the same way.
    reward = "in_rollout = true" if placement == "in-rollout" else f'placement = "{placement}"'
    toml.write_text(tiny_toml("breaker", steps=50, reward=reward, extra=ALWAYS_RAISES))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run_dir = tmp_path / "run"
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "relax.cli", "up", str(toml), "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
        cwd=ROOT,
    )
    took = time.monotonic() - started
    output = out.stdout + out.stderr
    assert out.returncode == 1, output[-3000:]
    assert took < 90, took
    # Why, in words: the breaker's message, naming the function's error and the setting.
    assert "the reward failed for 20 groups in a row" in out.stderr, out.stderr[-3000:]
    assert "reward.max_failed_groups = 20" in out.stderr
    assert "ZeroDivisionError" in out.stderr
    # The user's own traceback, exactly once: their frame and their source line.
    assert output.count("in always_raises") == 1, output[-3000:]
    assert output.count("return len(response) / 0") == 1
    assert "Traceback (most recent call last)" in out.stderr
    # No restart loop, no resume hint for a run that never trained a step.
    assert "resume with" not in output
    # Bounded logs: identical warnings are rate-limited (20 groups = 80 failed samples).
    failed_lines = output.count("reward failed")
    assert 1 <= failed_lines <= 5, failed_lines
    logs = run_dir / "logs"
    log_bytes = sum(p.stat().st_size for p in logs.glob("*.jsonl")) if logs.exists() else 0
    assert log_bytes < 200_000, log_bytes
