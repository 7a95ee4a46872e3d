"""Evaluation during training ([eval]) on the digits recipe: the evaluator follows the published
weights, evaluates every `every_steps`-th version and the final one, its reward rises as the
policy learns, training goes on while it evaluates, and `relax plot` and `relax status` show it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from relax import cluster
from relax.cli._status_text import eval_summary, plain_snapshot
from relax.config import load_config
from relax.observe import EVAL_FILE, last_eval
from relax.plot import write_plots
from tests.e2e.audit import read_jsonl

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS, EVERY, HOLD = 40, 10, 3

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.mark.timeout(180)
async def test_eval_during_a_digits_run(tmp_path) -> None:
    run = tmp_path / "run"
    gate = (
        '{name="hold", kind="python", target="tests.e2e.eval_rewards:hold_first_eval",'
        f' weight=0.0, timeout=90.0, options={{metrics="{run / "metrics.jsonl"}", steps={HOLD}}}}}'
    )
    cfg = load_config(
        EXAMPLES / "digits" / "cluster.toml",
        overrides=[
            f"trainer.steps={STEPS}",
            f"eval.every_steps={EVERY}",
            "eval.n_prompts=16",
            "eval.samples_per_prompt=4",
            f'reward.functions=[{{name="digit", kind="regex", pattern="^[0-9]"}}, {gate}]',
            'logging.level="warning"',
        ],
    )
    layout = cluster.prepare(cfg, run)
    tree = cluster.build_tree(cfg, layout)
    assert "eval" in tree.child_ids()
    async with tree:
        await tree.wait()

    trained = read_jsonl(run / "metrics.jsonl")
    evals = read_jsonl(run / EVAL_FILE)
    versions = [e["version"] for e in evals]
    # Every due version and the final one, each once, in order (none skipped in this run).
    assert versions == list(range(0, STEPS + 1, EVERY)), versions
    assert all(e["step"] == e["version"] for e in evals)
    for e in evals:
        assert e["eval/samples"] == 16 * 4 and e["eval/failed_rewards"] == 0
        assert 0 <= e["eval/pass@1"] <= e["eval/pass@k"] <= 1
    first, last = evals[0], evals[-1]
    assert last["eval/mean_reward"] - first["eval/mean_reward"] >= 0.5, evals
    assert last["eval/pass@k"] >= first["eval/pass@k"]
    # The trainer was not stalled: steps finished while the first evaluation was in flight
    # (the gate held it until HOLD steps were logged, so it could not have ended otherwise).
    during = [r for r in trained if first["started"] <= r["time"] <= first["time"]]
    assert len(during) >= HOLD - 1, (first, [r["time"] for r in trained[:5]])
    assert len(trained) == STEPS

    # relax plot draws the eval chart; relax status (plain snapshot, TUI row) shows the last.
    assert run / "plots" / "eval.png" in write_plots(run)
    assert last_eval(run) == last
    summary = eval_summary(last)
    assert summary.startswith(f"eval version {STEPS} · reward ")
    assert summary in plain_snapshot({"run_dir": str(run)}).splitlines()
