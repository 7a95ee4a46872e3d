"""The generation-engine interface every rollout backend implements (HF ``generate``, vLLM).

An engine turns token-id prompts into sampled responses with the sampling policy's per-token
log-probabilities, and swaps its weights between versions atomically. It knows nothing of
actors or the bus: the rollout role drives it.

Log-probabilities (``Generation.logprobs``) — the contract every engine keeps:

    logprobs[t] = log p(response_ids[t] | prompt_ids + response_ids[:t])

where ``p`` is the distribution the token was *actually sampled from*: the model's logits
divided by ``temperature``, then (when enabled) restricted to the ``top_k`` most likely tokens
and to the smallest set whose mass reaches ``top_p``, and renormalised. With ``top_k = 0`` and
``top_p = 1`` (the RL setting) this is exactly ``log_softmax(logits / temperature)``, the
quantity a trainer recomputes. With truncation it is larger by ``-log(kept mass)``: a trainer
that recomputes without truncation sees a systematic gap, so keep truncation off for RL (or
correct for it). ``temperature = 0`` means greedy decoding; the logprobs are then
``log_softmax(logits)`` (temperature 1), since the greedy "distribution" is degenerate.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from relax.errors import RelaxError

FinishReason = Literal["stop", "length"]

StateDict = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
"""Weights for ``load_weights``: a state dict, or ``(name, tensor)`` pairs (e.g. streamed buckets)."""


class EngineError(RelaxError, ValueError):
    """A generation engine refused a request or a weight update; nothing was changed."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; validated once so every engine sees the same meaning."""

    max_new_tokens: int
    """Most tokens generated per response (the stop token, when hit, counts as one)."""
    temperature: float = 1.0
    """Logits are divided by this before sampling; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches this; 1 disables."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation of a response ends after any of these ids (which is kept in the response)."""
    n: int = 1
    """Responses sampled per prompt."""
    seed: int | None = None
    """Seed of the sampling; the same seed, prompts and weights give the same responses."""

    def __post_init__(self) -> None:
        problems = []
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not self.temperature >= 0 or self.temperature == float("inf"):
            problems.append(f"temperature must be a finite number ≥ 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be ≥ 0 (0 disables it), got {self.top_k}")
        if self.n < 1:
            problems.append(f"n must be at least 1, got {self.n}")
        if problems:
            raise EngineError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        """Whether this is greedy decoding (temperature 0)."""
        return self.temperature == 0


@dataclass
class Generation:
    """One sampled response to one prompt."""

    prompt_ids: list[int]
    response_ids: list[int]
    """Generated ids, ending with the stop token when ``finish_reason == "stop"``."""
    logprobs: list[float]
    """Sampling policy's log-prob of each id of ``response_ids`` (see the module docstring)."""
    finish_reason: FinishReason
    """"stop": a stop token was generated; "length": ``max_new_tokens`` was reached."""
    version: int
    """Oldest weights version that generated any token of this response (the version its
    staleness is judged by); every token's, when an update landed mid-response, is in
    ``token_versions``."""
    index: int = 0
    """Which of the ``n`` samples of its prompt this is (0-based)."""
    token_versions: list[int] | None = None
    """Weights version whose logits each token of ``response_ids`` was sampled from; ``None``
    when the engine does not track it (then every token is ``version``)."""
    metadata: dict[str, Any] = field(default_factory=dict)


def sampling_request(
    prompts: Sequence[Sequence[int]],
    seed: int | Sequence[int] | None,
    **sampling: Any,
) -> tuple[SamplingParams, list[int] | None]:
    """Validate one ``generate`` call: its ``SamplingParams`` and, when ``seed`` is a sequence,
    the per-prompt seeds (then ``SamplingParams.seed`` is None)."""
    seeds = None
    if seed is not None and not isinstance(seed, int):
        seeds = [int(x) for x in seed]
        if len(seeds) != len(prompts):
            raise EngineError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        seed = None
    stops = tuple(int(t) for t in sampling.pop("stop_token_ids", ()))
    return SamplingParams(stop_token_ids=stops, seed=seed, **sampling), seeds


