"""Agentic runs end to end: environment episodes train, token-exact and masked, and survive
failing tools; the GuessNumber example's task success rises."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from relax import cluster
from relax.agents import model_spans
from relax.config import load_config, parse_config
from relax.models import load_tokenizer
from tests.actors.helpers import running_pid
from tests.e2e.audit import applied_steps, check_exactly_once, read_metrics, replay_samples_bus
from tests.polling import wait_until
from tests.tiny import tiny_toml

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def env_cluster(name: str, env: str, steps: int, agent: str = "") -> str:
    return tiny_toml(
        name,
        steps=steps,
        max_new_tokens=3,
        data='generator = "relax.agents.envs:guess_tasks"',
        extra=f'[rollout.agent]\nkind = "env"\nenv = "{env}"\nmax_turns = 3\n{agent}',
    )


async def run_tree(cfg, run_dir: Path) -> dict:
    layout = cluster.prepare(cfg, run_dir)
    async with cluster.build_tree(cfg, layout) as tree:
        await tree.wait()
        return await tree.snapshot()


async def test_env_episodes_train_token_exact_with_observations_masked(tmp_path) -> None:
    cfg = parse_config(env_cluster("episodes", "relax.agents.envs:GuessNumber", steps=4))
    layout = cluster.prepare(cfg, tmp_path / "run")
    # Episodes score themselves: no reward role, no "reward" task on the bus.
    assert "reward-0" not in cluster.build_tree(cfg, layout).child_ids()
    assert cluster.sample_tasks(cfg) == ["train"]
    snap = await run_tree(cfg, tmp_path / "run")
    assert all(c["restart_count"] == 0 for c in snap["children"])
    ledger = replay_samples_bus(tmp_path / "run")
    check_exactly_once(ledger)
    assert len(ledger.trained) >= 4 * 8
    tok = load_tokenizer(layout.model_dir)
    for uid in ledger.trained:
        cols = ledger.rows[uid]["columns"]
        ids, mask, lps = cols["response_ids"], cols["loss_mask"], cols["logprobs"]
        assert len(ids) == len(mask) == len(lps) == len(cols["token_versions"])
        replies = model_spans(mask, ids)
        assert len(replies) == cols["turns"] >= 1
        # Every observation is a whole turn of the environment, between two replies.
        observed = model_spans([1 - m for m in mask], ids)
        assert len(observed) in (len(replies) - 1, len(replies))
        for span in observed:
            text = tok.decode(span)
            assert "<|im_start|>tool\n" in text and text.endswith("<|im_start|>assistant\n")
        assert all(lp == 0.0 for lp, m in zip(lps, mask, strict=True) if not m)
        assert all(lp < 0.0 for lp, m in zip(lps, mask, strict=True) if m)
        assert cols["episode_end"] in ("done", "max_turns", "token_budget")
    steps = read_metrics(tmp_path / "run")
    assert all("success_rate" in s and "turns_mean" in s for s in steps if s["applied"])


async def test_failing_and_hanging_tools_end_episodes_not_the_rollout(tmp_path) -> None:
    cfg = parse_config(
        env_cluster(
            "flaky", "tests.e2e.fault_envs:FlakyGuess", 4, "tool_timeout = 0.5\nerror_reward = -1.0"
        )
    )
    snap = await run_tree(cfg, tmp_path / "run")
    assert all(c["restart_count"] == 0 for c in snap["children"]), snap
    ledger = replay_samples_bus(tmp_path / "run")
    check_exactly_once(ledger)
    ends = {}
    for uid in ledger.trained:
        cols = ledger.rows[uid]["columns"]
        ends.setdefault(cols["episode_end"], []).append(cols)
    # Episodes that reached a second step on a broken task ended with the reason recorded.
    assert ends.get("tool_error") and ends.get("tool_timeout"), sorted(ends)
    for cols in ends["tool_error"]:
        assert "RuntimeError: the game server crashed" in cols["episode_reason"]
        assert cols["reward"] == -1.0
    for cols in ends["tool_timeout"]:
        assert "0.5 s" in cols["episode_reason"] and cols["reward"] == -1.0
    steps = read_metrics(tmp_path / "run")
    assert any(s.get("episode_failed", 0) > 0 for s in steps)


def quarters(values: list[float]) -> tuple[float, float]:
    q = max(1, len(values) // 4)
    return sum(values[:q]) / q, sum(values[-q:]) / q


@pytest.mark.timeout(400)
async def test_guess_number_success_rises(tmp_path) -> None:
    """Two seeds, run side by side (each rollout in its own process, one thread per role, so
    the two runs share a 2-core machine instead of queueing): each one's success rises."""

    async def success(seed: int) -> tuple[float, float]:
        cfg = load_config(
            EXAMPLES / "guess_number" / "cluster.toml",
            overrides=[
                f'cluster.name="guess-number-{seed}"',
                f"model.init.seed={seed}",
                f"data.seed={seed}",
                f"rollout.seed={seed}",
                # Staleness 0 runs exactly the synchronous loop: the same numbers on every
                # machine (at the example's staleness 1 timing decides which weights generate
                # which rows).
                "staleness=0",
                'rollout.placement="process"',
                "rollout.threads=1",
                'logging.level="warning"',
            ],
        )
        layout = await cluster.run(cfg, tmp_path / f"run-{seed}")
        steps = [s for s in read_metrics(layout.run_dir) if s["applied"]]
        return quarters([s["success_rate"] for s in steps])

    results = await asyncio.gather(success(0), success(1))
    for seed, (first, last) in enumerate(results):
        print(json.dumps({"seed": seed, "success_first": first, "success_last": last}))
    # Measured (staleness 0, 100 steps, lr 0.002, both runs ~115 s together on 2 cores, the
    # same numbers run after run): seed 0 0.041 -> 0.309, seed 1 0.044 -> 0.276 (seeds 2, 3:
    # 0.052 -> 0.292, 0.052 -> 0.356). The example's earlier lr 0.003 collapsed seed 0 at step
    # 59 under transformers 5.19 (0.053 -> 0.043), a real instability, not noise.
    for first, last in results:
        assert first < 0.1
        assert last >= first + 0.15


