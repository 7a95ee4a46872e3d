"""The digits recipe with ``rollout.engine = "vllm"``: vLLM serves the rollouts of a real run.

Skipped when vllm is not installed, unless ``RELAX_REQUIRE_VLLM=1`` (CI), where a missing
vllm fails instead.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
from pathlib import Path

import pytest

from relax import cluster
from relax.config import load_config
from relax.engines._vllm import INSTALL_HINT
from relax.replay import RECORD_DIR, read_calls, replay

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "digits" / "cluster.toml"

if importlib.util.find_spec("vllm") is None:  # found, not imported: collection stays fast
    if os.environ.get("RELAX_REQUIRE_VLLM") == "1":
        raise ImportError(f"RELAX_REQUIRE_VLLM=1 but vllm is not installed: {INSTALL_HINT}")
    pytest.skip(f"vllm is not installed: {INSTALL_HINT}", allow_module_level=True)

STEPS = 8


async def test_digits_recipe_runs_on_vllm(tmp_path: Path) -> None:
    cfg = load_config(
        RECIPE,
        overrides=[
            'rollout.engine="vllm"',
            f"trainer.steps={STEPS}",
            # vLLM's CPU attention has no head size 16 (the recipe's 64 / 4): 2 heads of 32.
            "model.init.num_heads=2",
            "model.init.num_kv_heads=1",
        ],
    )
    layout = await cluster.run(cfg, tmp_path / "run")
    rows = [
        json.loads(line) for line in (layout.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if r["applied"]] == list(range(1, STEPS + 1))
    # The engine picked up the trainer's published weights: later rows come from newer ones.
    assert max(r["newest_row_version"] for r in rows) > 0, rows
    bound = cfg.staleness_bound
    for r in rows:
        assert r["oldest_row_version"] >= r["trainer_version_at_take"] - bound, r
    # The rollouts recorded their vLLM calls: a replay generates every trained row again with
    # vLLM on the replay's own weights of its version (older ones loaded after newer ones).
    # vLLM on the CPU repeats itself bit for bit; a difference is reported where it starts.
    report = replay(layout.run_dir, regenerate=True)
    regen = report.regenerated
    assert regen is not None and regen.engine == "vllm"
    trained = STEPS * cfg.trainer.global_batch_size
    assert (regen.rows, regen.unrecorded) == (trained, 0), regen
    calls = read_calls(layout.run_dir / RECORD_DIR)
    assert {c["engine"] for c in calls} == {"vllm"}
    assert len({v for c in calls for chunk in c["chunks"] for v in chunk}) > 1, calls
    assert regen.identical == regen.rows, report.divergences[:3]
    assert report.identical, report.divergences[:3]


async def test_partial_rollouts_on_vllm_resume_and_regenerate(tmp_path: Path) -> None:
    """At staleness "inf" with 64-token answers (a random-init policy answers to the cap), the
    trainer publishes while vLLM decodes: each running request is resumed from its prefix
    under the new weights. The trained rows carry the tokens of both versions, and the replay
    regenerates every one of them segment by segment, bit for bit."""
    cfg = load_config(
        RECIPE,
        overrides=[
            'rollout.engine="vllm"',
            "trainer.steps=6",
            'staleness="inf"',
            "rollout.max_new_tokens=64",
            "model.init.num_heads=2",
            "model.init.num_kv_heads=1",
        ],
    )
    assert cfg.rollout.interruptible  # the default
    layout = await cluster.run(cfg, tmp_path / "run")
    rows = [
        json.loads(line) for line in (layout.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if r["applied"]] == list(range(1, 7))
    # Tokens sampled after a weight update landed mid-response reached the trainer.
    assert max(r["resumed_token_share"] for r in rows) > 0, rows
    calls = read_calls(layout.run_dir / RECORD_DIR)
    interrupted = [runs for c in calls for runs in c["runs"] if len(runs) > 1]
    assert interrupted, calls
    assert all(a[0] < b[0] for runs in interrupted for a, b in itertools.pairwise(runs))
    report = replay(layout.run_dir, regenerate=True)
    regen = report.regenerated
    assert regen is not None and regen.rows == 6 * cfg.trainer.global_batch_size
    assert regen.identical == regen.rows, report.divergences[:3]
