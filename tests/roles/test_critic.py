"""The value model, its training, and the critic role on a bus."""

from __future__ import annotations

import json
import math

import pytest
import torch

from relax.actors import ChildSpec, InProc
from relax.bus import BusClient
from relax.config import AlgorithmConfig
from relax.roles import CriticRole
from relax.training import pack_batch
from relax.training._value import (
    CriticTrainer,
    ValueModel,
    clipped_value_loss,
    critic_token_rewards,
    value_forward,
)
from tests.polling import wait_until
from tests.roles.helpers import bus_spec, config, sample_rows, start, take_written, tiny_model

pytestmark = pytest.mark.anyio


def rows_with_rewards(n: int = 8, seed: int = 0) -> list[dict]:
    rewards = [float(i % 2) for i in range(n)]
    return [r["columns"] for r in sample_rows(n, seed=seed, reward=rewards)]


def trainer(model: ValueModel, **kwargs) -> CriticTrainer:
    kwargs.setdefault("lr", 1e-2)
    return CriticTrainer(model, AlgorithmConfig(), pad_id=256, micro_batch_size=3, **kwargs)


# ------------------------------------------------------------------ the value model


def test_value_model_starts_at_zero_and_round_trips(tmp_path) -> None:
    model = ValueModel.from_pretrained(tiny_model(tmp_path))
    assert not hasattr(model.body, "lm_head")  # the body only: no language-model head
    critic = trainer(model)
    rows = rows_with_rewards()
    values = critic.values(rows)
    assert [len(v) for v in values] == [len(r["response_ids"]) for r in rows]
    assert all(v == 0.0 for vals in values for v in vals)
    critic.train(rows, values)  # move away from zero
    moved = critic.values(rows)
    assert any(v != 0.0 for vals in moved for v in vals)
    model.save_pretrained(tmp_path / "saved")
    again = trainer(ValueModel.from_pretrained(tmp_path / "saved"))
    for a, b in zip(again.values(rows), moved, strict=True):
        assert a == pytest.approx(b, abs=1e-6)


def test_values_do_not_depend_on_padding_or_batching(tmp_path) -> None:
    model = ValueModel.from_pretrained(tiny_model(tmp_path))
    with torch.no_grad():
        model.head.weight.normal_()
    rows = rows_with_rewards(7)
    batched = trainer(model).values(rows)
    for row, vals in zip(rows, batched, strict=True):
        alone = trainer(model).values([row])[0]
        assert vals == pytest.approx(alone, abs=1e-5)


def test_values_sit_at_the_positions_that_predict_response_tokens(tmp_path) -> None:
    model = ValueModel.from_pretrained(tiny_model(tmp_path))
    with torch.no_grad():
        model.head.weight.normal_()
    prompt, response = [5, 6, 7], [8, 9]
    batch = pack_batch(
        [
            {
                "prompt_ids": prompt,
                "response_ids": response,
                "logprobs": [0, 0],
                "reward": 0.0,
                "group": 0,
            }
        ],
        pad_id=256,
    )
    with torch.no_grad():
        per_token = value_forward(model, batch)[0]
        full = model(batch.input_ids, batch.attention_mask)[0]
    # Response token j is predicted at position len(prompt) - 1 + j: V(s) before generating it.
    assert per_token.tolist() == pytest.approx([0.0, 0.0, full[2].item(), full[3].item()])


# ------------------------------------------------------------------ the loss and the targets


def test_clipped_value_loss_takes_the_pessimistic_side() -> None:
    old = torch.zeros(1, 3)
    returns = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    values = torch.tensor([[2.0, 0.3, 0.0]], requires_grad=True)
    loss, metrics = clipped_value_loss(values, old, returns, mask, clip=0.5)
    # token 0: unclipped (2-1)^2 = 1, clipped (0.5-1)^2 = 0.25 -> 1
    # token 1: inside the clip range -> (0.3-1)^2 = 0.49; token 2: (0+1)^2 = 1
    assert loss.item() == pytest.approx(0.5 * (1 + 0.49 + 1) / 3)
    assert metrics["value_clip_frac"].item() == 0.0
    # Moving past the clip range towards the target earns nothing: the clipped term wins.
    values = torch.tensor([[0.0, 0.9, 0.0]], requires_grad=True)
    loss, metrics = clipped_value_loss(values, old, returns, mask, clip=0.5)
    loss.backward()
    assert values.grad[0, 1].item() == 0.0
    assert metrics["value_clip_frac"].item() == pytest.approx(1 / 3)
    plain, _ = clipped_value_loss(values, old, returns, mask, clip=None)
    assert plain.item() == pytest.approx(0.5 * (1 + 0.01 + 1) / 3)


def test_critic_targets_are_gae_returns_with_the_reward_on_the_last_token(tmp_path) -> None:
    rows = [{"prompt_ids": [1, 2], "response_ids": [3, 4, 5], "reward": 2.0}]
    model = ValueModel.from_pretrained(tiny_model(tmp_path))
    critic = CriticTrainer(
        model, AlgorithmConfig(gamma=1.0, lam=1.0), lr=1e-2, pad_id=256, value_clip=None
    )
    batch = pack_batch([{**rows[0], "logprobs": [0, 0, 0], "group": 0}], 256)
    assert critic_token_rewards(batch, critic.algorithm)[0].tolist() == [0.0, 0.0, 0.0, 2.0]
    # gamma = lam = 1 and values 0: every response token's return is the final reward, so
    # the first update's loss is 0.5 * 2^2.
    applied, metrics = critic.train(rows, [[0.0, 0.0, 0.0]])
    assert applied and metrics["return_mean"] == pytest.approx(2.0)
    assert metrics["value_loss"] == pytest.approx(2.0)


