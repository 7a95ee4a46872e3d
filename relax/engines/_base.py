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

One call, one shape: ``generate(prompts, params)`` takes a validated ``SamplingParams`` (the
same object the ``Sampler`` batches by, the agent endpoint builds from a request body and
``SamplingParams.from_rollout`` builds from ``[rollout]``), and per prompt only what differs
between prompts: ``seeds`` and ``mm_inputs`` (``MediaInputs``).

Streaming: an engine whose ``streams`` is true takes ``on_token`` in ``generate`` and calls it
on the caller's event loop (never from a worker thread) once per decode step with that step's
``TokenEvent``s, in order, all of them before ``generate`` returns. For an engine that does not stream,
the ``Sampler`` replays each finished generation as events (time to first token is then the
whole generation).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from relax.errors import EngineError

if TYPE_CHECKING:
    from relax.config import RolloutConfig

FinishReason = Literal["stop", "length"]

StateDict = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
"""Weights for ``load_weights``: a state dict, or ``(name, tensor)`` pairs (e.g. streamed buckets)."""

MediaInputs = Mapping[str, torch.Tensor]
"""One prompt's processed media: the processor's outputs other than ``input_ids`` /
``attention_mask`` (``pixel_values``, ``image_grid_thw``, ``input_features``, ...)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; validated once so every engine sees the same meaning.

    Frozen and hashable (the ``Sampler`` batches requests by it): ``stop_token_ids`` may be
    given as any sequence and ``logit_bias`` as a ``{id: bias}`` mapping; both are stored as
    tuples (the bias as ``(id, bias)`` pairs sorted by id). An invalid value raises
    ``EngineError`` naming every problem.
    """

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
        # Normalised here so that equal settings are equal (hashable) objects however given.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias", bias_pairs(self.logit_bias))
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

    @classmethod
    def from_rollout(
        cls,
        rollout: RolloutConfig,
        *,
        n: int = 1,
        stop_token_ids: Sequence[int] = (),
        seed: int | None = None,
    ) -> SamplingParams:
        """What ``[rollout]`` means by sampling: its ``max_new_tokens``, ``temperature``,
        ``top_p`` and ``top_k``, with the stop ids of the model's tokenizer and ``n`` samples
        per prompt (``data.n_samples_per_prompt``). ``seed`` stays ``None`` unless given:
        ``rollout.seed`` seeds each prompt by its id instead (``generate``'s ``seeds``)."""
        return cls(
            max_new_tokens=rollout.max_new_tokens,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            stop_token_ids=tuple(stop_token_ids),
            n=n,
            seed=seed,
        )

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

OnFinished = Callable[[int, "Generation"], None]
"""Called with ``(sequence, generation)`` once a sequence of the call is finished
(``sequence``: prompt ``i``'s sample ``k`` is ``i * n + k``)."""


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
    routed_experts: Any = None
    """A mixture-of-experts model's routing: per token of ``prompt_ids + response_ids``, per MoE
    layer, the top-k expert ids its routers chose (a CPU tensor ``[tokens, layers, top_k]``;
    ``num_experts`` for the last token, never fed back). ``None``: a dense model, or an engine
    that does not record it (``relax.models._moe``)."""


def validate_request(
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    seeds: Sequence[int] | None,
    *,
    vocab_size: int,
    max_len: int | None,
) -> tuple[list[list[int]], list[int] | None]:
    """What every engine checks of one ``generate`` call before it samples: returns the
    prompts as lists of ids and the per-prompt seeds, or raises ``EngineError`` saying what is
    wrong (a bad seed count, a ``logit_bias`` id or prompt id outside the vocabulary, an empty
    prompt, a prompt plus ``max_new_tokens`` longer than ``max_len``)."""
    per_prompt = None
    if seeds is not None:
        if params.seed is not None:
            raise EngineError(
                "give either one seed for the call (SamplingParams.seed) or per-prompt seeds"
                " (seeds), not both"
            )
        per_prompt = [int(x) for x in seeds]
        if len(per_prompt) != len(prompts):
            raise EngineError(f"{len(per_prompt)} seeds for {len(prompts)} prompts")
    check_bias(params, vocab_size)
    checked = [
        check_prompt(i, p, params.max_new_tokens, vocab_size, max_len)
        for i, p in enumerate(prompts)
    ]
    return checked, per_prompt


@dataclass(frozen=True)
class GenerateCall:
    """One ``generate`` call, validated (``validate_request``), as an engine samples it."""

    prompts: list[list[int]]
    params: SamplingParams
    seeds: list[int] | None
    """Per-prompt seeds (``params.seed`` is then ``None``); ``None`` when not given."""
    mm_inputs: Sequence[MediaInputs | None] | None
    on_token: OnToken | None
    on_finished: OnFinished | None = None
    """Set only for an engine that ``finishes_early``; ``generate`` calls it otherwise."""


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


def refuse_adapter_tensors(items: Sequence[tuple[str, torch.Tensor]]) -> None:
    """An engine serving full weights refuses an update of LoRA adapter tensors (named by
    ``relax.models.is_adapter_name``) before it changes anything: the trainer and the engine
    were given different ``[model.lora]``."""
    from relax.models import is_adapter_name

    adapters = [name for name, _ in items if is_adapter_name(name)]
    if adapters:
        raise EngineError(
            f"weight update refused: {len(adapters)} of {len(items)} tensors are LoRA adapter"
            f" tensors (e.g. {adapters[0]!r}), but this engine serves full weights; serve"
            " with the same [model.lora] as the trainer"
        )


