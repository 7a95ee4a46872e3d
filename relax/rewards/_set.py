"""``RewardSet``: the configured reward functions, run together with failure isolation.

The contract the reward role relies on: ``score`` and ``score_batch`` never raise and never
hang much past the slowest function's timeout. Any function that raises, overruns its timeout,
or returns something that is not a finite real number (or a dict of them) makes the whole
sample *failed* (``ok=False``) with a readable reason, so the caller drops it and the trainer
never trains on a half-scored sample. A batched function's call covers the whole batch: if it
raises or overruns, every sample of the batch fails; one bad score in its list fails only
that sample.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from relax.config import RewardConfig
from relax.errors import ConfigError, ConfigIssue
from relax.rewards._sample import Sample
from relax.rewards._verifiers import BuildContext, OptionError, Verifier, build_verifier

FailureKind = Literal["error", "timeout", "invalid"]
"""Why a call failed: it raised, it overran its timeout, or it returned a non-finite/non-number."""


@dataclass(frozen=True)
class RewardResult:
    """The score of one sample."""

    ok: bool
    """False when any function failed; the sample must then be dropped, not trained on."""
    reward: float | None
    """Weighted sum of the components; None when not ``ok`` (a None fails loudly if misused)."""
    components: dict[str, float] = field(default_factory=dict)
    """Unweighted score of each function that succeeded, by name; a function that returned a
    dict gives one entry per key, named ``"<function>/<key>"``."""
    reason: str | None = None
    """Why the sample failed, e.g. ``"regex 'fmt': timed out after 2.0s"``; ``; ``-joined."""
    failures: dict[str, FailureKind] = field(default_factory=dict)
    """Kind of failure of each function that failed, by name."""
    errors: dict[str, BaseException] = field(default_factory=dict, repr=False, compare=False)
    """The exception each function that raised raised (with its traceback), by name."""


class _Failure(Exception):
    """Internal: one call failed; carries the kind, the human-readable detail and, when the
    function raised, its exception."""

    def __init__(self, kind: FailureKind, detail: str, error: BaseException | None = None) -> None:
        super().__init__(detail)
        self.kind: FailureKind = kind
        self.detail = detail
        self.error = error


Score = float | dict[str, float]
"""What one function gave one sample: a score, or named component scores."""


@dataclass
class _Stats:
    calls: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    total_latency_s: float = 0.0
    max_latency_s: float = 0.0


class RewardSet:
    """Scores responses with several verifiers, combined by weight.

        rewards = RewardSet.from_config(cfg.reward, answer_key=cfg.data.answer_key,
                                        max_response_tokens=cfg.rollout.max_new_tokens)
        result = await rewards.score(text, sample, response_tokens=len(ids))
        if not result.ok:
            drop(sample, result.reason)

    Functions of one sample run concurrently, each under its own timeout.
    """

    def __init__(self, verifiers: list[Verifier]) -> None:
        names = [v.name for v in verifiers]
        if len(set(names)) != len(names):
            raise ValueError(f"reward function names must be unique, got {names}")
        self.verifiers: tuple[Verifier, ...] = tuple(verifiers)
        self._stats = {v.name: _Stats() for v in verifiers}
        self._samples = 0
        self._failed_samples = 0
        self._abandoned: list[threading.Thread] = []

    @classmethod
    def from_config(
        cls,
        config: RewardConfig,
        *,
        answer_key: str = "answer",
        max_response_tokens: int | None = None,
    ) -> RewardSet:
        """Build the set a ``[reward]`` table describes; ``ConfigError`` lists every bad function.

        ``answer_key`` is ``[data] answer_key`` and ``max_response_tokens`` is
        ``[rollout] max_new_tokens`` (the default ``max_len`` of ``length_penalty``).
        """
        context = BuildContext(answer_key=answer_key, max_response_tokens=max_response_tokens)
        verifiers: list[Verifier] = []
        issues: list[ConfigIssue] = []
        for index, function in enumerate(config.functions):
            try:
                verifiers.append(build_verifier(function, context))
            except OptionError as exc:
                issues.append(_issue(index, exc))
        if issues:
            raise ConfigError(issues)
        return cls(verifiers)

    @property
    def loads(self) -> bool:
        """Whether ``load`` has anything to do (a function is model-backed)."""
        return any(verifier.loads for verifier in self.verifiers)

    def load(self) -> None:
        """Load what the functions need before the first sample (a reward model's weights):
        the reward role calls it once per replica as it starts. Blocking; ``ConfigError``
        naming the function's key when a model cannot be used (e.g. the wrong number of
        labels). Functions not loaded here load on their first call."""
        issues: list[ConfigIssue] = []
        for index, verifier in enumerate(self.verifiers):
            try:
                verifier.load()
            except OptionError as exc:
                issues.append(_issue(index, exc))
        if issues:
            raise ConfigError(issues)

    # ----------------------------------------------------------------------- scoring

    async def score(
        self, response_text: str, sample: Mapping[str, Any], *, response_tokens: int | None = None
    ) -> RewardResult:
        """Score one response. Never raises (except cancellation of the caller itself)."""
        one = Sample.of(response_text, sample, response_tokens)
        return (await self.score_batch([one]))[0]

    async def score_batch(self, samples: Sequence[Sample]) -> list[RewardResult]:
        """Score many samples at once: a batched function is called once with all of them,
        the others once per sample, all concurrently. Never raises (but cancellation)."""
        samples = list(samples)
        if not samples:
            return []
        outcomes = await asyncio.gather(*(self._run_all(v, samples) for v in self.verifiers))
        return [self._combine([per[i] for per in outcomes]) for i in range(len(samples))]

    def _combine(self, outcomes: list[Score | _Failure]) -> RewardResult:
        components: dict[str, float] = {}
        failures: dict[str, FailureKind] = {}
        errors: dict[str, BaseException] = {}
        reasons: list[str] = []
        total = 0.0
        for verifier, outcome in zip(self.verifiers, outcomes, strict=True):
            if isinstance(outcome, _Failure):
                failures[verifier.name] = outcome.kind
                reasons.append(f"{verifier.kind} {verifier.name!r}: {outcome.detail}")
                if outcome.error is not None:
                    errors[verifier.name] = outcome.error
            elif isinstance(outcome, dict):
                for key, value in outcome.items():
                    components[f"{verifier.name}/{key}"] = value
                    # Plain arithmetic, not fsum: overflow yields inf, caught below.
                    total += verifier.weight * verifier.component_weights.get(key, 1.0) * value
            else:
                components[verifier.name] = outcome
                total += verifier.weight * outcome
        self._samples += 1
        if failures:
            self._failed_samples += 1
            return RewardResult(False, None, components, "; ".join(reasons), failures, errors)
        if not math.isfinite(total):  # huge finite scores times weights can still overflow
            self._failed_samples += 1
            reason = f"weighted sum {total} is not finite"
            return RewardResult(False, None, components, reason, {})
        return RewardResult(True, total, components)

    async def _run_all(self, verifier: Verifier, samples: list[Sample]) -> list[Score | _Failure]:
        if verifier.batched:
            return await self._run_batch(verifier, samples)
        return list(
            await asyncio.gather(
                *(self._run(verifier, s.response, s, s.response_tokens) for s in samples)
            )
        )

    async def _run(
        self,
        verifier: Verifier,
        response: str,
        sample: Mapping[str, Any],
        response_tokens: int | None,
    ) -> Score | _Failure:
        outcome: Score | _Failure
        start = time.perf_counter()
        try:
            raw = await self._call(verifier, lambda: verifier(response, sample, response_tokens))
            _check_deadline(verifier, start)
            outcome = _as_scores(raw)
        except _Failure as failure:
            outcome = failure
        except asyncio.CancelledError:
            raise  # our caller is being cancelled: not this verifier's fault
        except Exception as exc:
            outcome = _raised(exc)
        self._count(verifier, start, [outcome])
        return outcome

    async def _run_batch(self, verifier: Verifier, samples: list[Sample]) -> list[Score | _Failure]:
        """One call for the whole batch; its list must have one score per sample."""
        outcomes: list[Score | _Failure]
        start = time.perf_counter()
        responses = [s.response for s in samples]
        try:
            raw = await self._call(verifier, lambda: verifier.score_batch(responses, samples))
            _check_deadline(verifier, start)
            if hasattr(raw, "tolist") and not isinstance(raw, (list, tuple)):
                raw = raw.tolist()  # a tensor or array of scores
            if not isinstance(raw, (list, tuple)):
                what = type(raw).__name__
                raise _Failure("invalid", f"returned a {what}, not a list of {len(samples)} scores")
            if len(raw) != len(samples):
                raise _Failure("invalid", f"returned {len(raw)} scores for {len(samples)} samples")
            outcomes = []
            for value in raw:
                if isinstance(value, Exception):  # this sample alone could not be scored
                    outcomes.append(_Failure("invalid", str(value), value))
                    continue
                try:
                    outcomes.append(_as_scores(value))
                except _Failure as failure:
                    outcomes.append(failure)
        except _Failure as failure:
            outcomes = [failure] * len(samples)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            outcomes = [_raised(exc)] * len(samples)
        self._count(verifier, start, outcomes)
        return outcomes

    def _count(self, verifier: Verifier, start: float, outcomes: list[Score | _Failure]) -> None:
        stats = self._stats[verifier.name]
        elapsed = time.perf_counter() - start
        stats.calls += len(outcomes)
        stats.total_latency_s += elapsed * len(outcomes)
        stats.max_latency_s = max(stats.max_latency_s, elapsed)
        for outcome in outcomes:
            if isinstance(outcome, _Failure):
                stats.failures[outcome.kind] = stats.failures.get(outcome.kind, 0) + 1

    async def _call(self, verifier: Verifier, call: Callable[[], Any]) -> Any:
        if verifier.mode == "inline":
            return call()
        deadline = time.perf_counter() + verifier.timeout
        if verifier.mode == "thread":
            result = await self._in_thread(verifier, call)
        else:
            result = call()
        # A sync function may hand back an awaitable (a partial of an async function): await it
        # on the loop with whatever time is left.
        if hasattr(result, "__await__"):
            result = await _await_within(result, deadline - time.perf_counter(), verifier.timeout)
        return result

    async def _in_thread(self, verifier: Verifier, call: Callable[[], Any]) -> Any:
        """Run a blocking call in its own daemon thread, waiting at most the timeout.

        Python cannot kill a thread. One that overruns is *abandoned*: it keeps running until its
        function returns, its result is discarded, and it is counted in ``statistics()``
        (``abandoned_threads``, ``abandoned_alive``). A daemon thread, rather than a pool's,
        so that a hung user function never blocks interpreter exit and never starves a shared
        pool that later calls need.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def deliver(ok: bool, value: Any) -> None:
            if future.done():  # already timed out and abandoned
                return
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

        def work() -> None:
            try:
                value = call()
            except BaseException as exc:  # delivered to the loop, never lost in the thread
                outcome = (False, exc)
            else:
                outcome = (True, value)
            try:
                loop.call_soon_threadsafe(deliver, *outcome)
            except RuntimeError:
                pass  # the loop closed while we were hung: nobody is waiting any more

        thread = threading.Thread(target=work, name=f"reward-{verifier.name}", daemon=True)
        thread.start()
        try:
            return await asyncio.wait_for(asyncio.shield(future), verifier.timeout)
        except asyncio.TimeoutError:
            self._abandoned.append(thread)
            future.cancel()
            raise _Failure("timeout", _timed_out(verifier.timeout)) from None

    # ----------------------------------------------------------------------- statistics

    def statistics(self) -> dict[str, Any]:
        """Counters since the set was built, as plain JSON-ready data.

        ``samples``/``failed_samples`` count ``score`` calls; per function: ``calls``,
        ``failures`` by kind ("error", "timeout", "invalid"), ``mean_latency_s`` and
        ``max_latency_s``; ``abandoned_threads`` counts sync calls left running after their
        timeout and ``abandoned_alive`` how many of those still run.
        """
        functions = {
            name: {
                "calls": stats.calls,
                "failures": dict(stats.failures),
                "mean_latency_s": stats.total_latency_s / stats.calls if stats.calls else 0.0,
                "max_latency_s": stats.max_latency_s,
            }
            for name, stats in self._stats.items()
        }
        return {
            "samples": self._samples,
            "failed_samples": self._failed_samples,
            "abandoned_threads": len(self._abandoned),
            "abandoned_alive": sum(thread.is_alive() for thread in self._abandoned),
            "functions": functions,
        }


