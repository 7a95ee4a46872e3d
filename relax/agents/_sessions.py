"""Agent sessions: endpoint calls recorded, token-exact, into trajectories.

A black-box agent sends the whole conversation on every call. The store remembers, per session,
the ids the last call was prompted with and the replies it got (one per choice). When the next
call's conversation is the previous one plus one of those replies plus new turns, the new
prompt is the previous ids + that reply's *sampled* ids + the new turns rendered on their own
(``continuation_ids``) — the reply is never re-tokenised. The trajectory is the same object an
environment episode builds: replies trained on, everything else masked.

A call that does not continue the session this way (the agent rewrote or summarised its
history) starts a new *segment*. A session's training row is its last segment (the one the
reward judges); earlier segments are counted in ``statistics()["segments_dropped"]``.
"""

from __future__ import annotations

import copy
import json
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relax.agents._chat import Message, content_text, continuation_ids, encode, prompt_ids
from relax.agents._trajectory import Trajectory
from relax.engines import Generation


@dataclass
class Choice:
    """One reply a call returned, as sampled and as the agent saw it."""

    generation: Generation
    ids: list[int]
    """The reply's ids as kept (a stop string may have cut the generation short)."""
    logprobs: list[float]
    message: Message | None = None
    """For chat calls: the assistant message returned (content and tool calls)."""
    text: str | None = None
    """For completion calls: the text returned."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per kept token, the most likely ``(id, logprob)`` of its distribution (when asked)."""


@dataclass
class Session:
    id: str
    trajectory: Trajectory | None = None
    """The current segment (None before the first call)."""
    messages: list[Message] | None = None
    """Chat calls: the conversation the last call was prompted with."""
    prompt_text: str | None = None
    """Completion calls with a text prompt: that prompt."""
    choices: list[Choice] = field(default_factory=list)
    """The last call's replies, not yet part of the trajectory (the agent picks one by
    continuing with it)."""
    calls: int = 0
    segments: int = 0
    last_used: float = field(default_factory=time.monotonic)


def _same_message(sent: Message, returned: Message) -> bool:
    """Whether the agent sent back the assistant message we returned (modulo whitespace and
    the formatting of tool-call arguments)."""
    if sent.get("role") != "assistant":
        return False
    if content_text(sent.get("content")).strip() != content_text(returned.get("content")).strip():
        return False
    return _calls(sent) == _calls(returned)


def _calls(message: Message) -> list[tuple[str, Any]]:
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        args = fn.get("arguments", "")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass
        out.append((fn.get("name"), args))
    return out


