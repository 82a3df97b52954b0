"""Fused decoder layers: each decoder layer's small operations compiled into a few kernels for decode-time forwards.

A decode-time forward (one token, a verification tree, a draft level) of a large target launches many small kernels
around its products: norms, the rotary embedding, residual adds, SiLU times the up projection, casts. `fuse` gives the
supported families' decoder layers (Llama, Mistral, Qwen2, Qwen3, with a SiLU-gated MLP) a forward that runs their
math as two pure functions of tensors, weights and constants, each compiled once and shared by every layer of every
model: what comes before attention (input norm, q/k/v projections, Qwen3's per-head norms, rotary embedding) and what
comes after it (output projection, residual add, post-attention norm, SwiGLU MLP, residual add). No layer's index or
module is in a compiled graph, so all layers run the same graph: one for a single row, one for any number of rows
from 2 to FUSED_ROWS (the row dimension is marked dynamic), per model shape and dtype. Between the two, the KV cache's
update and the attention function the model is set to run as the family runs them, and hooks on a layer still fire.
A forward of more than FUSED_ROWS rows (a long prefill block), training and any forward that records gradients
run the family's own forward. A layer of another class stays as it is.
The compiled code makes no CUDA graphs of its own, so a fused forward can be captured whole (steps.py), and rounds
half-precision results where eager code does, so a bf16 layer gives the family's numbers.
Knows the families' decoder-layer math and torch.compile; knows nothing of the engine, attention plans, the cache's
layout or which device should fuse (models.prepare decides).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .cache import rotate_half

FUSED_ROWS = 256  # compiled code serves forwards of up to this many rows (decode-time); more take the eager path
LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")  # one layer formula
BACKEND = "inductor"  # generated kernels (Triton on CUDA); "aot_eager" traces the same graph and runs it op by op
# graphs each function may keep, two per model shape and dtype (one row; more rows): torch's default of 8 would be
# spent by a target and a draft in two dtypes. Past it a new shape runs its ops one by one (a warning says so)
GRAPHS = 64

Norm = tuple[torch.Tensor, float]  # (weight (H,), eps)
Linear = tuple[torch.Tensor, torch.Tensor | None]  # (weight (out, in), bias (out,) or None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The supported families' RMSNorm, as they write it: fp32 inside, weight times the result cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def before_attention(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: Norm, q: Linear, k: Linear,
                     v: Linear, head_norms: tuple[Norm, Norm] | None, head_dim: int):
    """hidden (B, T, H), cos and sin (B, T, D) -> input norm, q/k/v projections, per-head norms of queries and keys
    (Qwen3), rotary embedding: query (B, H_q, T, D), key and value (B, H_kv, T, D)."""
    x = rms_norm(hidden, *norm)
    heads = (*hidden.shape[:-1], -1, head_dim)
    query, key = F.linear(x, *q).view(heads), F.linear(x, *k).view(heads)  # (B, T, H_q, D), (B, T, H_kv, D)
    if head_norms is not None:
        query, key = rms_norm(query, *head_norms[0]), rms_norm(key, *head_norms[1])
    query, key = query.transpose(1, 2), key.transpose(1, 2)
    value = F.linear(x, *v).view(heads).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D)
    return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin, value


def after_attention(hidden: torch.Tensor, attended: torch.Tensor, o: Linear, norm: Norm, gate: Linear, up: Linear,
                    down: Linear) -> torch.Tensor:
    """hidden (B, T, H), attended (B, T, H_q * D) -> output projection, residual add, post-attention norm, SwiGLU MLP,
    residual add: (B, T, H)."""
    hidden = hidden + F.linear(attended, *o)
    x = rms_norm(hidden, *norm)
    return hidden + F.linear(F.silu(F.linear(x, *gate)) * F.linear(x, *up), *down)


class Compiled(NamedTuple):
    before: Callable
    after: Callable


_COMPILED: dict[str, Compiled] = {}  # backend -> the pair every fused layer runs


def compiled(backend: str) -> Compiled:
    """The two functions compiled with `backend` (created once; each compiles on its first call per shape)."""
    if backend not in _COMPILED:
        # Inductor rounds half-precision results where eager does (it would keep fused intermediates in fp32)
        options = {"emulate_precision_casts": True} if backend == "inductor" else None
        _COMPILED[backend] = Compiled(*(torch.compile(fn, backend=backend, dynamic=False, recompile_limit=GRAPHS,
                                                      options=options) for fn in (before_attention, after_attention)))
    return _COMPILED[backend]


def rows_vary(*tensors: torch.Tensor) -> None:
    """Mark the token dimension (1) of (B, T, ...) tensors dynamic where it holds more rows than one, so one graph
    serves every padded verification and draft size; a single row keeps a graph of its own."""
    for t in tensors:
        if t.shape[1] > 1:
            torch._dynamo.mark_dynamic(t, 1)


def norm_of(module: nn.Module) -> Norm:
    return module.weight, module.variance_epsilon


def linear_of(module: nn.Linear) -> Linear:
    return module.weight, module.bias


class FusedLayer(nn.Module):
    """A supported family's decoder layer whose decode-time forwards run the compiled pair around attention. `fuse`
    makes one subclass per family class, which it names `family`."""

    family: type
    fusion_backend: str

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):
        attn, mlp = self.self_attn, self.mlp
        implementation = attn.config._attn_implementation
        if (torch.is_grad_enabled() or self.training or hidden_states.shape[:-1].numel() > FUSED_ROWS
                or implementation not in ALL_ATTENTION_FUNCTIONS):
            return super().forward(hidden_states, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                                   use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        fused = compiled(self.fusion_backend)
        cos, sin = position_embeddings
        rows_vary(hidden_states, cos, sin)
        head_norms = (norm_of(attn.q_norm), norm_of(attn.k_norm)) if hasattr(attn, "q_norm") else None
        query, key, value = fused.before(hidden_states, cos, sin, norm_of(self.input_layernorm), linear_of(attn.q_proj),
                                         linear_of(attn.k_proj), linear_of(attn.v_proj), head_norms, attn.head_dim)
        kwargs.update(position_ids=position_ids, use_cache=use_cache)  # what the family's attention hands on
        if cache is not None:
            key, value = cache.update(key, value, attn.layer_idx, kwargs=kwargs)
        # Qwen2 and Qwen3 pass their layer's window, Mistral its config's; Llama none, which every interface reads as None
        window = getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None))
        attended, _ = ALL_ATTENTION_FUNCTIONS[implementation](attn, query, key, value, attention_mask, dropout=0.0,
                                                              scaling=attn.scaling, sliding_window=window, **kwargs)
        # (B, T, H_q, D) -> (B, T, H_q * D): one layout, as the family's reshape gives (a single row's may come strided)
        attended = attended.reshape(*hidden_states.shape[:-1], -1)
        rows_vary(attended)
        return fused.after(hidden_states, attended, linear_of(attn.o_proj), norm_of(self.post_attention_layernorm),
                           linear_of(mlp.gate_proj), linear_of(mlp.up_proj), linear_of(mlp.down_proj))


_FUSED_CLASSES: dict[type, type] = {}  # a family's decoder layer class -> its FusedLayer subclass


def fusable(module: nn.Module) -> bool:
    """Whether `module` is a supported family's decoder layer (by class name, as models.NORMS) with a SiLU-gated MLP."""
    return type(module).__name__ in LAYERS and isinstance(module.mlp.act_fn, (SiLUActivation, nn.SiLU))


def fuse(model: nn.Module, backend: str = BACKEND) -> int:
    """Give every supported decoder layer of `model` the fused forward, compiled with `backend` on its first
    decode-time forward; returns how many layers are fused. Fusing again only sets the backend."""
    count = 0
    for module in model.modules():
        if not isinstance(module, FusedLayer):
            if not fusable(module):
                continue
            family = type(module)
            if family not in _FUSED_CLASSES:
                _FUSED_CLASSES[family] = type(f"Fused{family.__name__}", (FusedLayer, family), {"family": family})
            module.__class__ = _FUSED_CLASSES[family]
        module.fusion_backend = backend
        count += 1
    return count


def unfuse(model: nn.Module) -> int:
    """Give `model`'s fused layers their family's forward back; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, FusedLayer):
            module.__class__ = module.family
            del module.fusion_backend
            count += 1
    return count
