"""The reward contract in a real run: a Python reward function gets the whole sample.

examples/own_reward (its own prompt generator, rows with fields of their own, its own async
reward with weighted components) is run with the reward role in its own process, and beside
its reward two functions of tests/e2e/contract_rewards.py at weight 0: an async one that
returns named components and records what it was given, and a batched one. Each record is
checked against the samples bus log (the same uid, group, prompt, token ids, the row's fields
with their JSON types), every reward against its weighted parts, and the trainer's metrics
(each component logged on its own) show the recipe learning. README's reward example is the
recipe's, as printed.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from relax import cluster
from relax.config import load_config
from relax.models import load_tokenizer
from relax.preflight import load_checked
from relax.rewards import STANDARD_KEYS
from tests.e2e.audit import applied_steps, check_exactly_once, replay_samples_bus

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "own_reward" / "cluster.toml"
STEPS = 40
README = Path(__file__).resolve().parents[2] / "README.md"


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "where", ['reward.placement="process"', "reward.in_rollout=true"], ids=["role", "in-rollout"]
)
async def test_a_python_reward_gets_the_whole_sample(
    tmp_path, monkeypatch, request, where: str
) -> None:
    calls, batches = tmp_path / "calls.jsonl", tmp_path / "batches.jsonl"
    own = load_config(RECIPE).reward.functions
    assert [f.target for f in own] == ["reward:score"]
    functions = (
        '[{name="own", kind="python", target="reward:score", timeout=5.0,'
        " options={carry_bonus=0.5},"
        " components={digit=1.0, correct=1.0, ones=0.5}},"
        ' {name="c", kind="python", target="tests.e2e.contract_rewards:components",'
        f' weight=0.0, options={{log="{calls}"}}}},'
        ' {name="sum", kind="python", target="tests.e2e.contract_rewards:batched_sum",'
        f' batched=true, weight=0.0, options={{log="{batches}"}}}}]'
    )
    overrides = [
        where,  # the reward role in its own process, or each rollout scoring its own samples
        f"trainer.steps={STEPS}",
        "staleness=0",  # the same run every time: its seeds fix every sample
        "reward.batch_size=8",
        f"reward.functions={functions}",
        'logging.level="warning"',
    ]
    # What `relax up` runs: the preflight, which puts the config's folder on sys.path (for
    # reward.py and tasks.py); this test gives sys.path and the modules back afterwards.
    monkeypatch.setattr(sys, "path", list(sys.path))
    request.addfinalizer(lambda: [sys.modules.pop(m, None) for m in ("reward", "tasks")])
    cfg = load_checked(RECIPE, overrides=overrides)
    assert cfg.reward.functions[0] == own[0]  # the recipe's own reward, as the recipe says
    layout = cluster.prepare(cfg, tmp_path / "run")
    async with cluster.build_tree(cfg, layout) as tree:
        await tree.wait()
    run_dir = layout.run_dir

    ledger = replay_samples_bus(run_dir)
    check_exactly_once(ledger)
    tokenizer = load_tokenizer(run_dir / "model")
    seen = lines(calls)
    assert len(seen) >= cfg.trainer.global_batch_size * STEPS
    for record in seen:
        row = ledger.rows[record["uid"]]
        cols = row["columns"]
        a, b = record["fields"]["operands"]
        # The row's fields with their JSON types: a list of ints, an int answer, a bool.
        assert isinstance(a, int) and isinstance(b, int)
        assert record["answer"] == a + b and isinstance(record["answer"], int)
        assert record["fields"]["carry"] is (a + b >= 10)
        assert record["is_sample"] and set(STANDARD_KEYS) <= set(record["keys"])
        assert {"operands", "carry"} <= set(record["keys"])
        # The prompt, the response and the ids are this row's, as the rollout wrote them.
        assert record["prompt"] == f"{a}+{b}="
        assert record["group"] == row["group"]
        assert record["response_ids"] == list(cols["response_ids"])
        assert record["prompt_ids"] == list(cols["prompt_ids"])
        assert record["response"] == tokenizer.decode(
            cols["response_ids"], skip_special_tokens=True
        )

    # The batched function was called with whole batches, once per batch, for the same rows.
    calls_of = lines(batches)
    assert max(c["batch"] for c in calls_of) > 1
    assert sorted(u for c in calls_of for u in c["uids"]) == sorted(r["uid"] for r in seen)

    # Each reward is the weighted sum of its parts, which the row keeps by name.
    scored = 0
    for record in seen:
        uid = record["uid"]
        if uid not in ledger.rewards:
            continue  # scored after the last step took its batch
        parts = ledger.components[uid]
        text, (a, b) = record["response"], record["fields"]["operands"]
        first = text.strip()[:1]
        mine = {  # examples/own_reward/reward.py, recomputed from what the function was given
            "own/digit": float(first.isdigit()),
            "own/correct": float(text.strip().startswith(str(a + b))) * (1 + 0.5 * (a + b >= 10)),
            "own/ones": float(first == str((a + b) % 10)),
        }
        theirs = {
            "c/starts_digit": float(text[:1].isdigit()),
            "c/length": float(len(record["response_ids"])),
            "sum": 1.0,
        }
        assert parts == {**mine, **theirs}, parts
        total = mine["own/digit"] + mine["own/correct"] + 0.5 * mine["own/ones"]
        assert ledger.rewards[uid] == pytest.approx(total), uid  # weight 0 adds nothing
        scored += 1
    assert scored >= cfg.trainer.global_batch_size * STEPS

    # The trainer logs each component on its own, beside the total.
    steps = applied_steps(run_dir)
    assert len(steps) == STEPS
    for step in steps:
        assert {"reward/own/digit", "reward/c/length", "reward/sum"} <= step.keys(), step
        assert step["reward/sum"] == 1.0
    # The recipe learns its format, as its header says (chance ~4 %).
    digit = [s["reward/own/digit"] for s in steps]
    quarter = STEPS // 4
    first, end = sum(digit[:quarter]) / quarter, sum(digit[-quarter:]) / quarter
    print(f"\nreward/own/digit first -> last quarter: {first:.3f} -> {end:.3f}")
    assert end - first > 0.5, (first, end, digit)


def test_the_readme_reward_example_is_the_recipes() -> None:
    blocks = re.findall(r"```(?:python|toml)\n(.*?)```", README.read_text(), re.DOTALL)
    [code] = [b for b in blocks if "async def score(" in b]
    [toml] = [b for b in blocks if 'target = "reward:score"' in b]
    assert code in (RECIPE.parent / "reward.py").read_text()
    assert toml in RECIPE.read_text()