class SessionStore:
    """Sessions by id, least recently used evicted beyond ``max_sessions``."""

    def __init__(self, tokenizer: Any, *, max_sessions: int = 4096) -> None:
        self.tokenizer = tokenizer
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.stats = {
            "calls": 0,
            "continued": 0,
            "segments_dropped": 0,
            "finished": 0,
            "evicted": 0,
        }

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def statistics(self) -> dict[str, int]:
        return {**self.stats, "open": len(self._sessions)}

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            session = self._sessions[session_id] = Session(session_id)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
                self.stats["evicted"] += 1
        self._sessions.move_to_end(session_id)
        session.last_used = time.monotonic()
        return session

    # ------------------------------------------------------------------ prompts

    def chat_prompt(
        self,
        session_id: str | None,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The ids to prompt with for a chat call (token-exact within a session)."""
        messages = list(messages)
        if session_id is None:
            return prompt_ids(self.tokenizer, messages, tools)
        session = self.get(session_id)
        prev = session.messages
        if prev is not None and session.trajectory is not None and messages == prev:
            # The same conversation again (a retry after a failed or abandoned call, or more
            # samples of it): the same ids, and the segment goes on.
            return session.trajectory.ids
        if (
            prev is not None
            and session.trajectory is not None
            and len(messages) > len(prev)
            and messages[: len(prev)] == prev
        ):
            sent = messages[len(prev)]
            for choice in session.choices:
                if choice.message is not None and _same_message(sent, choice.message):
                    tail = messages[len(prev) + 1 :]
                    self._continue(session, choice, tail_messages=tail)
                    session.messages = messages
                    return session.trajectory.ids
        ids = prompt_ids(self.tokenizer, messages, tools)
        self._new_segment(session, ids)
        session.messages = messages
        return ids

    def completion_prompt(self, session_id: str | None, prompt: str | Sequence[int]) -> list[int]:
        """The ids to prompt with for a completions call (text or token ids)."""
        text = prompt if isinstance(prompt, str) else None
        ids = (
            encode(self.tokenizer, prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        )
        if session_id is None:
            return ids
        session = self.get(session_id)
        traj = session.trajectory
        if traj is not None and (
            text == session.prompt_text if text is not None else ids == traj.ids
        ):
            return traj.ids  # the same prompt again (a retry, or more samples of it)
        if traj is not None:
            for choice in session.choices:
                if text is not None and session.prompt_text is not None and choice.text is not None:
                    head = session.prompt_text + choice.text
                    if text.startswith(head):
                        self._continue(
                            session, choice, tail_ids=encode(self.tokenizer, text[len(head) :])
                        )
                        session.prompt_text = text
                        return traj.ids
                elif text is None:
                    head_ids = traj.ids + choice.ids
                    if ids[: len(head_ids)] == head_ids:
                        self._continue(session, choice, tail_ids=ids[len(head_ids) :])
                        return traj.ids
        self._new_segment(session, ids)
        session.prompt_text = text
        return ids

    def _new_segment(self, session: Session, ids: list[int]) -> None:
        if session.trajectory is not None:
            self.stats["segments_dropped"] += 1
        session.trajectory = Trajectory(list(ids))
        session.choices = []
        session.segments += 1

    def _continue(
        self,
        session: Session,
        choice: Choice,
        *,
        tail_messages: list[Message] | None = None,
        tail_ids: list[int] | None = None,
    ) -> None:
        traj = session.trajectory
        assert traj is not None
        _add_choice(traj, choice)
        if tail_messages is not None:
            tail_ids = (
                continuation_ids(self.tokenizer, choice.ids, tail_messages) if tail_messages else []
            )
        if tail_ids:
            traj.add_observation(tail_ids)
        session.choices = []
        self.stats["continued"] += 1

    # ------------------------------------------------------------------ results

    def record(self, session_id: str | None, choices: list[Choice]) -> None:
        """Remember a call's replies (the next call of the session picks one)."""
        self.stats["calls"] += 1
        if session_id is None:
            return
        session = self.get(session_id)
        session.calls += 1
        session.choices = list(choices)

    def finish(self, session_id: str, reward: float, *, choice: int = 0) -> Trajectory | None:
        """End a session: its trajectory (last segment) with ``reward``; the last call's reply
        ``choice`` is its final turn. ``None`` for an unknown session or one without calls."""
        traj = self.finished(session_id, reward, choice=choice)
        if traj is not None:
            self.close(session_id)
        return traj

    def finished(self, session_id: str, reward: float, *, choice: int = 0) -> Trajectory | None:
        """The trajectory ``finish`` would end the session with, leaving the session open (a
        copy: ``close`` it once the trajectory is safely handed on, or finish again)."""
        session = self._sessions.get(session_id)
        if session is None or session.trajectory is None:
            return None
        traj = copy.deepcopy(session.trajectory)
        if session.choices:
            _add_choice(traj, session.choices[min(choice, len(session.choices) - 1)])
        traj.reward = float(reward)
        traj.finish("done")
        return traj

    def close(self, session_id: str) -> None:
        """Forget a session whose trajectory was handed on."""
        if self._sessions.pop(session_id, None) is not None:
            self.stats["finished"] += 1

    def discard(self, session_id: str) -> None:
        """Forget a session without a trajectory (its episode was abandoned)."""
        self._sessions.pop(session_id, None)


def _add_choice(traj: Trajectory, choice: Choice) -> None:
    """Append a reply the agent continued with (or finished on). The call was prompted with
    the trajectory as it stands, so its routing record (an MoE policy's, for R3) covers the
    trajectory and the reply: cut to the ids kept (a stop string may have cut the reply)."""
    gen = choice.generation
    versions = gen.version if gen.token_versions is None else gen.token_versions[: len(choice.ids)]
    routed = gen.routed_experts
    if routed is not None:
        routed = routed[: len(traj) + len(choice.ids)]
    traj.add_reply(choice.ids, choice.logprobs, versions, routed)
