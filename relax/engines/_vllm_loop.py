"""The vLLM engine's step loop: continuous batching across calls, and weight updates that land
between two engine steps (partial rollouts).

``LLM.generate`` adds a call's requests and steps the engine until the last one ends: a second
call waits for the whole first one, and a weight update for both. This loop instead owns the
engine's stepping (``LLMEngine.add_request`` / ``step`` / ``abort_request``, in-process):

- **Continuous batching.** Calls queue with weight updates, in the order they came; the loop
  adds a call's requests at the next step, so a call that arrives while another decodes starts
  within one step, and vLLM's scheduler fills every slot that frees. A thread runs the loop while there is work and ends
  when there is none (no idle thread, nothing to stop).
- **Every token as it comes.** Requests report ``DELTA`` outputs, so each step's new tokens
  reach the caller (``on_token``), and each finished sequence is reported the moment it ends
  (``on_finished``), not when the call's longest one does.
- **Updates between steps.** A weight update offered while the loop runs is applied at the next
  step boundary. Interruptible (``[rollout] interruptible``): the running requests are aborted,
  the new weights loaded, and each request added again with its generated prefix appended to
  its prompt and the tokens left as its budget — vLLM recomputes the prefix's keys and values
  under the new weights (the prefix cache is reset by the load), and every token records the
  version it was sampled under. A resumed segment's seed is derived from the request's seed and
  the prefix length, so a recorded call can be decoded again segment by segment
  (``VLLMEngine.regenerate``). Presence and frequency penalties count the response's tokens,
  which a resumed request would see as prompt: a penalised request is never interrupted (the
  update waits for it). Not interruptible: the update waits until no request runs, and new
  calls wait with it, so it is never starved by a stream of calls.

Locks: the loop thread holds the engine's thread lock while it runs (a direct weight load or a
close takes it too, so they never overlap a step), and the process-wide vLLM lock around each
call into vLLM.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import itertools
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from relax.engines._base import (
    EngineError,
    Generation,
    OnFinished,
    OnToken,
    SamplingParams,
    TokenEvent,
)

Update = tuple[int, list[tuple[str, torch.Tensor]], Future[None]]
"""A weight update offered to the loop: its version, its tensors, and whom to tell."""


class StepEngine(Protocol):
    """What the loop needs of its engine (``VLLMEngine``)."""

    @property
    def version(self) -> int: ...

    def process_lock(self) -> Any:
        """Held around every call into vLLM."""

    def llm_core(self) -> Any:
        """vLLM's in-process ``LLMEngine``."""

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        seed: int | None,
        budget: int,
    ) -> None: ...

    def check_update(self, version: int, items: list[tuple[str, torch.Tensor]]) -> None: ...

    def apply_weights(self, version: int, items: list[tuple[str, torch.Tensor]]) -> None: ...

    def count_interruption(self, loads: int, resumed: int) -> None: ...


@dataclass(eq=False)
class _Sequence:
    """One (prompt, sample) of a call, across the requests it took (one per segment)."""

    call: Call
    sequence: int
    """Its place in the call: prompt ``i``'s sample ``k`` is ``i * n + k``."""
    prompt: list[int]
    index: int
    seed: int | None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    limit: int | None = None
    """How many tokens it may reach in all (``None``: ``max_new_tokens``)."""

    def resume(self, prefix: Generation | None, count: int) -> None:
        """Start from ``prefix`` (what earlier segments generated) and stop ``count`` tokens
        later: a regeneration ends each segment where the recorded one was interrupted."""
        if prefix is not None:
            self.ids, self.logprobs = list(prefix.response_ids), list(prefix.logprobs)
            self.versions = list(prefix.token_versions or [])
            self.tops = list(prefix.top_logprobs or [])
        self.limit = len(self.ids) + count

    def generation(self) -> Generation:
        stops = self.call.params.stop_token_ids
        return Generation(
            prompt_ids=list(self.prompt),
            response_ids=list(self.ids),
            logprobs=list(self.logprobs),
            finish_reason="stop" if self.ids and self.ids[-1] in stops else "length",
            version=min(self.versions, default=self.call.version),
            index=self.index,
            token_versions=list(self.versions),
            top_logprobs=list(self.tops) if self.call.params.top_logprobs else None,
        )


