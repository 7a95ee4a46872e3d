"""The step's objective: every aggregation and rollout correction gives exactly the whole-batch
loss however the batch is cut into micro-batches, the former off_policy names mean what they
did, and a rejected token leaves the loss as if it were masked."""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import torch

from relax.config import AlgorithmConfig, TrainerConfig
from relax.training import TorchBackend, pack_batch
from relax.training._objective import (
    aggregation,
    compute_advantages,
    correct_batch,
    correction_spec,
    loss_denominator,
    micro_batch_loss,
)
from tests.training.conftest import PAD, make_rows

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]

CORRECTIONS = {
    "none": {},
    "tis": {"off_policy": "tis", "tis_cap": 1.5},
    "icepop": {"off_policy": "icepop", "tis_cap": 1.5},
    "seq-is-norm": {"rollout_correction": {"is_level": "sequence", "is_batch_normalize": True}},
    "geo-mask": {
        "rollout_correction": {"is_level": "geometric", "is_mode": "mask", "is_high": 1.1}
    },
    "gspo-reject": {"loss": "gspo", "rollout_correction": {"reject_seq_k3": 0.08}},
    "cispo-geo-reject": {
        "loss": "cispo",
        "rollout_correction": {"reject_geo_low": 0.9, "reject_geo_high": 1.1},
    },
    "reject": {
        "rollout_correction": {
            "is_level": "token",
            "is_high": 1.5,
            "reject_token_high": 1.6,
            "reject_seq_k3": 0.08,
        }
    },
}


def _config(mode: str, extra: dict) -> AlgorithmConfig:
    norm = {"loss_norm_length": 6.0} if mode == "seq-mean-token-sum-norm" else {}
    kl = {"kl": {"coef": 0.1, "estimator": "low_var_kl"}}
    return AlgorithmConfig(
        loss_aggregation=mode, entropy_coef=0.01, advantage="reinforce_pp", **norm, **kl, **extra
    )


def _junk_batch(seed: int):
    """A packed batch of ragged rows whose positions outside the mask hold junk, plus the
    trainer's log-probs (a leaf to differentiate) and entropies with junk there too."""
    rows = make_rows(n_groups=3, per_group=3, seed=seed)
    rng = random.Random(seed)
    for row in rows:
        row["ref_logprobs"] = [lp + rng.uniform(-0.5, 0.5) for lp in row["logprobs"]]
        row["loss_mask"] = [int(rng.random() > 0.2) for _ in row["response_ids"]]
    rows[1]["loss_mask"] = [0] * len(rows[1]["response_ids"])  # a row with nothing counted
    batch = pack_batch(rows, PAD)
    gen = torch.Generator().manual_seed(seed)
    off = batch.mask == 0
    junk = lambda: (torch.rand(batch.mask.shape, generator=gen) - 0.5) * 2e4  # noqa: E731
    batch = replace(
        batch,
        rollout_logprobs=torch.where(off, junk(), batch.rollout_logprobs),
        ref_logprobs=torch.where(off, junk(), batch.ref_logprobs),
    )
    near = batch.rollout_logprobs + 0.4 * torch.randn(batch.mask.shape, generator=gen)
    logprobs = torch.where(off, junk(), near).requires_grad_()
    entropy = torch.where(off, junk(), torch.rand(batch.mask.shape, generator=gen))
    return batch, logprobs, entropy


