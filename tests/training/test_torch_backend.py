"""TorchBackend: updates, learning, safe skips, micro-batching, loss masks, checkpoints."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relax.config import AlgorithmConfig, TrainerConfig
from relax.replay import comparable_metrics
from relax.training import StepResult, TorchBackend, pack_batch, sequence_logprobs
from tests.training.conftest import PAD, make_rows


def _backend(model, algo: dict | None = None, **trainer) -> TorchBackend:
    trainer = {"lr": 1e-3, "micro_batch_size": 2, "global_batch_size": 4, **trainer}
    return TorchBackend(
        model, TrainerConfig(**trainer), AlgorithmConfig(**(algo or {})), pad_id=PAD
    )


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_step_updates_weights_and_version(load_model) -> None:
    model = load_model()
    backend = _backend(model)
    before = _weights(model)
    result = backend.step(make_rows(model=model))
    assert isinstance(result, StepResult)
    assert result.applied and result.skipped_reason is None
    assert backend.version == 1
    assert not _same(before, _weights(model))
    for key in (
        "loss",
        "policy_loss",
        "entropy",
        "grad_norm",
        "clip_frac",
        "reward_mean",
        "advantage_mean",
        "advantage_std",
        "tokens",
        "step_time_s",
        "gradient_time_s",
        "update_time_s",
    ):
        assert isinstance(result.metrics[key], float), key
    assert result.metrics["reward_mean"] == 0.5
    assert result.metrics["tokens"] > 0 and result.metrics["grad_norm"] > 0
    assert result.metrics["version"] == 1.0


def test_learning_raises_logprob_of_rewarded_response(load_model) -> None:
    model = load_model()
    backend = _backend(model, lr=1e-2, micro_batch_size=1, global_batch_size=2)
    rows = make_rows(n_groups=1, per_group=2, seed=5, model=model)
    assert [r["reward"] for r in rows] == [0.0, 1.0]
    batch = pack_batch(rows, PAD)

    def total_logprob(index: int) -> float:
        with torch.no_grad():
            return (sequence_logprobs(model, batch) * batch.mask)[index].sum().item()

    good0, bad0 = total_logprob(1), total_logprob(0)
    for _ in range(8):
        assert backend.step(rows).applied
    assert total_logprob(1) > good0 + 1.0
    assert total_logprob(0) < bad0
    assert backend.version == 8


def test_nan_reward_skips_step_bit_identically(load_model, caplog) -> None:
    model = load_model()
    backend = _backend(model)
    backend.step(make_rows(model=model))  # give AdamW some state worth protecting
    weights = _weights(model)
    opt_state = copy.deepcopy(backend.optimizer.state_dict())
    rows = make_rows(model=model, seed=1)
    rows[0]["reward"] = float("nan")
    with caplog.at_level("WARNING", logger="relax.training"):
        result = backend.step(rows)
    assert not result.applied
    assert result.skipped_reason == "non-finite reward in rows [0]"
    assert "skipped" in caplog.text
    assert backend.version == 1 and backend.skipped_steps == 1
    assert _same(weights, _weights(model))
    assert all(p.grad is None for p in model.parameters())
    after = backend.optimizer.state_dict()
    for key, state in opt_state["state"].items():
        assert all(torch.equal(state[k], after["state"][key][k]) for k in state)
    # The next healthy step applies normally.
    assert backend.step(make_rows(model=model, seed=2)).applied
    assert backend.version == 2


def test_nan_from_forward_hook_skips(load_model) -> None:
    model = load_model()
    backend = _backend(model)
    weights = _weights(model)
    handle = model.model.norm.register_forward_hook(lambda _m, _i, out: out * float("nan"))
    result = backend.step(make_rows(model=None))
    handle.remove()
    assert not result.applied and "non-finite loss" in (result.skipped_reason or "")
    assert _same(weights, _weights(model))
    assert all(p.grad is None for p in model.parameters())


def test_non_finite_token_inputs_skip(load_model) -> None:
    rows = make_rows()
    rows[2]["logprobs"][0] = float("inf")
    result = _backend(load_model()).step(rows)
    assert result.skipped_reason == "non-finite rollout_logprobs in rows [2]"


def test_grad_norm_above_threshold_skips(load_model) -> None:
    model = load_model()
    backend = _backend(model, max_grad_norm_skip=1e-9)
    weights = _weights(model)
    result = backend.step(make_rows(model=model))
    assert not result.applied
    assert "max_grad_norm_skip" in (result.skipped_reason or "")
    assert result.metrics["grad_norm"] > 1e-9
    assert backend.version == 0
    assert _same(weights, _weights(model))


def test_micro_batching_matches_one_big_batch(load_model) -> None:
    rows = make_rows(n_groups=2, per_group=4, seed=6)
    grads = []
    for micro in (1, 8):
        model = load_model()
        backend = _backend(model, micro_batch_size=micro, global_batch_size=8)
        _, problem = backend.compute_gradients(rows)
        assert problem is None
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_loss_masked_tokens_contribute_no_gradient(load_model) -> None:
    """Masking a response's tail equals cutting it off (attention is causal)."""
    rows = make_rows(n_groups=2, per_group=2, seed=7)
    masked = copy.deepcopy(rows)
    cut = copy.deepcopy(rows)
    for m, c in zip(masked, cut, strict=True):
        n = len(m["response_ids"])
        m["loss_mask"] = [1] * (n - 1) + [0]
        m["logprobs"][-1] = -50.0  # wild values on masked tokens must not matter either
        c["response_ids"] = c["response_ids"][:-1]
        c["logprobs"] = c["logprobs"][:-1]
    grads = []
    for batch_rows in (masked, cut):
        model = load_model()
        backend = _backend(model, {"off_policy": "tis"})
        _, problem = backend.compute_gradients(batch_rows)
        assert problem is None
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_loss_mask_in_the_middle_ignores_masked_columns(load_model) -> None:
    rows = make_rows(n_groups=2, per_group=2, seed=8)
    for row in rows:
        n = len(row["response_ids"])
        row["loss_mask"] = [1] + [0] * (n - 2) + [1]
    perturbed = copy.deepcopy(rows)
    for row in perturbed:
        for j, keep in enumerate(row["loss_mask"]):
            if not keep:
                row["logprobs"][j] = -99.0
    grads = []
    for batch_rows in (rows, perturbed):
        model = load_model()
        _backend(model, {"off_policy": "icepop"}).compute_gradients(batch_rows)
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_fully_masked_batch_is_skipped(load_model) -> None:
    rows = make_rows()
    for row in rows:
        row["loss_mask"] = [0] * len(row["response_ids"])
    result = _backend(load_model()).step(rows)
    assert not result.applied and "no response tokens" in (result.skipped_reason or "")


