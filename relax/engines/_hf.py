"""``HFEngine``: generation with a transformers causal LM — the CPU default and the test engine.

How it works, and why:

- **Off the event loop.** Decoding runs in a worker thread (``asyncio.to_thread``) so the
  caller's event loop keeps serving its mailbox, heartbeats and the bus while the model computes.
- **Our own decode loop** (a prefill, then one KV-cached forward per token) rather than
  ``generate``: it gives the two things RL needs that ``generate`` does not — a weight update
  may land *between two tokens* (interruptible rollouts, each token's version recorded), and each
  row may draw from its own seeded generator (a prompt's samples do not depend on its batch).
- **Batching.** One call's prompts (each repeated ``n`` times) are decoded together, left-padded
  (decoder-only models continue from the right edge), in chunks of at most ``max_batch_size``
  sequences. Concurrent calls are serialised, not merged: each call is already a batch, and the
  rollout role sizes its calls.
- **Logprobs of what was sampled.** Each token is drawn from the processed distribution
  (``logit_bias`` and presence/frequency penalties on the logits, then temperature, top-k,
  top-p, renormalised) and its logprob — and, when asked, the top-N alternatives — are read
  from that same distribution: the behaviour policy's logprob by construction (see
  ``relax.engines._base``). Penalties count the tokens each row sampled so far.
- **Streaming.** With ``on_token``, each decode step's tokens are handed to the caller's event
  loop (``call_soon_threadsafe``, so all of them arrive before the call returns) while the
  worker thread goes on decoding.
- **Media.** A multimodal model (e.g. a Qwen2.5-Omni thinker) takes each prompt's processed
  media (``mm_inputs``), checked against the prompt's placeholder tokens first; the prefill runs
  them batched (``collate_mm_inputs``, each of a prompt's ``n`` rows repeating its media). An
  M-RoPE model computes its 3-D prompt positions itself in that prefill; the offsets it reports
  (``rope_deltas``) are captured there, and every decode step passes its positions explicitly
  (text position + offset), so nothing depends on state the model keeps between calls. Tokens the
  model's generation config suppresses (media placeholders) are masked to ``-inf`` before
  sampling, so they are never drawn and the logprobs are those of the masked distribution.
- **Atomic weights.** A generation and a weight load never overlap: both take an
  ``asyncio.Lock`` (waiting never blocks the loop) and a ``threading.Lock`` inside the worker (a
  cancelled caller's thread keeps running, and still excludes a swap). An *interruptible* engine
  instead hands an update to the generation in flight, which applies it between two forward
  passes — all weights at once, so no forward pass sees a mix of versions.
- **LoRA.** With ``[model.lora]`` the engine's model carries the same adapters as the trainer's
  (``relax.models.apply_lora``: injected in place, the forward computes base + scaled low-rank
  path), and a weight load replaces the adapter tensors only — kilobytes, copied in place under
  the same atomicity as full weights. Not merged into a kept base copy: the trainer computes
  the unmerged form, so the engine's logprobs are the same computation as the trainer's rather
  than one rounded differently; a swap is a copy of the adapter instead of an O(d²) re-merge
  of every targeted weight; and no second copy of those weights is kept. The price is the
  rank-r side path in every forward. A load is all adapter tensors or all full weights,
  matching the engine: the other kind is refused by name (``relax.models.is_adapter_name``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from relax.config import LoraConfig
from relax.engines._base import (
    EngineError,
    GenerateCall,
    Generation,
    GenerationEngine,
    MediaInputs,
    OnFinished,
    OnToken,
    SamplingParams,
    StateDict,
    TokenEvent,
    refuse_adapter_tensors,
    thread_callbacks,
    with_rates,
)
from relax.engines._fast_decode import fast_decoder
from relax.models import (
    MediaSpec,
    RoutingRecorder,
    adapter_parameters,
    adapter_problems,
    apply_lora,
    collate_mm_inputs,
    load_policy,
    lora_config,
    moe_shape,
    pad_token_id,
    reset_rope_deltas,
    resolve_device,
    rope_deltas,
    suppressed_token_ids,
    uses_mrope,
)

_Job = tuple[list[int], int, int | None, dict[str, torch.Tensor] | None]
"""One sequence to decode: (prompt ids, sample index, row seed, the prompt's media)."""


class HFEngine(GenerationEngine):
    """Sample from a transformers causal LM (see the module docstring).

    ``model`` is owned by the engine from now on: only the arguments of ``generate`` decide how
    to sample (a checkpoint's generation config — its ``top_k = 50`` or EOS — never leaks in).
    ``interruptible``: weight updates land between two tokens of a generation in flight (for
    prompts with media too: their positions are fixed at the prefill, whatever the weights).
    The one thing of the checkpoint's generation config kept is ``suppress_tokens``: those ids
    are never sampled (see ``suppressed_token_ids``).
    """

    streams = True
    regenerates = True
    finishes_early = True  # a dense model's; an MoE's rows wait for the batch's routing

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pad_token_id: int,
        version: int = 0,
        max_batch_size: int = 64,
        tokenizer: PreTrainedTokenizerBase | None = None,
        interruptible: bool = False,
        compact: bool = True,
        fast_decode: bool = True,
    ) -> None:
        if max_batch_size < 1:
            raise EngineError(f"max_batch_size must be at least 1, got {max_batch_size}")
        suppressed = suppressed_token_ids(model)
        self.model = model.eval()
        self.model.generation_config = GenerationConfig(
            pad_token_id=pad_token_id, suppress_tokens=suppressed or None
        )
        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self._device = next(model.parameters()).device
        self.vocab_size = model.get_input_embeddings().num_embeddings
        text_config = model.config.get_text_config()
        self._max_positions: int | None = getattr(text_config, "max_position_embeddings", None)
        self.suppressed_token_ids = suppressed
        """Ids never sampled (masked to ``-inf``): the checkpoint's ``suppress_tokens``."""
        self._suppressed = (
            torch.tensor(suppressed, dtype=torch.long, device=self._device) if suppressed else None
        )
        self._media = MediaSpec.from_model(model)
        self._mrope = uses_mrope(model)
        self._moe = moe_shape(model)  # routing is recorded for every token (R3)
        self.lora = lora_config(model)
        """The adapters the model carries (``None``: full weights); loads replace only them."""
        self._version = version
        self._lock: asyncio.Lock | None = None
        self._thread_lock = threading.Lock()
        self.interruptible = interruptible
        self.compact = compact
        """Finished rows leave the decode batch (see ``_Live``); ``False`` keeps every row
        of a batch in every forward pass until its longest ends, as ``generate`` does."""
        self._fast = fast_decoder(self.model) if fast_decode else None
        """Decode steps without the forward pass's machinery, same logits (``_fast_decode``);
        ``None``: every step through ``model(...)`` (other architectures, or not asked for)."""
        self._pending_lock = threading.Lock()
        self._pending: list[tuple[int, list[tuple[str, torch.Tensor]], Future[None]]] = []
        self._generating = False
        # While regenerating: each decode step's recorded version, and the weights of any.
        self._schedule: tuple[list[int], Callable[[int], StateDict]] | None = None
        self._stats: dict[str, float | int] = {
            "requests": 0,
            "sequences": 0,
            "prompt_tokens": 0,
            "generated_tokens": 0,
            "generate_seconds": 0.0,
            "weight_loads": 0,
            "weight_load_seconds": 0.0,
            "interrupted_loads": 0,
        }

    @property
    def multimodal(self) -> bool:
        """Whether the model takes media (``mm_inputs``)."""
        return self._media is not None

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: str | torch.dtype = "float32",
        *,
        tokenizer: str | Path | None = None,
        version: int = 0,
        max_batch_size: int = 64,
        interruptible: bool = False,
        lora: LoraConfig | None = None,
        device: str = "cpu",
        compact: bool = True,
        fast_decode: bool = True,
    ) -> HFEngine:
        """Load a local HF model folder (see ``load_policy``) and serve it on ``device`` (a
        config's device: "auto", "cpu", "cuda[:N]"); with ``lora``, with fresh adapters (an
        identity update) that ``load_weights`` replaces."""
        model, tok = load_policy(path, dtype, tokenizer=tokenizer)
        if lora is not None:
            model = apply_lora(model, lora)
        model = model.to(resolve_device(device))
        pad = pad_token_id(tok, path)
        return cls(
            model,
            pad_token_id=pad,
            version=version,
            max_batch_size=max_batch_size,
            tokenizer=tok,
            interruptible=interruptible,
            compact=compact,
            fast_decode=fast_decode,
        )

    # ------------------------------------------------------------------ interface

    @property
    def version(self) -> int:
        return self._version

    @property
    def weights_device(self) -> torch.device:
        return self._device

    def statistics(self) -> dict[str, float | int]:
        return with_rates(self._stats, self._version)

    async def _generate(self, call: GenerateCall) -> list[Generation]:
        """``mm_inputs[i]``: prompt ``i``'s processed media (``None`` for none), matching the
        placeholder tokens in ``prompts[i]``; ``EngineError`` when it does not, or when the
        model takes no media."""
        media = self._check_media(call.prompts, call.mm_inputs)
        if not call.prompts:
            return []
        emit, finished = thread_callbacks(call)
        async with self._async_lock():
            return await asyncio.to_thread(
                self._generate_sync, call.prompts, call.params, call.seeds, media, emit, finished
            )

    async def load_weights(self, version: int, state_dict: StateDict) -> None:
        items = list(state_dict.items()) if isinstance(state_dict, Mapping) else list(state_dict)
        if self.interruptible:
            offered = self._offer(version, items)
            if offered is not None:
                await asyncio.wrap_future(offered)
                return
        async with self._async_lock():
            await asyncio.to_thread(self._load_sync, version, items)

    # ------------------------------------------------------------------ generation

    @property
    def max_model_len(self) -> int | None:
        return self._max_positions

    def _check_media(
        self, prompts: list[list[int]], mm_inputs: Sequence[MediaInputs | None] | None
    ) -> list[dict[str, torch.Tensor] | None]:
        """Each prompt's media, checked against its placeholders (``None``: no media)."""
        if mm_inputs is not None:
            if isinstance(mm_inputs, Mapping) or len(mm_inputs) != len(prompts):
                got = "a dict" if isinstance(mm_inputs, Mapping) else f"{len(mm_inputs)} entries"
                raise EngineError(
                    f"mm_inputs must have one entry (or None) per prompt: {got} for"
                    f" {len(prompts)} prompts"
                )
            if self._media is None and any(m for m in mm_inputs):
                first = next(i for i, m in enumerate(mm_inputs) if m)
                raise EngineError(
                    f"mm_inputs[{first}] has media, but the model is text-only"
                    f" ({type(self.model).__name__})"
                )
        if self._media is None:
            return [None] * len(prompts)
        given = list(mm_inputs) if mm_inputs is not None else [None] * len(prompts)
        return [
            self._media.check(i, p, m) for i, (p, m) in enumerate(zip(prompts, given, strict=True))
        ]

    def _generate_sync(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seeds: list[int] | None,
        media: list[dict[str, torch.Tensor] | None],
        emit: OnToken | None = None,
        finished: OnFinished | None = None,
    ) -> list[Generation]:
        with self._thread_lock:
            with self._pending_lock:
                self._generating = True
            try:
                started = time.perf_counter()
                jobs: list[_Job] = [
                    (prompt, k, None if seeds is None else _row_seed(seeds[i], k), media[i])
                    for i, prompt in enumerate(prompts)
                    for k in range(params.n)
                ]
                out: list[Generation] = []
                # One generator per call (or per row, for per-prompt seeds): a seeded call
                # never touches the process's global RNG.
                shared = None
                if params.seed is not None and seeds is None:
                    shared = torch.Generator(device=self._device).manual_seed(params.seed)
                for start in range(0, len(jobs), self.max_batch_size):
                    out += self._generate_batch(
                        jobs[start : start + self.max_batch_size],
                        params,
                        shared,
                        emit,
                        start,
                        finished,
                    )
            finally:
                # Updates offered during the last decode step land now, before anyone else
                # can generate: none is lost, none waits for the next generation.
                with self._pending_lock:
                    self._generating = False
                self._apply_pending()
            self._stats["requests"] += 1
            self._stats["sequences"] += len(out)
            self._stats["prompt_tokens"] += sum(len(g.prompt_ids) for g in out)
            self._stats["generated_tokens"] += sum(len(g.response_ids) for g in out)
            self._stats["generate_seconds"] += time.perf_counter() - started
            return out

    @torch.inference_mode()
    def _generate_batch(
        self,
        jobs: list[_Job],
        params: SamplingParams,
        shared: torch.Generator | None,
        emit: OnToken | None = None,
        first: int = 0,
        finished: OnFinished | None = None,
    ) -> list[Generation]:
        """Decode one left-padded batch token by token with a KV cache; ``emit`` hears each
        step's tokens (row ``r`` is sequence ``first + r`` of the call), ``finished`` each
        row's generation as the row ends.

        Our own loop rather than ``generate``: between two tokens a waiting weight update can
        land (interruptible rollouts), and each row may draw from its own seeded generator.
        """
        device, pad = self._device, self.pad_token_id
        size = len(jobs)
        width = max(len(prompt) for prompt, *_ in jobs)
        input_ids = torch.full((size, width), pad, dtype=torch.long)
        attention = torch.zeros((size, width), dtype=torch.long)
        for row, (prompt, *_) in enumerate(jobs):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention[row, width - len(prompt) :] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        recorder = RoutingRecorder(self.model) if self._moe is not None else None
        with recorder or contextlib.nullcontext():
            return self._decode(
                jobs, params, shared, emit, first, input_ids, attention, recorder, finished
            )

    def _decode(
        self,
        jobs: list[_Job],
        params: SamplingParams,
        shared: torch.Generator | None,
        emit: OnToken | None,
        first: int,
        input_ids: torch.Tensor,
        attention: torch.Tensor,
        recorder: RoutingRecorder | None,
        finished: OnFinished | None = None,
    ) -> list[Generation]:
        device, pad = self._device, self.pad_token_id
        size, width = input_ids.shape
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        rows_rng = None
        if jobs[0][2] is not None:
            rows_rng = [torch.Generator(device=device).manual_seed(s) for _, _, s, _ in jobs]
        if self._media is None:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention,
                position_ids=positions,
                use_cache=True,
            )
            next_position = positions[:, -1:] + 1
        else:
            out, next_position = self._prefill_media(input_ids, attention, positions, jobs)
        cache, logits = out.past_key_values, out.logits[:, -1, :].float()
        # (Never an MoE model, whose routing is recorded, nor one with media: not its classes.)
        fast = (
            None
            if self._fast is None
            else self._fast.start(cache, attention, params.max_new_tokens)
        )
        cache = cache if fast is None else fast
        stops = torch.tensor(sorted(params.stop_token_ids), dtype=torch.long, device=device)
        tokens: list[torch.Tensor] = []
        logprobs: list[torch.Tensor] = []
        tops: list[tuple[torch.Tensor, torch.Tensor]] = []
        versions: list[int] = []
        done = torch.zeros(size, dtype=torch.bool, device=device)
        ended_at = torch.full((size,), params.max_new_tokens, dtype=torch.long)
        announced: set[int] = set()  # rows already given to ``finished``
        bias = None
        if params.logit_bias:
            bias = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=device)
            ids, values = zip(*params.logit_bias, strict=True)
            bias[list(ids)] = torch.tensor(values, dtype=logits.dtype, device=device)
        # Per row: how often each id was sampled so far (for the penalties).
        counts = torch.zeros_like(logits) if params.penalised else None
        # The rows in the forward passes: all of them, or (compacting) those still generating.
        live = _Live(size, device) if self._compacts(cache, recorder) else None
        for step in range(params.max_new_tokens):
            logits = _processed_logits(logits, params, bias, counts)
            if self._suppressed is not None:
                logits = logits.index_fill(-1, self._suppressed, -math.inf)
            # The logits came from the weights served now: that is this token's version.
            token, logprob, logp = _sample(logits, params, shared, rows_rng, live)
            if counts is not None:
                counts.scatter_add_(-1, token[:, None], torch.ones_like(logprob[:, None]))
            top = None
            if params.top_logprobs:
                top = logp.topk(min(params.top_logprobs, logp.shape[-1]), dim=-1)
            if live is not None:  # back to batch rows (a finished row's values are never read)
                token, logprob = live.spread(token, pad), live.spread(logprob, 0.0)
                if top is not None:
                    top = (live.spread(top[0], -math.inf), live.spread(top[1], 0))
            tokens.append(token)
            logprobs.append(logprob)
            versions.append(self._version)
            if top is not None:
                tops.append(top)
            if emit is not None:
                self._emit(emit, first, token, logprob, tops[-1] if tops else None, done)
            if stops.numel():
                stopped = torch.isin(token, stops) & ~done
                ended_at[stopped.cpu()] = step + 1
                done |= stopped
                if finished is not None and recorder is None and bool(stopped.any()):
                    # Reported now, not when the batch's longest ends: the rollout puts a
                    # group on the bus as soon as its last sample stopped.
                    rows = stopped.cpu().nonzero().flatten().tolist()
                    out_rows = self._outputs(
                        jobs, params, rows, tokens, logprobs, tops, versions, ended_at
                    )
                    for row, gen in zip(rows, out_rows, strict=True):
                        finished(first + row, gen)
                        announced.add(row)
            if step + 1 == params.max_new_tokens or bool(done.all()):
                break
            self._between_tokens(step)
            attention = torch.cat(
                [attention, torch.ones((attention.shape[0], 1), dtype=torch.long, device=device)],
                1,
            )
            feed = token.masked_fill(done, pad)
            if live is not None:
                keep = live.shrink(done)
                if keep is not None:  # these rows of the forward batch go on, the rest leave
                    cache.batch_select_indices(keep)
                    attention, next_position = attention[keep], next_position[keep]
                    counts = None if counts is None else counts[keep]
                feed = feed[live.index]
            if fast is not None:
                logits = self._fast.step(fast, feed.unsqueeze(-1), next_position).float()
            else:
                out = self.model(
                    input_ids=feed.unsqueeze(-1),
                    attention_mask=attention,
                    position_ids=next_position,
                    past_key_values=cache,
                    use_cache=True,
                )
                cache, logits = out.past_key_values, out.logits[:, -1, :].float()
            next_position = next_position + 1
        routed = self._routed(recorder, jobs, width, len(tokens), ended_at)
        result = self._outputs(
            jobs, params, range(size), tokens, logprobs, tops, versions, ended_at, routed
        )
        if finished is not None:
            for row, gen in enumerate(result):
                if row not in announced:
                    finished(first + row, gen)
        return result

    def _compacts(self, cache: Any, recorder: RoutingRecorder | None) -> bool:
        """Whether finished rows may leave this decode batch: not while routing is recorded
        (every pass records the whole batch), nor with M-RoPE positions."""
        return (
            self.compact
            and recorder is None
            and not self._mrope
            and hasattr(cache, "batch_select_indices")
        )

    def _outputs(
        self,
        jobs: list[_Job],
        params: SamplingParams,
        rows: Sequence[int],
        tokens: list[torch.Tensor],
        logprobs: list[torch.Tensor],
        tops: list[tuple[torch.Tensor, torch.Tensor]],
        versions: list[int],
        ended_at: torch.Tensor,
        routed: list[torch.Tensor] | None = None,
    ) -> list[Generation]:
        """The generations of batch ``rows`` from the steps decoded so far (all of a row's,
        once it ended)."""
        stop_set = set(params.stop_token_ids)
        index = torch.tensor(list(rows), dtype=torch.long)
        all_tokens = torch.stack(tokens, 1).cpu()[index]
        all_logprobs = torch.stack(logprobs, 1).cpu()[index]
        top_values = torch.stack([v for v, _ in tops], 1).cpu()[index] if tops else None
        top_ids = torch.stack([i for _, i in tops], 1).cpu()[index] if tops else None
        result = []
        for at, row in enumerate(rows):
            prompt, sample = jobs[row][0], jobs[row][1]
            end = min(int(ended_at[row]), all_tokens.shape[1])
            ids, row_versions = all_tokens[at, :end].tolist(), versions[:end]
            row_tops = None
            if top_values is not None and top_ids is not None:
                row_tops = [
                    _finite_pairs(top_ids[at, t].tolist(), top_values[at, t].tolist())
                    for t in range(end)
                ]
            result.append(
                Generation(
                    prompt_ids=list(prompt),
                    response_ids=ids,
                    logprobs=all_logprobs[at, :end].tolist(),
                    finish_reason="stop" if ids and ids[-1] in stop_set else "length",
                    version=min(row_versions, default=self._version),
                    index=sample,
                    token_versions=row_versions,
                    top_logprobs=row_tops,
                    routed_experts=None if routed is None else routed[row],
                )
            )
        return result

    def _between_tokens(self, step: int) -> None:
        """After token ``step`` and before the forward pass of the next: where weights change."""
        if self._schedule is not None:  # a recorded decode: switch where the record did
            schedule, _ = self._schedule
            self._switch_to(schedule[min(step + 1, len(schedule) - 1)])
        elif self.interruptible:
            self._apply_pending()  # the next token uses the new weights

    def _switch_to(self, version: int) -> None:
        assert self._schedule is not None
        if version != self._version:
            items = list(self._schedule[1](version).items())
            if self.lora is not None:
                self._copy_adapter(items)
            else:
                self._copy_weights(items)
            self._version = version

    def regenerate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seeds: list[int],
        schedules: Sequence[Sequence[int] | None],
        weights: Callable[[int], StateDict],
    ) -> list[Generation | None]:
        """Decode a recorded call again as it ran (``relax replay --regenerate``): the same
        jobs in the same chunks of ``max_batch_size`` sequences (a row's logprobs depend on its
        batch in the last bits), chunk ``c`` on the weights of the versions ``schedules[c]``
        lists per token — the first for the prefill, then switching between tokens where the
        versions change, as an interruptible generation did. ``weights(v)`` gives version
        ``v``'s state dict (any version, older ones too). A chunk whose schedule is ``None`` is
        not decoded: its generations are ``None``. Text prompts only."""
        jobs: list[_Job] = [
            (prompt, k, _row_seed(seeds[i], k), None)
            for i, prompt in enumerate(prompts)
            for k in range(params.n)
        ]
        out: list[Generation | None] = []
        with self._thread_lock:
            for chunk, start in enumerate(range(0, len(jobs), self.max_batch_size)):
                batch, schedule = jobs[start : start + self.max_batch_size], schedules[chunk]
                if schedule is None:
                    out += [None] * len(batch)
                    continue
                self._schedule = (list(schedule), weights)
                try:
                    self._switch_to(schedule[0])
                    out += self._generate_batch(batch, params, None)
                finally:
                    self._schedule = None
        return out

    def _routed(
        self,
        recorder: RoutingRecorder | None,
        jobs: list[_Job],
        width: int,
        sampled: int,
        ended_at: torch.Tensor,
    ) -> list[torch.Tensor] | None:
        """Each row's routing, ``[prompt + response tokens, layers, top_k]``: the prefill's
        for its prompt (left padding cut), one decode step's per response token fed back
        (the last sampled token never is: it holds ``num_experts``)."""
        if recorder is None or self._moe is None:
            return None
        shape, size = self._moe, len(jobs)
        prefill = recorder.pass_ids(0).view(shape.layers, size, width, shape.top_k)
        steps = [
            recorder.pass_ids(i).view(shape.layers, size, shape.top_k) for i in range(1, sampled)
        ]
        decoded = torch.stack(steps, 2) if steps else prefill[:, :, :0]
        out = []
        for row, (prompt, *_) in enumerate(jobs):
            end = min(int(ended_at[row]), sampled)
            ids = torch.cat([prefill[:, row, width - len(prompt) :], decoded[:, row, : end - 1]], 1)
            last = torch.full((shape.layers, 1, shape.top_k), shape.unrecorded, dtype=ids.dtype)
            ids = torch.cat([ids.cpu(), last], 1).permute(1, 0, 2)
            out.append(ids.to(shape.dtype).contiguous())
        return out

    def _emit(
        self,
        emit: OnToken,
        first: int,
        token: torch.Tensor,
        logprob: torch.Tensor,
        top: tuple[torch.Tensor, torch.Tensor] | None,
        done: torch.Tensor,
    ) -> None:
        """Report one step's tokens of the rows still generating (a row's stop token is its
        last)."""
        alive = (~done).cpu().tolist()
        ids, lps = token.cpu().tolist(), logprob.cpu().tolist()
        top_ids = top[1].cpu().tolist() if top is not None else None
        top_values = top[0].cpu().tolist() if top is not None else None
        events = [
            TokenEvent(
                sequence=first + row,
                token_id=ids[row],
                logprob=lps[row],
                version=self._version,
                top_logprobs=tuple(_finite_pairs(top_ids[row], top_values[row]))
                if top_ids is not None and top_values is not None
                else (),
            )
            for row in range(len(ids))
            if alive[row]
        ]
        if events:
            emit(events)

    def _prefill_media(
        self,
        input_ids: torch.Tensor,
        attention: torch.Tensor,
        positions: torch.Tensor,
        jobs: list[_Job],
    ) -> tuple[Any, torch.Tensor]:
        """The prefill of a multimodal model, with the rows' media; returns its output and the
        position ids of the next token (``[3, batch, 1]`` for an M-RoPE model)."""
        media = collate_mm_inputs([m for *_, m in jobs])
        # As the processor made them (the towers cast to their own dtype): a training forward
        # given the same tensors computes the same features.
        kwargs: dict[str, Any] = {key: value.to(self._device) for key, value in media.items()}
        if self._mrope:
            # The model computes the 3-D positions of prompt + media (and their offsets) itself
            # when it gets no position ids; stale offsets of an earlier call must not leak in.
            reset_rope_deltas(self.model)
        else:
            kwargs["position_ids"] = positions
        try:
            out = self.model(
                input_ids=input_ids, attention_mask=attention, use_cache=True, **kwargs
            )
        except torch.OutOfMemoryError:
            raise
        except (IndexError, ValueError, RuntimeError, TypeError) as exc:
            if not media:
                raise
            raise EngineError(f"the model refused the prompts' media: {exc}") from exc
        if not self._mrope:
            return out, positions[:, -1:] + 1
        deltas = rope_deltas(out, self.model)
        if deltas is None:
            raise EngineError(
                f"{type(self.model).__name__} uses multimodal rotary positions but reported no"
                " rope_deltas after the prefill"
            )
        text_position = attention.sum(-1, keepdim=True)  # of the next token, padding excluded
        next_position = text_position + deltas.to(device=attention.device, dtype=torch.long)
        return out, next_position.unsqueeze(0).expand(3, -1, -1)

    # ------------------------------------------------------------------ weights

    def _load_sync(self, version: int, items: list[tuple[str, torch.Tensor]]) -> None:
        with self._thread_lock:
            self._apply_weights(version, items)

    def _offer(self, version: int, items: list[tuple[str, torch.Tensor]]) -> Future[None] | None:
        """Hand an update to the generation in flight (it lands between two tokens), or
        return ``None`` when nothing is generating and the caller should load it itself."""
        with self._pending_lock:
            if not self._generating:
                return None
            done: Future[None] = Future()
            self._pending.append((version, items, done))
            return done

    def _apply_pending(self) -> None:
        """Apply the updates offered to the running generation (called holding the thread lock)."""
        with self._pending_lock:
            pending, self._pending = self._pending, []
        for version, items, done in pending:
            # The caller may have given up waiting (its task was cancelled, e.g. the rollout is
            # stopping): such an update is dropped, and the generation goes on unharmed —
            # setting a result on a cancelled future would raise into it.
            if not done.set_running_or_notify_cancel():
                continue
            try:
                self._apply_weights(version, items)
            except BaseException as exc:
                done.set_exception(exc)
            else:
                self._stats["interrupted_loads"] += 1
                done.set_result(None)

    def _apply_weights(self, version: int, items: list[tuple[str, torch.Tensor]]) -> None:
        started = time.perf_counter()
        if version < self._version:
            raise EngineError(
                f"weights version {version} is older than the served version {self._version}"
            )
        if self.lora is not None:
            self._copy_adapter(items)
        else:
            self._copy_weights(items)
        self._version = version
        self._stats["weight_loads"] += 1
        self._stats["weight_load_seconds"] += time.perf_counter() - started

    def _copy_adapter(self, items: list[tuple[str, torch.Tensor]]) -> None:
        problems = adapter_problems(self.model, items)
        if problems:  # checked before copying anything: a bad update leaves the old adapter
            raise EngineError("adapter update refused: " + "; ".join(problems[:5]))
        own = adapter_parameters(self.model)
        with torch.no_grad():
            for name, tensor in items:
                own[name].copy_(tensor)

    def _copy_weights(self, items: list[tuple[str, torch.Tensor]]) -> None:
        refuse_adapter_tensors(items)
        current = self.model.state_dict()
        problems = []
        seen: set[str] = set()
        for name, tensor in items:
            if name not in current:
                problems.append(f"unknown weight {name!r}")
            elif tuple(tensor.shape) != tuple(current[name].shape):
                problems.append(
                    f"{name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(current[name].shape)}"
                )
            seen.add(name)
        # Tied weights share storage: providing any one name of a group covers all of them.
        groups: dict[int, list[str]] = {}
        for name, tensor in current.items():
            groups.setdefault(tensor.untyped_storage().data_ptr(), []).append(name)
        missing = [names[0] for names in groups.values() if not seen.intersection(names)]
        if missing:
            problems.append(f"{len(missing)} weights missing, e.g. {missing[:3]}")
        if problems:
            # Checked before copying anything, so a bad update leaves the old weights whole.
            raise EngineError("weight update refused: " + "; ".join(problems[:5]))
        with torch.no_grad():
            for name, tensor in items:
                current[name].copy_(tensor)


