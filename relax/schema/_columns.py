"""The names of the columns every role agrees on: one constant per column, so a misspelt column
is a ``NameError`` where it is written instead of a row that silently lacks it.

What each column holds (its type, rank, per-token length) is declared and checked by the bus
(``relax.bus.SCHEMA``); a column not named here (a user's own, ``answer``) is the user's.
"""

from __future__ import annotations

PROMPT_IDS = "prompt_ids"
"""The prompt's token ids."""
RESPONSE_IDS = "response_ids"
"""The generated response's token ids."""
LOGPROBS = "logprobs"
"""Per response token: its log-prob under the policy that generated it."""
REF_LOGPROBS = "ref_logprobs"
"""Per response token: its log-prob under the frozen reference policy."""
VALUES = "values"
"""Per response token: the critic's value estimate."""
LOSS_MASK = "loss_mask"
"""Per response token: 1 where the token is trained on (a model's), 0 where not (a tool's)."""
TOKEN_VERSIONS = "token_versions"
"""Per response token: the policy version that generated it (a generation can span updates)."""
REWARD = "reward"
"""The row's scalar reward."""
SUCCESS = "success"
"""An agent episode's success, 0..1."""
TURNS = "turns"
"""Model turns an agent episode took."""
EPISODE_END = "episode_end"
"""How an agent episode ended (``"done"``, ``"truncated"``, ...)."""
EPISODE_REASON = "episode_reason"
"""Why it ended, in words."""
SESSION = "session"
"""The agent session the row came from."""
TEXT = "text"
"""The response as text."""
MEDIA_TOKENS = "media_tokens"
"""Prompt tokens that stand for images, audio or video."""
MM_INPUTS = "mm_inputs"
"""The processor's multimodal inputs (pixel values, audio features, ...) for the prompt."""
ROUTED_EXPERTS = "routed_experts"
"""A mixture-of-experts policy's routing at generation: per token of prompt and response, per
MoE layer, the top-k expert ids its routers chose (``[tokens, layers, top_k]``, a small integer
dtype; ``num_experts`` where not recorded). What R3 replays (``[trainer] routing_replay``)."""

COLUMN_NAMES: tuple[str, ...] = (
    PROMPT_IDS,
    RESPONSE_IDS,
    LOGPROBS,
    REF_LOGPROBS,
    VALUES,
    LOSS_MASK,
    TOKEN_VERSIONS,
    REWARD,
    SUCCESS,
    TURNS,
    EPISODE_END,
    EPISODE_REASON,
    SESSION,
    TEXT,
    MEDIA_TOKENS,
    MM_INPUTS,
    ROUTED_EXPERTS,
)
"""Every declared column (``relax.bus.SCHEMA`` declares each one's type)."""
