"""Mixture-of-experts routing: recording the experts a forward pass chose, and replaying
recorded ones (R3, Rollout Routing Replay; Ma et al. 2025).

RL on an MoE model drifts when the trainer's routers pick other experts than the inference
engine's did for the same tokens. R3 records, at generation time, the top-k expert ids of
every token at every MoE layer, and makes the trainer's forward use them: the gate weights
are recomputed from the trainer's own router logits restricted to the recorded experts (a
softmax over all experts, gathered at the recorded ids, renormalised where the model does),
so gradients still reach the router.

Transformers' MoE layers (Qwen2-MoE, Qwen3-MoE, OLMoE, ...) route through a ``*TopKRouter``
module returning ``(router_logits, scores, indices)``; both directions are forward hooks on
those modules (``router_layers``), so any backend that runs the module (plain torch, DeepSpeed
ZeRO) records and replays alike.

Layout: ``routed_experts`` of one sample is ``[tokens, layers, top_k]`` (prompt and response
tokens; a compact integer dtype, ``expert_dtype``); a token whose routing was not recorded
(the last one: a sampled token is never fed back through the model) holds ``num_experts``,
which no expert has, and the trainer routes it itself.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from relax.errors import ConfigError, ConfigIssue


@dataclass(frozen=True)
class MoeShape:
    """What a model's routing records look like."""

    layers: int
    """MoE layers, in forward order (dense layers in between are not counted)."""
    top_k: int
    num_experts: int

    @property
    def unrecorded(self) -> int:
        """The id of a token whose routing was not recorded."""
        return self.num_experts

    @property
    def dtype(self) -> torch.dtype:
        return expert_dtype(self.num_experts)


def expert_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds every expert id and the "unrecorded" marker."""
    return torch.uint8 if num_experts < 255 else torch.int16


_ROUTERS: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Module]] = (
    weakref.WeakKeyDictionary()
)


def router_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers (``*TopKRouter`` modules), in forward order; ``[]`` for a dense
    model. Found once per model (every training forward asks)."""
    found = _ROUTERS.get(model)
    if found is None:
        found = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        _ROUTERS[model] = found
    return found


def moe_shape(model: torch.nn.Module) -> MoeShape | None:
    """The routing layout of ``model`` (``None``: not a mixture of experts)."""
    routers = router_layers(model)
    if not routers:
        return None
    first = routers[0]
    return MoeShape(layers=len(routers), top_k=int(first.top_k), num_experts=int(first.num_experts))


def check_replayable(model: torch.nn.Module, key: str = "trainer.routing_replay") -> MoeShape:
    """The model's routing layout, or a ``ConfigError`` naming ``key`` when R3 cannot run
    on it (no routers, or routers without the attributes replay needs)."""
    routers = router_layers(model)
    if not routers:
        raise ConfigError(
            [ConfigIssue(key, f"{type(model).__name__} has no mixture-of-experts routers")]
        )
    for router in routers:
        missing = [a for a in ("top_k", "num_experts", "norm_topk_prob") if not hasattr(router, a)]
        if missing:
            raise ConfigError(
                [ConfigIssue(key, f"{type(router).__name__} has no {', '.join(missing)}")]
            )
    shape = moe_shape(model)
    assert shape is not None
    return shape


class RoutingRecorder:
    """While entered, keeps each router call's chosen expert ids (``calls[layer]``: one
    ``[tokens, top_k]`` tensor per forward pass, in order)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = router_layers(model)
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._handles: list[Any] = []

    def __enter__(self) -> RoutingRecorder:
        for layer, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int) -> Any:
        def keep(module: torch.nn.Module, args: Any, output: Any) -> None:
            self.calls[layer].append(output[2].detach())

        return keep

    def pass_ids(self, index: int) -> torch.Tensor:
        """Forward pass ``index``'s ids: ``[layers, tokens, top_k]``."""
        return torch.stack([calls[index] for calls in self.calls])


@dataclass
class ReplayStats:
    """What the forward passes of a ``routing`` context saw: tokens with recorded routing,
    how many of those the model's own routers would have sent elsewhere (another top-k set),
    summed over layers, and the load-balancing loss when asked for."""

    tokens: int = 0
    disagreed: int = 0
    per_layer: list[int] = field(default_factory=list)
    aux_terms: list[torch.Tensor] = field(default_factory=list)

    @property
    def disagreement(self) -> float:
        return self.disagreed / self.tokens if self.tokens else 0.0

    @property
    def aux_loss(self) -> torch.Tensor | None:
        """The load-balancing loss (Switch Transformer's, as transformers computes it):
        ``num_experts * sum_e(tokens_e * prob_e)`` over every MoE layer's non-padding tokens,
        ``tokens_e`` the fraction routed to expert ``e`` (per top-k slot), ``prob_e`` its mean
        router probability; averaged over the forward passes. Carries gradient to the
        routers."""
        if not self.aux_terms:
            return None
        return torch.stack(self.aux_terms).mean()


