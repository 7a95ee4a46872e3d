"""The registry of verifier kinds and the built-in verifiers.

A verifier turns (response text, sample dict, response length in tokens) into one score. It says
how it must be run through ``mode``, and ``RewardSet`` supplies timeouts, validation and
statistics around it — so a verifier is just the scoring logic and may raise freely:

- ``"inline"``: cheap, pure Python; called on the event loop (a thread would cost more than the
  work). ``regex`` is inline too even though a pathological pattern can backtrack for long:
  CPython's ``re`` holds the GIL while matching, so a thread would not keep the loop responsive
  either. Patterns come from the operator's config, not from the policy; an inline call that
  overruns its timeout is still marked failed after the fact.
- ``"thread"``: a synchronous user function that may block (I/O, a sandbox); run in a thread.
- ``"async"``: a coroutine function; awaited on the loop and cancelled at its timeout.

A verifier may also be *batched* (``batched = True``): ``RewardSet`` then calls
``score_batch(responses, samples)`` once for the whole batch instead of once per sample. A score
is a real number, or a dict of named real numbers (components, each weighed by the function's
``components`` table and logged on its own).

Kinds register with ``@register_verifier("kind")``. Options are checked when the set is built,
so a typo in ``options`` fails before anything starts.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from relax.config import RewardFunctionConfig
from relax.errors import OptionError
from relax.importpath import ImportPathError, load
from relax.rewards._http import HttpError, post_json
from relax.rewards._parse import extract_answer, normalize_answer, parse_last_number
from relax.rewards._sample import Sample

Mode = Literal["inline", "thread", "async"]


@dataclass(frozen=True)
class BuildContext:
    """What a verifier may need from outside its own table when it is built."""

    answer_key: str = "answer"
    """Sample field holding the reference answer (``[data] answer_key``)."""
    max_response_tokens: int | None = None
    """Longest response the rollout generates (``[rollout] max_new_tokens``); the default
    ``max_len`` of ``length_penalty``."""


class Verifier:
    """Base of all verifiers: one configured scoring function."""

    kind: ClassVar[str] = ""
    options_allowed: ClassVar[frozenset[str] | None] = frozenset()
    """Option names this kind accepts; None accepts anything (user functions get them all)."""
    mode: Mode = "inline"
    batched: bool = False
    """Scores a whole batch per call (``score_batch``) rather than one sample (``__call__``)."""
    loads: ClassVar[bool] = False
    """Has something to ``load`` before scoring (a model)."""

    def __init__(self, config: RewardFunctionConfig, context: BuildContext) -> None:
        self.name = config.name
        self.weight = float(config.weight)
        self.timeout = float(config.timeout)
        self.component_weights: dict[str, float] = dict(config.components)
        self.options: dict[str, Any] = dict(config.options)
        if self.options_allowed is not None:
            for key in self.options:
                if key not in self.options_allowed:
                    allowed = ", ".join(sorted(self.options_allowed)) or "none"
                    raise OptionError(key, f"unknown option for kind {self.kind!r} ({allowed})")

    def __call__(
        self, response: str, sample: Mapping[str, Any], response_tokens: int | None
    ) -> Any:
        """The score (a real number); may return an awaitable when ``mode`` is "async"."""
        raise NotImplementedError

    def score_batch(self, responses: list[str], samples: list[Sample]) -> Any:
        """For a ``batched`` verifier: one score per sample, in order (or an awaitable). An
        ``Exception`` instance in place of a score fails that sample alone, its message the
        reason (e.g. a judge reply with no score in it)."""
        raise NotImplementedError

    def load(self) -> None:
        """Load what scoring needs once, before the first call (``RewardSet.load``); the
        model kinds load their weights here. Nothing by default."""

    def _option(self, key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        value = self.options.get(key, default)
        # bool is an int subclass: refuse it where a number is meant, it is always a typo.
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _tuple(kind)):
            raise OptionError(key, f"must be {_describe(kind)}, got {value!r}")
        return value


def _tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _describe(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in _tuple(kind))


VERIFIERS: dict[str, type[Verifier]] = {}
"""Kind name -> verifier class."""


def register_verifier(kind: str) -> Callable[[type[Verifier]], type[Verifier]]:
    """Class decorator adding a verifier kind to the registry."""

    def add(cls: type[Verifier]) -> type[Verifier]:
        cls.kind = kind
        VERIFIERS[kind] = cls
        return cls

    return add


def build_verifier(config: RewardFunctionConfig, context: BuildContext | None = None) -> Verifier:
    """The verifier one ``[[reward.functions]]`` table describes. Raises ``OptionError``."""
    cls = VERIFIERS.get(config.kind)
    if cls is None:
        raise OptionError(None, f"no verifier registered for kind {config.kind!r}")
    return cls(config, context or BuildContext())


# --------------------------------------------------------------------------- answers


class _AnswerVerifier(Verifier):
    """Shared by exact_match and numeric: where the reference is and how the answer is found."""

    def __init__(self, config: RewardFunctionConfig, context: BuildContext) -> None:
        super().__init__(config, context)
        self.answer_key: str = self._option("answer_key", str, context.answer_key)
        self.extract: str = self._option("extract", str, "auto")
        if self.extract not in ("auto", "none"):
            raise OptionError("extract", f'must be "auto" or "none", got {self.extract!r}')

    def _reference(self, sample: Mapping[str, Any]) -> Any:
        # A missing reference is a data fault, not a wrong answer: fail the sample, loudly.
        if self.answer_key not in sample or sample[self.answer_key] is None:
            raise KeyError(f"sample has no reference answer {self.answer_key!r}")
        return sample[self.answer_key]

    def _answer(self, response: str) -> str:
        return extract_answer(response) if self.extract == "auto" else response


@register_verifier("exact_match")
class ExactMatch(_AnswerVerifier):
    """1.0 if the final answer equals the reference after ``normalize_answer``, else 0.0.

    Options: ``answer_key`` (default ``[data] answer_key``), ``extract`` ("auto": see
    ``extract_answer``; "none": the whole response), ``case_sensitive`` (default false).
    """

    options_allowed = frozenset({"answer_key", "extract", "case_sensitive"})

    def __init__(self, config: RewardFunctionConfig, context: BuildContext) -> None:
        super().__init__(config, context)
        self.case_sensitive: bool = self._option("case_sensitive", bool, False)

    def __call__(
        self, response: str, sample: Mapping[str, Any], response_tokens: int | None
    ) -> float:
        reference = normalize_answer(
            str(self._reference(sample)), case_sensitive=self.case_sensitive
        )
        answer = normalize_answer(self._answer(response), case_sensitive=self.case_sensitive)
        return 1.0 if answer == reference else 0.0


@register_verifier("numeric")
class Numeric(_AnswerVerifier):
    """1.0 if the last number of the final answer is within tolerance of the reference, else 0.0.

    A response with no number scores 0.0 (the policy's fault); a reference that is not a number
    fails the sample (the data's fault). Equality is ``math.isclose(answer, reference,
    rel_tol=rel_tol, abs_tol=abs_tol)``. Options: ``answer_key``, ``extract`` (as exact_match),
    ``abs_tol`` (default 1e-6), ``rel_tol`` (default 0).
    """

    options_allowed = frozenset({"answer_key", "extract", "abs_tol", "rel_tol"})

    def __init__(self, config: RewardFunctionConfig, context: BuildContext) -> None:
        super().__init__(config, context)
        self.abs_tol = float(self._option("abs_tol", (int, float), 1e-6))
        self.rel_tol = float(self._option("rel_tol", (int, float), 0.0))
        if not (self.abs_tol >= 0 and self.rel_tol >= 0):
            raise OptionError("abs_tol", "tolerances must be non-negative")

    def __call__(
        self, response: str, sample: Mapping[str, Any], response_tokens: int | None
    ) -> float:
        raw = self._reference(sample)
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            reference = float(raw)
        else:
            parsed = parse_last_number(str(raw))
            if parsed is None:
                raise ValueError(f"reference answer {raw!r} is not a number")
            reference = float(parsed)
        answer = parse_last_number(self._answer(response))
        if answer is None:
            return 0.0
        close = math.isclose(float(answer), reference, rel_tol=self.rel_tol, abs_tol=self.abs_tol)
        return 1.0 if close else 0.0


@register_verifier("math")
class MathVerify(Verifier):
    """1.0 if the response's final answer equals the reference as mathematics, else 0.0.

    Uses math-verify (Hugging Face's checker, the one TRL and veRL use): both sides are parsed
    from LaTeX or plain expressions (``\\boxed{}`` answers first, ``$...$``, fractions,
    decimals, sets, intervals, equations) and compared symbolically, so ``\\boxed{0.5}``
    answers ``$\\frac{1}{2}$``. A reference without ``$`` or ``\\boxed`` is read as if boxed.
    A response with no parsable answer scores 0.0; a reference that does not parse fails the
    sample (the data's fault). Runs in a thread, under ``timeout`` (math-verify's own
    signal-based timeouts only work in the main thread and are off). Options: ``answer_key``,
    ``float_rounding`` (decimal places numbers are compared at, default 6), ``strict`` (default
    true: e.g. a variable name must match too).
    """

    options_allowed = frozenset({"answer_key", "float_rounding", "strict"})
    mode = "thread"

    def __init__(self, config: RewardFunctionConfig, context: BuildContext) -> None:
        super().__init__(config, context)
        try:
            import math_verify
        except ImportError:
            raise OptionError(
                None, "kind \"math\" needs the math-verify package: pip install 'relax-rl[math]'"
            ) from None
        _quiet_math_verify()
        self._parse, self._verify = math_verify.parse, math_verify.verify
        self.answer_key: str = self._option("answer_key", str, context.answer_key)
        self.float_rounding: int = self._option("float_rounding", int, 6)
        self.strict: bool = self._option("strict", bool, True)

    def __call__(
        self, response: str, sample: Mapping[str, Any], response_tokens: int | None
    ) -> float:
        if self.answer_key not in sample or sample[self.answer_key] is None:
            raise KeyError(f"sample has no reference answer {self.answer_key!r}")
        reference = str(sample[self.answer_key]).strip()
        if "$" not in reference and "\\boxed" not in reference:
            reference = "\\boxed{" + reference + "}"
        gold = self._parse(reference, parsing_timeout=None)
        if not gold:
            raise ValueError(f"reference answer {sample[self.answer_key]!r} does not parse")
        answer = self._parse(response, parsing_timeout=None)
        if not answer:
            return 0.0
        ok = self._verify(
            gold,
            answer,
            float_rounding=self.float_rounding,
            strict=self.strict,
            timeout_seconds=None,
        )
        return 1.0 if ok else 0.0


def _quiet_math_verify() -> None:
    """Drop math-verify's per-call "Timeout is disabled" warning: we run it under our own
    timeout, so the warning would repeat on every sample and say nothing."""
    import logging

    for name in ("math_verify.parser", "math_verify.grader"):
        target = logging.getLogger(name)
        if not any(isinstance(f, _NoTimeoutWarning) for f in target.filters):
            target.addFilter(_NoTimeoutWarning())


class _NoTimeoutWarning:
    def filter(self, record: Any) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


# --------------------------------------------------------------------------- format and length

_FLAGS = {
    "IGNORECASE": re.IGNORECASE,
    "MULTILINE": re.MULTILINE,
    "DOTALL": re.DOTALL,
    "VERBOSE": re.VERBOSE,
    "ASCII": re.ASCII,
}


@register_verifier("regex")
class Regex(Verifier):
    """Format reward: 1.0 if ``pattern`` matches the response, else 0.0.

    Options: ``mode`` ("search", the default: anywhere; "match": at the start; "fullmatch": the
    whole response), ``flags`` (list of IGNORECASE, MULTILINE, DOTALL, VERBOSE, ASCII), ``strip``
    (strip surrounding whitespace first; default true, so a trailing newline does not break a
    fullmatch).
    """

    options_allowed = frozenset({"mode", "flags", "strip"})

    def __init__(self, config: RewardFunctionConfig, context: BuildContext) -> None:
        super().__init__(config, context)
        how = self._option("mode", str, "search")
        if how not in ("search", "match", "fullmatch"):
            raise OptionError("mode", f'must be "search", "match" or "fullmatch", got {how!r}')
        flags = 0
        for flag in self._option("flags", (list, tuple), ()):
            if flag not in _FLAGS:
                raise OptionError("flags", f"unknown flag {flag!r} ({', '.join(_FLAGS)})")
            flags |= _FLAGS[flag]
        self.strip: bool = self._option("strip", bool, True)
        assert config.pattern is not None  # the config model requires it for this kind
        self.regex = re.compile(config.pattern, flags)
        self._match = getattr(self.regex, how)

    def __call__(
        self, response: str, sample: Mapping[str, Any], response_tokens: int | None
    ) -> float:
        text = response.strip() if self.strip else response
        return 1.0 if self._match(text) is not None else 0.0


@register_verifier("length_penalty")
class LengthPenalty(Verifier):
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13), in tokens.

    With ``L = response_tokens``, ``M = max_len`` and ``C = cache``::

        0                    if L <= M - C
        ((M - C) - L) / C    if M - C < L <= M      (linear from 0 down to -1)
        -1                   if L > M

    Options: ``max_len`` (default ``[rollout] max_new_tokens`` when the set is told it),
    ``cache`` (default ``max_len // 5``, DAPO's 4096 of 20480). Use a positive weight.
    """

    options_allowed = frozenset({"max_len", "cache"})

    def __init__(self, config: RewardFunctionConfig, context: BuildContext) -> None:
        super().__init__(config, context)
        max_len = self._option("max_len", (int, type(None)), context.max_response_tokens)
        if max_len is None or max_len <= 0:
            raise OptionError("max_len", "length_penalty needs a positive max_len (in tokens)")
        cache = self._option("cache", int, max_len // 5)
        if not 0 <= cache <= max_len:
            raise OptionError("cache", f"must be between 0 and max_len ({max_len}), got {cache}")
        self.max_len: int = max_len
        self.cache: int = cache

    def __call__(
        self, response: str, sample: Mapping[str, Any], response_tokens: int | None
    ) -> float:
        if response_tokens is None or response_tokens < 0:
            raise ValueError(f"needs response_tokens, got {response_tokens!r}")
        free = self.max_len - self.cache
        if response_tokens <= free:
            return 0.0
        if response_tokens > self.max_len:
            return -1.0
        return (free - response_tokens) / self.cache


# --------------------------------------------------------------------------- user code


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    )


@register_verifier("python")
class PythonFunction(Verifier):
    """A user's reward function, imported from ``target`` ("package.module:function").

    Called as ``fn(response, sample, **options)`` with the response text and a ``Sample`` (a
    read-only mapping too: ``sample["answer"]`` works as before), or — ``batched = true`` —
    as ``fn(responses, samples, **options)`` with lists, once per batch, returning a list of
    the same length. It returns a number, or a dict of named numbers (components). Sync
    functions run in a thread (they may block), async ones on the loop. It is imported, and
    its signature checked against these calls, when the set is built, so a wrong path or a
    function that cannot take them fails at startup. Each call gets its own copy of the
    sample's containers, so concurrent functions cannot see each other's edits.
    """

    options_allowed = None

    def __init__(self, config: RewardFunctionConfig, context: BuildContext) -> None:
        super().__init__(config, context)
        assert config.target is not None
        self.fn = load_function(config.target)
        self.batched = config.batched
        self.mode = "async" if _is_async(self.fn) else "thread"
        _check_signature(self.fn, config.target, self.batched, self.options)

    def __call__(
        self, response: str, sample: Mapping[str, Any], response_tokens: int | None
    ) -> Any:
        return self.fn(
            response, Sample.of(response, sample, response_tokens).copy(), **self.options
        )

    def score_batch(self, responses: list[str], samples: list[Sample]) -> Any:
        return self.fn(list(responses), [s.copy() for s in samples], **self.options)


def _check_signature(fn: Any, target: str, batched: bool, options: Mapping[str, Any]) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C callable without a signature: find out at the first call
    try:
        signature.bind(None, None, **options)
    except TypeError as exc:
        call = "fn(responses, samples" if batched else "fn(response, sample"
        call += ", **options)" if options else ")"
        raise OptionError("target", f"{target!r} cannot be called as {call}: {exc}") from None


def load_function(target: str) -> Callable[..., Any]:
    """The callable at ``"package.module:attr.path"``; ``OptionError`` naming ``target`` if not."""
    try:
        return load(target)
    except ImportPathError as exc:
        raise OptionError("target", str(exc)) from exc


@register_verifier("http")
class HttpEndpoint(Verifier):
    """POSTs ``{"response", "sample", "response_tokens"}`` as JSON; the reply is ``{"reward": x}``.

    A non-2xx status, a body that is not that JSON, or a network fault fails the sample.
    Options: ``headers`` (table of extra request headers, e.g. authorisation), ``sample_keys``
    (send only these sample fields; the sample must otherwise be JSON-serialisable),
    ``max_concurrency`` (requests in flight at once, default 32; waiting counts against the
    timeout).
    """

    options_allowed = frozenset({"headers", "sample_keys", "max_concurrency"})
    mode = "async"

    def __init__(self, config: RewardFunctionConfig, context: BuildContext) -> None:
        super().__init__(config, context)
        assert config.target is not None
        self.url = config.target
        headers = self._option("headers", dict, {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
            raise OptionError("headers", "must map header names to string values")
        self.headers: dict[str, str] = headers
        keys = self._option("sample_keys", (list, tuple, type(None)), None)
        self.sample_keys: tuple[str, ...] | None = None if keys is None else tuple(keys)
        limit = self._option("max_concurrency", int, 32)
        if limit <= 0:
            raise OptionError("max_concurrency", f"must be positive, got {limit}")
        self.max_concurrency: int = limit
        self._semaphore: asyncio.Semaphore | None = (
            None  # created lazily, inside the event loop that uses it
        )

    async def __call__(
        self, response: str, sample: Mapping[str, Any], response_tokens: int | None
    ) -> Any:
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        if self.sample_keys is not None:
            sample = {key: sample[key] for key in self.sample_keys if key in sample}
        payload = {"response": response, "sample": dict(sample), "response_tokens": response_tokens}
        async with self._semaphore:
            status, body = await post_json(self.url, payload, headers=self.headers)
        if not 200 <= status < 300:
            raise HttpError(f"HTTP {status}: {body[:200].decode('utf-8', 'replace')}")
        try:
            reply = json.loads(body)
        except ValueError as exc:
            raise HttpError(f"reply is not JSON: {body[:80]!r}") from exc
        if not isinstance(reply, dict) or "reward" not in reply:
            raise HttpError(f'reply has no "reward": {body[:80]!r}')
        return reply["reward"]
