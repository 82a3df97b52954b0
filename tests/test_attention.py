"""Attention kernels against plain references, standalone and inside the models.

Hybrid Tree Attention (fused prefix with log-sum-exp + masked tree part, merged by the LSEs), one fused
call under the tree mask, and split attention over key splits (the captured steps' kernel) must equal
plain masked attention in fp32 with grouped-query heads, for several prefix lengths including 0 and for
random trees; "auto" must pick one of them and keep it; the fused kernel's output and LSE must equal the
math path; the LSE merge must be exact; causal prefill with and without a sliding window (fresh or over a
cache, eager or fused) must equal a masked softmax, and bottom-right causal is that mask. Inside tiny Llama
and Qwen2 models, a tree verify forward with every kernel, and a static step, must give the logits of
recomputing every root-to-node path from scratch.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import VOCAB, tiny
from specextend import attention
from specextend.attention import (
    AttentionPlan,
    KeySplits,
    causal_window_mask,
    full_tree_mask,
    fused_attention_with_lse,
    hybrid_tree_attention,
    math_attention,
    merge_by_lse,
    onecall_tree_attention,
    prefill_attention,
    split_attention,
    tree_attention,
)
from specextend.cache import KVCache
from specextend.verification import tree_mask
from specextend.models import forward, prepare
from specextend.steps import StepRunner, capacity_for, sizes_up_to

Q_HEADS, KV_HEADS, DIM = 6, 2, 16
SCALE = DIM**-0.5
ATOL = 1e-5


def reference(query, key, value, mask, scale=SCALE):
    """Masked softmax attention in float64 with the KV heads repeated (query head h reads KV head h // G).
    mask (T_q, T_k) bool or None. Returns (output, log-sum-exp) in float64."""
    groups = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(groups, dim=1)
    v = value.double().repeat_interleave(groups, dim=1)
    logits = torch.matmul(query.double(), k.transpose(-1, -2)) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    return torch.matmul(torch.softmax(logits, dim=-1), v), lse


def tensors(batch, q_len, k_len, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, Q_HEADS, q_len, DIM, generator=gen)
    k = torch.randn(batch, KV_HEADS, k_len, DIM, generator=gen)
    v = torch.randn(batch, KV_HEADS, k_len, DIM, generator=gen)
    return q, k, v


def random_parents(n: int, gen: torch.Generator) -> list[int]:
    return [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)]


def close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=0)


# ------------------------------------------------------------------------- tree masks and HTA


def test_tree_mask_is_the_ancestor_relation():
    parents = [-1, -1, 0, 0, 2, 1]
    mask = tree_mask(parents)
    assert mask.shape == (7, 7)
    ancestors = {0: {0}}
    for i, p in enumerate(parents):
        ancestors[i + 1] = ancestors[p + 1] | {i + 1}
    for row in range(7):
        assert set(torch.nonzero(mask[row]).flatten().tolist()) == ancestors[row]
    assert full_tree_mask(mask, 12).shape == (7, 12)
    assert full_tree_mask(mask, 12)[:, :5].all()
    assert torch.equal(full_tree_mask(mask, 12)[:, 5:], mask)


@pytest.mark.parametrize("prefix", [0, 1, 7, 33, 130])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hybrid_tree_attention_equals_masked_attention(prefix, seed):
    gen = torch.Generator().manual_seed(100 + seed)
    nodes = int(torch.randint(0, 12, (1,), generator=gen))
    parents = random_parents(nodes, gen)
    mask = tree_mask(parents)  # (N+1, N+1): root + nodes
    tail = nodes + 1
    q, k, v = tensors(2, tail, prefix + tail, seed)
    full = full_tree_mask(mask, prefix + tail)
    want, _ = reference(q, k, v, full)
    close(hybrid_tree_attention(q, k, v, mask, SCALE), want)
    # the masked path math_attention takes must agree too
    close(math_attention(q, k, v, full, SCALE)[0], want)


@given(
    prefix=st.integers(0, 40),
    rows=st.integers(1, 6),
    extra=st.integers(0, 6),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=40, deadline=None)
def test_hybrid_tree_attention_with_rectangular_masks(prefix, rows, extra, seed):
    """The draft feeds a tree level against earlier fed nodes: a (T_q, tail) mask with tail >= T_q.
    Every row sees itself (the diagonal of its own block) plus any earlier tree keys."""
    gen = torch.Generator().manual_seed(seed)
    tail = rows + extra
    mask = torch.rand(rows, tail, generator=gen) < 0.4
    mask[torch.arange(rows), extra + torch.arange(rows)] = True
    q, k, v = tensors(1, rows, prefix + tail, seed)
    want, _ = reference(q, k, v, full_tree_mask(mask, prefix + tail))
    close(hybrid_tree_attention(q, k, v, mask, SCALE), want)


@pytest.mark.parametrize("q_len,k_len", [(1, 1), (1, 50), (5, 3), (17, 200)])
def test_fused_attention_returns_math_attention_output_and_lse(q_len, k_len):
    q, k, v = tensors(2, q_len, k_len, q_len * 1000 + k_len)
    out, lse = fused_attention_with_lse(q, k, v, SCALE)
    m_out, m_lse = math_attention(q, k, v, None, SCALE)
    want_out, want_lse = reference(q, k, v, None)
    assert out.shape == (2, Q_HEADS, q_len, DIM) and lse.shape == (2, Q_HEADS, q_len)
    close(out, want_out)
    close(lse, want_lse, atol=1e-5)
    close(m_out, want_out)
    close(m_lse, want_lse, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_merge_by_lse_is_exact(seed):
    """Attention over two disjoint key sets, merged by their LSEs, equals attention over their union."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = tensors(1, 5, 30, seed)
    q = q * (1 + 3 * seed)  # sharper softmaxes: LSEs far apart
    split = torch.randperm(30, generator=gen)
    a, b = split[:11].sort().values, split[11:].sort().values
    out_a, lse_a = math_attention(q, k[:, :, a], v[:, :, a], None, SCALE)
    out_b, lse_b = math_attention(q, k[:, :, b], v[:, :, b], None, SCALE)
    want, _ = reference(q, k, v, None)
    close(merge_by_lse(torch.stack([out_a, out_b]), torch.stack([lse_a, lse_b])), want)
    close(merge_by_lse(torch.stack([out_b, out_a]), torch.stack([lse_b, lse_a])), want)  # symmetric
    # a merge with equal weights would not do: the test can tell
    assert (0.5 * (out_a + out_b) - want.float()).abs().max() > 1e-3


def test_merge_by_lse_handles_an_empty_side():
    """A side that saw no key (LSE -inf) gets weight 0."""
    q, k, v = tensors(1, 3, 8, 9)
    out, lse = math_attention(q, k, v, None, SCALE)
    nothing = torch.full_like(lse, float("-inf"))
    close(merge_by_lse(torch.stack([out, torch.zeros_like(out)]), torch.stack([lse, nothing])), out)
    # a fused kernel may leave NaN rows where a row saw no key of its split: they must not leak
    close(merge_by_lse(torch.stack([torch.full_like(out, float("nan")), out]), torch.stack([nothing, lse])), out)


# --------------------------------------------------------------------------------- prefill


def window_reference_mask(q_len, k_len, window):
    past = k_len - q_len
    qp = torch.arange(past, k_len)[:, None]
    kp = torch.arange(k_len)[None, :]
    mask = kp <= qp
    if window is not None:
        mask &= qp - kp < window
    return mask


@pytest.mark.parametrize("kernel", ["eager", "fused"])
@pytest.mark.parametrize("window", [None, 1, 3, 8, 1000])
@pytest.mark.parametrize("q_len,past", [(7, 0), (7, 5), (4, 20), (1, 12), (30, 0)])
def test_prefill_attention_equals_masked_softmax(kernel, window, q_len, past):
    q, k, v = tensors(1, q_len, past + q_len, q_len * 31 + past)
    want, _ = reference(q, k, v, window_reference_mask(q_len, past + q_len, window))
    out = prefill_attention(q, k, v, window, kernel, SCALE)
    assert out.shape == q.shape
    close(out, want)


def test_sliding_window_changes_the_output():
    """Guard: a window that excludes keys must not be ignored."""
    q, k, v = tensors(1, 6, 26, 4)
    full = prefill_attention(q, k, v, None, "fused", SCALE)
    for kernel in ("eager", "fused"):
        assert (prefill_attention(q, k, v, 4, kernel, SCALE) - full).abs().max() > 1e-2


@given(q_len=st.integers(1, 8), key_start=st.integers(0, 6), extra=st.integers(0, 10),
       window=st.one_of(st.none(), st.integers(1, 12)))
@settings(max_examples=40, deadline=None)
def test_causal_window_mask_is_the_definition(q_len, key_start, extra, window):
    key_len = key_start + q_len + extra
    past = key_len - q_len
    mask = causal_window_mask(q_len, key_start, key_len, past, window, "cpu")
    assert mask.shape == (q_len, key_len - key_start)
    for i in range(q_len):
        for j in range(key_start, key_len):
            want = j <= past + i and (window is None or past + i - j < window)
            assert bool(mask[i, j - key_start]) == want


# ------------------------------------------------------------------------------ inside models


def path_tokens(parents, tokens, node):
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tree_verify_inside_models_equals_masked_and_recomputation(family):
    """Prefill a prompt into a KVCache, verify a tree in one forward (hybrid and masked), and compare each
    row's logits with a from-scratch forward of prompt + root + the node's root-to-node path."""
    model = prepare(tiny(family, layers=2, heads=6, kv_heads=2, hidden=48, seed=11))
    reference_model = tiny(family, layers=2, heads=6, kv_heads=2, hidden=48, seed=11)
    reference_model.set_attn_implementation("eager")
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, VOCAB, (37,), generator=gen).tolist()
    root = int(torch.randint(0, VOCAB, (1,), generator=gen))
    cases = [([], []), ([-1, 0, 1, 2], [3, 4, 5, 6]), ([-1, -1, 0, 1, 1, 2, 4, 0], list(range(10, 18)))]
    cases.append((random_parents(14, gen), torch.randint(0, VOCAB, (14,), generator=gen).tolist()))
    cache = KVCache(model.config.num_hidden_layers)
    n = len(prompt)
    forward(model, cache, prompt, torch.arange(n), AttentionPlan("prefill", "fused"))
    for parents, tokens in cases:
        depths = [len(path_tokens(parents, tokens, i)) for i in range(len(tokens))]
        positions = n + torch.tensor([0, *depths])
        mask = tree_mask(parents)
        logits = {}
        for kernel in ("hybrid", "onecall", "masked", "auto"):
            plan = AttentionPlan("tree", kernel, tree_mask=mask)
            logits[kernel] = forward(model, cache, [root, *tokens], positions, plan, logits_to_keep=len(tokens) + 1)
            assert cache.length == n + len(tokens) + 1
            cache.crop(n)
        assert logits["hybrid"].shape == (len(tokens) + 1, VOCAB)
        with torch.no_grad():
            for row in range(len(tokens) + 1):
                seq = prompt + [root] + (path_tokens(parents, tokens, row - 1) if row else [])
                want = reference_model(input_ids=torch.tensor([seq])).logits[0, -1]
                for kernel, got in logits.items():
                    torch.testing.assert_close(got[row], want, atol=1e-4, rtol=1e-5, msg=kernel)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kernel,window", [("fused", None), ("eager", None), ("fused", 8), ("eager", 8)])
