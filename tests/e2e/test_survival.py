"""A run survives bad data without restarting anything: broken rewards and a poisoned step.

(a) A reward function that raises, returns NaN or hangs past its timeout for some samples: the
    reward role keeps running, each failed sample's group is dropped with its reason and never
    trained on, the log says why, and training finishes.
(b) One huge (finite) reward makes one training step's gradient norm overflow: that step is
    skipped and says why, no weights version is published for it, the published weights stay
    finite, and training finishes.

Both replay the samples bus log offline (see ``tests/e2e/audit.py``): no sample is lost or
trained twice either way.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relax import cluster
from relax.config import load_config
from relax.models import load_tokenizer
from tests.e2e import fault_rewards
from tests.e2e.audit import (
    captured_logs,
    check_exactly_once,
    check_metrics,
    read_logs,
    read_metrics,
    replay_samples_bus,
)

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "digits" / "cluster.toml"
STEPS = 12
PROCESSES = [
    'rollout.placement="process"',
    'reward.placement="process"',
    'trainer.placement="process"',
    f"trainer.steps={STEPS}",
]


async def run(cfg, tmp_path: Path):
    """Run the cluster to the end with every log line captured (debug level: warnings held
    back by the reward role's rate limit too); the final tree snapshot."""
    layout = cluster.prepare(cfg, tmp_path / "run")
    with captured_logs(tmp_path / "run.log", level="debug"):
        async with cluster.build_tree(cfg, layout) as tree:
            await tree.wait()
            snap = await tree.snapshot()
    return layout.run_dir, snap, read_logs(tmp_path / "run.log")


def no_restarts(snap: dict) -> None:
    restarted = {c["id"]: c["restart_count"] for c in snap["children"] if c["restart_count"]}
    assert not restarted, restarted


@pytest.mark.timeout(240)
async def test_broken_reward_function_drops_its_samples_and_nothing_restarts(tmp_path) -> None:
    timeout = 1.0  # generous: a healthy call on a loaded 2-core machine must never hit it
    broken = (
        '{name="broken", kind="python", target="tests.e2e.fault_rewards:broken", '
        f"timeout={timeout}, options={{hang_s=3.0}}}}"
    )
    cfg = load_config(RECIPE, overrides=[*PROCESSES, f"reward.functions=[{broken}]"])
    run_dir, snap, logs = await run(cfg, tmp_path)

    no_restarts(snap)  # the reward role never crashed on its function's faults
    records = read_metrics(run_dir)
    _, redone = check_metrics(records, STEPS)
    assert redone == 0 and all(r["applied"] for r in records), records

    ledger = replay_samples_bus(run_dir)
    check_exactly_once(ledger)
    assert len(ledger.trained) == cfg.trainer.global_batch_size * STEPS

    # What the function did to each sample is a pure function of the response and answer:
    # recompute it offline for every row on the bus.
    tokenizer = load_tokenizer(run_dir / "model")
    text: dict[str, str] = {}
    how: dict[str, str] = {}
    for uid, row in ledger.rows.items():
        text[uid] = tokenizer.decode(row["columns"]["response_ids"], skip_special_tokens=True)
        how[uid] = fault_rewards.verdict(text[uid], row["columns"]["answer"])
    failing = {uid for uid, v in how.items() if v != "ok"}
    reward_failed = ledger.dropped_for("reward_failed")
    groups = {uid: row["group"] for uid, row in ledger.rows.items()}
    bad_groups = {groups[uid] for uid in failing}

    # Never trained on: neither a failed sample nor anything of its group.
    assert not {groups[uid] for uid in ledger.trained} & bad_groups
    # A failed sample got no reward; it left the bus with its group, for its reason (or never
    # reached the reward role before the run ended).
    assert not failing & set(ledger.rewards)
    unscored = ledger.pending | ledger.dropped_on_arrival | set(ledger.dropped)
    assert failing <= unscored, sorted(failing - unscored)[:5]
    # Every reward_failed drop had a failed sample behind it; every scored sample was right.
    for op in ledger.drop_ops:
        if op["reason"] == "reward_failed":
            assert set(op["groups"]) <= bad_groups, op
    for uid, reward in ledger.rewards.items():
        assert how[uid] == "ok" and reward == fault_rewards.digit(text[uid], {}), uid
    assert ledger.counters["dropped_reward_failed"] == len(reward_failed) > 0
    dropped_kinds = {how[uid] for uid in reward_failed & failing}
    assert dropped_kinds == {"raise", "nan", "hang"}, dropped_kinds

    # The reward role said, for each failed sample, which one and why: a warning, or (a
    # repeat of the same reason held back by the rate limit) a debug line.
    said = [
        e
        for e in logs.json
        if e.get("actor") == "reward-0"
        and {"uid", "reason"} <= e.keys()
        and (e.get("level") == "warning" or e.get("held_back") is True)
    ]
    logged = {e["uid"]: str(e["reason"]) for e in said}
    assert logged, "no warning from the reward role names a failed sample and its reason"
    # Identical warnings are rate-limited: one per reason per 30 s.
    last_warned: dict[str, datetime] = {}
    for e in said:
        if e["level"] == "warning":
            at = datetime.fromisoformat(e["timestamp"])
            before = last_warned.get(str(e["reason"]))
            assert before is None or (at - before).total_seconds() >= 29.0, e
            last_warned[str(e["reason"])] = at
    # Each left the bus with its group, unless the run ended before the drop was sent.
    gone = set(ledger.dropped) | ledger.pending
    assert set(logged) <= failing & gone, sorted(set(logged) - (failing & gone))[:5]
    expected = {
        "raise": "raised ValueError: deliberately broken reward",
        "nan": "returned nan",
        "hang": f"timed out after {timeout}s",
    }
    for uid, reason in logged.items():
        assert expected[how[uid]] in reason, (uid, how[uid], reason)
    assert {how[uid] for uid in logged} == {"raise", "nan", "hang"}
    announced = {groups[uid] for uid in logged}
    for op in ledger.drop_ops:  # no group was dropped for a failed reward without a word
        if op["reason"] == "reward_failed":
            assert set(op["groups"]) <= announced, op
    print(
        f"\nfailing samples on the bus: {len(failing)} "
        f"({ {k: sum(how[u] == k for u in failing) for k in expected} }); "
        f"logged: {len(logged)}; bus: {ledger.summary()}"
    )


@pytest.mark.timeout(240)
async def test_non_finite_step_is_skipped_and_never_published(tmp_path) -> None:
    marker = tmp_path / "poisoned"
    poison = (
        '{name="poison", kind="python", target="tests.e2e.fault_rewards:poison_once", '
        f'options={{marker="{marker}", after=150}}}}'
    )
    cfg = load_config(
        RECIPE,
        overrides=[
            *PROCESSES,
            'algorithm.advantage="dr_grpo"',  # no std normalisation: the huge reward stays huge
            f"reward.functions=[{poison}]",
            "checkpoint.every_steps=4",
        ],
    )
    run_dir, snap, logs = await run(cfg, tmp_path)

    no_restarts(snap)
    assert marker.exists(), "the poisoned reward was never handed out"
    ledger = replay_samples_bus(run_dir)
    check_exactly_once(ledger)
    (poisoned,) = [uid for uid, r in ledger.rewards.items() if r > 1e20]
    assert poisoned in ledger.trained  # consumed by the skipped step, not dropped

    # Exactly one step was skipped, for a non-finite loss or gradient norm, and said so.
    records = read_metrics(run_dir)
    applied, redone = check_metrics(records, STEPS)
    assert redone == 0 and applied == list(range(1, STEPS + 1)), applied
    (skipped,) = [r for r in records if not r["applied"]]
    assert "non-finite" in skipped["skipped_reason"], skipped
    assert skipped["reward_mean"] > 1e20  # the batch that held the poisoned group
    assert all(r["reward_mean"] <= 1.0 for r in records if r["applied"])
    assert skipped["version"] == skipped["step"]  # the policy version did not move
    reason = skipped["skipped_reason"]
    warned = [line for line in logs.text if "skipped" in line and reason in line] + [
        e for e in logs.json if e.get("level") == "warning" and reason in json.dumps(e)
    ]
    assert warned, f"no warning says why the step was skipped ({reason})"
    # The skipped batch was consumed (acked once), not retried.
    assert len(ledger.trained) == cfg.trainer.global_batch_size * (STEPS + 1)

    # No version was published for it: versions stay consecutive, one per applied step.
    assert ledger.versions == list(range(1, STEPS + 1)), ledger.versions
    files = sorted((run_dir / "samples" / "weights").glob("v*.safetensors"))
    assert files and files[-1].name == f"v{STEPS:012d}.safetensors", files
    for path in files:  # and what was published is never poisoned
        for name, tensor in load_file(path).items():
            assert torch.isfinite(tensor).all(), f"{path.name}: {name} is not finite"
    assert math.isfinite(sum(r["grad_norm"] for r in records if r["applied"]))
    # The final checkpoint holds exactly the last published weights.
    final = load_file(run_dir / "checkpoints" / f"step-{STEPS:08d}" / "model.safetensors")
    published = {name.split("/", 1)[1]: t for name, t in load_file(files[-1]).items()}
    assert final.keys() & published.keys() == final.keys(), sorted(final.keys() - published.keys())
    for name, tensor in final.items():
        assert torch.equal(tensor, published[name]), name
    print(f"\nskipped step {skipped['step']}: {skipped['skipped_reason']}; bus: {ledger.summary()}")
