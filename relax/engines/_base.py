"""The generation-engine interface every rollout backend implements (HF ``generate``, vLLM).

An engine turns token-id prompts into sampled responses with the sampling policy's per-token
log-probabilities, and swaps its weights between versions atomically. It knows nothing of
actors or the bus: the rollout role drives it.

Log-probabilities (``Generation.logprobs``) — the contract every engine keeps:

    logprobs[t] = log p(response_ids[t] | prompt_ids + response_ids[:t])

where ``p`` is the distribution the token was *actually sampled from* (the "processed"
distribution): the model's logits plus ``logit_bias``, minus the ``frequency_penalty`` times
each token's count in the response so far and the ``presence_penalty`` for each token already
in it (OpenAI's definitions; the prompt does not count), divided by ``temperature``, then (when
enabled) restricted to the ``top_k`` most likely tokens and to the smallest set whose mass
reaches ``top_p``, and renormalised. ``Generation.top_logprobs`` lists the most likely tokens
of that same distribution (tokens it cannot draw, outside top-k/top-p, are not listed). With ``top_k = 0`` and
``top_p = 1`` (the RL setting) this is exactly ``log_softmax(logits / temperature)``, the
quantity a trainer recomputes (without bias and penalties: a trainer recomputing the plain
model distribution sees their effect as a gap, like truncation's). With truncation it is larger by ``-log(kept mass)``: a trainer
that recomputes without truncation sees a systematic gap, so keep truncation off for RL (or
correct for it). ``temperature = 0`` means greedy decoding; the logprobs are then
``log_softmax`` of the biased and penalised logits (temperature 1), since the greedy
"distribution" is degenerate.

Streaming: an engine whose ``streams`` is true takes ``on_token`` in ``generate`` and calls it
on the caller's event loop (never from a worker thread) once per decode step with that step's
``TokenEvent``s, in order, all of them before ``generate`` returns. For an engine that does not stream,
the ``Sampler`` replays each finished generation as events (time to first token is then the
whole generation).
"""

from __future__ import annotations

import abc
import asyncio
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from relax.errors import EngineError

FinishReason = Literal["stop", "length"]

StateDict = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
"""Weights for ``load_weights``: a state dict, or ``(name, tensor)`` pairs (e.g. streamed buckets)."""


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
    logit_bias: tuple[tuple[int, float], ...] = ()
    """``(token id, bias)`` pairs added to the logits before anything else (OpenAI's
    ``logit_bias``; -100 all but bans a token, +100 all but forces it)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already in the response (OpenAI's)."""
    frequency_penalty: float = 0.0
    """Times a token's count in the response so far, subtracted from its logit (OpenAI's)."""
    top_logprobs: int = 0
    """How many of the most likely tokens (of the processed distribution) to record per step
    in ``Generation.top_logprobs``; 0 records none."""

    def __post_init__(self) -> None:
        problems = []
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value):
                problems.append(f"{name} must be a finite number, got {value}")
        bad_bias = [(t, b) for t, b in self.logit_bias if not math.isfinite(b) or t < 0]
        if bad_bias:
            problems.append(f"logit_bias needs token ids ≥ 0 and finite biases, got {bad_bias[:3]}")
        if self.top_logprobs < 0:
            problems.append(f"top_logprobs must be ≥ 0, got {self.top_logprobs}")
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

    @property
    def penalised(self) -> bool:
        """Whether presence or frequency penalties apply (counts of sampled tokens needed)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0


def bias_pairs(
    logit_bias: Mapping[int, float] | Iterable[tuple[int, float]] | None,
) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted ``(id, bias)`` pairs (hashable: a sampler groups by it)."""
    if not logit_bias:
        return ()
    items = logit_bias.items() if isinstance(logit_bias, Mapping) else logit_bias
    return tuple(sorted((int(t), float(b)) for t, b in items))


@dataclass(frozen=True)
class TokenEvent:
    """One token just sampled, as a streaming engine reports it (see the module docstring)."""

    sequence: int
    """Which generation of the call: prompt ``i``'s sample ``k`` is ``i * n + k``."""
    token_id: int
    logprob: float
    version: int
    """The weights version whose logits the token was drawn from."""
    top_logprobs: tuple[tuple[int, float], ...] = ()
    """``(id, logprob)`` of the most likely tokens, when ``top_logprobs`` was asked for."""


OnToken = Callable[[list[TokenEvent]], None]
"""A streaming callback: one decode step's tokens (see the module docstring)."""


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
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per token, ``(id, logprob)`` of the most likely tokens of the distribution it was drawn
    from, most likely first (``SamplingParams.top_logprobs`` of them); ``None`` when not asked."""


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
    bias = bias_pairs(sampling.pop("logit_bias", None))
    return SamplingParams(stop_token_ids=stops, seed=seed, logit_bias=bias, **sampling), seeds


def check_bias(params: SamplingParams, vocab_size: int) -> None:
    """``EngineError`` when ``logit_bias`` names an id outside the vocabulary."""
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise EngineError(f"logit_bias has token ids outside [0, {vocab_size}): {bad[:5]}")


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

    streams: bool = False
    """Whether ``generate`` reports tokens as they are sampled (``on_token``)."""

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
        logit_bias: Mapping[int, float] | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        top_logprobs: int = 0,
        on_token: OnToken | None = None,
    ) -> list[Generation]:
        """Sample ``n`` responses per prompt.

        ``logit_bias``, ``presence_penalty``, ``frequency_penalty`` shape the distribution
        sampled from (see the module docstring); ``top_logprobs`` records its ``N`` most likely
        tokens per step; ``on_token`` (engines that ``stream``) reports each token as it is
        sampled. An engine that cannot honour one of them raises ``EngineError``, never ignores it.

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
