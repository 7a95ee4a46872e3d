"""Every algorithm-family recipe in examples/ runs, uses what makes it that family, and learns.

Each recipe is the digits task of examples/digits (a random tiny model learns to answer "a+b="
with a digit; chance is ~4 %) under another algorithm. Margins were measured over six seeds
(model, data, rollout and trainer seeds varied together) at 40 steps; see each entry.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from relax import cluster
from relax.config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 40

# recipe -> (extra children, minimum rise of the mean reward from the first to the last quarter)
RECIPES = {
    # measured first -> last quarter: 0.04-0.08 -> 0.83-0.97
    "grpo_kl": (["reference-0"], 0.5),
    # 0.04-0.09 -> 0.94-0.98
    "ppo": (["critic-0"], 0.6),
    # 0.04-0.09 -> 0.93-0.98
    "rloo": ([], 0.6),
    # 0.04-0.08 -> 0.84-0.97
    "reinforce_pp": (["reference-0"], 0.5),
    # 0.04-0.09 -> 0.92-0.98
    "gspo": ([], 0.6),
    # reward = digit + 0.5 * overlong penalty: -0.38..-0.31 -> 0.49-0.66
    "dapo": ([], 0.6),
}


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_builds_the_tree_its_algorithm_needs(tmp_path, recipe) -> None:
    cfg = load_config(EXAMPLES / recipe / "cluster.toml")
    layout = cluster.prepare(cfg, tmp_path / "run")
    tree = cluster.build_tree(cfg, layout)
    extra, _ = RECIPES[recipe]
    assert tree.child_ids() == [
        "prompts",
        "samples",
        "dataset",
        "reward-0",
        *extra,
        "trainer",
        "rollout-0",
    ]
    tasks = cluster.sample_tasks(cfg)
    assert ("reference" in tasks) == ("reference-0" in extra)
    assert ("critic" in tasks) == ("critic-0" in extra)


def test_more_than_one_critic_is_refused_by_the_config() -> None:
    from relax.errors import ConfigError

    with pytest.raises(ConfigError, match=r"critic\.replicas"):
        load_config(EXAMPLES / "ppo" / "cluster.toml", overrides=["critic.replicas=2"])


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("recipe", sorted(RECIPES))
async def test_recipe_learns(tmp_path, recipe) -> None:
    cfg = load_config(
        EXAMPLES / recipe / "cluster.toml",
        overrides=[f"trainer.steps={STEPS}", 'logging.level="warning"'],
    )
    layout = await cluster.run(cfg, tmp_path / "run")
    steps = records(layout.run_dir / "metrics.jsonl")
    applied = [s for s in steps if s["applied"]]
    assert [s["step"] for s in applied] == list(range(1, STEPS + 1))

    # What makes each recipe its family showed up in the metrics.
    last = applied[-1]
    if recipe in ("grpo_kl", "reinforce_pp"):  # ref_logprobs reached the trainer
        kls = [s["kl"] for s in applied]
        assert all(math.isfinite(k) and k >= -1e-6 for k in kls if recipe == "grpo_kl")
        assert all(math.isfinite(k) for k in kls)
        assert abs(kls[0]) < 1e-3  # version 0 is the reference itself
        assert max(kls) > 0.01  # the policy moved away from it
    if recipe == "ppo":
        assert "dual_clip_frac" in last
        critic = records(layout.run_dir / "critic.jsonl")
        # GAE needs the values column (the trainer raises without it), so every applied step
        # above used the critic's values; the critic also learned from (nearly) every row —
        # not quite all: empty responses are skipped and the run may end mid-update.
        assert sum(c["rows"] for c in critic) >= 0.8 * STEPS * cfg.trainer.global_batch_size
        assert all(math.isfinite(c["value_loss"]) for c in critic)
        # The critic tracks the return: its values end near the (high) final reward.
        tail = critic[-5:]
        assert sum(c["value_mean"] for c in tail) / len(tail) > 0.5
        assert (layout.run_dir / "checkpoints" / "critic").is_dir()
    if recipe == "gspo":
        assert "seq_ratio_mean" in last
    if recipe == "dapo":
        assert "dropped_rows" in last
        assert any(s["dropped_rows"] > 0 for s in steps)  # dynamic sampling dropped groups

    rewards = [s["reward_mean"] for s in applied]
    quarter = len(rewards) // 4
    first, end = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
    assert end - first > RECIPES[recipe][1], (first, end, rewards)