class _Live:
    """The rows of a decode batch still in its forward passes. A finished row's tokens are
    never read again, so once a quarter of the rows in the passes have finished, they leave
    (their KV cache rows too): a long tail decodes at the size of the rows still generating,
    not of the whole batch. Decode cost grows with the batch (one CPU thread, a 256-wide
    2-layer model: 3.3 ms a step for 64 rows, 1.3 ms for 8). Sampling keeps every row's
    draws as in the whole batch (``_sample``)."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size = size
        self.index = torch.arange(size, device=device)
        self.rows = list(range(size))  # ``index`` as a list: picking generators reads no device

    def spread(self, values: torch.Tensor, fill: float) -> torch.Tensor:
        """``values`` of the rows in the pass, as a whole batch's (``fill`` elsewhere)."""
        if len(self.rows) == self.size:
            return values
        out = values.new_full((self.size, *values.shape[1:]), fill)
        out[self.index] = values
        return out

    def shrink(self, done: torch.Tensor) -> torch.Tensor | None:
        """The positions in the pass of the rows that stay, when enough have finished."""
        finished = done[self.index]
        count = int(finished.sum())
        if count == 0 or count == len(self.rows) or 4 * count < len(self.rows):
            return None
        keep = (~finished).nonzero().flatten()
        self.index = self.index[keep]
        self.rows = self.index.tolist()
        return keep


