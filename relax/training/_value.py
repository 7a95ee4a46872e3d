"""The value model (critic) for PPO with GAE: a transformer body with a scalar value head.

:class:`ValueModel` is the policy architecture's transformer body (the causal LM without its
language-model head) followed by ``nn.Linear(hidden, 1)``. Built from the policy's Hugging Face
folder, the head starts at zero, so every value starts at 0 — a neutral prior for rewards
around 0 — and the body starts from the policy's features.

Alignment is the trainer's (see :mod:`relax.training._batch`): ``values[:, t]`` is the value of
the state that *predicts* ``input_ids[:, t + 1]``, i.e. the value before that token is
generated, read from the hidden state at position ``t``. So per-token values line up with
``batch.mask`` and with the log-probs of :func:`relax.training.sequence_logprobs`, and
``response_values`` unpacks them into one list per row's response tokens (the ``values``
column).

:class:`CriticTrainer` computes the ``values`` column and trains the critic on the same rows:
returns from GAE over those values (the targets the trainer's advantages imply), a clipped
value loss, AdamW and gradient clipping; a non-finite loss or gradient skips the update.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from relax.algos import gae_advantages, kl_divergence, masked_mean, sequence_to_token_rewards
from relax.config import AlgorithmConfig
from relax.models import load_pretrained, one_build_at_a_time
from relax.schema import LOGPROBS, RESPONSE_IDS, REWARD, VALUES
from relax.training import _checkpoint as ckpt
from relax.training._batch import Batch, Row, pack_batch, response_values

VALUE_FILE = "value_model.safetensors"
"""All weights of a saved :class:`ValueModel` (body and head), in one safetensors file."""
CRITIC_META = "relax_critic.json"
"""JSON metadata of a critic checkpoint: format and number of updates."""
CRITIC_STATE = "critic_state.pt"
"""Optimiser state of a critic checkpoint (tensors and plain containers only)."""
_FORMAT = 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ValueModel(nn.Module):
    """A transformer body plus a scalar head: ``forward`` gives one value per position."""

    def __init__(self, body: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.body = body
        param = next(body.parameters())
        self.head = nn.Linear(hidden_size, 1, dtype=param.dtype, device=param.device)
        with torch.no_grad():  # values start at 0, whatever the seed
            self.head.weight.zero_()
            self.head.bias.zero_()

    @property
    def config(self) -> Any:
        """The body's Hugging Face config."""
        return self.body.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[batch, seq]`` float32 values, one per input position."""
        out = self.body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return self.head(out.last_hidden_state).squeeze(-1).float()

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        dtype: str | torch.dtype = "float32",
        *,
        trust_remote_code: bool = False,
    ) -> ValueModel:
        """Build from a local folder: a saved value model, or any HF causal-LM folder.

        A folder written by :meth:`save_pretrained` (it holds ``value_model.safetensors``)
        gives back that value model, head included. Any other model folder gives its causal
        LM's body (``base_model``; the LM head is dropped) and a fresh zero head.
        """
        path = Path(folder)
        torch_dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
        if (path / VALUE_FILE).is_file():
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
            with one_build_at_a_time():
                body = AutoModel.from_config(
                    config, dtype=torch_dtype, trust_remote_code=trust_remote_code
                )
            model = cls(body, config.hidden_size)
            model.load_state_dict(load_file(str(path / VALUE_FILE)))
            return model
        causal = load_pretrained(
            AutoModelForCausalLM, path, dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
        body = causal.base_model
        return cls(body, body.config.hidden_size)

    def save_pretrained(self, folder: str | Path) -> Path:
        """Write ``config.json`` and ``value_model.safetensors`` (see :meth:`from_pretrained`)."""
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        self.body.config.save_pretrained(path)
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(path / VALUE_FILE))
        return path


def value_forward(model: ValueModel, batch: Batch) -> torch.Tensor:
    """Values ``[batch, seq - 1]`` at next-token prediction positions, 0 outside responses.

    Column ``t`` is the value of the state whose next token is ``input_ids[:, t + 1]`` (the
    hidden state at position ``t``): aligned with ``batch.mask`` like the trainer's log-probs.
    """
    values = model(batch.input_ids, batch.attention_mask)[:, :-1]
    on = batch.response_mask > 0
    return torch.where(on, values, torch.zeros_like(values))


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.5,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss, averaged over counted tokens.

    ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``: the new value may not
    profit from moving more than ``c`` away from the value the advantages were computed with.
    Value clipping comes with PPO's reference implementation (Schulman et al. 2017, "Proximal
    Policy Optimization Algorithms", arXiv:1707.06347, and OpenAI baselines' ``ppo2``); its
    effect is studied in Engstrom et al. 2020, "Implementation Matters in Deep Policy Gradients",
    arXiv:2005.12729. ``clip=None`` gives the plain squared error. Returns ``(loss, metrics)``.
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        loss_tok = unclipped
        clip_frac = torch.zeros((), dtype=torch.float32, device=values.device)
    else:
        moved = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (moved - returns) ** 2
        loss_tok = torch.maximum(unclipped, clipped)
        clip_frac = masked_mean((clipped > unclipped).float(), mask)
    loss = 0.5 * masked_mean(loss_tok, mask)
    return loss, {"value_clip_frac": clip_frac.detach()}


def critic_token_rewards(batch: Batch, cfg: AlgorithmConfig) -> torch.Tensor:
    """Per-token rewards ``[batch, seq - 1]`` exactly as the trainer's GAE sees them.

    The sequence reward sits on the last counted token; with ``kl.mode = "reward"`` the
    per-token ``coef * KL(rollout || reference)`` is subtracted (rows then need ``logprobs``
    and ``ref_logprobs``).
    """
    rewards = sequence_to_token_rewards(batch.rewards, batch.mask)
    if cfg.kl.coef > 0 and cfg.kl.mode == "reward":
        if batch.ref_logprobs is None:
            raise ValueError("kl.mode = 'reward' needs rows with a 'ref_logprobs' column")
        kl = kl_divergence(
            batch.rollout_logprobs, batch.ref_logprobs, cfg.kl.estimator, cfg.kl.clamp
        )
        # Exactly the trainer's penalty (relax.training._objective._reward_kl).
        rewards = rewards - cfg.kl.coef * torch.where(batch.mask > 0, kl, torch.zeros_like(kl))
    return rewards


def critic_rows(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Rows as ``pack_batch`` needs them; ``logprobs``/``reward``/``group`` are filled in when
    absent (values need only the token ids)."""
    out = []
    for index, row in enumerate(rows):
        n = len(row[RESPONSE_IDS])
        full = dict(row)
        full.setdefault(LOGPROBS, [0.0] * n)
        full.setdefault(REWARD, 0.0)
        full.setdefault("group", index)
        out.append(full)
    return out


