"""The project's CPU kernel (specextend/cpu_kernels.py, csrc/bf16_attention.c): attention over a bf16 KV cache agrees
with fp32 attention, gives a row the same bits alone as in a verification (whatever the thread count), keeps every
method's greedy output equal to the target alone's in bf16-kv, and steps aside (PyTorch's path) when it cannot run."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import VOCAB, tiny
from specextend import cpu_kernels, numerics
from specextend.attention import bf16_cache_attention
from specextend.config import AttentionConfig, DraftConfig, RetrievalConfig, preset
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


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(prefix=st.integers(1, 600), chain=st.integers(1, 6), threads=st.sampled_from([1, 2]), seed=st.integers(0, 99))
def test_a_row_gets_the_same_bits_alone_as_in_a_chain(prefix, chain, threads, seed):
    """Verification row j of a chain sees the prefix and the chain up to j: the autoregressive step at that position
    sees the same keys, all committed. Greedy output equal across methods rests on these bits being equal."""
    k, v = cache(prefix + chain, seed=seed)
    q = torch.randn(1, 9, chain, 64, generator=torch.Generator().manual_seed(seed + 1))
    mask = tree_mask(list(range(-1, chain - 1)))[1:, 1:]  # (chain, chain): each token sees itself and those before
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        verified = bf16_cache_attention(q, k, v, mask, 0.125)
        torch.set_num_threads(3 - threads)  # the other thread count for the steps alone
        for j in range(chain):
            end = prefix + j + 1
            alone = bf16_cache_attention(q[:, :, j : j + 1], k[:, :, :end], v[:, :, :end], torch.ones(1, 1, dtype=torch.bool),
                                         0.125)
            assert torch.equal(verified[:, :, j : j + 1], alone), (prefix, chain, j)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_every_method_equals_the_target_alone_with_the_kernel(monkeypatch):
    calls = []
    run = cpu_kernels.bf16_attention
    monkeypatch.setattr(cpu_kernels, "bf16_attention", lambda *a: calls.append(1) or run(*a))
    # heads of 32 (the kernel's smallest), its own pair: the numerics switch a model in place
    pair = make_pair(tiny("llama", layers=2, hidden=64, heads=2, kv_heads=1, seed=21),
                     tiny("llama", layers=1, hidden=64, heads=2, kv_heads=1, seed=22))
    prompt = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    retrieval = RetrievalConfig(chunk_size=16, top_k=3, retrieve_every=2, prefill_window=32)

    def greedy(method: str) -> list[int]:  # chains: bf16-kv refuses a tree (test_numerics)
        config = preset(method, max_new_tokens=16, retrieval=retrieval, draft=DraftConfig(shape="chain", k=3),
                        attention=AttentionConfig(numerics="bf16-kv"))
        return list(list(generate(pair, prompt, config))[-1].token_ids)

    try:
        alone = greedy("autoregressive")
        assert calls and len(alone) == 16
        for method in ("speculative", "specextend", "lookup"):
            assert greedy(method) == alone, method
    finally:
        numerics.apply(pair.target, "fp32")


def test_without_the_kernel_pytorch_attends(monkeypatch):
    monkeypatch.setenv("SPECEXTEND_CPU_KERNELS", "off")
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.status() == "turned off (SPECEXTEND_CPU_KERNELS=off)"
        k, v = cache(300)
        assert not cpu_kernels.supports(k, k, v)
        q = torch.randn(1, 9, 2, 64)
        mask = torch.tensor([[True, False], [True, True]])
        out = bf16_cache_attention(q, k, v, mask, 0.125)
        folded = (q * 0.125).reshape(1, 3, 6, 64).bfloat16()
        want = reference(folded, k, v, ~mask.repeat(3, 1)).reshape(1, 9, 2, 64)
        torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)
    finally:
        monkeypatch.delenv("SPECEXTEND_CPU_KERNELS")
        cpu_kernels.library.cache_clear()


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