def test_publish_is_a_detached_cpu_copy(load_model) -> None:
    model = load_model()
    backend = _backend(model)
    published = backend.state_dict_for_publish()
    assert published.keys() == model.state_dict().keys()
    assert all(t.device.type == "cpu" and not t.requires_grad for t in published.values())
    snapshot = {k: v.clone() for k, v in published.items()}
    backend.step(make_rows(model=model))
    assert _same(snapshot, published)  # later updates do not leak into a published copy


def test_checkpoint_resume_is_bit_identical(load_model, tmp_path: Path) -> None:
    first, second = make_rows(seed=10), make_rows(seed=11)

    model = load_model()
    straight = _backend(model)
    straight.step(first)
    ckpt = straight.save_checkpoint(tmp_path / "step-1")
    expected = straight.step(second)
    expected_weights = _weights(model)

    # A differently initialised model proves the checkpoint really overwrites everything.
    torch.manual_seed(123)
    other = AutoModelForCausalLM.from_config(load_model().config)
    resumed = _backend(other)
    resumed.load_checkpoint(ckpt)
    assert resumed.version == 1
    got = resumed.step(second)
    assert got.applied and resumed.version == 2
    assert _same(expected_weights, _weights(other))
    assert comparable_metrics(got.metrics) == comparable_metrics(expected.metrics)  # no timings


