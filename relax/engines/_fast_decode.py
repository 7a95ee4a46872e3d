"""A decode step for plain dense decoders (Llama, Qwen2, Qwen3) without the per-call
machinery of a Hugging Face forward pass.

One decode step of a small model is bound by that machinery, not by its matrix multiplies: the
mask built from the attention mask at every call, the cache object, the output dataclasses,
the hooks and wrappers of every module (a 2-layer, 256-wide Qwen2 decoding 16 rows on one CPU
thread, a prefill and 32 steps, the model's passes alone: 81 ms through ``model(...)``, 56 ms
here; a whole rollout call, sampling included: ``bench/fast_decode.py``). This runs the same
arithmetic op for op — the model's own norm and rotary modules, its ``apply_rotary_pos_emb``,
the same projections, and attention called as ``sdpa_attention_forward`` calls it (a mask and
repeated KV heads when a row is padded, no mask and grouped heads when none is) — so the
logits are those of ``model(...)`` bit for bit (tested per architecture, with padding,
through weight swaps and compaction). The prefill still goes through ``model(...)``; its
cache is copied into buffers that grow in steps, and the weights are read from the modules at
each step, so an update copied into them between two tokens is used at the next.

Anything else — another architecture or a subclass, LoRA layers, sliding windows, an
attention implementation other than ``sdpa``, MoE, media — keeps the Hugging Face path:
``fast_decoder`` returns ``None`` for it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

# Exactly these classes (not subclasses, which may change the forward pass).
_SUPPORTED = {
    ("transformers.models.llama.modeling_llama", "LlamaForCausalLM"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2ForCausalLM"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3ForCausalLM"),
}


def fast_decoder(model: torch.nn.Module) -> FastDecoder | None:
    """A ``FastDecoder`` for ``model``, or ``None`` when it must decode through ``model(...)``."""
    kind = (type(model).__module__, type(model).__name__)
    if kind not in _SUPPORTED:
        return None
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return None
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return None  # sliding windows
    if getattr(config, "pretraining_tp", 1) != 1:
        return None
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        linears += (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(type(m) is not torch.nn.Linear for m in linears):
            return None  # LoRA (peft) layers, quantised layers: their own forward
        if getattr(attn, "sliding_window", None) is not None:
            return None
    if type(model.lm_head) is not torch.nn.Linear:
        return None
    return FastDecoder(model)


class FastDecoder:
    """Decode steps of one dense decoder; ``start`` one batch, then ``step`` token by token."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.rotate = sys.modules[type(model).__module__].apply_rotary_pos_emb
        attn = model.model.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.groups = attn.num_key_value_groups
        self.scaling = attn.scaling
        self.qk_norm = hasattr(attn, "q_norm")

    def start(self, cache: Any, attention: torch.Tensor, new_tokens: int) -> FastCache | None:
        """The decode state after a prefill: ``cache`` is the prefill's ``DynamicCache``,
        ``attention`` its ``[rows, width]`` mask, ``new_tokens`` how many steps may follow.

        ``None`` while a forward hook is registered on a module these steps do not call (the
        model, a layer, a projection, the head): whoever registered it expects to see, or
        change, every pass, so the batch decodes through ``model(...)``."""
        if _hooked(self._bypassed()):
            return None
        return FastCache(cache, attention, new_tokens)

    def _bypassed(self) -> list[torch.nn.Module]:
        model, inner = self.model, self.model.model
        modules = [model, inner, model.lm_head]
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            modules += [layer, attn, mlp, attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
            modules += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        return modules

    @torch.inference_mode()
    def step(
        self, state: FastCache, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of one token per row (``input_ids [rows, 1]`` at
        ``positions [rows, 1]``), its keys and values appended to ``state``."""
        model, inner = self.model, self.model.model
        rows = input_ids.shape[0]
        hidden = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(hidden, positions)
        at = state.append()
        mask = state.mask()
        for index, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            shape = (rows, 1, -1, self.head_dim)
            query = F.linear(hidden, attn.q_proj.weight, attn.q_proj.bias).view(shape)
            key = F.linear(hidden, attn.k_proj.weight, attn.k_proj.bias).view(shape)
            value = F.linear(hidden, attn.v_proj.weight, attn.v_proj.bias).view(shape)
            if self.qk_norm:
                query, key = attn.q_norm(query), attn.k_norm(key)
            query, key = self.rotate(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
            keys, values = state.write(index, at, key, value.transpose(1, 2))
            out = self._attention(query, keys, values, mask)
            out = out.transpose(1, 2).reshape(rows, 1, -1).contiguous()
            hidden = residual + F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
            residual = hidden
            hidden = layer.post_attention_layernorm(hidden)
            gate = F.linear(hidden, mlp.gate_proj.weight, mlp.gate_proj.bias)
            up = F.linear(hidden, mlp.up_proj.weight, mlp.up_proj.bias)
            down = F.linear(mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
            hidden = residual + down
        hidden = inner.norm(hidden)
        return F.linear(hidden[:, -1, :], model.lm_head.weight, model.lm_head.bias)

    def _attention(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        # As transformers' sdpa_attention_forward does it for one query token: with a mask the
        # KV heads are repeated, without one sdpa groups them itself.
        extra: dict[str, Any] = {}
        if self.groups > 1:
            if mask is None and keys.shape[-1] <= 256:
                extra["enable_gqa"] = True
            else:
                keys = _repeat_kv(keys, self.groups)
                values = _repeat_kv(values, self.groups)
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, dropout_p=0.0, scale=self.scaling, **extra
        )


def _hooked(modules: list[torch.nn.Module]) -> bool:
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def _repeat_kv(states: torch.Tensor, times: int) -> torch.Tensor:
    batch, heads, length, dim = states.shape
    expanded = states[:, :, None, :, :].expand(batch, heads, times, length, dim)
    return expanded.reshape(batch, heads * times, length, dim)


class FastCache:
    """Keys and values of every layer in buffers that grow in steps (not to the whole
    decode at once: most rows may stop long before ``max_new_tokens``), and the padding mask;
    rows leave it together (``batch_select_indices``, as a ``DynamicCache``)."""

    GROWTH = 64  # tokens of room added at least, each time the buffers fill

    def __init__(self, cache: Any, attention: torch.Tensor, new_tokens: int) -> None:
        layers = cache.layers
        first = layers[0].keys
        rows, heads, width, dim = first.shape
        self.limit = width + new_tokens
        self.keys = first.new_empty((len(layers), rows, heads, width, dim))
        self.values = first.new_empty((len(layers), rows, heads, width, dim))
        for index, layer in enumerate(layers):
            self.keys[index] = layer.keys
            self.values[index] = layer.values
        self.length = width
        # Padding only ever comes from the prompts' left padding: rows without any need no
        # mask, as transformers then passes none.
        self.padded = not bool(attention.all())
        self.allowed = attention.bool()[:, None, None, :]

    def append(self) -> int:
        """Room for the next token; returns its index."""
        at = self.length
        if at == self.keys.shape[3]:
            self._grow(min(self.limit, at + max(self.GROWTH, at // 2)))
        self.length += 1
        return at

    def _grow(self, capacity: int) -> None:
        def wider(buffer: torch.Tensor, fill: Any) -> torch.Tensor:
            shape = (*buffer.shape[:3], capacity - buffer.shape[3], *buffer.shape[4:])
            return torch.cat([buffer, buffer.new_full(shape, fill)], 3)

        self.keys, self.values = wider(self.keys, 0), wider(self.values, 0)
        self.allowed = wider(self.allowed, True)

    def mask(self) -> torch.Tensor | None:
        return self.allowed[..., : self.length] if self.padded else None

    def write(
        self, layer: int, at: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[layer, :, :, at : at + 1] = key
        self.values[layer, :, :, at : at + 1] = value
        return self.keys[layer, :, :, : self.length], self.values[layer, :, :, : self.length]

    def batch_select_indices(self, keep: torch.Tensor) -> None:
        self.keys = self.keys[:, keep]
        self.values = self.values[:, keep]
        self.allowed = self.allowed[keep]
