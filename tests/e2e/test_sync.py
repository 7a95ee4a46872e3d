"""Staleness 0 is strictly on-policy: a cluster run equals the synchronous loop, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from relax import cluster
from relax.config import load_config
from relax.sync import run_sync

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "digits" / "cluster.toml"
STEPS = 10


def steps(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def final_weights(run_dir: Path) -> dict:
    return load_file(run_dir / "checkpoints" / f"step-{STEPS:08d}" / "model.safetensors")


# Both cores at work in each phase (the layout bench/vs_trl.py times at staleness 0): two
# rollout processes generate half a step each, then a trainer process steps on two threads.
TWO_CORES = (
    "rollout.replicas=2",
    'rollout.placement="process"',
    "rollout.threads=1",
    'trainer.placement="process"',
    "trainer.threads=2",
)


@pytest.mark.parametrize(
    ("rollout_batch", "layout"),
    [(4, ()), (2, ()), (2, TWO_CORES)],  # one, then two generation calls per step
    ids=["one-call", "two-calls", "two-rollout-processes"],
)
async def test_staleness_0_equals_a_synchronous_run(
    tmp_path: Path, rollout_batch: int, layout: tuple[str, ...]
) -> None:
    overrides = [
        "staleness=0",
        f"trainer.steps={STEPS}",
        f"checkpoint.every_steps={STEPS}",
        f"rollout.batch_size={rollout_batch}",
        *layout,
    ]
    cfg = load_config(RECIPE, overrides=overrides)
    await cluster.run(cfg, tmp_path / "cluster")
    generated = tmp_path / "cluster" / "record" / "generations"
    calls = {f.stem: len(f.read_text().splitlines()) for f in generated.glob("rollout-*.jsonl")}
    assert sum(calls.values()) == STEPS * 4 // rollout_batch
    if layout:  # the replicas started together and shared the work
        assert len(calls) == 2 and min(calls.values()) > 0, calls
    await run_sync(cfg, tmp_path / "sync")
    ours, reference = steps(tmp_path / "cluster"), steps(tmp_path / "sync")
    assert len(ours) == len(reference) == STEPS
    keys = ("step", "applied", "reward_mean", "loss", "grad_norm", "tokens")
    for a, b in zip(ours, reference, strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
        assert a["oldest_row_version"] == a["newest_row_version"] == a["step"] - 1
    # Rewards moved (the comparison is not between two runs that learned nothing).
    assert len({s["reward_mean"] for s in ours}) > 1
    a, b = final_weights(tmp_path / "cluster"), final_weights(tmp_path / "sync")
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a)


async def test_a_different_seed_gives_a_different_run(tmp_path: Path) -> None:
    # The identity above is not an artefact of ignoring the seed.
    base = ["staleness=0", "trainer.steps=3"]
    await run_sync(load_config(RECIPE, overrides=base), tmp_path / "a")
    await run_sync(load_config(RECIPE, overrides=[*base, "rollout.seed=1"]), tmp_path / "b")
    rewards = [[s["reward_mean"] for s in steps(tmp_path / r)] for r in ("a", "b")]
    assert rewards[0] != rewards[1]
