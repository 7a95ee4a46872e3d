"""Samples that are episodes: environment episodes and agent-program sessions, as bus rows.

The rollout role calls these for an admitted batch of prompts when ``[rollout.agent] kind`` is
"env" or "openai". Each of a prompt's ``n`` samples is one episode; its row carries the whole
trajectory (``loss_mask`` 1 on model tokens) and its ``reward``, so no reward role scores it.
An episode's seed derives from its uid, so a prompt retried after a crash replays the same
episodes — provided the environment itself is deterministic given its task.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import time
from collections.abc import Callable
from typing import Any

from relax.agents import (
    Env,
    EpisodeLimits,
    Sampler,
    SessionStore,
    Trajectory,
    describe_failure,
    run_episode,
)
from relax.config import AgentConfig, ClusterConfig
from relax.engines import SamplingParams
from relax.importpath import load
from relax.media import media_limits
from relax.roles._common import as_list, prompt_seed
from relax.schema import PROMPT_IDS, TEXT


def episode_task(row: dict[str, Any]) -> dict[str, Any]:
    """What an environment or agent program gets: the prompt row's id, text and answer."""
    cols = row["columns"]
    return {"id": row["uid"], "prompt": cols.get(TEXT, ""), "answer": cols.get("answer", "")}


def episode_row(prompt: dict[str, Any], index: int, n: int, traj: Trajectory) -> dict[str, Any]:
    """The bus row of sample ``index`` of ``prompt``'s group."""
    columns = traj.columns()
    columns["answer"] = prompt["columns"].get("answer", "")
    return {
        "uid": f"{prompt['uid']}/{index}",
        "group": prompt["uid"],
        "group_size": n,
        # A trajectory without a model token (its reset failed) is as fresh as it gets.
        "version": max(traj.version, 0),
        "columns": columns,
    }


def limits(cfg: ClusterConfig) -> EpisodeLimits:
    agent = cfg.rollout.agent
    return EpisodeLimits(
        max_turns=agent.max_turns,
        max_tokens=agent.max_tokens,
        max_reply_tokens=cfg.rollout.max_new_tokens,
        tool_timeout=agent.tool_timeout,
        error_reward=agent.error_reward,
        observation_role=agent.observation_role,
        chat=agent.chat,
    )


def make_env(agent: AgentConfig) -> Env:
    env = load(agent.env or "")(**agent.options)
    if not isinstance(env, Env):
        raise TypeError(f"{agent.env!r} made a {type(env).__name__}, not a relax.agents.Env")
    return env


async def env_rows(
    cfg: ClusterConfig,
    sampler: Sampler,
    tokenizer: Any,
    prompts: list[dict[str, Any]],
    stops: list[int],
    processor: Any = None,
) -> tuple[list[dict[str, Any]], list[Trajectory]]:
    """Play ``n`` episodes of every prompt, concurrently (their turns batch in the sampler).
    ``processor``: the model's (``None`` for a text-only model); with it, openings and
    observations may carry media, decoded within ``[data.media]``."""
    n = cfg.data.n_samples_per_prompt
    rollout = cfg.rollout
    bounds = limits(cfg)
    media = media_limits(cfg.data.media)

    async def one(prompt: dict[str, Any], j: int) -> Trajectory:
        sampling = SamplingParams.from_rollout(
            rollout, stop_token_ids=stops, seed=prompt_seed(rollout.seed, f"{prompt['uid']}/{j}")
        )
        env = make_env(rollout.agent)
        return await run_episode(
            env,
            episode_task(prompt),
            sampler,
            tokenizer,
            bounds,
            sampling,
            processor=processor,
            media_limits=media,
        )

    trajs = await asyncio.gather(*(one(p, j) for p in prompts for j in range(n)))
    rows = [episode_row(p, j, n, trajs[i * n + j]) for i, p in enumerate(prompts) for j in range(n)]
    return rows, list(trajs)


async def program_rows(
    cfg: ClusterConfig,
    sessions: SessionStore,
    session_url: Callable[[str], str],
    api_key: str | None,
    prompts: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[Trajectory]]:
    """Run the agent program ``n`` times per prompt, each in its own endpoint session; the
    sessions' recorded calls become the rows, with the rewards the program returned."""
    agent = cfg.rollout.agent
    program = load(agent.program or "")
    n = cfg.data.n_samples_per_prompt
    # A sync program blocks a thread per episode: all of them run at once (the default
    # executor has a handful of threads, which would serialise the episodes).
    threads = (
        None
        if inspect.iscoroutinefunction(program)
        else concurrent.futures.ThreadPoolExecutor(len(prompts) * n, "relax-agent")
    )
    loop = asyncio.get_running_loop()

    async def one(prompt: dict[str, Any], j: int) -> Trajectory:
        # A fresh session per attempt: a retried prompt must not continue an old session.
        sid = f"{prompt['uid']}.{j}.{time.monotonic_ns()}"
        task = episode_task(prompt)
        args = (session_url(sid), api_key, task)
        call = (
            program(*args, **agent.options)
            if threads is None
            else loop.run_in_executor(threads, functools.partial(program, *args, **agent.options))
        )
        end, reason, reward = "done", "", agent.error_reward
        try:
            reward = float(await asyncio.wait_for(call, agent.episode_timeout))
        except TimeoutError:
            end, reason = "tool_timeout", f"the agent program ran over {agent.episode_timeout:g} s"
        except Exception as exc:
            end, reason = "agent_error", describe_failure(exc)
        traj = sessions.finish(sid, reward)
        if traj is None:  # the program never called the endpoint: nothing to train on
            traj = Trajectory(as_list(prompt["columns"][PROMPT_IDS]) or [0])
            traj.reward = reward
        if end != "done":
            traj.reward = agent.error_reward
            traj.finish(end, reason)
        traj.info["session"] = sid
        return traj

    try:
        trajs = await asyncio.gather(*(one(p, j) for p in prompts for j in range(n)))
    finally:
        if threads is not None:  # a timed-out program's thread is left to finish on its own
            threads.shutdown(wait=False, cancel_futures=True)
    rows = [episode_row(p, j, n, trajs[i * n + j]) for i, p in enumerate(prompts) for j in range(n)]
    return rows, list(trajs)
