"""``HFEngine``: generation with Hugging Face ``generate`` — the CPU default and the test engine.

How it works, and why:

- **Off the event loop.** ``generate`` runs in a worker thread (``asyncio.to_thread``) so the
  caller's event loop keeps serving its mailbox, heartbeats and the bus while the model computes.
- **Batching.** One call's prompts (each repeated ``n`` times) are decoded together, left-padded
  (decoder-only models continue from the right edge), in chunks of at most ``max_batch_size``
  sequences. Concurrent calls are serialised, not merged: each call is already a batch, and the
  rollout role sizes its calls.
- **Logprobs from ``output_scores``.** ``generate`` hands back the *processed* scores of every
  step — logits after temperature, top-k and top-p — which is exactly the distribution each
  token was drawn from; ``log_softmax`` of them at the sampled id is the behaviour policy's
  logprob by construction (see ``relax.engines._base`` for the precise contract). Recomputing
  with a second forward pass would cost as much again and could differ from what was actually
  sampled by the numerics of the cached, padded decode. Memory is ``batch * new_tokens * vocab``
  floats per chunk; lower ``max_batch_size`` for large vocabularies.
- **Atomic weights.** ``generate`` and ``load_weights`` take the same lock — an ``asyncio.Lock``
  so waiting never blocks the loop, plus a ``threading.Lock`` inside the worker so that even a
  cancelled caller (whose thread keeps running) can never overlap a weight swap. The version is
  read and written under that lock, together with the weights.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from relax.engines._base import EngineError, Generation, GenerationEngine, SamplingParams, StateDict
from relax.engines._models import load_policy


class HFEngine(GenerationEngine):
    """Sample from a transformers causal LM with ``generate``.

    ``model`` is owned by the engine from now on: its ``generation_config`` is replaced by a
    neutral one so that only the arguments of ``generate`` decide how to sample (a checkpoint's
    default ``top_k = 50`` or EOS must not leak in).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pad_token_id: int,
        version: int = 0,
        max_batch_size: int = 64,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise EngineError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self.model = model.eval()
        self.model.generation_config = GenerationConfig(pad_token_id=pad_token_id)
        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self._device = next(model.parameters()).device
        self._vocab_size = model.get_input_embeddings().num_embeddings
        self._max_positions: int | None = getattr(model.config, "max_position_embeddings", None)
        self._version = version
        self._lock: asyncio.Lock | None = None
        self._thread_lock = threading.Lock()
        self._stats: dict[str, float | int] = {
            "requests": 0,
            "sequences": 0,
            "prompt_tokens": 0,
            "generated_tokens": 0,
            "generate_seconds": 0.0,
            "weight_loads": 0,
            "weight_load_seconds": 0.0,
        }

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: str | torch.dtype = "float32",
        *,
        tokenizer: str | Path | None = None,
        version: int = 0,
        max_batch_size: int = 64,
    ) -> HFEngine:
        """Load a local HF model folder (see ``load_policy``) and serve it."""
        model, tok = load_policy(path, dtype, tokenizer=tokenizer)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if pad is None:
            raise EngineError(
                f"the tokenizer of {path} has neither a pad nor an EOS token to pad with"
            )
        return cls(
            model, pad_token_id=pad, version=version, max_batch_size=max_batch_size, tokenizer=tok
        )

    # ------------------------------------------------------------------ interface

    @property
    def version(self) -> int:
        return self._version

    def statistics(self) -> dict[str, float | int]:
        stats = dict(self._stats)
        stats["version"] = self._version
        seconds = float(stats["generate_seconds"])
        stats["tokens_per_second"] = stats["generated_tokens"] / seconds if seconds > 0 else 0.0
        return stats

    def _async_lock(self) -> asyncio.Lock:
        # Created on first use so the engine can be built outside a running loop.
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

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
        seed: int | None = None,
    ) -> list[Generation]:
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_token_ids=tuple(int(t) for t in stop_token_ids),
            n=n,
            seed=seed,
        )
        checked = [self._check_prompt(i, p, max_new_tokens) for i, p in enumerate(prompts)]
        if not checked:
            return []
        async with self._async_lock():
            return await asyncio.to_thread(self._generate_sync, checked, params)

    async def load_weights(self, version: int, state_dict: StateDict) -> None:
        items = list(state_dict.items()) if isinstance(state_dict, Mapping) else list(state_dict)
        async with self._async_lock():
            await asyncio.to_thread(self._load_sync, version, items)

    # ------------------------------------------------------------------ generation

    def _check_prompt(self, i: int, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        ids = [int(t) for t in prompt]
        if not ids:
            raise EngineError(f"prompt {i} is empty; it needs at least one token (e.g. BOS)")
        bad = [t for t in ids if not 0 <= t < self._vocab_size]
        if bad:
            raise EngineError(
                f"prompt {i} has token ids outside [0, {self._vocab_size}): {bad[:5]}"
            )
        if self._max_positions is not None and len(ids) + max_new_tokens > self._max_positions:
            raise EngineError(
                f"prompt {i} ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the"
                f" model's {self._max_positions} positions"
            )
        return ids

    def _generate_sync(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        with self._thread_lock:
            version = self._version
            started = time.perf_counter()
            jobs = [(prompt, k) for prompt in prompts for k in range(params.n)]
            out: list[Generation] = []
            # fork_rng: a seeded call must not reset the RNG of everything else in the process.
            devices = [self._device.index or 0] if self._device.type != "cpu" else []
            with torch.random.fork_rng(
                devices=devices, enabled=params.seed is not None, device_type=self._device.type
            ):
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                for start in range(0, len(jobs), self.max_batch_size):
                    out += self._generate_batch(
                        jobs[start : start + self.max_batch_size], params, version
                    )
            self._stats["requests"] += 1
            self._stats["sequences"] += len(out)
            self._stats["prompt_tokens"] += sum(len(g.prompt_ids) for g in out)
            self._stats["generated_tokens"] += sum(len(g.response_ids) for g in out)
            self._stats["generate_seconds"] += time.perf_counter() - started
            return out

    @torch.inference_mode()
    def _generate_batch(
        self, jobs: list[tuple[list[int], int]], params: SamplingParams, version: int
    ) -> list[Generation]:
        width = max(len(prompt) for prompt, _ in jobs)
        input_ids = torch.full((len(jobs), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for row, (prompt, _) in enumerate(jobs):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        sampling: dict[str, Any] = {"do_sample": False}
        if not params.greedy:
            sampling = {
                "do_sample": True,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k,  # 0 disables it (None would mean the default, 50)
            }
        result = self.model.generate(
            input_ids=input_ids.to(self._device),
            attention_mask=attention_mask.to(self._device),
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=0,
            eos_token_id=list(params.stop_token_ids) or None,
            pad_token_id=self.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
            **sampling,
        )
        tokens = result.sequences[:, width:].cpu()
        # scores[t] are the processed logits the token at step t was drawn from.
        scores = torch.stack(result.scores, dim=1).float().cpu()
        logprobs = scores.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        stops = set(params.stop_token_ids)
        out = []
        for row, (prompt, index) in enumerate(jobs):
            ids = tokens[row].tolist()
            # Rows that stopped early are padded to the batch's length: cut after the first stop.
            end = next((t + 1 for t, token in enumerate(ids) if token in stops), None)
            finish = "stop" if end is not None else "length"
            end = end if end is not None else len(ids)
            out.append(
                Generation(
                    prompt_ids=list(prompt),
                    response_ids=ids[:end],
                    logprobs=logprobs[row, :end].tolist(),
                    finish_reason=finish,
                    version=version,
                    index=index,
                )
            )
        return out

    # ------------------------------------------------------------------ weights

    def _load_sync(self, version: int, items: list[tuple[str, torch.Tensor]]) -> None:
        with self._thread_lock:
            started = time.perf_counter()
            if version < self._version:
                raise EngineError(
                    f"weights version {version} is older than the served version {self._version}"
                )
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
            self._version = version
            self._stats["weight_loads"] += 1
            self._stats["weight_load_seconds"] += time.perf_counter() - started
