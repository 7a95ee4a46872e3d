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
reason recorded and ``error_reward``; it never raises out of ``run_episode``. Replies are sampled
as the episode's ``SamplingParams`` say (``relax.engines``), turn ``t`` seeded ``seed + t``.

The opening and the observations may carry images, audio and video as content parts
(``{"type": "image", "image": SRC}``, as ``relax.media.process_prompt`` takes them) when
``run_episode`` has the model's processor: each item is decoded and processed once, its
placeholders join the sequence and its tensors the trajectory's ``mm_inputs`` (see
``relax.agents._media``). A bad item ends the episode as a ``tool_error`` naming it.
"""

from __future__ import annotations

import abc
import asyncio
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from relax.agents._chat import ChatFormatError, Message, continuation_ids, encode, prompt_ids
from relax.agents._media import media_continuation, media_prompt, spelled_placeholders
from relax.agents._sampler import Sampler
from relax.agents._trajectory import Trajectory
from relax.engines import SamplingParams
from relax.media import MediaError, MediaLimits, has_media

Task = dict[str, Any]
"""What an episode is about: a dataset row's ``id``, ``prompt`` text and ``answer``."""


@dataclass
class Step:
    """What the environment answers to one reply."""

    observation: str | list[Message] | None = None
    """The next turn: text (sent as one message of the episode's observation role), messages
    (whose content may hold media parts, for a model with a processor), or None (nothing to
    add; only sensible with ``done``)."""
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


def _observation(
    tokenizer: Any,
    reply_ids: Sequence[int],
    observation: str | list[Message],
    limits: EpisodeLimits,
    processor: Any,
    media_limits: MediaLimits,
    item: str,
) -> tuple[list[int], dict[str, Any] | None]:
    """The observation's ids and the tensors of its media (``None`` without media)."""
    if not limits.chat:
        if has_media(observation):
            raise ChatFormatError("media observations need chat turns ([rollout.agent] chat)")
        text = (
            observation
            if isinstance(observation, str)
            else "".join(str(m.get("content", "")) for m in observation)
        )
        return encode(tokenizer, text), None
    messages = (
        [{"role": limits.observation_role, "content": observation}]
        if isinstance(observation, str)
        else list(observation)
    )
    if has_media(messages):
        _need_processor(processor)
        out = media_continuation(processor, reply_ids, messages, media_limits, item=item)
        return out.prompt_ids, out.mm_inputs or None
    return continuation_ids(tokenizer, reply_ids, messages), None


def _need_processor(processor: Any) -> None:
    if processor is None:
        raise ChatFormatError(
            "the episode's messages carry media but run_episode has no processor (a text-only"
            " model, or the processor was not passed)"
        )


def _opening(
    tokenizer: Any,
    opening: str | list[Message],
    limits: EpisodeLimits,
    processor: Any,
    media_limits: MediaLimits,
    item: str,
) -> tuple[list[int], dict[str, Any] | None]:
    """The first prompt's ids and the tensors of its media (``None`` without media)."""
    if isinstance(opening, str) and not limits.chat:
        return encode(tokenizer, opening), None
    messages = [{"role": "user", "content": opening}] if isinstance(opening, str) else opening
    if has_media(messages):
        _need_processor(processor)
        out = media_prompt(processor, messages, media_limits, item=item)
        return out.prompt_ids, out.mm_inputs or None
    return prompt_ids(tokenizer, messages), None


def _spelled(processor: Any, ids: Sequence[int], media: Any) -> str | None:
    """Why text ids cannot join the sequence: they spell out media placeholders (with media,
    ``process_prompt`` has already matched the placeholders to the items)."""
    found = 0 if media else spelled_placeholders(processor, ids)
    if found:
        return f"the text spells out {found} media placeholder token(s) with no media behind them"
    return None


