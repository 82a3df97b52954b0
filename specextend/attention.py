"""Attention kernels: the only module that hooks into the models' attention.

Registered with transformers as the attention implementation "specextend". Each forward gets an
`AttentionPlan` through the model's keyword arguments and does one of:

- prefill: causal attention of new tokens over the cache (optionally a sliding window), with a fused
  kernel (SDPA; flash-attn on CUDA when installed) or eager matmul + softmax (the paper's baseline). A
  block after the first is causal aligned to the bottom right, which fused CUDA kernels take as is;
- tree: new tokens (a chain or tree) over the committed prefix plus a tree region with a boolean mask, as
  Hybrid Tree Attention ("hybrid": prefix through a fused kernel that returns each row's log-sum-exp, tree
  part in plain PyTorch, merged exactly by the log-sum-exps), one fused call over every key under the
  tree mask ("onecall"), SDPA with a full mask and repeated KV heads ("masked", what transformers does),
  or the fastest of these for the device, shapes and length, timed on first use ("auto");
- static: a fixed number of new tokens over a fixed key bucket under a precomputed mask (steps.py), as one
  fused call over key splits merged by their log-sum-exps (flash-decoding), so it can be captured.

It also keeps the queries of the layers retrieval scores from (signal.py), only when retrieval needs them (the
residual streams a feature drafter reads are kept by hooks in target.py, into the same `Capture`).
Grouped-query attention is handled by folding query heads onto their KV head (no repeated KV) wherever all
queries see the same keys.
Knows tensors and kernels; knows nothing of drafting, verification or retrieval policy.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import cpu_kernels

IMPLEMENTATION = "specextend"
TRITON = importlib.util.find_spec("triton") is not None
log = logging.getLogger(__name__)
FLASH_MIN_CAPABILITY = (8, 0)  # flash-attn 2 runs on Ampere and newer
_flash: list = []  # [flash_attn_func or None] once the first CUDA half-precision call has tried to import it


def flash_attn_func():
    """flash-attn's attention function, or None where it is absent or broken (built for another torch, an
    unsupported GPU): imported once, on first use; a failure is logged once and the fused PyTorch kernels serve."""
    if not _flash:
        func = None
        if importlib.util.find_spec("flash_attn") is not None:
            try:
                from flash_attn import flash_attn_func as func
            except (ImportError, OSError, RuntimeError) as exc:
                log.warning("flash-attn is installed but cannot be used (%s); using PyTorch's fused kernels", exc)
            if func is not None and torch.cuda.is_available() and torch.cuda.get_device_capability() < FLASH_MIN_CAPABILITY:
                log.warning("flash-attn needs an Ampere or newer GPU (compute capability 8.0); this one is %s.%s: using "
                            "PyTorch's fused kernels", *torch.cuda.get_device_capability())
                func = None
        _flash.append(func)
    return _flash[0]


def compiled_on_cuda(fn):
    """`fn`, compiled into fused kernels on its first call with CUDA tensors where Triton is present; as written
    elsewhere. For small elementwise chains that decode-time forwards call once per layer."""
    compiled = None

    def call(x: torch.Tensor, *args):
        nonlocal compiled
        if not (TRITON and x.is_cuda):
            return fn(x, *args)
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(x, *args)

    return call


def use_flash_attn(x: torch.Tensor) -> bool:
    """flash-attn runs on CUDA in half precision only, where it imports."""
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and flash_attn_func() is not None


@dataclass
class Capture:
    """What the latest forward left for the engine: the queries of some layers {layer: (B, H_q, T_q, D)} (retrieval)
    and some residual streams {stream: (B, T, H)} (a feature drafter; target.py fills them)."""

    layers: frozenset[int]
    streams: frozenset[int] = frozenset()
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def key(self) -> tuple[frozenset[int], frozenset[int]]:
        """What a forward keeps: a captured step serves only forwards that keep the same."""
        return self.layers, self.streams


@dataclass(frozen=True)
class AttentionPlan:
    """What every attention layer of one forward must do."""

    kind: str  # "prefill", "tree" or "static"
    kernel: str  # prefill: "fused" | "eager"; tree: "hybrid" | "onecall" | "masked" | "auto"; static: "split"
    window: int | None = None  # prefill: sliding window (keys at distance < window)
    tree_mask: torch.Tensor | None = None  # tree: (T_q, tail) bool, visibility of the last `tail` keys
    capture: Capture | None = field(default=None, compare=False)
    keys: KeySplits | None = field(default=None, compare=False)  # static: the mask over the key bucket, split


def placed(plan: AttentionPlan, device: torch.device) -> AttentionPlan:
    """`plan` with its tree mask on `device` (the model's: the masks are built on the host)."""
    if plan.tree_mask is None or plan.tree_mask.device == device:
        return plan
    return replace(plan, tree_mask=plan.tree_mask.to(device))


@dataclass(frozen=True)
class KeySplits:
    """A boolean mask (T_q, T_k) made ready for `split_attention`: folded over G query heads per KV head and cut
    into S equal key splits. bias (S, 1, G*T_q, T_k/S): 0 where seen, -inf where hidden; seen (S, 1, G*T_q, 1):
    whether a row sees any key of a split."""

    bias: torch.Tensor
    seen: torch.Tensor

    @classmethod
    def of(cls, mask: torch.Tensor, groups: int, splits: int, dtype: torch.dtype) -> KeySplits:
        rows = mask.repeat(groups, 1)  # (G*T_q, T_k)
        cut = rows.view(rows.shape[0], splits, -1).transpose(0, 1)  # (S, G*T_q, T_k/S)
        bias = torch.zeros(cut.shape, dtype=dtype, device=mask.device).masked_fill_(~cut, float("-inf"))
        return cls(bias[:, None], cut.any(-1)[:, None, :, None])

    def fill_(self, mask: torch.Tensor, groups: int) -> None:
        """Overwrite in place (a captured step reads these buffers) from a new (T_q, T_k) mask."""
        fresh = KeySplits.of(mask, groups, self.bias.shape[0], self.bias.dtype)
        self.bias.copy_(fresh.bias)
        self.seen.copy_(fresh.seen)


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
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over every key through a fused kernel, with an optional additive `bias` (broadcast
    to (B, H_kv, G*T_q, T_k), query heads folded): (output, LSE (B,H_q,T_q)). Every row must see some key."""
    q_heads, kv_heads = query.shape[1], key.shape[1]
    if bias is not None:
        q = fold_heads(query, kv_heads)  # (B, H_kv, G*T_q, D)
        bias = bias.expand(q.shape[0], kv_heads, q.shape[2], key.shape[2])
        if query.is_cuda:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, key, value, bias, True, scale=scale)[:2]
            lse = lse[..., : q.shape[2]]
        elif query.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, key, value, 0.0, False, attn_mask=bias, scale=scale)[:2]
        else:
            logits = torch.matmul(q.float(), key.float().transpose(-1, -2)) * scale + bias.float()
            lse = torch.logsumexp(logits, dim=-1)  # (B, H_kv, G*T_q)
            out = torch.matmul(torch.exp(logits - lse[..., None]), value.float()).to(query.dtype)
        return unfold_heads(out, q_heads), unfold_heads(lse.float(), q_heads)
    if use_flash_attn(query):
        out, lse, _ = flash_attn_func()(
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


_FOLDED: tuple = (None, 0, None)  # the last tree mask folded, its head groups, and what the kernel reads of it


def folded_tail(tree_mask: torch.Tensor, groups: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """`tree_mask` (T_q, tail) as the kernel reads it for `groups` query heads a KV head: hidden (G*T_q, tail) and its
    `tail_order`; made once a forward (every layer hands over the same mask: 14 us a layer, a step's 1.4%)."""
    global _FOLDED
    mask, seen_groups, folded = _FOLDED  # one read: another thread may replace it meanwhile
    if mask is tree_mask and seen_groups == groups:
        return folded
    hidden = ~tree_mask.repeat(groups, 1)
    folded = (hidden, cpu_kernels.tail_order(hidden))
    _FOLDED = (tree_mask, groups, folded)
    return folded


def bf16_cache_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tree_mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """New rows over a bf16 KV cache on the CPU (numerics "bf16-kv"): the committed prefix visible to every row, the
    last `tail` keys under `tree_mask` (T_q, tail); (B, H_q, T_q, D). Two bf16 products (the logits rounded to bf16 by
    the first), the softmax between them in fp32, every key in one pass. A row attends to the tail keys it sees as if
    they sat right after the prefix, in order: a chain's row or a tree node gets the same bits as the autoregressive
    step will once its ancestors are committed, whatever kernel the plan names. Over 7,680 keys (3 KV heads of 64,
    one thread, busy machine) 3 folded rows took 0.25-0.34 ms this way against 0.9-3.0 ms in PyTorch's CPU flash
    kernel (bf16 or fp32) and 6-16 ms in SDPA with grouped heads in bf16; at 51 rows they were even. Where the kernel
    cannot run, each new token is attended alone over its own keys: one masked product over every row's keys summed
    them in other groupings (5 of 200 random chains and trees differed from the row alone)."""
    q_heads, kv_heads = query.shape[1], key.shape[1]
    groups, rows = q_heads // kv_heads, query.shape[2]
    q = fold_heads(query * scale, kv_heads).to(key.dtype)  # (B, H_kv, G*T_q, D)
    if cpu_kernels.supports(q, key, value):
        return unfold_heads(cpu_kernels.bf16_attention(q, key, value, *folded_tail(tree_mask, groups)), q_heads)
    start = key.shape[2] - tree_mask.shape[1]
    order, count = cpu_kernels.tail_order(~tree_mask)  # (T_q, tail), (T_q,)
    out = torch.empty(q.shape, dtype=value.dtype, device=q.device)
    for t in range(rows):  # each new token's G folded rows over the keys it sees, as the autoregressive step's product
        seen = order[t, : count[t]].long()
        # a chain's row sees the cache's first keys (a view of them); a tree node, the prefix and its ancestors
        at = (slice(start + len(seen)) if torch.equal(seen, torch.arange(len(seen)))
              else torch.cat([torch.arange(start), start + seen]))
        folded = t + rows * torch.arange(groups)
        for b in range(q.shape[0]):
            for h in range(kv_heads):  # a KV head's keys are one contiguous block of the cache; a batched product over
                # the cache's strided view copied them first (1.3 ms against 0.34 ms for 3 rows over 7,680 keys)
                logits = torch.mm(q[b, h, folded], key[b, h, at].t())  # (G, T_k)
                out[b, h, folded] = torch.mm(torch.softmax(logits, dim=-1), value[b, h, at])
    return unfold_heads(out, q_heads)


def merge_by_lse(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Exact merge of attention over S disjoint key sets: outs (S, ..., T_q, D), lses (S, ..., T_q) -> (..., T_q, D),
    weighted by softmax over S of the log-sum-exps (for two sets, w = sigmoid(lse_a - lse_b)). A set a row does
    not see has LSE -inf and weight zero."""
    w = torch.softmax(lses.float(), dim=0)[..., None]  # (S, ..., T_q, 1)
    return (w * outs.float().nan_to_num()).sum(0).to(outs.dtype)


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
    return merge_by_lse(torch.stack([out_p, out_t]), torch.stack([lse_p, lse_t]))


def onecall_tree_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tree_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Queries over prefix keys + tree keys in one fused call: query heads folded onto their KV head (no repeated
    KV), the full mask repeated over the folded heads."""
    q_heads, kv_heads = query.shape[1], key.shape[1]
    mask = full_tree_mask(tree_mask, key.shape[2]).repeat(q_heads // kv_heads, 1)  # (G*T_q, T_k)
    out = F.scaled_dot_product_attention(fold_heads(query, kv_heads), key, value, attn_mask=mask, scale=scale)
    return unfold_heads(out, q_heads)


def split_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keys: KeySplits, scale: float) -> torch.Tensor:
    """Queries (1, H_q, T_q, D) over keys (1, H_kv, T_k, D) under a mask cut into S key splits: one fused call with
    the splits as its batch (each split a block of every KV head's keys, no copy), merged by log-sum-exp. With
    enough splits every SM gets work even for one query row (flash-decoding); the shapes never depend on how
    many keys the mask shows, so the call can be captured."""
    splits, q_heads, kv_heads = keys.bias.shape[0], query.shape[1], key.shape[1]
    q = fold_heads(query, kv_heads).expand(splits, -1, -1, -1).contiguous()  # (S, H_kv, G*T_q, D)
    k = key[0].unflatten(1, (splits, -1)).transpose(0, 1)  # (S, H_kv, T_k/S, D), a view
    v = value[0].unflatten(1, (splits, -1)).transpose(0, 1)
    out, lse = fused_attention_with_lse(q, k, v, scale, keys.bias)  # (S, H_kv, G*T_q, D), (S, H_kv, G*T_q)
    return unfold_heads(merge_splits(out, lse, keys.seen)[None], q_heads)


@compiled_on_cuda
def merge_splits(out: torch.Tensor, lse: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Merge per-split attention (S, H, R, D) by log-sum-exp, the splits a row does not see weighing zero."""
    return merge_by_lse(out, lse.masked_fill(~seen[..., 0], float("-inf")))


CHOSEN: dict[tuple, str] = {}  # (device, dtype, H_q, H_kv, D, T_q, key bucket) -> the kernel "auto" timed fastest


def masked_tree_attention(module, query, key, value, tree_mask, scale) -> torch.Tensor:
    """What transformers does: SDPA with the full boolean mask and KV heads repeated: (B, H_q, T_q, D)."""
    mask = full_tree_mask(tree_mask, key.shape[2])[None, None]
    return sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=scale)[0].transpose(1, 2)


TREE_KERNELS = {  # name -> f(module, query, key, value, tree_mask, scale)
    "hybrid": lambda module, *args: hybrid_tree_attention(*args),
    "onecall": lambda module, *args: onecall_tree_attention(*args),
    "masked": masked_tree_attention,
}


def tree_attention(kernel: str, module, query, key, value, tree_mask, scale) -> torch.Tensor:
    """A tree forward's attention by the named kernel; "auto" times every kernel on the first forward of each
    (device, dtype, head shapes, new tokens, key-length bucket) and keeps the fastest."""
    args = (module, query, key, value, tree_mask, scale)
    if kernel == "auto":
        bucket = 1 << max(key.shape[2] - 1, 1).bit_length()
        shape = (str(query.device), query.dtype, query.shape[1], key.shape[1], query.shape[3], query.shape[2], bucket)
        if shape not in CHOSEN:
            CHOSEN[shape] = min(TREE_KERNELS, key=lambda name: best_time(lambda: TREE_KERNELS[name](*args), query.device))
        kernel = CHOSEN[shape]
    return TREE_KERNELS[kernel](*args)


def best_time(fn, device: torch.device, repeats: int = 3) -> float:
    """The best of a few timings of fn() after one warm-up call, in seconds."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


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
        out = flash_attn_func()(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), softmax_scale=scale,
            causal=True, window_size=(-1, -1) if window is None else (window - 1, 0),
        )  # (B, T_q, H_q, D); causal aligned to the bottom right, as here
        return out.transpose(1, 2)
    plain_causal = past == 0 and (window is None or window >= q_len)
    if not plain_causal and window is None and query.is_cuda:  # a later block: fused kernels align to the bottom right
        return F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(q_len, key_len),
                                              scale=scale, enable_gqa=True)
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
            q_len, key_len = query.shape[2], key.shape[2]
            attention_mask = causal_window_mask(q_len, 0, key_len, key_len - q_len, None, query.device)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scale, **kwargs)
    if plan.capture is not None and module.layer_idx in plan.capture.layers:
        plan.capture.queries[module.layer_idx] = query
    dtype = query.dtype  # a cache kept in another dtype (numerics "bf16-kv") is attended in its dtype
    query = query.to(key.dtype)
    if plan.kind == "prefill":
        out = prefill_attention(query, key, value, plan.window, plan.kernel, scale)
    elif plan.kind == "static":
        out = split_attention(query, key, value, plan.keys, scale)
    elif key.dtype == torch.bfloat16 and not query.is_cuda and plan.tree_mask is not None:  # a bf16 cache on the CPU
        out = bf16_cache_attention(query, key, value, plan.tree_mask, scale)
    elif query.shape[2] == 1:  # one new token sees every key: a single unmasked fused call
        out = F.scaled_dot_product_attention(query, key, value, scale=scale, enable_gqa=True)
    else:
        out = tree_attention(plan.kernel, module, query, key, value, plan.tree_mask, scale)
    return out.transpose(1, 2).to(dtype).contiguous(), None


AttentionInterface.register(IMPLEMENTATION, specextend_attention)
