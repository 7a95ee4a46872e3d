"""Model-backed reward kinds: ``reward_model`` (a sequence-classification model's score).

A model-backed verifier is built (and checked: its folder exists) wherever the reward set is
built — the preflight included, which must stay free of side effects — but its weights are
loaded only by ``load()``: the reward role calls ``RewardSet.load()`` once per replica when it
starts, so each replica holds one copy on the device its placement gives it. A verifier that
was never loaded loads on its first call.

Scoring is batched: the role's batch is cut into chunks of ``[reward.functions.model]
batch_size`` and each chunk is one padded forward pass. Texts are prompt + response, tokenized
one by one exactly as a lone forward pass would tokenize them, cut to their last
``max_length`` tokens and right-padded with the model's pad id, so the model reads each
sample's score at its last real token — the same score as the sample scored alone.

torch and transformers are imported when a model loads, never at import time: the preflight
and ``relax validate`` import this package.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from relax.config import RewardFunctionConfig
from relax.errors import OptionError
from relax.rewards._sample import Sample
from relax.rewards._verifiers import BuildContext, Verifier, register_verifier


class ModelVerifier(Verifier):
    """Shared by the model kinds: the ``[reward.functions.model]`` table, lazy loading, chunks.

    Runs batched in a thread (a forward pass blocks); one call at a time per verifier, so
    concurrent batches queue for the model instead of racing on it.
    """

    mode = "thread"
    batched = True
    loads = True

    def __init__(self, config: RewardFunctionConfig, context: BuildContext) -> None:
        super().__init__(config, context)
        assert config.model is not None  # the config model requires it for these kinds
        self.model_config = config.model
        self.folder = Path(config.model.path).expanduser()
        if not (self.folder / "config.json").is_file():
            reason = "does not exist" if not self.folder.exists() else "has no config.json"
            raise OptionError(
                "model.path",
                f"{config.model.path!r} {reason}: it must be a local Hugging Face model folder",
            )
        self._lock = threading.Lock()
        self.model: Any = None
        self.tokenizer: Any = None
        self.device: Any = None

    def load(self) -> None:
        """Load the model and tokenizer once (later calls do nothing)."""
        with self._lock:
            if self.model is None:
                self._load()

    def _load(self) -> None:
        raise NotImplementedError

    def _load_parts(self, model_class: Any) -> None:
        from relax.models import load_pretrained, load_tokenizer, resolve_device, torch_dtype

        cfg = self.model_config
        self.device = resolve_device(cfg.device)
        self.tokenizer = load_tokenizer(self.folder)
        model = load_pretrained(model_class, self.folder, dtype=torch_dtype(cfg.dtype))
        self.model = model.to(self.device).eval()

    def score_batch(self, responses: list[str], samples: list[Sample]) -> list[Any]:
        self.load()
        scores: list[Any] = []
        with self._lock:
            for chunk in _chunks(samples, self.model_config.batch_size):
                scores += self._score_chunk(chunk)
        return scores

    def _score_chunk(self, samples: list[Sample]) -> list[Any]:
        raise NotImplementedError

    def _encode(self, text: str) -> list[int]:
        """``text``'s ids as the tokenizer gives them alone, cut to the last ``max_length``."""
        ids = list(self.tokenizer(text)["input_ids"])
        return ids[-self.model_config.max_length :]

    def _pad_id(self) -> int:
        """The id padding uses: the model's own (which it reads to find each text's last
        token), else the tokenizer's pad or end-of-text id, else 0."""
        config = self.model.config
        for candidate in (
            getattr(config, "pad_token_id", None),
            self.tokenizer.pad_token_id,
            self.tokenizer.eos_token_id,
        ):
            if isinstance(candidate, int):
                return candidate
        return 0


def _chunks(items: list[Sample], size: int) -> Iterator[list[Sample]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def reward_text(sample: Mapping[str, Any]) -> str:
    """What a reward model reads for one sample: its prompt text followed by its response."""
    return str(sample.get("prompt") or "") + str(sample.get("response") or "")


@register_verifier("reward_model")
class RewardModel(ModelVerifier):
    """The score a sequence-classification model (``num_labels = 1``) gives prompt + response.

    ``[reward.functions.model]``: ``path``, ``batch_size``, ``max_length``, ``dtype``,
    ``device``. The score is the model's raw logit (use ``weight`` to scale it).
    """

    def _load(self) -> None:
        from transformers import AutoModelForSequenceClassification

        self._load_parts(AutoModelForSequenceClassification)
        labels = self.model.config.num_labels
        if labels != 1:
            self.model = None
            raise OptionError(
                "model.path",
                f"{str(self.folder)!r} has {labels} labels: a reward model needs num_labels = 1",
            )
        # Hugging Face's classifier needs a pad id to find each padded text's last token.
        if getattr(self.model.config, "pad_token_id", None) is None:
            self.model.config.pad_token_id = self._pad_id()

    def _score_chunk(self, samples: list[Sample]) -> list[Any]:
        import torch

        encoded = [self._encode(reward_text(s)) for s in samples]
        scores: list[Any] = [None] * len(samples)
        live = [i for i, ids in enumerate(encoded) if ids]
        for i, ids in enumerate(encoded):
            if not ids:
                scores[i] = ValueError("prompt + response is empty: nothing for the model to read")
        if not live:
            return scores
        width = max(len(encoded[i]) for i in live)
        pad = self._pad_id()
        input_ids = torch.full((len(live), width), pad, dtype=torch.long)
        attention = torch.zeros((len(live), width), dtype=torch.long)
        for row, i in enumerate(live):
            ids = encoded[i]
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention[row, : len(ids)] = 1
        with torch.inference_mode():
            logits = self.model(
                input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device)
            ).logits
        values = logits[:, 0].float().cpu().tolist()
        for row, i in enumerate(live):
            scores[i] = values[row]
        return scores
