"""The project's CPU kernel (specextend/cpu_kernels.py, csrc/bf16_attention.c): attention over a bf16 KV cache agrees
with fp32 attention, gives a row the same bits alone as in a verification (whatever the thread count), keeps every
method's greedy output equal to the target alone's in bf16-kv, and steps aside (PyTorch's path) when it cannot run."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import VOCAB, tiny
from specextend import cpu_kernels, numerics
from specextend import events as ev
from specextend.attention import bf16_cache_attention
from specextend.config import AttentionConfig, DraftConfig, LookupConfig, RetrievalConfig, preset
from specextend.engine import generate
from specextend.models import make_pair
from specextend.verification import tree_mask

BUILT = cpu_kernels.status() == "built"
needs_kernel = pytest.mark.skipif(not BUILT, reason=f"the bf16 attention kernel is not in use here: {cpu_kernels.status()}")


def cache(t: int, room: int = 40, heads: int = 3, dim: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (1, heads, t, dim) in bf16, views of a larger buffer as the KV cache hands them over."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(1, heads, t + room, dim, generator=g).bfloat16()[:, :, :t] for _ in range(2))
    return k, v


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 attention over the same bf16 numbers: q (1, H, R, D) (scaled), hidden (R, tail)."""
    s = q.float() @ k.float().transpose(-1, -2)
    tail = hidden.shape[1]
    s[..., s.shape[-1] - tail:] = s[..., s.shape[-1] - tail:].masked_fill(hidden, float("-inf"))
    return torch.softmax(s, -1) @ v.float()


@needs_kernel
@pytest.mark.parametrize("keys,rows,tail", [(5, 3, 2), (255, 9, 3), (256, 3, 1), (257, 48, 16), (700, 15, 5)])
def test_the_kernel_agrees_with_fp32_attention(keys, rows, tail):
    k, v = cache(keys, seed=keys)
    q = (torch.randn(1, 3, rows, 64, generator=torch.Generator().manual_seed(rows)) * 0.125).bfloat16()
    hidden = torch.rand(rows, tail, generator=torch.Generator().manual_seed(tail)) < 0.5
    hidden[:, 0] = False  # every row sees a key
    out = cpu_kernels.bf16_attention(q, k, v, hidden)
    assert out.dtype == torch.float32 and out.shape == (1, 3, rows, 64)
    # the probabilities are rounded to bf16 before they weigh the values: a few parts in a thousand
    torch.testing.assert_close(out, reference(q, k, v, hidden), atol=1e-2, rtol=1e-2)


@needs_kernel
@pytest.mark.parametrize("dim", [32, 96, 128, 256])
def test_other_head_sizes_and_a_batch(dim):
    """One library per head size (HEAD_DIM): each agrees with fp32 attention, two sequences of two KV heads at once."""
    g = torch.Generator().manual_seed(dim)
    k, v = (torch.randn(2, 2, 609, dim, generator=g).bfloat16()[:, :, :600] for _ in range(2))
    q = (torch.randn(2, 2, 7, dim, generator=g) * dim**-0.5).bfloat16()
    hidden = torch.rand(7, 3, generator=g) < 0.5
    hidden[:, 0] = False
    assert cpu_kernels.supports(q, k, v)
    torch.testing.assert_close(cpu_kernels.bf16_attention(q, k, v, hidden), reference(q, k, v, hidden), atol=1e-2, rtol=1e-2)


@contextmanager
def kernel(on: bool):
    """The kernel in use (`on`), or PyTorch's path as where it cannot run."""
    if on and not BUILT:
        pytest.skip(f"the bf16 attention kernel is not in use here: {cpu_kernels.status()}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECEXTEND_CPU_KERNELS", "on" if on else "off")
        cpu_kernels.library.cache_clear()
        try:
            yield
        finally:
            cpu_kernels.library.cache_clear()


def parents_of(draws: list[int]) -> list[int]:
    """A tree's parents in the engine's order (a parent before its children; -1: the root's child) from any draws."""
    return [d % (i + 1) - 1 for i, d in enumerate(draws)]


@pytest.mark.parametrize("on", [True, False], ids=["kernel", "pytorch"])
@settings(max_examples=25, deadline=None)
@given(prefix=st.integers(1, 600), draws=st.lists(st.integers(0, 99), min_size=1, max_size=14),
       chain=st.booleans(), threads=st.sampled_from([1, 2]), seed=st.integers(0, 99))
