"""Multi-turn environments, and the loop that plays one episode of one against the policy.

An environment is a small async object, one instance per episode::

    class Calculator(Env):
        async def reset(self, task):            # -> the opening messages (or plain text)
            return [{"role": "user", "content": task["prompt"]}]
        async def step(self, action):           # the model's reply, as text
            return Step(observation="= 42", reward=0.0, done=False)

``run_episode`` plays it: prompt, sample a reply, ``step``, append the observation as the next
turn (token-in/token-out, see ``relax.agents._chat``), until ``done``, ``max_turns`` or the
token budget. A ``step`` that raises or overruns ``tool_timeout`` ends the episode with the
reason recorded and ``error_reward``; it never raises out of ``run_episode``.
"""

from __future__ import annotations

import abc
import asyncio
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relax.agents._chat import Message, continuation_ids, encode, prompt_ids
from relax.agents._sampler import Sampler
from relax.agents._trajectory import Trajectory

Task = dict[str, Any]
"""What an episode is about: a dataset row's ``id``, ``prompt`` text and ``answer``."""


@dataclass
class Step:
    """What the environment answers to one reply."""

    observation: str | list[Message] | None = None
    """The next turn: text (sent as one message of the episode's observation role), messages,
    or None (nothing to add; only sensible with ``done``)."""
    reward: float = 0.0
    """Reward of this step; an episode's reward is the sum over its steps."""
    done: bool = False
    """The episode is over."""
    info: dict[str, Any] = field(default_factory=dict)


class Env(abc.ABC):
    """A multi-turn environment (see the module docstring). One instance plays one episode."""

    @abc.abstractmethod
    async def reset(self, task: Task) -> str | list[Message]:
        """Start an episode of ``task``: the opening messages (or plain text, for a model
        without a chat template)."""

    @abc.abstractmethod
    async def step(self, action: str) -> Step:
        """Act on the model's reply (its text, special tokens removed)."""

    async def close(self) -> None:
        """Release what the episode held (a sandbox, a process); called once it ends."""


@dataclass(frozen=True)
class EpisodeLimits:
    """Budgets of one episode, and what a failure scores."""

    max_turns: int = 4
    """Model replies at most."""
    max_tokens: int = 256
    """Tokens after the first prompt (replies and observations together) at most."""
    max_reply_tokens: int = 64
    """Tokens of one reply at most."""
    tool_timeout: float = 10.0
    """Seconds ``Env.step`` (and ``reset``) may take before the episode ends as a timeout."""
    error_reward: float = 0.0
    """The reward of an episode a tool failure or timeout ended."""
    observation_role: str = "tool"
    """Chat role of a text observation."""
    chat: bool = True
    """Render turns with the tokenizer's chat template; False appends plain text."""


@dataclass(frozen=True)
class Sampling:
    """How replies are sampled (``relax.engines.SamplingParams`` without the budget)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    """Seed of the episode; turn ``t`` samples with ``seed + t``, so a replayed episode (a
    retried prompt) reproduces its replies."""


def describe_failure(exc: BaseException) -> str:
    """An exception as the one line an episode records as its reason."""
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


async def _guarded(coro: Any, timeout: float) -> tuple[Any, str | None, str]:
    """``(result, end, reason)``: ``end`` is set when the call failed or timed out."""
    try:
        return await asyncio.wait_for(coro, timeout), None, ""
    except TimeoutError:
        return None, "tool_timeout", f"no answer within {timeout:g} s"
    except Exception as exc:
        return None, "tool_error", describe_failure(exc)


def _observation_ids(
    tokenizer: Any,
    reply_ids: Sequence[int],
    observation: str | list[Message],
    limits: EpisodeLimits,
) -> list[int]:
    if not limits.chat:
        text = (
            observation
            if isinstance(observation, str)
            else "".join(str(m.get("content", "")) for m in observation)
        )
        return encode(tokenizer, text)
    messages = (
        [{"role": limits.observation_role, "content": observation}]
        if isinstance(observation, str)
        else list(observation)
    )
    return continuation_ids(tokenizer, reply_ids, messages)


async def run_episode(
    env: Env,
    task: Task,
    sampler: Sampler,
    tokenizer: Any,
    limits: EpisodeLimits = EpisodeLimits(),
    sampling: Sampling = Sampling(),
) -> Trajectory:
    """Play one episode of ``env`` on ``task`` with the policy behind ``sampler``.

    Returns the trajectory, ended (``Trajectory.end`` says why). Environment failures are
    recorded, not raised; an engine failure or a cancellation is raised (the episode cannot be
    completed; its caller decides) after the environment is closed.
    """
    try:
        opening, end, reason = await _guarded(env.reset(task), limits.tool_timeout)
        if end is not None:
            prompt = encode(tokenizer, str(task.get("prompt", ""))) or [0]
            traj = Trajectory(prompt)
            traj.reward = limits.error_reward
            traj.finish(end, f"reset: {reason}")
            return traj
        if isinstance(opening, str) and not limits.chat:
            first = encode(tokenizer, opening)
        else:
            messages = (
                [{"role": "user", "content": opening}] if isinstance(opening, str) else opening
            )
            first = prompt_ids(tokenizer, messages)
        traj = Trajectory(first)
        while True:
            if traj.turns >= limits.max_turns:
                traj.finish("max_turns")
                break
            budget = min(limits.max_reply_tokens, limits.max_tokens - len(traj.response_ids))
            if budget < 1:
                traj.finish("token_budget")
                break
            seed = None if sampling.seed is None else sampling.seed + traj.turns
            (gen,) = await sampler.generate(
                traj.ids,
                max_new_tokens=budget,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                stop_token_ids=sampling.stop_token_ids,
                seed=seed,
            )
            versions = gen.token_versions if gen.token_versions is not None else gen.version
            traj.add_reply(gen.response_ids, gen.logprobs, versions)
            text = tokenizer.decode(gen.response_ids, skip_special_tokens=True)
            step, end, reason = await _guarded(env.step(text), limits.tool_timeout)
            if end is not None:
                traj.reward = limits.error_reward
                traj.finish(end, reason)
                break
            traj.reward += float(step.reward)
            traj.info.update(step.info)
            if step.done:
                traj.finish("done")
                break
            if step.observation is None:
                continue
            obs = _observation_ids(tokenizer, gen.response_ids, step.observation, limits)
            if len(traj.response_ids) + len(obs) >= limits.max_tokens:
                # No room left for a reply to it: the episode ends before the observation.
                traj.finish("token_budget")
                break
            traj.add_observation(obs)
        return traj
    finally:
        await _close(env, limits.tool_timeout)


async def _close(env: Env, timeout: float) -> None:
    try:
        await asyncio.wait_for(env.close(), timeout)
    except Exception:  # a failing close must not lose the episode
        pass
