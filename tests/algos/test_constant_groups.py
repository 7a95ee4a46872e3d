"""A group whose rewards are all equal carries no signal: every group-baseline estimator must
give it exactly 0, whatever the value and dtype, and leave other groups as they were."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.algos import (
    dr_grpo_advantages,
    group_stats,
    grpo_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    rloo_advantages,
)

GROUP_ESTIMATORS = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def test_the_reported_case_partial_credit_group_is_exactly_zero() -> None:
    # The numbers: float32 mean of eight 0.1s is off by ~7e-9, std ~8e-9 > 0, and
    # dividing by std + 1e-6 gave -0.0074 per sample.
    adv = grpo_advantages(torch.full((8,), 0.1), torch.zeros(8, dtype=torch.long))
    assert torch.equal(adv, torch.zeros(8))
    _, std, _ = group_stats(torch.full((8,), 0.1), torch.zeros(8, dtype=torch.long))
    assert torch.equal(std, torch.zeros(8))


@pytest.mark.parametrize("name", sorted(GROUP_ESTIMATORS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("value", [0.1, 0.3, 1 / 3, 0.7, -2.9, 7.7, 1e4 + 0.1])
@pytest.mark.parametrize("size", [2, 3, 8, 16, 64])
def test_constant_group_is_exactly_zero(
    name: str, dtype: torch.dtype, value: float, size: int
) -> None:
    rewards = torch.full((size,), value, dtype=dtype)
    adv = GROUP_ESTIMATORS[name](rewards, torch.zeros(size, dtype=torch.long))
    assert adv.dtype == torch.promote_types(dtype, torch.float32)
    assert torch.equal(adv, torch.zeros_like(adv)), adv


def test_reinforce_pp_constant_batch_and_baseline_are_exactly_zero() -> None:
    rewards, mask = torch.full((8,), 0.1), torch.ones(8, 5)
    mask[3, 3:] = 0
    groups = torch.arange(4).repeat_interleave(2)
    for adv in (
        reinforce_pp_advantages(rewards, mask),  # global baseline: whitening a constant
        reinforce_pp_advantages(rewards, mask, group_ids=groups),
    ):
        assert torch.equal(adv, torch.zeros_like(adv)), adv


def test_masked_whiten_of_a_constant_is_zero_or_the_constant() -> None:
    x = torch.full((3, 4), 0.1)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.float32)
    x[0, 3] = 5.0  # a masked-out position does not count
    assert torch.equal(masked_whiten(x, mask), torch.zeros_like(x))
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False), 0.1 * mask)


_value = st.floats(-100, 100, allow_nan=False, width=32)


@settings(max_examples=150, deadline=None)
@given(
    groups=st.lists(
        st.tuples(st.booleans(), st.integers(2, 9), st.lists(_value, min_size=9, max_size=9)),
        min_size=1,
        max_size=6,
    ),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_mixed_batches_constant_groups_zero_others_unchanged(groups, dtype) -> None:
    """Constant groups are exactly 0; a group with spread matches a float64 reference of the
    textbook formula (up to the dtype's rounding of the inputs)."""
    values, ids, constant = [], [], []
    for gid, (is_constant, size, draws) in enumerate(groups):
        draws = draws[:size]
        members = [draws[0]] * size if is_constant else draws
        values += members
        ids += [gid] * size
        constant += [len(set(torch.tensor(members).to(dtype).tolist())) == 1] * size
    rewards = torch.tensor(values).to(dtype)
    group_ids = torch.tensor(ids)
    flat = torch.tensor(constant)
    ref = rewards.to(torch.float64)
    for gid in range(len(groups)):
        sel = group_ids == gid
        r = ref[sel]
        expected = {
            "grpo": (r - r.mean()) / (r.std() + 1e-6),
            "dr_grpo": r - r.mean(),
            "rloo": r - (r.sum() - r) / (r.numel() - 1),
        }
        for name, fn in GROUP_ESTIMATORS.items():
            adv = fn(rewards, group_ids)[sel]
            if bool(flat[sel][0]):
                assert torch.equal(adv, torch.zeros_like(adv)), (name, adv)
            else:
                torch.testing.assert_close(
                    adv.to(torch.float64), expected[name], atol=1e-4, rtol=1e-4
                )
