"""Reward functions: a registry of verifiers and ``RewardSet``, which runs them safely.

    from relax.rewards import RewardSet
    rewards = RewardSet.from_config(cfg.reward, answer_key=cfg.data.answer_key,
                                    max_response_tokens=cfg.rollout.max_new_tokens)
    result = await rewards.score(text, sample, response_tokens=n)
    results = await rewards.score_batch([Sample(...), ...])  # batched functions: one call
    # result.ok, result.reward (weighted sum), result.components, result.reason

Kinds (``[[reward.functions]] kind``): ``exact_match``, ``numeric``, ``math`` (math-verify),
``regex``, ``length_penalty`` (DAPO overlong shaping), ``python`` (a user function by import
path, sync or async, per sample or ``batched``), ``http`` (a JSON endpoint), ``reward_model`` (a
sequence-classification model's score of prompt + response) and ``judge`` (an LLM's greedy reply
to a rubric, parsed to a score in [0, 1]); the model kinds load their weights in
``RewardSet.load()``, once per reward replica (see docs/reward_models.md). A function gets
a ``Sample`` (the response, its ids, the prompt text and messages, the dataset row's fields,
uid and group) and returns a number or a dict of named component numbers. A function that
raises, overruns its timeout or returns NaN/Inf/a non-number fails the *sample* with a reason;
``score`` itself never raises.

This package sits on the ``config`` floor: it imports only the standard library,
``relax.errors`` and ``relax.config`` — and, when a model kind loads its model, torch,
transformers and ``relax.models`` (same floor).
"""

from __future__ import annotations

from relax.rewards._judge import Judge, UnscorableReply
from relax.rewards._model import RewardModel, reward_text
from relax.rewards._parse import extract_answer, normalize_answer, parse_last_number
from relax.rewards._sample import STANDARD_KEYS, Sample, json_fields
from relax.rewards._set import FailureKind, RewardResult, RewardSet
from relax.rewards._verifiers import (
    VERIFIERS,
    BuildContext,
    OptionError,
    Verifier,
    build_verifier,
    load_function,
    register_verifier,
)

__all__ = [
    "STANDARD_KEYS",
    "VERIFIERS",
    "BuildContext",
    "FailureKind",
    "Judge",
    "OptionError",
    "RewardModel",
    "RewardResult",
    "RewardSet",
    "Sample",
    "UnscorableReply",
    "Verifier",
    "build_verifier",
    "extract_answer",
    "json_fields",
    "load_function",
    "normalize_answer",
    "parse_last_number",
    "register_verifier",
    "reward_text",
]