class CriticTrainer:
    """Computes the ``values`` column and trains a :class:`ValueModel` on the same rows.

    ``values(rows)`` scores rows with the current weights (no gradient). ``train(rows, values)``
    takes the values that were handed out (so that its GAE returns are the targets the
    trainer's advantages imply), runs ``epochs`` passes of micro-batches of the clipped value
    loss, clips the gradient norm to ``grad_clip`` and steps AdamW once per pass. A non-finite
    loss or gradient norm skips the update and leaves the weights untouched.

    Thread-safe: ``values``, ``train`` and checkpointing hold one lock, so a role may run them
    in worker threads and checkpoint on stop while an update is still finishing.
    """

    def __init__(
        self,
        model: ValueModel,
        algorithm: AlgorithmConfig,
        *,
        lr: float,
        pad_id: int = 0,
        grad_clip: float = 1.0,
        value_clip: float | None = 0.5,
        micro_batch_size: int = 16,
        epochs: int = 1,
        weight_decay: float = 0.0,
    ) -> None:
        self.model = model
        self.model.train()
        self.algorithm = algorithm
        self.pad_id = pad_id
        self.grad_clip = grad_clip
        self.value_clip = value_clip
        self.micro_batch_size = micro_batch_size
        self.epochs = epochs
        self._params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(  # fused: as the policy's (TorchBackend)
            self._params, lr=lr, weight_decay=weight_decay, fused=True
        )
        self.updates = 0
        self.skipped = 0
        self._lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _pack(self, rows: Sequence[Row]) -> Batch:
        return pack_batch(critic_rows(rows), self.pad_id).to(self.device)

    def values(self, rows: Sequence[Row]) -> list[list[float]]:
        """Each row's values, one per response token (the ``values`` column)."""
        out: list[list[float]] = []
        with self._lock, torch.no_grad():
            for start in range(0, len(rows), self.micro_batch_size):
                batch = self._pack(rows[start : start + self.micro_batch_size])
                out.extend(response_values(batch, value_forward(self.model, batch).cpu()))
        return out

    def train(
        self, rows: Sequence[Row], values: Sequence[Sequence[float]]
    ) -> tuple[bool, dict[str, float]]:
        """One update on ``rows`` whose handed-out values were ``values``.

        Returns ``(applied, metrics)``. Rows need ``prompt_ids``, ``response_ids`` and
        ``reward`` (plus ``logprobs``/``ref_logprobs`` with ``kl.mode = "reward"``).
        """
        started = time.perf_counter()
        keep = [i for i, row in enumerate(rows) if len(row[RESPONSE_IDS]) > 0]
        if not keep:
            return False, {"rows": 0.0}
        with self._lock:
            rows = [{**rows[i], VALUES: list(values[i])} for i in keep]
            batch = self._pack(rows)
            assert batch.values is not None
            token_rewards = critic_token_rewards(batch, self.algorithm)
            _, returns = gae_advantages(
                token_rewards, batch.values, batch.mask, self.algorithm.gamma, self.algorithm.lam
            )
            total = batch.mask.sum()
            metrics: dict[str, float] = {
                "rows": float(batch.size),
                "tokens": float(total.item()),
                "return_mean": masked_mean(returns, batch.mask).item(),
                "value_mean": masked_mean(batch.values, batch.mask).item(),
                "explained_variance": _explained_variance(batch.values, returns, batch.mask),
            }
            if total.item() == 0:
                return False, metrics
            applied = True
            for epoch in range(self.epochs):
                self.optimizer.zero_grad(set_to_none=True)
                sums = {"value_loss": 0.0, "value_clip_frac": 0.0}
                problem = None
                for start in range(0, batch.size, self.micro_batch_size):
                    mb = batch.select(start, min(start + self.micro_batch_size, batch.size))
                    weight = mb.mask.sum() / total
                    if weight.item() == 0:
                        continue
                    width = mb.mask.shape[1]
                    loss, mb_metrics = clipped_value_loss(
                        value_forward(self.model, mb),
                        mb.values,
                        returns[start : start + mb.size, :width],
                        mb.mask,
                        self.value_clip,
                    )
                    if not math.isfinite(loss.item()):
                        problem = f"non-finite value loss ({loss.item()})"
                        break
                    (loss * weight).backward()
                    sums["value_loss"] += weight.item() * loss.item()
                    sums["value_clip_frac"] += weight.item() * mb_metrics["value_clip_frac"].item()
                if problem is None:
                    grads = [p.grad for p in self._params if p.grad is not None]
                    norm = torch.nn.utils.get_total_norm(grads)
                    if math.isfinite(norm.item()):
                        torch.nn.utils.clip_grads_with_norm_(self._params, self.grad_clip, norm)
                        self.optimizer.step()
                        metrics["value_grad_norm"] = norm.item()
                    else:
                        problem = f"non-finite value grad norm ({norm.item()})"
                self.optimizer.zero_grad(set_to_none=True)
                if epoch == 0:  # the loss of the values that were handed out
                    metrics.update(sums)
                if problem is not None:
                    metrics["skipped_reason"] = problem  # type: ignore[assignment]
                    applied = False
                    break
            if applied:
                self.updates += 1
            else:
                self.skipped += 1
            metrics["updates"] = float(self.updates)
            metrics["update_time_s"] = time.perf_counter() - started
            return applied, metrics

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Write weights, optimiser state and the update count atomically to ``directory``."""

        def write(tmp: Path) -> None:
            self.model.save_pretrained(tmp)
            torch.save({"optimizer": self.optimizer.state_dict()}, tmp / CRITIC_STATE)
            (tmp / CRITIC_META).write_text(
                json.dumps({"format": _FORMAT, "updates": self.updates, "skipped": self.skipped})
            )

        with self._lock:
            return ckpt.write_atomically(directory, write)

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""
        path = Path(directory)
        meta = json.loads((path / CRITIC_META).read_text())
        if meta.get("format") != _FORMAT:
            raise ValueError(f"unsupported critic checkpoint format {meta.get('format')!r}")
        state = torch.load(path / CRITIC_STATE, map_location="cpu", weights_only=True)
        weights = load_file(str(path / VALUE_FILE))
        with self._lock:
            self.model.load_state_dict(weights)
            self.optimizer.load_state_dict(state["optimizer"])
            self.updates = int(meta["updates"])
            self.skipped = int(meta.get("skipped", 0))


def _explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over counted tokens (1 is perfect, 0 no better than a constant)."""
    var_r = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    diff = returns - values
    var_d = masked_mean((diff - masked_mean(diff, mask)) ** 2, mask)
    if var_r.item() <= 1e-12:
        return float("nan")
    return (1 - var_d / var_r).item()