def test_checkpoint_layout_loads_with_from_pretrained(load_model, tmp_path: Path) -> None:
    model = load_model()
    backend = _backend(model)
    backend.step(make_rows(model=model))
    path = backend.save_checkpoint(tmp_path / "ckpt")
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    assert not list(tmp_path.glob(".*tmp"))  # the temp dir was renamed into place
    reloaded = AutoModelForCausalLM.from_pretrained(path)
    assert _same(_weights(model), _weights(reloaded))
    # Saving again under the same name replaces the checkpoint.
    backend.step(make_rows(model=model, seed=1))
    backend.save_checkpoint(path)
    assert _same(_weights(model), _weights(AutoModelForCausalLM.from_pretrained(path)))


def test_load_rejects_a_folder_that_is_not_a_checkpoint(load_model, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a trainer checkpoint"):
        _backend(load_model()).load_checkpoint(tmp_path)


def _with_values_and_ref(rows: list[dict]) -> list[dict]:
    for i, row in enumerate(rows):
        n = len(row["response_ids"])
        row["values"] = [0.1 * ((i + j) % 3) for j in range(n)]
        row["ref_logprobs"] = [lp - 0.05 for lp in row["logprobs"]]
    return rows


@pytest.mark.parametrize(
    "algo",
    [
        {"advantage": "grpo"},
        {"advantage": "dr_grpo"},
        {"advantage": "rloo"},
        {"advantage": "reinforce_pp", "gamma": 0.99},
        {"advantage": "gae", "lam": 0.9},
        {"loss": "gspo", "clip_low": 3e-4, "clip_high": 4e-4},
        {"loss": "cispo"},
        {"loss": "cispo", "clip_low": 0.5},
        {"clip_high": 0.28, "dual_clip": 3.0, "aggregation": "sequence"},
        {"off_policy": "tis", "tis_cap": 1.5},
        {"off_policy": "icepop"},
        {"off_policy": "decoupled"},
        {"kl": {"coef": 0.1, "mode": "loss", "estimator": "k3"}},
        {"kl": {"coef": 0.1, "mode": "reward", "estimator": "k1"}},
        {"kl": {"coef": 0.1, "mode": "reward"}, "advantage": "reinforce_pp"},
        {"entropy_coef": 0.01},
        {"dynamic_sampling": True},
    ],
    ids=lambda algo: "-".join(f"{k}={v}" for k, v in algo.items()),
)
def test_every_algorithm_option_steps(load_model, algo: dict) -> None:
    model = load_model()
    backend = _backend(model, algo)
    rows = _with_values_and_ref(make_rows(n_groups=2, per_group=3, seed=12))
    result = backend.step(rows)
    assert result.applied, result.skipped_reason
    assert all(isinstance(v, float) for v in result.metrics.values())
    assert "kl" in result.metrics  # ref_logprobs present -> KL is always reported


def test_dynamic_sampling_drops_flat_groups(load_model) -> None:
    rows = make_rows(n_groups=2, per_group=2, seed=13)
    rows[0]["reward"] = rows[1]["reward"] = 1.0  # group g0 carries no signal
    result = _backend(load_model(), {"dynamic_sampling": True}).step(rows)
    assert result.applied and result.metrics["dropped_rows"] == 2.0
    for row in rows:
        row["reward"] = 0.0
    flat = _backend(load_model(), {"dynamic_sampling": True}).step(rows)
    assert not flat.applied and "zero reward variance" in (flat.skipped_reason or "")


def test_clear_errors_for_missing_columns_and_unsupported_combinations(load_model) -> None:
    from relax.errors import ConfigError

    rows = make_rows()
    with pytest.raises(ValueError, match="'values'"):
        _backend(load_model(), {"advantage": "gae"}).step(rows)
    with pytest.raises(ValueError, match="ref_logprobs"):
        _backend(load_model(), {"kl": {"coef": 0.1}}).step(rows)
    with pytest.raises(ConfigError, match="off_policy"):
        _backend(load_model(), {"loss": "gspo", "off_policy": "tis"})
    with pytest.raises(ConfigError, match="dual_clip"):
        _backend(load_model(), {"off_policy": "decoupled", "dual_clip": 3.0})


def test_adopt_continues_from_published_weights(load_model) -> None:
    trained = _backend(load_model())
    trained.step(make_rows(model=trained.model))
    published = trained.state_dict_for_publish()
    fresh = _backend(load_model())  # a restarted trainer without a checkpoint of that version
    fresh.adopt(trained.version, published)
    assert fresh.version == trained.version == 1
    assert _same(fresh.state_dict_for_publish(), published)
    assert not fresh.optimizer.state  # the optimiser starts afresh: it was never published
    result = fresh.step(make_rows(seed=3, model=fresh.model))
    assert result.applied and fresh.version == 2
    with pytest.raises(ValueError, match="do not fit"):
        fresh.adopt(5, {"not.a.weight": published[next(iter(published))]})


@pytest.mark.parametrize(
    "algo",
    [
        {},
        {"off_policy": "icepop"},
        {"off_policy": "decoupled"},
        {"kl": {"coef": 0.1, "mode": "loss", "estimator": "k3"}},
        {"advantage": "gae", "lam": 0.9},
        {"advantage": "reinforce_pp", "gamma": 0.99},
    ],
    ids=lambda algo: "-".join(f"{k}={v}" for k, v in algo.items()) or "grpo",
)
def test_length_sorted_micro_batches_compute_less_for_the_same_gradient(
    load_model, algo: dict
) -> None:
    """``sort_micro_batches``: rows of similar length share a micro-batch, longest first, so
    the passes hold fewer padded positions; every per-row input (advantages, correction
    weights, values, reference log-probs) moves with its row: the gradient and the metrics are
    those of the rows in the order taken, up to float rounding."""
    rows = _with_values_and_ref(make_rows(n_groups=4, per_group=4, seed=21))
    grads, shapes, metrics = {}, {}, {}
    for sort in (True, False):
        model = load_model()
        seen: list[tuple[int, int]] = []

        def hook(module, args, kwargs, seen=seen) -> None:
            seen.append(tuple((kwargs.get("input_ids") if args == () else args[0]).shape))

        model.register_forward_pre_hook(hook, with_kwargs=True)
        backend = _backend(
            model, algo, micro_batch_size=4, global_batch_size=16, sort_micro_batches=sort
        )
        metrics[sort], problem = backend.compute_gradients(rows)
        assert problem is None
        grads[sort] = [p.grad.clone() for p in model.parameters()]
        shapes[sort] = seen
    for a, b in zip(grads[True], grads[False], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert metrics[True].keys() == metrics[False].keys()
    for key, value in metrics[True].items():
        assert value == pytest.approx(metrics[False][key], rel=1e-4, abs=1e-6), key
    trained = [s for s in shapes[True] if s[0] == 4][-4:]  # the step's micro-batches
    widths = [w for _, w in trained]
    assert widths == sorted(widths, reverse=True) and widths[0] > widths[-1]
    computed = {sort: sum(b * w for b, w in shapes[sort]) for sort in shapes}
    assert computed[True] < 0.9 * computed[False]


@pytest.mark.parametrize("algo", [{"off_policy": "icepop"}, {"off_policy": "tis", "tis_cap": 1.2}])
def test_correction_metrics_are_the_batch_s_whatever_the_micro_batches(
    load_model, algo: dict
) -> None:
    """A correction computed per micro-batch reports means over kept tokens and over
    sequences: combined by each micro-batch's share of the loss they came out different for
    every micro-batch size (``rejected_seq_frac`` 0.19 with micro-batches of 1 row, 0.31 with
    one of 16); combined by their own counts, they are the whole batch's."""
    rows = make_rows(n_groups=4, per_group=4, seed=21)
    seen = []
    for micro in (16, 4, 1):
        backend = _backend(load_model(), algo, micro_batch_size=micro, global_batch_size=16)
        metrics, problem = backend.compute_gradients(rows)
        assert problem is None
        seen.append(metrics)
    for key in ("rejected_token_frac", "rejected_seq_frac", "is_weight_mean", "is_weight_max"):
        whole = seen[0][key]
        assert all(m[key] == pytest.approx(whole, rel=1e-5) for m in seen[1:]), key
    assert not any(key.startswith("count:") for key in seen[0])