def _row_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a prompt seeded ``seed`` (distinct, stable, 63-bit)."""
    return (seed * 1_000_003 + index * 7_919 + 1) % (1 << 63)


def _processed_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    bias: torch.Tensor | None,
    counts: torch.Tensor | None,
) -> torch.Tensor:
    """The logits with ``logit_bias`` added and presence/frequency penalties subtracted
    (OpenAI's formula: ``- frequency * count - presence * (count > 0)``)."""
    if bias is not None:
        logits = logits + bias
    if counts is not None:
        logits = (
            logits
            - params.frequency_penalty * counts
            - params.presence_penalty * (counts > 0).to(logits.dtype)
        )
    return logits


def _finite_pairs(ids: list[int], values: list[float]) -> list[tuple[int, float]]:
    """``(id, logprob)`` pairs of tokens the distribution can draw (-inf ones are left out)."""
    return [(i, v) for i, v in zip(ids, values, strict=True) if v != -math.inf]


def _draw_per_row(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs``, row ``i`` drawing from ``generators[i]`` alone (one
    uniform per row and step: a row draws the same whatever else is in the batch).

    By inverse CDF over the whole batch at once. ``torch.multinomial`` once per row cost
    ~20 µs a row on a 261-token vocabulary (CPU, one thread, ``bench/seeded_draws.py``:
    10.9 vs 0.8 ms a decode step for 16 rows of a 32k vocabulary, 203 vs 27 ms for 64 rows of
    a 152k one), and one ``torch.multinomial`` for the whole batch was no better (10.5 / 216
    ms), so rows that share a generator draw by inverse CDF too (``_sample``).
    """
    u = torch.stack(
        [torch.rand((), dtype=torch.float64, generator=g, device=g.device) for g in generators]
    )
    return _inverse_cdf(probs, u)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability passes ``u`` (in [0, 1]) of the
    row's total: a draw from the row's distribution for a uniform ``u``."""
    cdf = probs.cumsum(-1)
    # Scaled by each row's own total, so rounding in the sum favours no token.
    at = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    token = torch.searchsorted(cdf, at, right=True).clamp_(max=probs.shape[-1] - 1)
    # right=True never lands on a token of probability 0, except past the end (u·total
    # rounded up to the total): such a row takes its last token that can be drawn.
    stuck = (probs.gather(-1, token) == 0).squeeze(-1)
    token = token.squeeze(-1)
    if bool(stuck.any()):
        rows = stuck.nonzero().flatten()
        token[rows] = probs.shape[-1] - 1 - (probs[rows] > 0).flip(-1).int().argmax(-1)
    return token


def _sample(
    logits: torch.Tensor,
    params: SamplingParams,
    shared: torch.Generator | None,
    rows_rng: list[torch.Generator] | None,
    live: _Live | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row; returns ``(tokens, logprobs, log-distribution)`` under the
    sampled-from distribution (temperature, then top-k, then top-p, renormalised — see
    ``_base``). ``logits`` are of ``live``'s rows when given: each draws what it would have
    drawn in the whole batch (its own generator, or its place in the shared generator's draw
    for the whole batch), so leaving the pass changes no row's tokens."""
    if params.greedy:
        token = logits.argmax(-1)
        logp = logits.log_softmax(-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1), logp
    scores = logits / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = scores.topk(params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1:
        ordered, order = scores.sort(-1, descending=True)
        probs = ordered.softmax(-1)
        # Drop a token once the tokens before it already reach top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        scores = scores.scatter(-1, order, ordered.masked_fill(drop, -math.inf))
    logp = scores.log_softmax(-1)
    probs = logp.exp()
    if rows_rng is not None:
        token = _draw_per_row(probs, rows_rng if live is None else [rows_rng[r] for r in live.rows])
    else:  # one uniform per row of the whole batch, from the shared generator (or torch's)
        u = torch.rand(
            len(probs) if live is None else live.size,
            dtype=torch.float64,
            generator=shared,
            device=probs.device,
        )
        token = _inverse_cdf(probs, u if live is None else u[live.index])
    return token, logp.gather(-1, token[:, None]).squeeze(-1), logp
