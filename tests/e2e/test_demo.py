"""README's main command until the RL roles exist: the demo tree, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_relax_demo_survives_a_sigkill_and_answers_every_job_once() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "relax.cli", "demo", "--jobs", "20"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = " ".join(out.stdout.split())
    assert "jobs answered: 20/20 (exactly once: True, correct: True)" in text
    assert "restarts 1" in text and "killed by SIGKILL" in text


def test_help_lists_the_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "relax.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    assert "demo" in out.stdout and "validate" in out.stdout