def test_a_row_gets_the_same_bits_alone_as_in_a_chain_or_a_tree(on, prefix, draws, chain, threads, seed):
    """Verification row j sees the prefix, the root and its ancestors (in a chain: every token before it): the
    autoregressive step at that position sees the same keys, committed, right after the prefix. Greedy output equal
    across methods rests on these bits being equal, in the slots a tree's node has and its token will have."""
    parents = list(range(-1, len(draws) - 1)) if chain else parents_of(draws)
    mask = tree_mask(parents)  # (N+1, N+1) over the root and the nodes
    rows = mask.shape[0]
    k, v = cache(prefix + rows, seed=seed)
    q = torch.randn(1, 9, rows, 64, generator=torch.Generator().manual_seed(seed + 1))
    before = torch.get_num_threads()
    with kernel(on):
        torch.set_num_threads(threads)
        try:
            verified = bf16_cache_attention(q, k, v, mask, 0.125)
            torch.set_num_threads(3 - threads)  # the other thread count for the steps alone
            for j in range(rows):
                committed = torch.cat([torch.arange(prefix), prefix + mask[j].nonzero()[:, 0]])  # in slot order
                alone = bf16_cache_attention(q[:, :, j : j + 1], k[:, :, committed], v[:, :, committed],
                                             torch.ones(1, 1, dtype=torch.bool), 0.125)
                assert torch.equal(verified[:, :, j : j + 1], alone), (prefix, parents, j)
        finally:
            torch.set_num_threads(before)


@pytest.mark.parametrize("on", [True, False], ids=["kernel", "pytorch"])
def test_every_method_and_draft_shape_equals_the_target_alone_in_bf16_kv(monkeypatch, on):
    with kernel(on):
        calls = []
        attend = cpu_kernels.bf16_attention
        monkeypatch.setattr(cpu_kernels, "bf16_attention", lambda *a: calls.append(1) or attend(*a))
        # heads of 32 (the kernel's smallest), its own pair: the numerics switch a model in place
        pair = make_pair(tiny("llama", layers=2, hidden=64, heads=2, kv_heads=1, seed=21),
                         tiny("llama", layers=1, hidden=64, heads=2, kv_heads=1, seed=22))
        prompt = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(5)).tolist()
        retrieval = RetrievalConfig(chunk_size=16, top_k=3, retrieve_every=2, prefill_window=32)
        chain, tree = DraftConfig(shape="chain", k=3), DraftConfig(shape="tree", max_depth=4, node_budget=10, branch=2,
                                                                   children=3, stop_threshold=0.0)

        def run(method: str, draft: DraftConfig = chain, on_pair=pair, **changes) -> list:
            config = preset(method, max_new_tokens=24, retrieval=retrieval, draft=draft,
                            attention=AttentionConfig(numerics="bf16-kv"), **changes)
            return list(generate(on_pair, prompt, config))

        def greedy(*args, **changes) -> list[int]:
            return list(run(*args, **changes)[-1].token_ids)

        # a draft with the target's own weights: its trees are accepted deep, through nodes whose keys sit in other
        # slots than their tokens' will (a sibling's subtree before them)
        twin = make_pair(pair.target, tiny("llama", layers=2, hidden=64, heads=2, kv_heads=1, seed=21))
        try:
            alone = greedy("autoregressive")
            assert bool(calls) == on and len(alone) == 24
            for method in ("speculative", "specextend", "lookup"):
                assert greedy(method) == alone, method
            moved = 0
            for method in ("speculative", "specextend"):
                trace = run(method, tree, twin)
                assert list(trace[-1].token_ids) == alone, (method, "tree")
                moved += sum(list(e.accepted_nodes) != list(range(len(e.accepted_nodes)))
                             for e in trace if isinstance(e, ev.Verified))
            assert moved >= 3
            assert greedy("lookup", lookup=LookupConfig(branches=3, min_ngram=1)) == alone
            assert greedy("specextend", lookup=LookupConfig(enabled=True, with_draft="always", min_ngram=1)) == alone
        finally:
            numerics.apply(pair.target, "fp32")


def test_without_the_kernel_pytorch_attends():
    with kernel(False):
        assert cpu_kernels.status() == "turned off (SPECEXTEND_CPU_KERNELS=off)"
        k, v = cache(300)
        assert not cpu_kernels.supports(k, k, v)
        q = torch.randn(1, 9, 2, 64)
        mask = torch.tensor([[True, False], [True, True]])
        out = bf16_cache_attention(q, k, v, mask, 0.125)
        folded = (q * 0.125).reshape(1, 3, 6, 64).bfloat16()
        want = reference(folded, k, v, ~mask.repeat(3, 1)).reshape(1, 9, 2, 64)
        torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)


def test_a_kernel_that_cannot_be_built_says_why(monkeypatch, tmp_path):
    if "avx512_bf16" not in cpu_kernels.cpu_flags():
        pytest.skip("this CPU has no AVX-512 BF16, so no build is tried")
    monkeypatch.setenv("SPECEXTEND_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is None
        assert cpu_kernels.status().startswith("could not be built")
        assert not list(tmp_path.rglob("*.so"))
    finally:
        monkeypatch.undo()
        cpu_kernels.library.cache_clear()


@needs_kernel
def test_the_transpose_inside_is_a_transpose():
    a = torch.arange(256, dtype=torch.int32).reshape(16, 16)
    out = torch.empty_like(a)
    cpu_kernels.library().se_transpose_check(a.data_ptr(), out.data_ptr())
    assert torch.equal(out, a.t().contiguous())