def test_blockwise_prefill_inside_models_equals_recomputation(family, kernel, window):
    """Prefill in two blocks over the cache. Without a window the logits equal a from-scratch eager forward;
    with one they equal a single eager pass under the same window (itself checked against a masked
    softmax above), and differ from the unwindowed logits."""
    model = prepare(tiny(family, layers=2, heads=6, kv_heads=2, hidden=48, seed=12))
    reference_model = tiny(family, layers=2, heads=6, kv_heads=2, hidden=48, seed=12)
    reference_model.set_attn_implementation("eager")
    prompt = torch.randint(0, VOCAB, (29,), generator=torch.Generator().manual_seed(6)).tolist()
    cache = KVCache(2)
    plan = AttentionPlan("prefill", kernel, window=window)
    first = forward(model, cache, prompt[:13], torch.arange(13), plan)
    second = forward(model, cache, prompt[13:], torch.arange(13, 29), plan)
    got = torch.cat([first, second])
    if window is None:
        with torch.no_grad():
            want = reference_model(input_ids=torch.tensor([prompt])).logits[0]
    else:  # the same blocks in one call of the kernel, with the window applied to the whole sequence
        want = forward(model, KVCache(2), prompt, torch.arange(29), AttentionPlan("prefill", "eager", window=window))
        with torch.no_grad():
            unwindowed = reference_model(input_ids=torch.tensor([prompt])).logits[0]
        assert (want[-1] - unwindowed[-1]).abs().max() > 1e-3  # the window really cut something
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