def _issue(index: int, exc: OptionError) -> ConfigIssue:
    """``exc`` at its key path: ``target``, a dotted table key (``model.path``) as it is, any
    other key as an option."""
    path = f"reward.functions[{index}]"
    if exc.key == "target" or (exc.key is not None and "." in exc.key):
        path += f".{exc.key}"
    elif exc.key is not None:
        path += f".options.{exc.key}"
    return ConfigIssue(path=path, message=exc.message)


def _timed_out(timeout: float) -> str:
    return f"timed out after {timeout}s"


def _check_deadline(verifier: Verifier, start: float) -> None:
    # An inline call (or an async one that blocked the loop) cannot be interrupted; if it
    # overran anyway, its answer came too late to trust the deadline contract.
    if time.perf_counter() - start > verifier.timeout:
        raise _Failure("timeout", _timed_out(verifier.timeout))


def _raised(exc: Exception) -> _Failure:
    return _Failure("error", f"raised {type(exc).__name__}: {exc}", _from_user_frame(exc))


_OWN_FRAMES = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(asyncio.__file__))


def _from_user_frame(exc: Exception) -> Exception:
    """``exc`` with its traceback starting at the first frame outside this package and asyncio
    (the user's function): the traceback a user is shown is theirs, not our plumbing."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_OWN_FRAMES):
        tb = tb.tb_next
    return exc.with_traceback(tb) if tb is not None else exc


async def _await_within(awaitable: Any, remaining: float, timeout: float) -> Any:
    """Await with a hard deadline, even for a coroutine that swallows its cancellation.

    ``asyncio.wait_for`` waits for the cancelled task to finish; a task that ignores
    ``CancelledError`` would then hang ``score``. So the task is cancelled and left behind.
    """
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=max(remaining, 0.0))
    if task in done:
        return task.result()
    task.cancel()
    # Retrieve its eventual exception so asyncio does not log "exception never retrieved".
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    raise _Failure("timeout", _timed_out(timeout))


def _as_scores(value: Any) -> Score:
    """A score, or a dict of named scores (non-empty, str keys), each a finite float."""
    if not isinstance(value, Mapping):
        return _as_score(value)
    if not value:
        raise _Failure("invalid", "returned an empty dict, not named scores")
    scores: dict[str, float] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key:
            raise _Failure("invalid", f"returned a dict with key {key!r}: names must be strings")
        try:
            scores[key] = _as_score(item)
        except _Failure as failure:
            raise _Failure("invalid", f"component {key!r} {failure.detail}") from None
    return scores


def _as_score(value: Any) -> float:
    """``value`` as a finite float, or a ``_Failure("invalid")`` raised saying what it was."""
    if isinstance(value, (str, bytes)) or value is None:
        raise _Failure("invalid", f"returned {value!r}, not a number")
    if not isinstance(value, numbers.Real):
        # numpy scalars are Real; a one-element tensor is not, but converts with float().
        if not hasattr(value, "__float__"):
            raise _Failure("invalid", f"returned a {type(value).__name__}, not a number")
        try:
            value = float(value)
        except Exception as exc:
            raise _Failure("invalid", f"returned {type(value).__name__} {exc}") from None
    score = float(value)
    if not math.isfinite(score):
        raise _Failure("invalid", f"returned {score}")
    return score
