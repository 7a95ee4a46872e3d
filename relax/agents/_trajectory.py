"""A multi-turn trajectory as one trainable sample row.

One row per episode: ``prompt_ids`` is the first prompt; ``response_ids`` is everything after
it — the model's replies *and* the observations between them — with ``loss_mask`` 1 on the
model's tokens and 0 on the rest, so the trainer conditions on tool outputs without training
the policy to produce them. ``logprobs`` and ``token_versions`` hold the sampling policy's
values on model tokens (observation tokens get 0.0 and the version of the reply before them:
they are masked out, and must not make the row look staler than it is).

Media (images, audio, video in the opening or in observations) are placeholder tokens in the
ids, never trained on (the engine cannot sample them), plus ``mm_inputs``: the processor's
tensors of every item of the row, in order of appearance.

A mixture-of-experts policy's routing (``routed_experts``, for R3) is kept per token as it was
first computed: each reply's call records the routing of what it prefilled (the observations
since the last reply, and that reply's last token, never fed back then) and of its own tokens;
earlier tokens keep the records of the call that processed them first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relax.agents._media import merge_media
from relax.schema import (
    EPISODE_END,
    EPISODE_REASON,
    LOGPROBS,
    LOSS_MASK,
    MM_INPUTS,
    PROMPT_IDS,
    RESPONSE_IDS,
    REWARD,
    ROUTED_EXPERTS,
    SESSION,
    SUCCESS,
    TOKEN_VERSIONS,
    TURNS,
)

END_REASONS = ("done", "max_turns", "token_budget", "tool_error", "tool_timeout", "agent_error")
"""Why an episode ended: the environment said done, a budget ran out, or a failure."""


@dataclass
class Trajectory:
    """Token ids of an episode so far, with what training needs per token."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    """Model replies so far."""
    end: str | None = None
    """Why it ended (one of ``END_REASONS``), once it has."""
    reason: str = ""
    """Details of a failure ending (the exception, the timeout)."""
    info: dict[str, Any] = field(default_factory=dict)
    """What the environment reported (``Step.info``, merged); ``info["success"]`` becomes the
    row's ``success`` column (the trainer logs its mean as ``success_rate``)."""
    calls: list[dict[str, Any]] = field(default_factory=list)
    """Per model call: its prompt length, the ids and log-probs it returned, its version."""
    mm_inputs: dict[str, Any] | None = None
    """The media tensors of the whole sequence (``pixel_values``, ``image_grid_thw``, ...;
    items in order of their placeholders), or ``None`` for a text-only trajectory."""
    routed_experts: Any = None
    """An MoE policy's routing of the tokens processed so far (``[tokens, layers, top_k]``;
    the last one not yet, ``num_experts``), or ``None``: no record (a dense policy, a sampler
    that does not record, or a reply without one: then none is kept)."""
    _unrouted: bool = False

    def __len__(self) -> int:
        """Tokens in the whole sequence (prompt and response)."""
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def ids(self) -> list[int]:
        """The whole sequence: what the model is prompted with for its next reply."""
        return self.prompt_ids + self.response_ids

    @property
    def version(self) -> int:
        """The oldest weights version that generated any model token (``-1`` before any)."""
        model = [v for v, m in zip(self.token_versions, self.loss_mask, strict=True) if m]
        return min(model) if model else -1

    def add_reply(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float],
        versions: int | Sequence[int],
        routed: Any = None,
    ) -> None:
        """Append the model's reply, trained on. ``routed``: the call's routing record, of
        the whole sequence it was prompted with and the reply (``Generation.routed_experts``)."""
        per_token = [versions] * len(ids) if isinstance(versions, int) else list(versions)
        if not len(ids) == len(logprobs) == len(per_token):
            raise ValueError(
                f"a reply of {len(ids)} ids has {len(logprobs)} logprobs and"
                f" {len(per_token)} versions"
            )
        self._add_routing(routed, len(self) + len(ids))
        self.calls.append(
            {
                "prompt_tokens": len(self),
                "ids": list(ids),
                "logprobs": list(logprobs),
                "versions": per_token,
            }
        )
        self.response_ids += list(ids)
        self.loss_mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs]
        self.token_versions += per_token
        self.turns += 1

    def add_observation(self, ids: Sequence[int], mm_inputs: dict[str, Any] | None = None) -> None:
        """Append ids the model did not generate (tool output, user turn): conditioned on,
        never trained on. ``mm_inputs``: the tensors of the media whose placeholders ``ids``
        hold, appended to the trajectory's."""
        if mm_inputs:
            self.mm_inputs = merge_media(self.mm_inputs, mm_inputs)
        version = self.token_versions[-1] if self.token_versions else 0
        self.response_ids += list(ids)
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.token_versions += [version] * len(ids)

    def _add_routing(self, routed: Any, length: int) -> None:
        if self._unrouted:
            return
        if routed is None or len(routed) != length:
            self.routed_experts, self._unrouted = None, True  # a partial record is none
            return
        if self.routed_experts is None:
            self.routed_experts = routed
            return
        import torch

        # Keep what earlier calls processed first; the previous reply's last token (never fed
        # back then) and everything after it come from this call.
        kept = len(self.routed_experts) - 1
        self.routed_experts = torch.cat([self.routed_experts[:kept], routed[kept:]])

    def routing(self) -> Any:
        """The row's ``routed_experts``: one entry per token, those after the last reply
        (a closing observation) not recorded; ``None`` without records."""
        record = self.routed_experts
        if record is None or self._unrouted:
            return None
        missing = len(self) - len(record)
        if missing <= 0:
            return record
        import torch

        marker = record[-1:].clone()  # the last entry is always "not recorded"
        return torch.cat([record, marker.expand(missing, *marker.shape[1:])])

    def finish(self, end: str, reason: str = "") -> None:
        if end not in END_REASONS:
            raise ValueError(f"unknown end {end!r}; one of {END_REASONS}")
        self.end, self.reason = end, reason

    def generated_ids(self) -> list[list[int]]:
        """The ids of each model reply, in order (what token-exactness is checked against)."""
        return [call["ids"] for call in self.calls]

    def columns(self) -> dict[str, Any]:
        """The row's columns on the sample bus (``reward`` included: the episode scored it)."""
        columns = {
            PROMPT_IDS: list(self.prompt_ids),
            RESPONSE_IDS: list(self.response_ids),
            LOGPROBS: list(self.logprobs),
            LOSS_MASK: list(self.loss_mask),
            TOKEN_VERSIONS: list(self.token_versions),
            REWARD: float(self.reward),
            TURNS: self.turns,
            EPISODE_END: self.end or "",
            EPISODE_REASON: self.reason,
        }
        if "success" in self.info:
            columns[SUCCESS] = float(bool(self.info["success"]))
        if "session" in self.info:  # the endpoint session it was recorded from
            columns[SESSION] = str(self.info["session"])
        if self.mm_inputs:
            columns[MM_INPUTS] = dict(self.mm_inputs)
        routing = self.routing()
        if routing is not None:
            columns[ROUTED_EXPERTS] = routing
        return columns


def model_spans(loss_mask: Sequence[int], ids: Sequence[int]) -> list[list[int]]:
    """The runs of ``ids`` whose mask is 1: a row's model replies, in order."""
    spans: list[list[int]] = []
    previous = 0
    for token, m in zip(ids, loss_mask, strict=True):
        if m and not previous:
            spans.append([])
        if m:
            spans[-1].append(int(token))
        previous = m
    return spans
