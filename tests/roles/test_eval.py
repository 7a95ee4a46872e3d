"""The evaluator ([eval]): which versions it evaluates, what it skips when behind, what it
computes, and that stopping it evaluates the newest version it has not (the final policy)."""

from __future__ import annotations

import json
import math

import pytest

from relax.actors import ChildSpec, InProc
from relax.bus import BusClient
from relax.models import load_policy, load_tokenizer
from relax.observe import EVAL_FILE
from relax.roles import EvalRole, eval_metrics
from relax.roles._eval import due, passed_over
from tests.polling import wait_until
from tests.roles.helpers import bus_spec, config, start, tiny_model

pytestmark = pytest.mark.anyio


def test_due_versions_are_multiples_and_the_final_one() -> None:
    assert [v for v in range(13) if due(v, 5, final=12)] == [0, 5, 10, 12]


@pytest.mark.parametrize(
    ("last", "version", "every", "missed"),
    [
        (0, 5, 5, 0),  # the next multiple: nothing passed over
        (5, 7, 5, 0),
        (5, 15, 5, 1),  # 10
        (5, 16, 5, 2),  # 10 and 15
        (-1, 10, 5, 2),  # from nothing evaluated: 0 and 5
    ],
)
def test_passed_over_counts_due_versions_strictly_between(last, version, every, missed) -> None:
    assert passed_over(last, version, every) == missed


def test_eval_metrics() -> None:
    # Two prompts, k = 4: the first has 2 of 4 correct, the second none (one failed reward).
    rewards = [1.0, 0.0, 1.0, 0.5, 0.0, None, 0.0, 0.0]
    got = eval_metrics(rewards, k=4, threshold=1.0)
    assert got["eval/mean_reward"] == pytest.approx(2.5 / 7)  # the failed one left out
    assert got["eval/pass@1"] == pytest.approx((2 / 4 + 0) / 2)
    assert got["eval/pass@k"] == pytest.approx((1 + 0) / 2)
    assert got["eval/failed_rewards"] == 1 and got["eval/samples"] == 8
    # With a threshold of 0.5 the 0.5 counts: 3 of 4 correct.
    assert eval_metrics(rewards, 4, 0.5)["eval/pass@1"] == pytest.approx(3 / 8)


@pytest.mark.timeout(120)
async def test_evaluator_follows_versions_skips_when_behind_and_evaluates_the_last(
    tmp_path,
) -> None:
    model_dir = tiny_model(tmp_path)
    cfg = config(
        "[rollout]\nmax_new_tokens = 3\n"
        "[eval]\nevery_steps = 5\nn_prompts = 4\nsamples_per_prompt = 2\n"
    )
    cfg["trainer"]["steps"] = 100  # the final version is never reached here
    bus, url = bus_spec(["train"], tmp_path)
    role = ChildSpec(
        "eval",
        EvalRole,
        kwargs={
            "config": cfg,
            "samples_url": url,
            "model_dir": str(model_dir),
            "run_dir": str(tmp_path),
        },
        placement=InProc(),
        shutdown=60.0,
    )
    path = tmp_path / EVAL_FILE

    def versions() -> list[int]:
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line)["version"] for line in lines]

    weights = load_policy(model_dir)[0].state_dict()
    sup = await start([bus, role])
    try:
        await wait_until(lambda: versions() == [0], 60, "the evaluation of version 0")
        async with await BusClient.connect(url) as client:
            await client.publish_weights(3, weights)  # not due
            await client.publish_weights(5, weights)
            await wait_until(lambda: versions() == [0, 5], 60, "the evaluation of version 5")
            # Behind: 10 is never seen (12 comes, then 15): it is skipped and counted.
            await client.publish_weights(12, weights)
            await client.publish_weights(15, weights)
            await wait_until(lambda: versions()[-1:] == [15], 60, "the evaluation of 15")
            await client.publish_weights(16, weights)  # not due: only the stop evaluates it
            stats = await sup.ref("eval").call("statistics")
            assert stats["evaluated"] == 15 and stats["skipped_versions"] == 1
    finally:
        await sup.__aexit__(None, None, None)
    assert versions() == [0, 5, 15, 16]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["eval/skipped_versions"] for r in records] == [0, 0, 1, 1]
    for r in records:
        assert r["step"] == r["version"] and r["eval/samples"] == 8
        assert math.isfinite(r["eval/mean_reward"]) and 0 <= r["eval/pass@1"] <= r["eval/pass@k"]


def held_out(tmp_path, extra: str) -> list[dict]:
    model_dir = tiny_model(tmp_path)
    role = EvalRole(
        config=config(extra), samples_url="inproc://unused", model_dir=str(model_dir),
        run_dir=str(tmp_path),
    )  # fmt: skip
    role.tokenizer = load_tokenizer(model_dir)
    return role._held_out_prompts()


def test_held_out_prompts_default_to_the_builtin_task_with_another_seed(tmp_path) -> None:
    rows = held_out(tmp_path, "[eval]\nevery_steps = 5\nn_prompts = 6\n")
    assert [r["uid"] for r in rows] == [f"arith-1-{i}" for i in range(6)]  # training: arith-0-


def test_a_held_out_file_smaller_than_n_prompts_is_used_once(tmp_path) -> None:
    data = tmp_path / "heldout.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(3))
    )
    rows = held_out(
        tmp_path, f'[eval]\nevery_steps = 5\nn_prompts = 10\n[eval.data]\npath = "{data}"\n'
    )
    assert [r["columns"]["answer"] for r in rows] == ["1", "2", "3"]
