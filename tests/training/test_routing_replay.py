"""R3 in training: rows carry the rollout's routing (``routed_experts``), the backend replays it
(``[trainer] routing_replay``), logs the router disagreement and the load-balancing loss.

The mismatch setup is a real one: the rollout samples with bf16 weights (as vLLM does), the
trainer scores in fp32. A dense model of the same size shows what that alone costs; an MoE
without replay is measurably further off (near-tie tokens flip experts), with replay it is back
near the dense figure."""

from __future__ import annotations

import pytest
import torch

from relax.config import AlgorithmConfig, ModelInitConfig, TrainerConfig
from relax.engines import HFEngine, SamplingParams
from relax.errors import ConfigError
from relax.models import build_tiny_model, load_policy, routing
from relax.training import TorchBackend, make_backend
from relax.training._batch import pack_batch
from relax.training._logprobs import forward_logprobs

pytestmark = pytest.mark.anyio
SIZES = {"vocab_size": 261, "hidden_size": 64, "num_layers": 2, "seed": 3}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 250, (12,), generator=g).tolist() for _ in range(16)]


async def sampled_rows(folder) -> list[dict]:
    """Rows as a bf16 rollout makes them (routing included on an MoE)."""
    engine = HFEngine.from_pretrained(folder, "bfloat16")
    gens = await engine.generate(prompts(), SamplingParams(max_new_tokens=24, n=2, seed=1))
    return [
        {
            "prompt_ids": g.prompt_ids,
            "response_ids": g.response_ids,
            "logprobs": g.logprobs,
            "reward": float(i % 2),
            "group": str(i // 2),
            **({} if g.routed_experts is None else {"routed_experts": g.routed_experts}),
        }
        for i, g in enumerate(gens)
    ]


def worst_mismatch(model, rows, replay: bool) -> float:
    batch = pack_batch(rows, 0)
    with torch.no_grad(), routing(model, batch.routed_experts, replay=replay):
        logprobs, _ = forward_logprobs(model, batch)
    return float((logprobs - batch.rollout_logprobs)[batch.mask > 0].abs().max())


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model(
        ModelInitConfig(arch="qwen3_moe", **SIZES), tmp_path_factory.mktemp("moe")
    )


async def test_replay_brings_an_moe_s_mismatch_back_to_a_dense_model_s(moe_dir, tmp_path) -> None:
    dense_dir = build_tiny_model(ModelInitConfig(arch="qwen2", **SIZES), tmp_path)
    dense = worst_mismatch(load_policy(dense_dir)[0], await sampled_rows(dense_dir), True)
    rows = await sampled_rows(moe_dir)
    model = load_policy(moe_dir)[0]
    without, with_replay = worst_mismatch(model, rows, False), worst_mismatch(model, rows, True)
    assert without > 3 * with_replay, (without, with_replay)
    assert with_replay < 3 * dense, (with_replay, dense)


async def test_a_step_replays_and_logs_disagreement_and_the_aux_loss(moe_dir) -> None:
    rows = await sampled_rows(moe_dir)
    shifted = [{**r, "routed_experts": (r["routed_experts"] + 1) % 8} for r in rows]
    results = {}
    for replay in (True, False):
        trainer = TrainerConfig(
            lr=1e-3,
            micro_batch_size=8,
            global_batch_size=32,
            routing_replay=replay,
            moe_aux_loss_coef=0.01,
        )
        backend = make_backend(trainer, AlgorithmConfig(), load_policy(moe_dir)[0], 0, 1.0)
        result = backend.step(shifted)
        assert result.applied
        results[replay] = result.metrics
    for metrics in results.values():
        # Every recorded token was moved: the trainer's own routers disagree with (almost:
        # where bf16 and fp32 routed apart, fp32's may be the moved one) all of it.
        assert metrics["router_disagreement"] > 0.95
        assert metrics["moe_aux_loss"] > 0
    # Replaying the (shifted) experts scores other log-probs than routing itself.
    assert results[True]["mismatch_kl"] != pytest.approx(results[False]["mismatch_kl"])


async def test_rows_without_routing_train_as_a_dense_batch_would(moe_dir) -> None:
    rows = [
        {k: v for k, v in r.items() if k != "routed_experts"} for r in await sampled_rows(moe_dir)
    ]
    backend = TorchBackend(
        load_policy(moe_dir)[0],
        TrainerConfig(micro_batch_size=8, global_batch_size=32, routing_replay=True),
        AlgorithmConfig(),
        pad_id=0,
    )
    result = backend.step(rows)
    assert result.applied and "router_disagreement" not in result.metrics


def test_replay_on_a_dense_model_is_a_clear_error(tmp_path) -> None:
    dense = load_policy(build_tiny_model(ModelInitConfig(**SIZES), tmp_path))[0]
    with pytest.raises(ConfigError, match="routing_replay"):
        make_backend(TrainerConfig(routing_replay=True), AlgorithmConfig(), dense, 0, 1.0)


def test_a_record_of_the_wrong_length_is_refused_when_packed() -> None:
    row = {
        "prompt_ids": [1, 2],
        "response_ids": [3],
        "logprobs": [-1.0],
        "reward": 1.0,
        "group": "g",
        "routed_experts": torch.zeros((2, 2, 2), dtype=torch.uint8),  # 3 tokens, not 2
    }
    with pytest.raises(ValueError, match=r"row 0: routed_experts has shape \[2, 2, 2\]"):
        pack_batch([row], 0)


async def test_the_reference_scores_with_the_rollout_s_routing_too(moe_dir) -> None:
    from relax.roles._reference import reference_logprobs

    rows = await sampled_rows(moe_dir)
    shifted = [{**r, "routed_experts": (r["routed_experts"] + 1) % 8} for r in rows]
    model = load_policy(moe_dir)[0]
    replayed = reference_logprobs(model, shifted, pad_id=0, routing_replay=True)
    itself = reference_logprobs(model, shifted, pad_id=0, routing_replay=False)
    batch = pack_batch(shifted, 0)
    with torch.no_grad(), routing(model, batch.routed_experts):
        want, _ = forward_logprobs(model, batch)
    for row, values in enumerate(replayed):
        n = len(shifted[row]["response_ids"])
        start = len(shifted[row]["prompt_ids"]) - 1
        torch.testing.assert_close(torch.tensor(values), want[row, start : start + n])
    assert replayed != itself


@pytest.mark.parametrize("stage", [2, 3])
async def test_deepspeed_zero_replays_as_the_torch_backend_does(moe_dir, stage) -> None:
    pytest.importorskip("deepspeed")
    from relax.training import DeepSpeedBackend

    rows = await sampled_rows(moe_dir)
    shifted = [{**r, "routed_experts": (r["routed_experts"] + 1) % 8} for r in rows]
    common = {"lr": 1e-3, "micro_batch_size": 8, "global_batch_size": 32}
    plain = TorchBackend(
        load_policy(moe_dir)[0],
        TrainerConfig(**common, routing_replay=True),
        AlgorithmConfig(),
        pad_id=0,
    )
    sharded = DeepSpeedBackend(
        load_policy(moe_dir)[0],
        TrainerConfig(**common, backend="deepspeed", zero_stage=stage, routing_replay=True),
        AlgorithmConfig(),
        pad_id=0,
    )
    want, got = plain.step(shifted), sharded.step(shifted)
    assert got.applied
    for key in ("loss", "mismatch_kl", "router_disagreement"):
        assert got.metrics[key] == pytest.approx(want.metrics[key], rel=1e-4, abs=1e-6), key
