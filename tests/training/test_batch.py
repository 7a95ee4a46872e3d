"""pack_batch: shapes, right padding, masks aligned to next-token prediction, validation."""

from __future__ import annotations

import pytest
import torch

from relax.training import pack_batch, response_values

PAD = 0


def _rows() -> list[dict]:
    return [
        {
            "prompt_ids": [5, 6, 7],
            "response_ids": [8, 9],
            "logprobs": [-0.5, -1.5],
            "reward": 1.0,
            "group": "a",
        },
        {
            "prompt_ids": [11],
            "response_ids": [12, 13, 14, 15],
            "logprobs": [-1.0, -2.0, -3.0, -4.0],
            "reward": 0.0,
            "group": "b",
            "loss_mask": [1, 0, 0, 1],
        },
        {
            "prompt_ids": [5, 6, 7],
            "response_ids": [20],
            "logprobs": [-0.25],
            "reward": 0.5,
            "group": "a",
        },
    ]


def test_shapes_padding_and_masks() -> None:
    batch = pack_batch(_rows(), PAD)
    assert batch.input_ids.shape == (3, 5)
    assert batch.mask.shape == batch.rollout_logprobs.shape == (3, 4)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15], [5, 6, 7, 20, 0]]
    assert batch.attention_mask.tolist() == [[1] * 5, [1] * 5, [1, 1, 1, 1, 0]]
    # Column t predicts input_ids[:, t + 1]: row 0's response starts at input 3 -> column 2.
    assert batch.response_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 1, 0]]
    assert batch.mask.tolist() == [[0, 0, 1, 1], [1, 0, 0, 1], [0, 0, 1, 0]]
    assert batch.rollout_logprobs.tolist() == [
        [0, 0, -0.5, -1.5],
        [-1.0, -2.0, -3.0, -4.0],
        [0, 0, -0.25, 0],
    ]
    # The target at each counted column is the response token itself.
    targets = batch.input_ids[:, 1:]
    assert targets[batch.response_mask > 0].tolist() == [8, 9, 12, 13, 14, 15, 20]
    assert batch.group_ids.tolist() == [0, 1, 0]
    assert batch.groups == ("a", "b")
    assert batch.rewards.tolist() == [1.0, 0.0, 0.5]
    assert batch.lengths.tolist() == [5, 5, 4]
    assert batch.num_tokens == 5
    assert batch.ref_logprobs is None and batch.values is None


def test_optional_columns_and_unpacking() -> None:
    rows = _rows()
    for row in rows:
        row["ref_logprobs"] = [-0.1 * (i + 1) for i in range(len(row["response_ids"]))]
    batch = pack_batch(rows, PAD)
    assert batch.ref_logprobs is not None
    unpacked = response_values(batch, batch.ref_logprobs)
    for row, values in zip(rows, unpacked, strict=True):
        assert values == pytest.approx(row["ref_logprobs"])
    assert response_values(batch, batch.rollout_logprobs)[1] == [-1.0, -2.0, -3.0, -4.0]


def test_select_trims_padding_of_short_rows() -> None:
    batch = pack_batch(_rows(), PAD)
    tail = batch.select(2, 3)
    assert tail.input_ids.tolist() == [[5, 6, 7, 20]]
    assert tail.mask.tolist() == [[0, 0, 1]]
    assert tail.group_ids.tolist() == [0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda rows: rows[0].pop("reward"), "no 'reward'"),
        (lambda rows: rows[0].update(prompt_ids=[]), "empty prompt_ids"),
        (lambda rows: rows[1].update(logprobs=[-1.0]), "'logprobs' has 1 entries"),
        (lambda rows: rows[1].update(loss_mask=[1, 2, 0, 1]), "0 or 1"),
        (lambda rows: rows[0].update(ref_logprobs=[-1.0, -1.0]), "on some rows"),
    ],
)
def test_malformed_rows_are_rejected(change, message: str) -> None:
    rows = _rows()
    change(rows)
    with pytest.raises(ValueError, match=message):
        pack_batch(rows, PAD)


def test_empty_batch_is_rejected() -> None:
    with pytest.raises(ValueError, match="empty batch"):
        pack_batch([], PAD)


def test_to_device_keeps_values() -> None:
    batch = pack_batch(_rows(), PAD)
    moved = batch.to("cpu")
    assert torch.equal(moved.input_ids, batch.input_ids)
