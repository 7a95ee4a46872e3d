"""Agentic RL: multi-turn environments, agent sessions and an OpenAI-compatible endpoint.

- ``Env`` / ``Step`` / ``run_episode``: a multi-turn environment the rollout role drives,
  token-in/token-out (the model's ids are never re-tokenised; observations are masked out).
- ``Sampler``: concurrent generation requests batched into engine calls.
- ``SessionStore``: endpoint calls grouped by session id into token-exact trajectories.
- ``Trajectory``: one episode as one trainable row (``loss_mask`` 1 on model tokens).
- ``AgentServer``: the OpenAI-compatible endpoint a rollout serves (calls in a session are
  recorded); ``Policy`` / ``connect``: the asyncio client for a user's own program.
"""

from relax.agents._chat import (
    ChatFormatError,
    ToolCall,
    continuation_ids,
    cut_at_stop,
    parse_tool_calls,
    prompt_ids,
    render,
)
from relax.agents._client import (
    AgentEndpointError,
    ChatReply,
    Completion,
    Policy,
    SamplingOptions,
)
from relax.agents._connect import EndpointNotFound, connect, read_endpoint
from relax.agents._env import (
    Env,
    EpisodeLimits,
    Step,
    Task,
    describe_failure,
    run_episode,
)
from relax.agents._sampler import Sampler
from relax.agents._server import SESSION_HEADER, AgentServer
from relax.agents._sessions import Choice, Session, SessionStore
from relax.agents._trajectory import END_REASONS, Trajectory, model_spans

__all__ = [
    "END_REASONS",
    "SESSION_HEADER",
    "AgentEndpointError",
    "AgentServer",
    "ChatFormatError",
    "ChatReply",
    "Choice",
    "Completion",
    "EndpointNotFound",
    "Env",
    "EpisodeLimits",
    "Policy",
    "Sampler",
    "SamplingOptions",
    "Session",
    "SessionStore",
    "Step",
    "Task",
    "ToolCall",
    "Trajectory",
    "connect",
    "continuation_ids",
    "cut_at_stop",
    "describe_failure",
    "model_spans",
    "parse_tool_calls",
    "prompt_ids",
    "read_endpoint",
    "render",
    "run_episode",
]