def _loss_in_micro_batches(mode: str, extra: dict, micro: int, seed: int):
    """The step's loss as ``SafeStepBackend.compute_gradients`` accumulates it, and the
    gradient on the trainer's log-probs."""
    cfg = _config(mode, extra)
    batch, logprobs, entropy = _junk_batch(seed)
    adv, _ = compute_advantages(batch, cfg)
    junk = 1e3 * torch.randn(adv.shape, generator=torch.Generator().manual_seed(seed))
    adv = torch.where(batch.mask > 0, adv, junk)
    weights, metrics = None, {}
    if correction_spec(cfg).needs_whole_batch:
        batch, weights, metrics = correct_batch(batch, logprobs.detach(), cfg)
    agg = aggregation(cfg)
    total_den = loss_denominator(batch.mask, agg)
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, batch.size, micro):
        mb = batch.select(start, min(start + micro, batch.size))
        width = mb.mask.shape[1]
        rows = slice(start, start + mb.size)
        w = None if weights is None else weights[rows, :width]
        loss, _, _ = micro_batch_loss(
            logprobs[rows, :width], entropy[rows, :width], mb, adv[rows, :width], cfg, w
        )
        total = total + loss * (loss_denominator(mb.mask, agg) / total_den)
    (grad,) = torch.autograd.grad(total, logprobs)
    return total.detach(), grad, metrics


@pytest.mark.parametrize("correction", sorted(CORRECTIONS))
@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_sum_to_the_whole_batch_loss(mode: str, correction: str) -> None:
    whole, whole_grad, metrics = _loss_in_micro_batches(mode, CORRECTIONS[correction], 9, seed=1)
    assert torch.isfinite(whole) and torch.isfinite(whole_grad).all()
    if "reject" in correction:  # the rules must bite on this batch for the test to mean much
        assert 0 < metrics["rejected_token_frac"].item() < 1
    for micro in (1, 2, 4):
        got, grad, _ = _loss_in_micro_batches(mode, CORRECTIONS[correction], micro, seed=1)
        torch.testing.assert_close(got, whole, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, whole_grad, rtol=1e-5, atol=1e-8)


def test_former_off_policy_names_map_onto_the_table() -> None:
    tis = correction_spec(AlgorithmConfig(off_policy="tis", tis_cap=3.0))
    assert (tis.is_level, tis.is_mode, tis.is_high, tis.on_reject) == (
        "token",
        "truncate",
        3.0,
        "drop",
    )
    assert not tis.needs_whole_batch  # computed per micro-batch, as before
    icepop = correction_spec(AlgorithmConfig(off_policy="icepop", tis_cap=4.0))
    assert (icepop.is_mode, icepop.is_low, icepop.is_high) == ("mask", 0.25, 4.0)
    assert icepop.on_reject == "zero_weight" and not icepop.needs_whole_batch
    assert not correction_spec(AlgorithmConfig(off_policy="decoupled")).active
    assert not correction_spec(AlgorithmConfig()).active
    # the old aggregation names still mean the same reductions
    assert AlgorithmConfig(aggregation="token").loss_aggregation == "token-mean"
    assert AlgorithmConfig(aggregation="sequence").loss_aggregation == "seq-mean-token-mean"
    assert aggregation(AlgorithmConfig(loss="gspo", loss_aggregation="token-mean")) == (
        "seq-mean-token-mean"
    )


# --------------------------------------------------------------------------- through the trainer


def _backend(model, algo: dict, **trainer) -> TorchBackend:
    trainer = {"lr": 1e-3, "micro_batch_size": 2, "global_batch_size": 6, **trainer}
    return TorchBackend(model, TrainerConfig(**trainer), AlgorithmConfig(**algo), pad_id=PAD)


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_rejected_tokens_train_exactly_like_masked_ones(load_model) -> None:
    """With on_reject = "drop", rejecting a token equals giving it loss_mask 0."""
    rows = make_rows(n_groups=2, per_group=2, seed=21, model=load_model())  # on-policy
    rejected = copy.deepcopy(rows)
    masked = copy.deepcopy(rows)
    for i, (rej, msk) in enumerate(zip(rejected, masked, strict=True)):
        j = i % len(rej["logprobs"])
        rej["logprobs"][j] -= 3.0  # ratio e^3 > reject_token_high
        msk["loss_mask"] = [int(k != j) for k in range(len(msk["logprobs"]))]
    algo = {"loss_aggregation": "token-mean", "rollout_correction": {"reject_token_high": 2.0}}
    grads, metrics = [], []
    for batch_rows, cfg in ((rejected, algo), (masked, {}), (rejected, {})):
        model = load_model()
        backend = _backend(model, cfg, global_batch_size=4)
        step_metrics, problem = backend.compute_gradients(batch_rows)
        assert problem is None
        grads.append(_grads(model))
        metrics.append(step_metrics)
    assert metrics[0]["rejected_token_frac"] == pytest.approx(4 / metrics[0]["tokens"])
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # without the rule, the same rows train differently (the test has teeth)
    assert any(not torch.allclose(a, c, rtol=1e-3) for a, c in zip(grads[0], grads[2], strict=True))


