"""Attention kernels: the only module that hooks into the models' attention.

Registered with transformers as the attention implementation "specextend". Each forward gets an
`AttentionPlan` through the model's keyword arguments and does one of:

- prefill: causal attention of new tokens over the cache (optionally a sliding window), with a fused
  kernel (SDPA; flash-attn on CUDA when installed) or eager matmul + softmax (the paper's baseline);
- tree: new tokens (a chain or tree) over the committed prefix plus a tree region with a boolean mask,
  either as Hybrid Tree Attention (prefix through a fused kernel that returns each row's log-sum-exp,
  tree part in plain PyTorch, merged exactly by the two log-sum-exps) or as SDPA with a full boolean
  mask (what transformers does).

It also keeps the queries of the layers retrieval scores from (signal.py), only when retrieval needs them. Grouped-query attention is handled by folding query heads onto
their KV head (no repeated KV) wherever all queries see the same keys.
Knows tensors and kernels; knows nothing of drafting, verification or retrieval policy.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

IMPLEMENTATION = "specextend"
FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def use_flash_attn(x: torch.Tensor) -> bool:
    """flash-attn runs on CUDA in half precision only."""
    return FLASH_ATTN and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


@dataclass
class QueryCapture:
    """Holds the queries of some layers from the latest forward: {layer: (B, H_q, T_q, D)}."""

    layers: frozenset[int]
    queries: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class AttentionPlan:
    """What every attention layer of one forward must do."""

    kind: str  # "prefill" or "tree"
    kernel: str  # prefill: "fused" | "eager"; tree: "hybrid" | "masked"
    window: int | None = None  # prefill: sliding window (keys at distance < window)
    tree_mask: torch.Tensor | None = None  # tree: (T_q, tail) bool, visibility of the last `tail` keys
    capture: QueryCapture | None = field(default=None, compare=False)


# ---------------------------------------------------------------- pure kernels (B, H, T, D) layout


def fold_heads(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H_q, T, D) -> (B, H_kv, G*T, D): each KV head's query heads stacked along T."""
    b, hq, t, d = query.shape
    return query.reshape(b, kv_heads, (hq // kv_heads) * t, d)


def unfold_heads(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    """Inverse of fold_heads for outputs (B, H_kv, G*T, D) -> (B, H_q, T, D) and LSEs (B, H_kv, G*T)."""
    b = x.shape[0]
    if x.dim() == 3:
        return x.reshape(b, q_heads, -1)
    return x.reshape(b, q_heads, -1, x.shape[-1])


def math_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention returning (output, log-sum-exp), fp32 inside. query (B,H_q,T_q,D), key (B,H_kv,T_k,D),
    mask (T_q, T_k) bool or None. Every row must see at least one key."""
    q_heads, kv_heads = query.shape[1], key.shape[1]
    q = fold_heads(query.float(), kv_heads)  # (B, H_kv, G*T_q, D)
    logits = torch.matmul(q, key.float().transpose(-1, -2)) * scale  # (B, H_kv, G*T_q, T_k)
    if mask is not None:
        groups = q_heads // kv_heads
        logits = logits.masked_fill(~mask.repeat(groups, 1), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # (B, H_kv, G*T_q)
    out = torch.matmul(torch.exp(logits - lse[..., None]), value.float())  # (B, H_kv, G*T_q, D)
    return unfold_heads(out, q_heads).to(query.dtype), unfold_heads(lse, q_heads)


def fused_attention_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of every query over every key through a fused kernel: (output, LSE (B,H_q,T_q))."""
    q_heads, kv_heads = query.shape[1], key.shape[1]
    if use_flash_attn(query):
        from flash_attn import flash_attn_func

        out, lse, _ = flash_attn_func(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
            softmax_scale=scale, causal=False, return_attn_probs=True,
        )  # out (B, T_q, H_q, D), lse (B, H_q, T_q)
        return out.transpose(1, 2), lse.float()
    q = fold_heads(query, kv_heads)  # (B, H_kv, G*T_q, D)
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, key, value, 0.0, False, False, scale=scale)[:2]
    elif query.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q.contiguous(), key.contiguous(), value.contiguous(), None, True, scale=scale
        )[:2]
        lse = lse[..., : q.shape[2]]
    elif query.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, key, value, 0.0, False, attn_mask=None, scale=scale
        )[:2]
    else:
        return math_attention(query, key, value, None, scale)
    return unfold_heads(out, q_heads), unfold_heads(lse.float(), q_heads)


