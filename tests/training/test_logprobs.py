"""sequence_logprobs equals scoring each response token by hand, one prefix at a time."""

from __future__ import annotations

import pytest
import torch

from relax.training import forward_logprobs, pack_batch, response_values, sequence_logprobs
from tests.training.conftest import PAD, make_rows


def _hand_logprobs(model, row: dict, temperature: float) -> list[float]:
    """Score response token j from the logits of the unpadded prefix before it."""
    ids = row["prompt_ids"] + row["response_ids"]
    out = []
    with torch.no_grad():
        for j, token in enumerate(row["response_ids"]):
            prefix = torch.tensor([ids[: len(row["prompt_ids"]) + j]])
            logits = model(input_ids=prefix).logits[0, -1] / temperature
            out.append(torch.log_softmax(logits.double(), -1)[token].item())
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_hand_loop(load_model, temperature: float) -> None:
    model = load_model()
    rows = make_rows(n_groups=2, per_group=2, seed=3)
    batch = pack_batch(rows, PAD)
    with torch.no_grad():
        logprobs = sequence_logprobs(model, batch, temperature=temperature)
    assert logprobs.shape == batch.mask.shape
    assert torch.all(logprobs[batch.response_mask == 0] == 0)
    for row, got in zip(rows, response_values(batch, logprobs), strict=True):
        assert got == pytest.approx(_hand_logprobs(model, row, temperature), abs=1e-5)


def test_entropy_is_finite_on_response_tokens_only(load_model) -> None:
    model = load_model()
    batch = pack_batch(make_rows(seed=4), PAD)
    with torch.no_grad():
        _, entropy = forward_logprobs(model, batch, with_entropy=True)
    assert entropy is not None
    assert torch.all(entropy[batch.response_mask > 0] > 0)
    assert torch.all(entropy[batch.response_mask == 0] == 0)


def test_temperature_must_be_positive(load_model) -> None:
    batch = pack_batch(make_rows(), PAD)
    with pytest.raises(ValueError, match="temperature"):
        sequence_logprobs(load_model(), batch, temperature=0.0)