@pytest.mark.parametrize(
    "algo",
    [
        {"loss_aggregation": "seq-mean-token-mean"},
        {"loss_aggregation": "seq-mean-token-sum"},
        {"loss_aggregation": "seq-mean-token-sum-norm", "loss_norm_length": 8.0},
        {
            "loss_aggregation": "token-mean",
            "rollout_correction": {
                "is_level": "sequence",
                "is_batch_normalize": True,
                "reject_token_low": 0.3,
            },
        },
    ],
    ids=["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "reject"],
)
def test_backend_micro_batching_matches_one_big_batch(load_model, algo: dict) -> None:
    """TorchBackend's own loop (tests/training/test_torch_backend.py has token-mean)."""
    rows = make_rows(n_groups=2, per_group=2, seed=24)
    for row in rows[:2]:
        row["loss_mask"] = [1] * (len(row["response_ids"]) - 1) + [0]
    grads = []
    for micro in (1, 4):
        model = load_model()
        backend = _backend(model, algo, micro_batch_size=micro, global_batch_size=4)
        _, problem = backend.compute_gradients(rows)
        assert problem is None
        grads.append(_grads(model))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_new_mode_steps_through_the_trainer_and_logs_its_metrics(load_model) -> None:
    model = load_model()
    algo = {
        "loss_aggregation": "seq-mean-token-sum-norm",
        "loss_norm_length": 8.0,
        "dual_clip": 3.0,
        "kl": {"coef": 0.05, "estimator": "low_var_kl"},
        "rollout_correction": {
            "is_level": "geometric",
            "is_batch_normalize": True,
            "reject_token_low": 0.3,
        },
    }
    rows = make_rows(n_groups=2, per_group=3, seed=22)  # random rollout log-probs: off-policy
    for row in rows:
        row["ref_logprobs"] = [lp - 0.1 for lp in row["logprobs"]]
    result = _backend(model, algo, micro_batch_size=3).step(rows)
    assert result.applied, result.skipped_reason
    m = result.metrics
    for key in (
        "ppo_kl",
        "approx_kl",
        "kl",
        "is_weight_mean",
        "is_weight_max",
        "is_batch_norm_factor",
        "rejected_token_frac",
        "rejected_seq_frac",
    ):
        assert isinstance(m[key], float), key
    assert 0 < m["rejected_token_frac"] < 1  # rollout log-probs are far from the model's
    assert m["ppo_kl"] == pytest.approx(0.0, abs=1e-6)  # one update per batch: old == new


def test_a_batch_whose_every_token_is_rejected_is_skipped(load_model) -> None:
    model = load_model()
    rows = make_rows(n_groups=1, per_group=2, seed=23)
    result = _backend(model, {"rollout_correction": {"reject_geo_high": 1e-30}}).step(rows)
    assert not result.applied
    assert result.skipped_reason == "the rollout correction rejected every token"
    assert result.metrics["rejected_seq_frac"] == 1.0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm", "seq-mean-token-mean"])
def test_loss_denominators_stay_float32_whatever_the_default_dtype(agg: str) -> None:
    # torch's default dtype is process-wide, and transformers sets it while it builds a model:
    # a bf16 model loading in another thread (an in-process role restarting) must not turn a
    # step's denominator into bf16, where 257 rows count as 256.
    mask = torch.ones(257, 1, dtype=torch.bool)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        got = loss_denominator(mask, agg)
    finally:
        torch.set_default_dtype(default)
    assert got.dtype == torch.float32 and got.item() == 257.0
