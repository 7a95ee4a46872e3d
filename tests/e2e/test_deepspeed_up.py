"""The digits recipe with a DeepSpeed ZeRO-2 trainer gang of two processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax import cluster
from relax.config import load_config

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.anyio, pytest.mark.slow]
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "digits" / "cluster.toml"


async def test_zero2_gang_of_two_trains_the_recipe(tmp_path: Path) -> None:
    cfg = load_config(
        RECIPE,
        overrides=[
            'trainer.backend="deepspeed"',
            "trainer.zero_stage=2",
            "trainer.gang=2",
            'trainer.placement="process"',
            "trainer.micro_batch_size=16",  # 32 rows a step: one micro-batch per rank
            "trainer.steps=4",
            "checkpoint.every_steps=2",
        ],
    )
    layout = await cluster.run(cfg, tmp_path / "run")
    steps = [
        json.loads(line) for line in (layout.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert [s["step"] for s in steps if s["applied"]] == [1, 2, 3, 4]
    for s in steps:
        assert s["world_size"] == 2.0, "both ranks of the gang trained"
        assert 0.0 <= s["reward_mean"] <= 1.0 and s["rows"] == 32.0
    # Checkpoints are collective: each rank wrote its optimiser partition.
    newest = layout.run_dir / "checkpoints" / "step-00000004"
    assert (newest / "model.safetensors").is_file()
    partitions = sorted(p.name for p in (newest / "deepspeed").glob("*optim_states.pt"))
    assert len(partitions) == 2, partitions
    # One process cannot redo a gang's sums bit for bit: a replay says so and starts nothing.
    from relax.replay import RecordError, replay

    with pytest.raises(RecordError, match="gang of 2 ranks"):
        replay(layout.run_dir)
    assert not (layout.run_dir / "replays" / "replay-1").exists()


async def test_a_staleness_0_gang_trains_what_the_synchronous_run_trains(tmp_path: Path) -> None:
    """`bench/vs_trl.py`'s data-parallel layout: ZeRO-0, two ranks of 16 rows. Its first step
    sees exactly the synchronous run's samples; the update, summed over two ranks instead of
    two micro-batches of one process, equals it to float rounding (and --sync says so)."""
    from structlog.testing import capture_logs

    from relax.sync import run_sync

    overrides = [
        'trainer.backend="deepspeed"',
        "trainer.zero_stage=0",
        "trainer.gang=2",
        "trainer.micro_batch_size=16",
        "trainer.steps=1",
        "staleness=0",
        'trainer.placement="process"',
    ]
    cfg = load_config(RECIPE, overrides=overrides)
    gang = await cluster.run(cfg, tmp_path / "gang")
    with capture_logs() as logs:
        sync = await run_sync(cfg, tmp_path / "sync")  # placement aside: one loop, one process
    assert any("gang's batch in one process" in e["event"] for e in logs), logs

    def first(run_dir: Path) -> dict:
        return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])

    g, s = first(gang.run_dir), first(sync.run_dir)
    assert g["applied"] and s["applied"] and g["world_size"] == 2.0
    for key in ("reward_mean", "tokens", "rows"):  # the same samples
        assert g[key] == s[key], key
    for key in ("loss", "grad_norm"):
        assert g[key] == pytest.approx(s[key], rel=1e-4, abs=1e-6), key