def test_the_kl_penalty_is_part_of_the_critic_reward_in_reward_mode() -> None:
    cfg = AlgorithmConfig.model_validate({"kl": {"coef": 0.5, "mode": "reward", "estimator": "k1"}})
    row = {
        "prompt_ids": [1],
        "response_ids": [2, 3],
        "logprobs": [-1.0, -2.0],
        "ref_logprobs": [-1.5, -1.0],
        "reward": 1.0,
        "group": 0,
    }
    batch = pack_batch([row], 0)
    # k1 = logp - ref: 0.5 and -1.0, times 0.5, subtracted per token.
    assert critic_token_rewards(batch, cfg)[0].tolist() == pytest.approx([-0.25, 1.5])


# ------------------------------------------------------------------ training


def test_value_loss_drops_on_a_fixed_batch(tmp_path) -> None:
    critic = trainer(ValueModel.from_pretrained(tiny_model(tmp_path)), lr=1e-2, epochs=1)
    rows = rows_with_rewards(8)
    losses = []
    for _ in range(15):
        applied, metrics = critic.train(rows, critic.values(rows))
        assert applied
        losses.append(metrics["value_loss"])
    # Measured: 0.23 -> below 0.005 after 10 updates.
    assert losses[-1] < 0.2 * losses[0], losses
    assert critic.updates == 15


def test_a_non_finite_loss_skips_the_update_and_keeps_the_weights(tmp_path) -> None:
    critic = trainer(ValueModel.from_pretrained(tiny_model(tmp_path)))
    rows = rows_with_rewards(4)
    before = {k: v.clone() for k, v in critic.model.state_dict().items()}
    bad = [dict(r) for r in rows]
    bad[0]["reward"] = math.nan
    applied, metrics = critic.train(bad, critic.values(bad))
    assert not applied and "non-finite" in metrics["skipped_reason"]
    assert critic.updates == 0 and critic.skipped == 1
    for name, tensor in critic.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_a_checkpoint_restores_weights_optimiser_and_count(tmp_path) -> None:
    model_dir = tiny_model(tmp_path)
    critic = trainer(ValueModel.from_pretrained(model_dir))
    rows = rows_with_rewards(6)
    for _ in range(3):
        critic.train(rows, critic.values(rows))
    critic.save_checkpoint(tmp_path / "ckpt")
    again = trainer(ValueModel.from_pretrained(model_dir))
    again.load_checkpoint(tmp_path / "ckpt")
    assert again.updates == 3
    assert again.values(rows) == critic.values(rows)
    # The next update is the same too: the optimiser state came back with the weights.
    critic.train(rows, critic.values(rows))
    again.train(rows, again.values(rows))
    for a, b in zip(again.values(rows), critic.values(rows), strict=True):
        assert a == pytest.approx(b, abs=1e-6)


# ------------------------------------------------------------------ the role


async def test_the_role_writes_values_then_learns_and_resumes(tmp_path) -> None:
    model_dir = tiny_model(tmp_path)
    run_dir = tmp_path / "run"
    cfg = config(
        '[critic]\nenabled = true\nlr = 0.01\n[algorithm]\nadvantage = "gae"\n'
        "[checkpoint]\nevery_steps = 2\nkeep_last = 2\n"
    )
    bus, url = bus_spec(["critic", "train"], tmp_path)

    def critic_spec() -> ChildSpec:
        return ChildSpec(
            "critic-0",
            CriticRole,
            kwargs={
                "config": cfg,
                "samples_url": url,
                "model_dir": str(model_dir),
                "run_dir": str(run_dir),
            },
            placement=InProc(),
        )

    rows = sample_rows(8, reward=[float(i % 2) for i in range(8)])
    # A row without a reward is not the critic's yet.
    rows.append({**sample_rows(1, seed=3)[0], "uid": "late/0", "group": "late", "group_size": 1})
    rows[-1]["columns"]["response_ids"] = [1, 2]
    rows[-1]["columns"]["logprobs"] = [-1.0, -1.0]
    sup = await start([bus, critic_spec()])
    try:
        async with await BusClient.connect(url) as client:
            await client.put(rows)
            got = await take_written(client, "values", 8, writer="the critic")
            assert "late/0" not in got
            for row in rows[:8]:
                assert len(got[row["uid"]]) == len(row["columns"]["response_ids"])
            await client.add_columns("late/0", {"reward": 1.0})
            async with client.take("train", batch_size=1, columns=["values"], wait=30.0) as b:
                assert [r["uid"] for r in b.rows] == ["late/0"]
                assert len(b.rows[0]["columns"]["values"]) == 2

            async def all_acked() -> bool:
                stats = await client.statistics()
                return stats["counters"].get("acked_critic", 0) >= 9

            # Acked once trained on: all nine rows (the empty response is skipped in training).
            await wait_until(all_acked, 30, "the critic to ack all nine rows", interval=0.05)
            history = await sup.ref("critic-0").call("metrics")
            assert sum(h["rows"] for h in history) == 8
            updates = (await sup.ref("critic-0").call("statistics"))["updates"]
            assert updates == len(history) >= 2
            assert all(math.isfinite(h["value_loss"]) for h in history)
        # Stop and start it again (a restart inside the run): it continues, not from scratch.
        await sup.terminate_child("critic-0")
        saved = sorted((run_dir / "checkpoints" / "critic").glob("update-*"))
        assert saved and saved[-1].name == f"update-{updates:08d}"
        await sup.restart_child("critic-0")
        assert (await sup.ref("critic-0").call("statistics"))["updates"] == updates
    finally:
        await sup.__aexit__(None, None, None)
    records = [json.loads(line) for line in (run_dir / "critic.jsonl").read_text().splitlines()]
    assert len(records) == updates