def check_prompt(
    i: int, prompt: Sequence[int], max_new_tokens: int, vocab_size: int, max_len: int | None
) -> list[int]:
    """Prompt ``i`` as a list of ids, or ``EngineError`` saying what is wrong with it."""
    ids = [int(t) for t in prompt]
    if not ids:
        raise EngineError(f"prompt {i} is empty; it needs at least one token (e.g. BOS)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise EngineError(f"prompt {i} has token ids outside [0, {vocab_size}): {bad[:5]}")
    if max_len is not None and len(ids) + max_new_tokens > max_len:
        raise EngineError(
            f"prompt {i} ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the"
            f" model's {max_len} positions"
        )
    return ids


def with_rates(stats: dict[str, float | int], version: int) -> dict[str, float | int]:
    """An engine's counters plus the version served and the generation rate."""
    out = dict(stats)
    out["version"] = version
    seconds = float(out["generate_seconds"])
    out["tokens_per_second"] = out["generated_tokens"] / seconds if seconds > 0 else 0.0
    return out


class GenerationEngine(abc.ABC):
    """A backend that samples responses and swaps weights between versions.

    Concurrency contract: ``generate`` and ``load_weights`` may be awaited concurrently from one
    event loop, and neither blocks the event loop while the model computes. Weights switch
    atomically: no forward pass ever sees a mix of two versions. By default a generation runs
    entirely on one version (``load_weights`` waits for it); an engine built *interruptible*
    instead lets an update land between two tokens of a generation in flight, and records the
    version of every token (``Generation.token_versions``), as partial-rollout systems do.
    """

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The weights version now served."""

    @abc.abstractmethod
    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_token_ids: Sequence[int] = (),
        n: int = 1,
        seed: int | Sequence[int] | None = None,
        mm_inputs: Sequence[Mapping[str, torch.Tensor] | None] | None = None,
    ) -> list[Generation]:
        """Sample ``n`` responses per prompt.

        ``seed``: one int seeds the whole call; a sequence gives each prompt its own seed, so a
        prompt's samples do not depend on which other prompts share the batch (a retried prompt
        reproduces its samples).

        ``mm_inputs``: for a multimodal model, each prompt's processed media (the processor's
        outputs other than ``input_ids`` / ``attention_mask``, e.g. ``pixel_values`` and
        ``image_grid_thw``), or ``None`` for a prompt without media; the prompt's ids hold the
        matching placeholder tokens. An engine that serves no media raises ``EngineError`` for
        any media given.

        Returns ``len(prompts) * n`` generations, grouped by prompt: prompt ``i``'s samples are
        at ``i * n … i * n + n - 1`` (with ``index`` 0 … n - 1).
        """

    @abc.abstractmethod
    async def load_weights(self, version: int, state_dict: StateDict) -> None:
        """Replace the weights by ``state_dict`` and start serving ``version``, atomically.

        Waits for in-flight generations to finish first (an interruptible engine instead swaps
        between two of their tokens). Raises ``EngineError`` (and changes
        nothing) when names or shapes do not match the model, or the version goes backwards.
        """

    @property
    def max_model_len(self) -> int | None:
        """Longest sequence (prompt + response) the engine serves; None when it does not say."""
        return None

    @abc.abstractmethod
    def statistics(self) -> dict[str, float | int]:
        """Counters for metrics: requests, sequences, tokens, time spent, weight loads, …"""

    async def close(self) -> None:
        """Release resources (threads, processes, accelerator memory)."""

    def _async_lock(self) -> asyncio.Lock:
        """The lock generations and weight loads take (created on first use, so an engine can
        be built outside a running loop)."""
        lock: asyncio.Lock | None = getattr(self, "_lock", None)
        if lock is None:
            lock = self._lock = asyncio.Lock()
        return lock
