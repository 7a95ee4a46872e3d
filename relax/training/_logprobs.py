"""Per-token log-probs (and entropy) of a batch's tokens under a causal language model."""

from __future__ import annotations

import torch

from relax.algos import entropy_from_logits, logprobs_from_logits
from relax.models import collate_mm_inputs, suppressed_token_ids
from relax.training._batch import Batch


def forward_logprobs(
    model: torch.nn.Module,
    batch: Batch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward pass: ``(logprobs, entropy)``, each ``[batch, seq - 1]``.

    ``logprobs[:, t]`` is the log-prob of ``input_ids[:, t + 1]`` under the logits at ``t``
    divided by ``temperature`` (the rollout samples from tempered logits, so the trainer must
    score with the same temperature or every ratio is off). Both are 0 outside
    ``batch.response_mask``. ``entropy`` is ``None`` unless asked for; it carries gradient
    whenever the model does, unless ``entropy_grad`` is False (entropy as a metric only: no
    graph is kept for it).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}")
    media = collate_mm_inputs(batch.mm_inputs) if batch.mm_inputs else {}
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        use_cache=False,
        **media,
    )
    logits = out.logits[:, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    banned = suppressed_token_ids(getattr(model, "module", model))  # a DeepSpeed engine wraps
    if banned:
        # The rollout never samples these (media placeholders): score the same distribution.
        # The dtype's lowest finite value, not -inf: it underflows to probability 0 all the
        # same, and the entropy's p * z stays 0 instead of 0 * -inf = NaN.
        lowest = torch.finfo(logits.dtype).min
        logits = logits.index_fill(-1, torch.tensor(banned, device=logits.device), lowest)
    targets = batch.input_ids[:, 1:]
    logprobs = logprobs_from_logits(logits, targets)
    on = batch.response_mask > 0
    # `where` rather than multiply: padding positions may hold any value and must not leak.
    logprobs = torch.where(on, logprobs, torch.zeros_like(logprobs))
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            source = logits if entropy_grad else logits.detach()
            entropy = torch.where(on, entropy_from_logits(source), torch.zeros_like(logprobs))
    return logprobs, entropy


def sequence_logprobs(
    model: torch.nn.Module, batch: Batch, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probs ``[batch, seq - 1]`` of the response tokens under ``model``, 0 elsewhere.

    Aligned with ``batch.mask`` and ``batch.rollout_logprobs``; gradients flow when the caller
    has them enabled.
    """
    return forward_logprobs(model, batch, temperature)[0]