def thread_callbacks(call: GenerateCall) -> tuple[OnToken | None, OnFinished | None]:
    """``call``'s ``on_token`` and ``on_finished`` made callable from a worker thread: each
    call is handed to the caller's event loop (``call_soon_threadsafe``), FIFO with the call's
    own result (delivered the same way), so all of them run before ``generate`` returns.
    Called on the caller's loop."""
    emit = finished = None
    if call.on_token is not None or call.on_finished is not None:
        loop = asyncio.get_running_loop()

        def later(callback: Callable[..., None]) -> Callable[..., None]:
            def soon(*args: Any) -> None:
                with contextlib.suppress(RuntimeError):  # the loop closed under a stray thread
                    loop.call_soon_threadsafe(callback, *args)

            return soon

        emit = later(call.on_token) if call.on_token is not None else None
        finished = later(call.on_finished) if call.on_finished is not None else None
    return emit, finished


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

    An engine implements ``_generate``: ``generate`` checks every call the same way first
    (``validate_request``, and the engine's ``_refuse`` of what it cannot serve at all).
    """

    streams: bool = False
    """Whether ``generate`` reports tokens as they are sampled (``on_token``)."""

    regenerates: bool = False
    """Whether ``regenerate`` can run a recorded call again (``relax replay --regenerate``)."""

    finishes_early: bool = False
    """Whether ``on_finished`` hears of a sequence the moment it ends, before the longest of
    its batch (else ``generate`` reports every sequence once the call returns)."""

    def regenerate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seeds: list[int],
        schedules: Sequence[Sequence[int] | None],
        weights: Callable[[int], StateDict],
    ) -> list[Generation | None]:
        """Decode a recorded call again (blocking): ``schedules[c]`` lists the weights version
        of every decode step of chunk ``c`` (the engine's decode batches), ``weights(v)`` gives
        version ``v``'s state dict; a chunk scheduled ``None`` is skipped (its generations are
        ``None``)."""
        raise EngineError(f"{type(self).__name__} cannot regenerate a recorded call")

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The weights version now served."""

    @property
    def weights_device(self) -> Any:
        """Where this process holds the served weights (``None``: not in this process, as
        with vLLM's workers); the weight plane delivers published versions there."""
        return None

    vocab_size: int
    """Ids ``0 … vocab_size - 1`` are the model's (every prompt and ``logit_bias`` is checked
    against it); set by the engine."""

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seeds: Sequence[int] | None = None,
        mm_inputs: Sequence[MediaInputs | None] | None = None,
        on_token: OnToken | None = None,
        on_finished: OnFinished | None = None,
    ) -> list[Generation]:
        """Sample ``params.n`` responses per prompt, as ``params`` says.

        ``params.logit_bias``, ``presence_penalty`` and ``frequency_penalty`` shape the
        distribution sampled from (see the module docstring); ``params.top_logprobs`` records
        its ``N`` most likely tokens per step; ``on_token`` (engines that ``stream``) reports
        each token as it is sampled. An engine that cannot honour one of them raises
        ``EngineError``, never ignores it.

        Seeding: ``params.seed`` seeds the whole call; ``seeds`` instead gives each prompt its
        own seed (``params.seed`` is then ``None``), so a prompt's samples do not depend on
        which other prompts share the batch (a retried prompt reproduces its samples).

        ``mm_inputs``: for a multimodal model, each prompt's processed media (the processor's
        outputs other than ``input_ids`` / ``attention_mask``, e.g. ``pixel_values`` and
        ``image_grid_thw``), or ``None`` for a prompt without media; the prompt's ids hold the
        matching placeholder tokens. An engine that serves no media raises ``EngineError`` for
        any media given.

        ``on_finished(sequence, generation)``: called on the caller's event loop once per
        sequence, with the very generation returned for it, all before ``generate`` returns;
        an engine that ``finishes_early`` calls it as each sequence ends (shortest first), any
        other once the call is done, in order.

        Returns ``len(prompts) * n`` generations, grouped by prompt: prompt ``i``'s samples are
        at ``i * n … i * n + n - 1`` (with ``index`` 0 … n - 1).
        """
        self._refuse(mm_inputs, on_token)
        checked, per_prompt = validate_request(
            prompts, params, seeds, vocab_size=self.vocab_size, max_len=self.max_model_len
        )
        early = on_finished if self.finishes_early else None
        call = GenerateCall(checked, params, per_prompt, mm_inputs, on_token, early)
        gens = await self._generate(call)
        if on_finished is not None and early is None:
            for sequence, gen in enumerate(gens):
                on_finished(sequence, gen)
        return gens

    def _refuse(
        self, mm_inputs: Sequence[MediaInputs | None] | None, on_token: OnToken | None
    ) -> None:
        """Raise ``EngineError`` for what this engine cannot serve at all (before anything
        else of the call is checked)."""

    async def _generate(self, call: GenerateCall) -> list[Generation]:
        """Sample a validated call: what an engine implements (a test double may override
        ``generate`` whole instead)."""
        raise NotImplementedError(
            f"{type(self).__name__} implements neither generate nor _generate"
        )

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