@contextlib.contextmanager
def routing(
    model: torch.nn.Module,
    routed: torch.Tensor | None = None,
    *,
    replay: bool = True,
    token_mask: torch.Tensor | None = None,
    aux_loss: bool = False,
) -> Iterator[ReplayStats]:
    """Within this context, forward passes of ``model`` over one ``[batch, seq]`` batch:

    - route by ``routed`` (``[batch, seq, layers, top_k]``, aligned with the batch's
      ``input_ids``; ``num_experts`` where not recorded: those tokens route themselves) when
      ``replay``; count the disagreement of the model's own routing with it either way;
    - with ``aux_loss``, compute the load-balancing loss (``ReplayStats.aux_loss``) over the
      tokens ``token_mask`` (``[batch, seq]``, the attention mask) keeps.

    A dense model, or no records and no aux loss: nothing happens.
    """
    stats = ReplayStats()
    routers = router_layers(model)
    if not routers or (routed is None and not aux_loss):
        yield stats
        return
    if routed is not None and (routed.dim() != 4 or routed.shape[2] != len(routers)):
        raise ValueError(
            f"routed experts of shape {list(routed.shape)} do not fit a model of"
            f" {len(routers)} MoE layers ([batch, seq, layers, top_k])"
        )
    stats.per_layer = [0] * len(routers)
    layers: list[tuple[torch.Tensor, torch.Tensor]] = []  # (logits, chosen) of this pass
    keep = None if token_mask is None else token_mask.reshape(-1) > 0

    def done_pass() -> None:
        if aux_loss and layers:
            stats.aux_terms.append(_load_balancing(layers, keep))
        layers.clear()

    handles = [
        router.register_forward_hook(
            _routing_hook(layer, len(routers), routed, stats, replay, layers, done_pass, aux_loss)
        )
        for layer, router in enumerate(routers)
    ]
    try:
        yield stats
    finally:
        for handle in handles:
            handle.remove()


def _routing_hook(
    layer: int,
    count: int,
    routed: torch.Tensor | None,
    stats: ReplayStats,
    replay: bool,
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    done_pass: Any,
    aux_loss: bool,
) -> Any:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
        logits, _scores, own = output
        chosen, new = own, None
        if routed is not None:
            recorded = routed[:, :, layer, :].reshape(-1, routed.shape[-1])
            recorded = recorded.to(own.device, torch.long)
            if recorded.shape != own.shape:
                raise ValueError(
                    f"routed experts cover {recorded.shape[0]} tokens, the forward pass has"
                    f" {own.shape[0]}: replay needs the whole batch in one pass"
                )
            known = (recorded < module.num_experts).all(-1)  # tokens whose routing was recorded
            with torch.no_grad():
                differ = (own.sort(-1).values != recorded.sort(-1).values).any(-1) & known
                count_known, moved = int(known.sum()), int(differ.sum())
            stats.tokens += count_known
            stats.disagreed += moved
            stats.per_layer[layer] += moved
            if replay:
                chosen = torch.where(known[:, None], recorded, own)
                # The gate weights from the trainer's own logits, at the recorded experts:
                # the router still gets gradients (R3), unrecorded tokens keep their own.
                probs = F.softmax(logits, dim=-1, dtype=torch.float)
                weights = probs.gather(-1, chosen)
                if module.norm_topk_prob:
                    weights = weights / weights.sum(dim=-1, keepdim=True)
                new = (logits, weights.to(logits.dtype), chosen)
        if aux_loss:
            layers.append((logits, chosen))
        if layer == count - 1:
            done_pass()
        return new

    return hook


def _load_balancing(
    layers: list[tuple[torch.Tensor, torch.Tensor]], keep: torch.Tensor | None
) -> torch.Tensor:
    logits = torch.cat([lg for lg, _ in layers])
    chosen = torch.cat([ch for _, ch in layers])
    experts = logits.shape[-1]
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    hits = F.one_hot(chosen, experts).float()  # [tokens, top_k, experts]
    if keep is not None:
        weight = keep.to(probs.device).float().repeat(len(layers))
        total = weight.sum().clamp(min=1.0)
        tokens_per_expert = (hits * weight[:, None, None]).sum(0) / total
        prob_per_expert = (probs * weight[:, None]).sum(0) / total
    else:
        tokens_per_expert = hits.mean(0)
        prob_per_expert = probs.mean(0)
    return (tokens_per_expert * prob_per_expert[None, :]).sum() * experts


__all__ = [
    "MoeShape",
    "ReplayStats",
    "RoutingRecorder",
    "check_replayable",
    "expert_dtype",
    "moe_shape",
    "router_layers",
    "routing",
]