# ------------------------------------------------------------------- one call, split, auto, bottom-right


@pytest.mark.parametrize("prefix,seed", [(0, 0), (1, 1), (13, 2), (64, 3)])
def test_onecall_tree_attention_equals_masked_attention(prefix, seed):
    gen = torch.Generator().manual_seed(seed)
    parents = random_parents(9, gen)
    mask = tree_mask(parents)
    q, k, v = tensors(1, 10, prefix + 10, seed)
    want, _ = reference(q, k, v, full_tree_mask(mask, prefix + 10))
    close(onecall_tree_attention(q, k, v, mask, SCALE), want)


@given(rows=st.integers(1, 9), splits=st.sampled_from([1, 2, 4, 8]), width=st.sampled_from([8, 16]),
       density=st.floats(0.0, 1.0), seed=st.integers(0, 10_000))
@settings(max_examples=60, deadline=None)
def test_split_attention_equals_masked_attention(rows, splits, width, density, seed):
    """Any mask in which each row sees a key, whole splits unseen included (their rows get weight zero)."""
    gen = torch.Generator().manual_seed(seed)
    keys = splits * width
    q, k, v = tensors(1, rows, keys, seed)
    mask = torch.rand(rows, keys, generator=gen) < density
    mask[torch.arange(rows), torch.randint(0, keys, (rows,), generator=gen)] = True
    want, _ = reference(q, k, v, mask)
    close(split_attention(q, k, v, KeySplits.of(mask, Q_HEADS // KV_HEADS, splits, torch.float32), SCALE), want)


def test_key_splits_refill_in_place():
    """A captured step reads the same buffers every replay: fill_ must overwrite them, not rebind them."""
    first = torch.zeros(3, 32, dtype=torch.bool)
    first[:, 0] = True
    second = torch.ones(3, 32, dtype=torch.bool)
    keys = KeySplits.of(first, 2, 4, torch.float32)
    bias, seen = keys.bias.data_ptr(), keys.seen.data_ptr()
    assert keys.bias.shape == (4, 1, 6, 8) and keys.seen.shape == (4, 1, 6, 1)
    assert keys.seen[0].all() and not keys.seen[1:].any()
    keys.fill_(second, 2)
    assert (keys.bias.data_ptr(), keys.seen.data_ptr()) == (bias, seen)
    assert keys.seen.all() and (keys.bias == 0).all()


def test_auto_picks_a_kernel_once_per_shape_and_keeps_it(monkeypatch):
    monkeypatch.setattr(attention, "CHOSEN", {})
    q, k, v = tensors(1, 5, 45, 9)
    mask = tree_mask([-1, 0, 0, 1])
    module = type("M", (), {"num_key_value_groups": Q_HEADS // KV_HEADS, "is_causal": True})()
    want, _ = reference(q, k, v, full_tree_mask(mask, 45))
    close(tree_attention("auto", module, q, k, v, mask, SCALE), want)
    (shape, chosen), = attention.CHOSEN.items()
    assert chosen in ("hybrid", "onecall", "masked") and shape[-1] == 64  # keys bucketed to a power of two
    attention.CHOSEN[shape] = "masked"  # a kept choice is used as is, not timed again
    calls = []
    monkeypatch.setitem(attention.TREE_KERNELS, "masked", lambda *a: calls.append(1) or torch.zeros_like(q))
    tree_attention("auto", module, q, k[:, :, :40], v[:, :, :40], mask, SCALE)
    assert calls == [1]


@pytest.mark.parametrize("q_len,key_len", [(5, 5), (5, 12), (1, 9), (16, 40)])
def test_bottom_right_causal_is_the_blockwise_prefill_mask(q_len, key_len):
    """Blocked prefill on CUDA hands SDPA causal_lower_right; it must be the mask the other paths build."""
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = tensors(1, q_len, key_len, q_len + key_len)
    want, _ = reference(q, k, v, window_reference_mask(q_len, key_len, None))
    got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_len, key_len),
                                                           scale=SCALE, enable_gqa=True)
    close(got, want)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_static_steps_inside_models_equal_eager_forwards(family):
    """The same chain and tree forwards through a static runner (padded, over a key bucket, split attention) and
    eagerly: equal logits, equal cache length and RoPE positions, and the padding never inside the length."""
    model = prepare(tiny(family, layers=2, heads=6, kv_heads=2, hidden=48, seed=13))
    gen = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, VOCAB, (509,), generator=gen).tolist()  # the second tree crosses a bucket edge
    sizes = sizes_up_to(16)
    static = StepRunner(model, KVCache(2, capacity_for(600, sizes)), "static", sizes)
    eager = KVCache(2)
    for cache in (static.cache, eager):
        forward(model, cache, prompt, torch.arange(509), AttentionPlan("prefill", "fused"))
    for parents in ([-1, 0, 1], [-1, -1, 0, 1, 1, 2, 4, 0], []):
        tokens = torch.randint(0, VOCAB, (len(parents),), generator=gen).tolist()
        n = static.cache.length
        depths = [len(path_tokens(parents, tokens, i)) for i in range(len(tokens))]
        positions = n + torch.tensor([0, *depths])
        plan = AttentionPlan("tree", "hybrid", tree_mask=tree_mask(parents))
        got = static.forward([1, *tokens], positions, plan, len(tokens) + 1)
        want = forward(model, eager, [1, *tokens], positions, plan, len(tokens) + 1)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
        assert static.cache.length == eager.length == n + len(tokens) + 1
        assert torch.equal(static.cache.rope_positions, eager.rope_positions)
        for cache in (static.cache, eager):  # keep the first path only, as a commit would
            cache.keep(torch.arange(n + min(2, len(tokens) + 1)))
    assert len(static.steps) >= 3  # forwards of 4, 16 and 1 padded tokens ran static, across two buckets


def test_a_broken_flash_attn_falls_back_with_one_warning(monkeypatch, caplog):
    """Installed but unusable (built for another torch): imported once, one warning, PyTorch's kernels serve."""
    import importlib.util
    import sys

    monkeypatch.setattr(attention, "_flash", [])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else None)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # importing it now raises ImportError
    with caplog.at_level("WARNING", logger="specextend.attention"):
        assert attention.flash_attn_func() is None and attention.flash_attn_func() is None
    assert sum("flash-attn is installed but cannot be used" in r.message for r in caplog.records) == 1
    assert not attention.use_flash_attn(torch.zeros(1, dtype=torch.bfloat16))  # and never on the CPU


def test_flash_attn_on_a_gpu_older_than_ampere_falls_back_with_one_warning(monkeypatch, caplog):
    import importlib.util
    import sys
    import types

    monkeypatch.setattr(attention, "_flash", [])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else None)
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=lambda *a: None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))  # a T4
    with caplog.at_level("WARNING", logger="specextend.attention"):
        assert attention.flash_attn_func() is None and attention.flash_attn_func() is None
    assert sum("needs an Ampere or newer GPU" in r.message and "7.5" in r.getMessage() for r in caplog.records) == 1