def merge_by_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Exact merge of attention over two disjoint key sets: w = sigmoid(lse_a - lse_b)."""
    w = torch.sigmoid(lse_a - lse_b)[..., None]  # (B, H, T_q, 1)
    return (w * out_a.float() + (1.0 - w) * out_b.float()).to(out_a.dtype)


def hybrid_tree_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tree_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Queries over prefix keys (all visible) + the last `tail` keys under `tree_mask` (T_q, tail)."""
    tail = tree_mask.shape[1]
    prefix = key.shape[2] - tail
    out_t, lse_t = math_attention(query, key[:, :, prefix:], value[:, :, prefix:], tree_mask, scale)
    if prefix == 0:
        return out_t
    out_p, lse_p = fused_attention_with_lse(query, key[:, :, :prefix], value[:, :, :prefix], scale)
    return merge_by_lse(out_p, lse_p, out_t, lse_t)


def full_tree_mask(tree_mask: torch.Tensor, key_len: int) -> torch.Tensor:
    """(T_q, tail) tree mask -> (T_q, key_len): every prefix key visible."""
    prefix = key_len - tree_mask.shape[1]
    ones = torch.ones(tree_mask.shape[0], prefix, dtype=torch.bool, device=tree_mask.device)
    return torch.cat([ones, tree_mask], dim=1)


def causal_window_mask(q_len: int, key_start: int, key_len: int, past: int, window: int | None, device) -> torch.Tensor:
    """(q_len, key_len - key_start) bool: query at past+i sees key j iff j <= past+i and past+i-j < window."""
    q_pos = torch.arange(past, past + q_len, device=device)[:, None]
    k_pos = torch.arange(key_start, key_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= (q_pos - k_pos) < window
    return mask


def prefill_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int | None, kernel: str, scale: float
) -> torch.Tensor:
    """Causal attention of T_q new tokens (the last T_q of the T_k keys), optionally within a sliding window."""
    q_len, key_len = query.shape[2], key.shape[2]
    past = key_len - q_len
    start = 0 if window is None else max(0, past - window + 1)
    key, value = key[:, :, start:], value[:, :, start:]
    if kernel == "eager":
        mask = causal_window_mask(q_len, start, key_len, past, window, query.device)
        return math_attention(query, key, value, mask, scale)[0]
    if use_flash_attn(query):
        from flash_attn import flash_attn_func

        out = flash_attn_func(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), softmax_scale=scale,
            causal=True, window_size=(-1, -1) if window is None else (window - 1, 0),
        )  # (B, T_q, H_q, D); causal aligned to the bottom right, as here
        return out.transpose(1, 2)
    plain_causal = past == 0 and (window is None or window >= q_len)
    mask = None if plain_causal else causal_window_mask(q_len, start, key_len, past, window, query.device)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=plain_causal, scale=scale, enable_gqa=True
    )


# ---------------------------------------------------------------- the hook


def specextend_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention interface: returns ((B, T_q, H_q, D), None)."""
    plan: AttentionPlan | None = kwargs.get("attention_plan")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if plan is None:  # used outside the engine (e.g. transformers' own generate): behave like SDPA
        if attention_mask is None and query.shape[2] not in (1, key.shape[2]):
            attention_mask = causal_window_mask(query.shape[2], 0, key.shape[2], key.shape[2] - query.shape[2], None, query.device)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scale, **kwargs)
    if plan.capture is not None and module.layer_idx in plan.capture.layers:
        plan.capture.queries[module.layer_idx] = query
    if plan.kind == "prefill":
        out = prefill_attention(query, key, value, plan.window, plan.kernel, scale)
    elif query.shape[2] == 1:  # one new token sees every key: a single unmasked fused call
        out = F.scaled_dot_product_attention(query, key, value, scale=scale, enable_gqa=True)
    elif plan.kernel == "hybrid":
        out = hybrid_tree_attention(query, key, value, plan.tree_mask, scale)
    else:
        mask = full_tree_mask(plan.tree_mask, key.shape[2])
        return sdpa_attention_forward(module, query, key, value, mask[None, None], dropout=0.0, scaling=scale)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(IMPLEMENTATION, specextend_attention)