def logged_calls(path: Path) -> dict[str, list[list[int]]]:
    """session -> the token ids the endpoint returned for each of its calls, in order."""
    calls: dict[str, list[list[int]]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        calls.setdefault(record["session"], []).append(record["token_ids"][0])
    return calls


def program_cluster(name: str, program: str, log: Path, steps: int, agent: str = "") -> str:
    return tiny_toml(
        name,
        steps=steps,
        max_new_tokens=3,
        extra=(
            f'[rollout.agent]\nkind = "openai"\nprogram = "{program}"\n'
            f'options = {{ log = "{log}" }}\n{agent}'
        ),
    )


async def test_black_box_agent_sessions_train_exactly_what_the_endpoint_returned(tmp_path) -> None:
    log = tmp_path / "calls.jsonl"
    cfg = parse_config(program_cluster("blackbox", "tests.e2e.agent_programs:ask_twice", log, 3))
    snap = await run_tree(cfg, tmp_path / "run")
    assert all(c["restart_count"] == 0 for c in snap["children"]), snap
    ledger = replay_samples_bus(tmp_path / "run")
    check_exactly_once(ledger)
    calls = logged_calls(log)
    tok = load_tokenizer(tmp_path / "run" / "model")
    assert len(ledger.trained) >= 3 * 8
    for uid in ledger.trained:
        cols = ledger.rows[uid]["columns"]
        # Token-exact: the row's model spans are the ids each call returned, in order.
        assert model_spans(cols["loss_mask"], cols["response_ids"]) == calls[cols["session"]]
        assert cols["turns"] == 2
        between = model_spans([1 - m for m in cols["loss_mask"]], cols["response_ids"])
        assert len(between) == 1 and "<|im_start|>user\nAnswer with a number." in tok.decode(
            between[0]
        )


async def test_failing_agent_program_ends_its_episode_not_the_rollout(tmp_path) -> None:
    log = tmp_path / "calls.jsonl"
    program = "tests.e2e.agent_programs:sync_agent_that_sometimes_fails"
    cfg = parse_config(program_cluster("failing", program, log, 3, "error_reward = -0.5"))
    snap = await run_tree(cfg, tmp_path / "run")
    assert all(c["restart_count"] == 0 for c in snap["children"]), snap
    ledger = replay_samples_bus(tmp_path / "run")
    check_exactly_once(ledger)
    calls = logged_calls(log)
    failed = [
        ledger.rows[u]["columns"]
        for u in ledger.trained
        if ledger.rows[u]["columns"]["episode_end"] == "agent_error"
    ]
    assert failed
    for cols in failed:
        assert "RuntimeError: the agent tripped" in cols["episode_reason"]
        assert cols["reward"] == -0.5
        # What it generated before failing is still recorded, token-exact (completions API).
        assert model_spans(cols["loss_mask"], cols["response_ids"]) == calls[cols["session"]]


@pytest.mark.timeout(300)
async def test_openai_agent_example_reward_rises(tmp_path, monkeypatch) -> None:
    # The program ("agent:solve") is a module of the config's own folder, which `relax up`
    # puts on sys.path; load_config alone does not, so the test does.
    monkeypatch.syspath_prepend(str(EXAMPLES / "openai_agent"))
    cfg = load_config(
        EXAMPLES / "openai_agent" / "cluster.toml", overrides=['logging.level="warning"']
    )
    layout = await cluster.run(cfg, tmp_path / "run")
    steps = [s for s in read_metrics(layout.run_dir) if s["applied"]]
    first, last = quarters([s["reward_mean"] for s in steps])
    turns_first, turns_last = quarters([s["turns_mean"] for s in steps])
    print(json.dumps({"reward": [first, last], "turns": [turns_first, turns_last]}))
    # Measured (seed 0, 40 steps, ~19 s): reward 0.07 -> 0.50, turns 1.93 -> 1.11.
    assert first < 0.2 and last >= first + 0.25
    assert turns_last < turns_first


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["env", "openai"])
async def test_sigkilled_rollout_and_trainer_lose_no_episode_and_train_none_twice(
    tmp_path, kind
) -> None:
    log = tmp_path / "calls.jsonl"
    text = (
        env_cluster("killed", "relax.agents.envs:GuessNumber", 12)
        if kind == "env"
        else program_cluster("killed", "tests.e2e.agent_programs:ask_twice", log, 12)
    )
    cfg = parse_config(
        text,
        overrides=[
            'rollout.placement="process"',
            'trainer.placement="process"',
            "supervisor.intensity=10",
            "supervisor.period=300",
        ],
    )
    layout = cluster.prepare(cfg, tmp_path / "run")
    kills = {"rollout-0": 0, "trainer": 0}
    async with cluster.build_tree(cfg, layout) as tree:
        finished = asyncio.create_task(tree.wait())
        for point, target in ((2, "rollout-0"), (5, "trainer"), (7, "rollout-0")):
            await wait_until(
                lambda at=point: len(applied_steps(layout.run_dir)) >= at,
                timeout=120,
                what=f"{point} applied steps",
            )
            pid = await running_pid(tree, target, timeout=60)
            os.kill(pid, signal.SIGKILL)
            kills[target] += 1
        await asyncio.wait_for(finished, 240)
        snap = await tree.snapshot()
    for child in snap["children"]:
        assert child["restart_count"] == kills.get(child["id"], 0), child
    ledger = replay_samples_bus(layout.run_dir)
    check_exactly_once(ledger)
    assert len(ledger.trained) >= 12 * 8
    if kind == "openai":
        calls = logged_calls(log)
        for uid in ledger.trained:
            cols = ledger.rows[uid]["columns"]
            assert model_spans(cols["loss_mask"], cols["response_ids"]) == calls[cols["session"]]
