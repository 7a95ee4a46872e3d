"""Packing sample rows from the bus into the padded tensors a training step needs.

Layout. Each row is ``prompt_ids + response_ids``, left-aligned (right padding), so
``input_ids`` is ``[batch, seq]``. Per-token tensors (``mask``, ``rollout_logprobs``,
``ref_logprobs``, ``values``) are ``[batch, seq - 1]`` and aligned to *next-token prediction
positions*: column ``t`` holds the quantity for token ``input_ids[:, t + 1]``, which is what the
logits at position ``t`` predict. So a model's logits ``[:, :-1]`` line up with them directly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

import relax.schema as col

Row = Mapping[str, Any]
"""One sample as the trainer receives it (a bus row's columns)."""

_PER_TOKEN_OPTIONAL = (col.REF_LOGPROBS, col.VALUES)


@dataclass(frozen=True)
class Batch:
    """Padded tensors of a list of rows; see the module docstring for the alignment."""

    input_ids: torch.Tensor
    """``[batch, seq]`` token ids, prompt then response, right-padded with ``pad_id``."""
    attention_mask: torch.Tensor
    """``[batch, seq]`` 1 on real tokens, 0 on padding."""
    response_mask: torch.Tensor
    """``[batch, seq - 1]`` float, 1 where the predicted token is a response token."""
    mask: torch.Tensor
    """``[batch, seq - 1]`` float, 1 where the predicted token counts in the loss: a response
    token whose ``loss_mask`` is 1 (tool outputs in multi-turn rows have 0)."""
    rollout_logprobs: torch.Tensor
    """``[batch, seq - 1]`` float32 log-probs the behaviour (rollout) policy gave each token."""
    rewards: torch.Tensor
    """``[batch]`` float32 scalar reward per row."""
    group_ids: torch.Tensor
    """``[batch]`` int64 dense group index (order of first appearance of each ``group``)."""
    groups: tuple[str, ...]
    """The group name of each dense index."""
    lengths: torch.Tensor
    """``[batch]`` int64 real length (prompt + response) of each row."""
    ref_logprobs: torch.Tensor | None = None
    """``[batch, seq - 1]`` reference-model log-probs, when the rows carry them."""
    values: torch.Tensor | None = None
    """``[batch, seq - 1]`` critic values per response token, when the rows carry them."""
    mm_inputs: tuple[dict[str, torch.Tensor] | None, ...] = ()
    """Per row, the processor's media inputs of its prompt (pixel values, grids, audio
    features …) exactly as the rollout generated with them; ``()`` when no row has media.
    The forward pass collates them (``relax.models.collate_mm_inputs``)."""
    routed_experts: torch.Tensor | None = None
    """``[batch, seq, layers, top_k]`` a mixture-of-experts policy's routing at generation,
    aligned with ``input_ids`` (``relax.models.routing`` replays it); at least ``num_experts``
    where not recorded (padding, the last token, a row without records). ``None`` when no row
    has records."""

    @property
    def size(self) -> int:
        """Number of rows."""
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Number of tokens that count in the loss."""
        return int(self.mask.sum().item())

    def select(self, start: int, stop: int) -> Batch:
        """Rows ``start:stop``, with columns past their longest row trimmed away.

        Trimming is safe because padding is on the right and attention is causal: the
        dropped columns never influence the kept ones. It saves compute on micro-batches of
        short rows.
        """
        rows = slice(start, stop)
        width = max(int(self.lengths[rows].max().item()), 2) if stop > start else 2
        cols = slice(0, width)
        tok = slice(0, width - 1)

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows, tok]

        return replace(
            self,
            input_ids=self.input_ids[rows, cols],
            attention_mask=self.attention_mask[rows, cols],
            response_mask=self.response_mask[rows, tok],
            mask=self.mask[rows, tok],
            rollout_logprobs=self.rollout_logprobs[rows, tok],
            rewards=self.rewards[rows],
            group_ids=self.group_ids[rows],
            lengths=self.lengths[rows],
            ref_logprobs=cut(self.ref_logprobs),
            values=cut(self.values),
            mm_inputs=self.mm_inputs[rows],
            routed_experts=None if self.routed_experts is None else self.routed_experts[rows, cols],
        )

    def reordered(self, order: torch.Tensor) -> Batch:
        """The rows ``order`` lists (a permutation of row indices), in that order."""
        index = order.to(device=self.input_ids.device, dtype=torch.long)

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        return replace(
            self,
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            response_mask=self.response_mask[index],
            mask=self.mask[index],
            rollout_logprobs=self.rollout_logprobs[index],
            rewards=self.rewards[index],
            group_ids=self.group_ids[index],
            lengths=self.lengths[index],
            ref_logprobs=pick(self.ref_logprobs),
            values=pick(self.values),
            mm_inputs=tuple(self.mm_inputs[i] for i in index.tolist()) if self.mm_inputs else (),
            routed_experts=pick(self.routed_experts),
        )

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with every tensor on ``device``."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(
            self,
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            response_mask=self.response_mask.to(device),
            mask=self.mask.to(device),
            rollout_logprobs=self.rollout_logprobs.to(device),
            rewards=self.rewards.to(device),
            group_ids=self.group_ids.to(device),
            lengths=self.lengths.to(device),
            ref_logprobs=move(self.ref_logprobs),
            values=move(self.values),
            routed_experts=move(self.routed_experts),
            mm_inputs=tuple(
                None if mm is None else {k: v.to(device) for k, v in mm.items()}
                for mm in self.mm_inputs
            ),
        )


def _check_row(index: int, row: Row) -> None:
    """Raise ``ValueError`` naming the row and column when a row is malformed."""
    for key in (col.PROMPT_IDS, col.RESPONSE_IDS, col.LOGPROBS, col.REWARD, "group"):
        if key not in row:
            raise ValueError(f"row {index} has no {key!r} column")
    if len(row[col.PROMPT_IDS]) == 0:
        # The first response token is predicted from the last prompt token; without one there
        # is nothing to condition on.
        raise ValueError(f"row {index} has an empty prompt_ids")
    n = len(row[col.RESPONSE_IDS])
    for key in (col.LOGPROBS, col.LOSS_MASK, *_PER_TOKEN_OPTIONAL):
        value = row.get(key)
        if value is not None and len(value) != n:
            raise ValueError(
                f"row {index}: {key!r} has {len(value)} entries but response_ids has {n}"
            )


def pack_batch(rows: Sequence[Row], pad_id: int) -> Batch:
    """Pack rows into a right-padded :class:`Batch`.

    Each row needs ``prompt_ids``, ``response_ids`` (lists of ints), ``logprobs`` (the rollout
    policy's log-prob of each response token), ``reward`` (float) and ``group`` (the prompt's
    group id, any hashable; compared as a string). Optional: ``loss_mask`` (0/1 per response
    token; 0 excludes a token from the loss, e.g. tool output in a multi-turn row),
    ``ref_logprobs`` and ``values`` (per response token), ``mm_inputs`` (the prompt's media
    inputs: a dict of tensors, or None for a text row). An optional per-token column must be on
    every row or on none, since a batch cannot train half its rows against a reference.

    Raises ``ValueError`` on an empty batch, a malformed row or a partially present column.
    """
    if not rows:
        raise ValueError("cannot pack an empty batch")
    for index, row in enumerate(rows):
        _check_row(index, row)
    present = {key: [row.get(key) is not None for row in rows] for key in _PER_TOKEN_OPTIONAL}
    for key, flags in present.items():
        if any(flags) and not all(flags):
            missing = flags.index(False)
            raise ValueError(f"{key!r} is on some rows but not on row {missing}")

    batch = len(rows)
    lengths = [len(r[col.PROMPT_IDS]) + len(r[col.RESPONSE_IDS]) for r in rows]
    # At least 2 columns so the per-token tensors are never zero-width.
    seq = max(max(lengths), 2)
    input_ids = torch.full((batch, seq), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, seq), dtype=torch.long)
    response_mask = torch.zeros((batch, seq - 1), dtype=torch.float32)
    mask = torch.zeros((batch, seq - 1), dtype=torch.float32)
    rollout = torch.zeros((batch, seq - 1), dtype=torch.float32)
    extra = {
        key: torch.zeros((batch, seq - 1), dtype=torch.float32)
        for key, flags in present.items()
        if all(flags)
    }

    group_index: dict[str, int] = {}
    group_ids = []
    for b, row in enumerate(rows):
        prompt, response = list(row[col.PROMPT_IDS]), list(row[col.RESPONSE_IDS])
        p, n = len(prompt), len(response)
        input_ids[b, : p + n] = torch.tensor(prompt + response, dtype=torch.long)
        attention_mask[b, : p + n] = 1
        # Response token j sits at input position p + j and is predicted at position p + j - 1.
        span = slice(p - 1, p - 1 + n)
        response_mask[b, span] = 1.0
        loss_mask = row.get(col.LOSS_MASK)
        mask[b, span] = (
            torch.ones(n) if loss_mask is None else torch.tensor(loss_mask, dtype=torch.float32)
        )
        rollout[b, span] = torch.tensor(row[col.LOGPROBS], dtype=torch.float32)
        for key, tensor in extra.items():
            tensor[b, span] = torch.tensor(row[key], dtype=torch.float32)
        name = str(row["group"])
        group_ids.append(group_index.setdefault(name, len(group_index)))

    if not torch.all((mask == 0) | (mask == 1)):
        raise ValueError("loss_mask entries must be 0 or 1")
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        mask=mask,
        rollout_logprobs=rollout,
        rewards=torch.tensor([float(r[col.REWARD]) for r in rows], dtype=torch.float32),
        group_ids=torch.tensor(group_ids, dtype=torch.long),
        groups=tuple(group_index),
        lengths=torch.tensor(lengths, dtype=torch.long),
        ref_logprobs=extra.get(col.REF_LOGPROBS),
        values=extra.get(col.VALUES),
        mm_inputs=tuple(r.get(col.MM_INPUTS) or None for r in rows)
        if any(r.get(col.MM_INPUTS) for r in rows)
        else (),
        routed_experts=_routed_experts(rows, lengths, seq),
    )


def _routed_experts(rows: Sequence[Row], lengths: list[int], seq: int) -> torch.Tensor | None:
    """The rows' routing records as ``[batch, seq, layers, top_k]`` (``None``: no row has
    any); rows without records, and padding, hold the dtype's largest value: not recorded."""
    records = [row.get(col.ROUTED_EXPERTS) for row in rows]
    first = next((r for r in records if r is not None), None)
    if first is None:
        return None
    shape = tuple(first.shape[1:])
    out = torch.full((len(rows), seq, *shape), torch.iinfo(first.dtype).max, dtype=first.dtype)
    for b, (record, length) in enumerate(zip(records, lengths, strict=True)):
        if record is None:
            continue
        if tuple(record.shape) != (length, *shape):
            raise ValueError(
                f"row {b}: routed_experts has shape {list(record.shape)}, expected"
                f" [{length}, {', '.join(map(str, shape))}] (prompt + response tokens)"
            )
        out[b, :length] = record
    return out


def response_values(batch: Batch, per_token: torch.Tensor) -> list[list[float]]:
    """Unpack a ``[batch, seq - 1]`` per-token tensor into one list per row's response tokens.

    The inverse of packing, e.g. for a reference role writing ``ref_logprobs`` back as a column.
    """
    out = []
    for b in range(batch.size):
        positions = batch.response_mask[b].nonzero().squeeze(-1)
        out.append(per_token[b, positions].tolist())
    return out