async def run_episode(
    env: Env,
    task: Task,
    sampler: Sampler,
    tokenizer: Any,
    limits: EpisodeLimits = EpisodeLimits(),
    sampling: SamplingParams | None = None,
    *,
    processor: Any = None,
    media_limits: MediaLimits | None = None,
) -> Trajectory:
    """Play one episode of ``env`` on ``task`` with the policy behind ``sampler``.

    Returns the trajectory, ended (``Trajectory.end`` says why). Environment failures are
    recorded, not raised; an engine failure or a cancellation is raised (the episode cannot be
    completed; its caller decides) after the environment is closed.

    ``sampling``: how replies are sampled (``n`` must be 1: a turn is one reply). A reply is
    at most ``sampling.max_new_tokens`` and ``limits.max_reply_tokens`` tokens, and fits the
    episode's remaining budget. ``sampling.seed`` is the episode's: turn ``t`` samples with
    ``seed + t``, so a replayed episode (a retried prompt) reproduces its replies. ``None``
    samples at temperature 1, unseeded, with no stop tokens.

    ``processor`` (the model's, ``relax.models.load_processor``) and ``media_limits``
    (``relax.media.media_limits(cfg.data.media)``; defaults when ``None``) let the opening and
    the observations carry media; without a processor, media parts raise ``ChatFormatError``.
    """
    if sampling is None:
        sampling = SamplingParams(max_new_tokens=limits.max_reply_tokens)
    bounds = media_limits if media_limits is not None else MediaLimits()
    item = str(task.get("id", "episode"))
    try:
        if sampling.n != 1:  # raised inside: the environment is still closed
            raise ValueError(f"an episode samples one reply per turn: sampling.n is {sampling.n}")
        opening, end, reason = await _guarded(env.reset(task), limits.tool_timeout)
        first: list[int] = []
        media = None
        if end is None:
            try:
                first, media = _opening(tokenizer, opening, limits, processor, bounds, item)
            except MediaError as exc:
                end, reason = "tool_error", str(exc)
            else:
                spelled = _spelled(processor, first, media)
                if spelled is not None:
                    end, reason = "tool_error", spelled
        if end is not None:
            prompt = encode(tokenizer, str(task.get("prompt", ""))) or [0]
            traj = Trajectory(prompt)
            traj.reward = limits.error_reward
            traj.finish(end, f"reset: {reason}")
            return traj
        traj = Trajectory(first, mm_inputs=media)
        while True:
            if traj.turns >= limits.max_turns:
                traj.finish("max_turns")
                break
            budget = min(
                limits.max_reply_tokens,
                sampling.max_new_tokens,
                limits.max_tokens - len(traj.response_ids),
            )
            if budget < 1:
                traj.finish("token_budget")
                break
            seed = None if sampling.seed is None else sampling.seed + traj.turns
            turn = replace(sampling, max_new_tokens=budget, seed=seed)
            (gen,) = await sampler.generate(
                traj.ids,
                turn,
                # Only with media: a text episode calls a sampler just as it always did.
                **({"mm_inputs": traj.mm_inputs} if traj.mm_inputs else {}),
            )
            versions = gen.token_versions if gen.token_versions is not None else gen.version
            traj.add_reply(
                gen.response_ids, gen.logprobs, versions, getattr(gen, "routed_experts", None)
            )
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
            try:
                obs, obs_media = _observation(
                    tokenizer,
                    gen.response_ids,
                    step.observation,
                    limits,
                    processor,
                    bounds,
                    f"{item} observation {traj.turns}",
                )
            except MediaError as exc:
                traj.reward = limits.error_reward
                traj.finish("tool_error", f"observation: {exc}")
                break
            spelled = _spelled(processor, obs, obs_media)
            if spelled is not None:
                traj.reward = limits.error_reward
                traj.finish("tool_error", f"observation: {spelled}")
                break
            if len(traj.response_ids) + len(obs) >= limits.max_tokens:
                # No room left for a reply to it: the episode ends before the observation.
                traj.finish("token_budget")
                break
            traj.add_observation(obs, obs_media)
        return traj
    finally:
        await _close(env, limits.tool_timeout)


async def _close(env: Env, timeout: float) -> None:
    try:
        await asyncio.wait_for(env.close(), timeout)
    except Exception:  # a failing close must not lose the episode
        pass