class Call:
    """A generate call queued on the loop: ``future`` gets its generations, in call order."""

    def __init__(
        self,
        jobs: list[tuple[list[int], int, int | None]],
        params: SamplingParams,
        *,
        emit: OnToken | None = None,
        finished: OnFinished | None = None,
    ) -> None:
        self.params = params
        self.emit = emit
        self.finished = finished
        self.future: Future[list[Generation]] = Future()
        self.version = 0  # the version served when its requests were added
        self.sequences = [
            _Sequence(self, s, prompt, index, seed) for s, (prompt, index, seed) in enumerate(jobs)
        ]
        self._results: list[Generation | None] = [None] * len(jobs)
        self._left = len(jobs)
        self.abandoned = False
        """Set by a caller that stopped waiting: the loop aborts what is left of the call."""

    def done(self, seq: _Sequence) -> None:
        gen = seq.generation()
        self._results[seq.sequence] = gen
        self._left -= 1
        if self.finished is not None:
            self.finished(seq.sequence, gen)
        if self._left == 0 and not self.future.done():
            self.future.set_result([g for g in self._results if g is not None])

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


class StepLoop:
    """Runs ``engine``'s vLLM (see the module docstring); built by ``VLLMEngine``."""

    def __init__(
        self, engine: StepEngine, thread_lock: threading.Lock, *, interruptible: bool
    ) -> None:
        self.engine = engine
        self._thread_lock = thread_lock  # the engine's: direct loads and close take it too
        self.interruptible = interruptible
        self._lock = threading.Lock()  # guards the queue and ``_looping``
        # Calls and updates in the order they came: a call queued before an update is added
        # before the update lands (it starts on the version served when it was queued).
        self._queue: collections.deque[Call | Update] = collections.deque()
        self._looping = False
        self._closed = False
        self._running: dict[str, _Sequence] = {}  # the loop thread's alone
        self._ids = itertools.count()

    # ------------------------------------------------------------------ callers' side

    def submit(self, call: Call) -> None:
        """Queue ``call``; its requests join the batch at the next step."""
        with self._lock:
            if self._closed:
                raise EngineError("the vLLM engine is closed")
            self._queue.append(call)
            self._start()

    def offer(self, version: int, items: list[tuple[str, torch.Tensor]]) -> Future[None] | None:
        """Hand an update to the running loop (applied at a step boundary), or ``None`` when
        the loop is not running and the caller should load it itself."""
        with self._lock:
            if not self._looping:
                return None
            done: Future[None] = Future()
            self._queue.append((version, items, done))
            return done

    def close(self) -> None:
        """Refuse new calls (those queued or running still finish)."""
        with self._lock:
            self._closed = True

    async def wait(self, call: Call) -> list[Generation]:
        """Await ``call``'s generations; a cancelled waiter abandons the call (aborted at the
        next step, so a stopping rollout does not keep the engine busy)."""
        try:
            return await asyncio.wrap_future(call.future)
        except asyncio.CancelledError:
            call.abandoned = True
            raise

    # ------------------------------------------------------------------ the loop thread

    def _start(self) -> None:
        if not self._looping:
            self._looping = True
            threading.Thread(target=self._run, name="relax-vllm-steps", daemon=True).start()

    def _run(self) -> None:
        try:
            with self._thread_lock:
                while self._turn():
                    pass
        except BaseException as exc:  # a failed step fails every call it held, not the process
            self._fail_everything(exc)

    def _turn(self) -> bool:
        """One step: add the calls queued ahead of any update, apply the updates that are due,
        step, collect. ``False``: nothing is left to do (the thread ends)."""
        with self._lock:
            calls = self._take_calls()
        for call in calls:
            self._add(call)
        with self._lock:
            movable = not any(s.call.params.penalised for s in self._running.values())
            updates: list[Update] = []
            if not self._running or (self.interruptible and movable):
                while self._queue and not isinstance(self._queue[0], Call):
                    updates.append(self._queue.popleft())
            if not (calls or updates or self._running or self._queue):
                self._looping = False
                return False
        if updates:
            self._apply(updates)
        self._drop_abandoned()
        if self._running:
            with self.engine.process_lock():
                outputs = self.engine.llm_core().step()
            self._collect(outputs)
        return True

    def _take_calls(self) -> list[Call]:
        """The calls at the front of the queue (an update waiting there holds back the rest)."""
        calls = []
        while self._queue and isinstance(self._queue[0], Call):
            calls.append(self._queue.popleft())
        return calls

    def _add(self, call: Call) -> None:
        call.version = self.engine.version
        try:
            for seq in call.sequences:
                self._request(seq)
        except BaseException as exc:
            self._fail_call(call, exc)

    def _request(self, seq: _Sequence) -> None:
        """Add ``seq``'s next segment: its prompt plus what it generated, for what is left."""
        engine, params = self.engine, seq.call.params
        seed = None if seq.seed is None else segment_seed(seq.seed, len(seq.ids))
        budget = (params.max_new_tokens if seq.limit is None else seq.limit) - len(seq.ids)
        request_id = f"relax-{next(self._ids)}"
        with engine.process_lock():
            engine.add_request(request_id, seq.prompt + seq.ids, params, seed, budget)
        self._running[request_id] = seq

    def _collect(self, outputs: list[Any]) -> None:
        """Append one step's tokens, hand them to the callers, then report what ended."""
        version = self.engine.version
        events: dict[Call, list[TokenEvent]] = {}
        ended = []
        for out in outputs:
            seq = self._running.get(out.request_id)
            if seq is None:
                continue
            completion = out.outputs[0]
            ids = [int(t) for t in completion.token_ids]
            entries = completion.logprobs or []
            logprobs = [float(e[t].logprob) for e, t in zip(entries, ids, strict=True)]
            count = seq.call.params.top_logprobs
            tops = [top_pairs(e, count) for e in entries] if count else [[] for _ in ids]
            seq.ids += ids
            seq.logprobs += logprobs
            seq.versions += [version] * len(ids)
            if count:
                seq.tops += tops
            if seq.call.emit is not None:
                events.setdefault(seq.call, []).extend(
                    TokenEvent(seq.sequence, t, lp, version, tuple(top))
                    for t, lp, top in zip(ids, logprobs, tops, strict=True)
                )
            if out.finished:
                del self._running[out.request_id]
                ended.append((seq, completion.finish_reason))
        for call, batch in events.items():
            if call.emit is not None and not call.future.done():
                call.emit(batch)  # a step's tokens reach the caller before its ends do
        for seq, reason in ended:
            if reason not in ("stop", "length"):
                self._fail_call(seq.call, EngineError(f"vLLM ended a response with {reason!r}"))
            elif not seq.call.future.done():
                seq.call.done(seq)

    def _apply(self, updates: list[Update]) -> None:
        """Check the updates, and if any is good: abort what runs, load them in order, resume
        what was aborted (a refused update interrupts nothing)."""
        good: list[Update] = []
        for version, items, done in updates:
            # A caller that gave up waiting (a stopping rollout) dropped its update.
            if not done.set_running_or_notify_cancel():
                continue
            try:
                self.engine.check_update(version, items)
            except BaseException as exc:
                done.set_exception(exc)
            else:
                good.append((version, items, done))
        if not good:
            return
        paused = list(self._running.values())
        self._abort(paused)
        loaded = 0
        for version, items, done in good:
            try:
                self.engine.apply_weights(version, items)
            except BaseException as exc:
                done.set_exception(exc)
            else:
                loaded += 1
                done.set_result(None)
        self.engine.count_interruption(loaded if paused else 0, len(paused))
        for seq in paused:
            try:
                self._request(seq)
            except BaseException as exc:
                self._fail_call(seq.call, exc)

    def _fail_call(self, call: Call, exc: BaseException) -> None:
        """``call`` fails with ``exc``: what it still runs is aborted."""
        self._abort([s for s in self._running.values() if s.call is call])
        call.fail(exc)

    def _abort(self, seqs: list[_Sequence]) -> None:
        gone = set(seqs)  # by identity (eq=False)
        ids = [rid for rid, s in self._running.items() if s in gone]
        if ids:
            with self.engine.process_lock():
                self.engine.llm_core().abort_request(ids)
            for rid in ids:
                del self._running[rid]

    def _drop_abandoned(self) -> None:
        gone = [s for s in self._running.values() if s.call.abandoned or s.call.future.done()]
        if gone:
            self._abort(gone)
            for call in {s.call for s in gone}:
                call.future.cancel()

    def _fail_everything(self, exc: BaseException) -> None:
        with self._lock:
            queued, self._looping = list(self._queue), False
            self._queue.clear()
        for seq in self._running.values():
            seq.call.fail(exc)
        self._running.clear()
        for item in queued:
            if isinstance(item, Call):
                item.fail(exc)
            else:
                with contextlib.suppress(Exception):  # its caller may have given up
                    item[2].set_exception(EngineError(f"the vLLM step loop failed: {exc!r}"))


def mix_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers; distinct inputs give unrelated seeds."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def segment_seed(seed: int, prefix: int) -> int:
    """The seed of a request resumed after ``prefix`` generated tokens (the first segment keeps
    the request's own seed, so an uninterrupted request samples as ``LLM.generate`` would)."""
    return mix_seed(seed, prefix) if prefix else seed


def top_pairs(entry: Mapping[int, Any], count: int) -> list[tuple[int, float]]:
    """vLLM's logprobs of one step (the top ``count`` by rank, plus the sampled token) as our
    most-likely-first ``(id, logprob)`` pairs, tokens it could not draw left out."""
    ranked = sorted(
        (int(v.rank), int(t), float(v.logprob))
        for t, v in entry.items()
        if v.rank is not None and v.rank <= count
    )
    return [(t, lp) for _, t, lp in ranked if lp != float("-inf")]
