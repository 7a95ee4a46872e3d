"""Mixture-of-experts routing (relax.models._moe): the tiny Qwen3-MoE, recording the experts a
forward pass chose, replaying recorded ones (R3), the load-balancing loss."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from relax.config import ModelInitConfig
from relax.errors import ConfigError
from relax.models import (
    RoutingRecorder,
    build_tiny_model,
    check_replayable,
    expert_dtype,
    load_policy,
    moe_shape,
    router_layers,
    routing,
)

INIT = ModelInitConfig(
    arch="qwen3_moe", vocab_size=261, num_experts=8, num_experts_per_tok=2, seed=4
)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    folder = build_tiny_model(INIT, tmp_path_factory.mktemp("moe"))
    return load_policy(folder)[0]


def batch(seed: int = 0, size: int = 3, width: int = 9) -> torch.Tensor:
    return torch.randint(3, 250, (size, width), generator=torch.Generator().manual_seed(seed))


def recorded(model, ids: torch.Tensor) -> torch.Tensor:
    """The model's own routing of ``ids`` as ``[batch, seq, layers, top_k]``."""
    with RoutingRecorder(model) as rec, torch.no_grad():
        model(input_ids=ids)
    per_pass = rec.pass_ids(0)  # [layers, batch * seq, top_k]
    return per_pass.view(per_pass.shape[0], *ids.shape, -1).permute(1, 2, 0, 3)


def test_the_tiny_moe_is_an_ordinary_checkpoint_with_a_routing_layout(moe) -> None:
    assert type(moe).__name__ == "Qwen3MoeForCausalLM"
    shape = moe_shape(moe)
    assert shape is not None
    assert (shape.layers, shape.top_k, shape.num_experts) == (2, 2, 8)
    assert shape.dtype == torch.uint8 and expert_dtype(300) == torch.int16
    assert check_replayable(moe) == shape


def test_a_dense_model_cannot_replay_and_says_which_key(tmp_path) -> None:
    dense = load_policy(build_tiny_model(ModelInitConfig(vocab_size=261), tmp_path))[0]
    assert moe_shape(dense) is None and router_layers(dense) == []
    with pytest.raises(ConfigError, match=r"trainer\.routing_replay.*no mixture-of-experts"):
        check_replayable(dense)


def test_replaying_the_model_s_own_routing_changes_nothing_and_other_routing_does(moe) -> None:
    ids = batch()
    with torch.no_grad():
        plain = moe(input_ids=ids).logits
    own = recorded(moe, ids)
    with torch.no_grad(), routing(moe, own) as stats:
        again = moe(input_ids=ids).logits
    assert torch.equal(plain, again)
    assert stats.tokens == ids.numel() * 2 and stats.disagreed == 0
    shifted = (own + 1) % 8  # every token to other experts
    with torch.no_grad(), routing(moe, shifted) as stats:
        moved = moe(input_ids=ids).logits
    assert not torch.allclose(plain, moved)
    assert stats.disagreement > 0.5
    # Counting only (replay off): the model routes itself, the disagreement is still seen.
    with torch.no_grad(), routing(moe, shifted, replay=False) as stats:
        counted = moe(input_ids=ids).logits
    assert torch.equal(plain, counted) and stats.disagreement > 0.5


def test_unrecorded_tokens_route_themselves(moe) -> None:
    ids = batch(1)
    with torch.no_grad():
        plain = moe(input_ids=ids).logits
    nothing = torch.full((*ids.shape, 2, 2), 255, dtype=torch.uint8)  # no record at all
    with torch.no_grad(), routing(moe, nothing) as stats:
        assert torch.equal(moe(input_ids=ids).logits, plain)
    assert stats.tokens == 0
    # Records for the first 4 positions only: those replay, the rest route themselves.
    part = (recorded(moe, ids) + 3) % 8
    part[:, 4:] = 255
    with torch.no_grad(), routing(moe, part):
        mixed = moe(input_ids=ids).logits
    assert not torch.allclose(mixed[:, :4], plain[:, :4])


def test_gradients_reach_the_router_under_replay(moe) -> None:
    ids = batch(2)
    routed = (recorded(moe, ids) + 1) % 8
    moe.zero_grad(set_to_none=True)
    with routing(moe, routed):
        moe(input_ids=ids).logits.logsumexp(-1).mean().backward()
    for router in router_layers(moe):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    moe.zero_grad(set_to_none=True)


def test_the_load_balancing_loss_is_transformers_own(moe) -> None:
    ids = batch(3)
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0  # padding does not count
    with torch.no_grad():
        out = moe(input_ids=ids, attention_mask=mask, output_router_logits=True)
    want = load_balancing_loss_func(out.router_logits, 8, 2, mask)
    with torch.no_grad(), routing(moe, None, token_mask=mask, aux_loss=True) as stats:
        moe(input_ids=ids, attention_mask=mask)
    assert stats.aux_loss is not None
    torch.testing.assert_close(stats.aux_loss, want.float(), rtol=1e-5, atol=1e-6)
    # No records and no aux loss asked: nothing is hooked.
    with routing(moe, None) as stats:
        moe(input_ids=ids)
    assert stats.aux_loss is None and stats.tokens == 0


def test_records_that_do_not_fit_the_model_or_the_batch_are_refused(moe) -> None:
    ids = batch(4)
    wrong_layers = torch.zeros((3, 9, 5, 2), dtype=torch.uint8)
    with (
        pytest.raises(ValueError, match="do not fit a model of 2 MoE layers"),
        routing(moe, wrong_layers),
    ):
        pass
    whole = torch.zeros((3, 9, 2, 2), dtype=torch.uint8)
    with pytest.raises(ValueError, match="whole batch"), torch.no_grad(), routing(moe, whole):
        moe(input_ids=ids[:2])
