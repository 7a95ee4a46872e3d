"""The ``judge`` reward kind: an LLM prompted with a rubric, its reply parsed to a score.

Each sample's prompt and response fill ``[reward.functions.judge] template``; the judge model
(``[reward.functions.model]``, a causal LM) answers greedily — so a sample always gets the same
score — with at most ``max_new_tokens`` tokens; ``score_pattern``'s first group in the reply is
the score ``s``, counted as ``(s - low) / (high - low)`` over ``score_range = [low, high]``.
A reply with no match, or a score outside the range, fails that sample alone, the reply quoted
in the reason. Generation is plain ``transformers`` ``generate`` (``relax.engines`` sits a floor
above the rewards), one left-padded batch per chunk of ``batch_size`` samples.
"""

from __future__ import annotations

import re
from typing import Any

from relax.config import RewardFunctionConfig
from relax.rewards._model import ModelVerifier
from relax.rewards._sample import Sample
from relax.rewards._verifiers import BuildContext, register_verifier


class UnscorableReply(ValueError):
    """The judge's reply gave no score in range; the sample fails with this as its reason."""


@register_verifier("judge")
class Judge(ModelVerifier):
    """A score in [0, 1] read from a judge model's greedy reply to a rubric (module docstring)."""

    def __init__(self, config: RewardFunctionConfig, context: BuildContext) -> None:
        super().__init__(config, context)
        assert config.judge is not None  # the config model requires it for this kind
        self.template = config.judge.template
        self.pattern = re.compile(config.judge.score_pattern)
        self.low, self.high = config.judge.score_range
        self.max_new_tokens = config.judge.max_new_tokens

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM

        self._load_parts(AutoModelForCausalLM)

    def prompt_for(self, sample: Sample) -> str:
        """The rubric filled in for one sample (str.format never re-reads the values)."""
        return self.template.format(prompt=sample.get("prompt") or "", response=sample.response)

    def parse(self, reply: str) -> float | UnscorableReply:
        """The score ``reply`` gives, scaled to [0, 1]; an ``UnscorableReply`` if it gives none."""
        match = self.pattern.search(reply)
        if match is None:
            return UnscorableReply(
                f"judge reply has no score matching {self.pattern.pattern!r}: {reply[:200]!r}"
            )
        try:
            score = float(match.group(1))
        except (TypeError, ValueError):
            return UnscorableReply(f"judge score {match.group(1)!r} is not a number")
        if not self.low <= score <= self.high:
            return UnscorableReply(
                f"judge score {score:g} is outside score_range [{self.low:g}, {self.high:g}]"
            )
        return (score - self.low) / (self.high - self.low)

    def replies(self, samples: list[Sample]) -> list[str]:
        """The judge's greedy replies for one chunk, one left-padded ``generate`` call."""
        import torch

        encoded = [self._encode(self.prompt_for(s)) for s in samples]
        width = max(len(ids) for ids in encoded)
        pad = self._pad_id()
        # Left padding: every prompt ends at the same column, where generation continues.
        input_ids = torch.full((len(samples), width), pad, dtype=torch.long)
        attention = torch.zeros((len(samples), width), dtype=torch.long)
        for row, ids in enumerate(encoded):
            if ids:
                input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
                attention[row, width - len(ids) :] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention.to(self.device),
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                num_beams=1,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=pad,
            )
        new = out[:, width:].cpu().tolist()
        return [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in new]

    def _score_chunk(self, samples: list[Sample]) -> list[Any]:
        scores: list[Any] = [
            UnscorableReply("the filled-in template is empty: nothing to ask the judge")
        ] * len(samples)
        # An all-padding row would give the judge nothing to attend to: leave it out.
        live = [i for i, s in enumerate(samples) if self._encode(self.prompt_for(s))]
        if live:
            for i, reply in zip(live, self.replies([samples[i] for i in live]), strict=True):
                scores[i] = self.parse(reply)
        return scores
