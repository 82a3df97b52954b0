"""KV cache verbs and RoPE re-positioning.

Checks `KVCache` against a plain reference (a list of slots) under random sequences of its verbs
(update, append, crop, keep, gather, replace), including buffer growth past the initial capacity, and
checks `reposition` against transformers' own RoPE: it maps a key rotated at position p to the same key
rotated at p', round-trips, composes, and inside a real model turns the cache of a shifted run into the
cache of the unshifted one.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from conftest import tiny
from specextend.attention import AttentionPlan
from specextend.cache import KVCache, reposition
from specextend.models import forward, prepare, rope_inv_freq

LAYERS, BATCH, HEADS, DIM, VDIM = 2, 1, 2, 4, 3
FAST = settings(max_examples=40, deadline=None)


def random_kv(n: int, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys (B, H, n, D), values (B, H, n, D_v))."""
    return [
        (torch.randn(BATCH, HEADS, n, DIM, generator=gen), torch.randn(BATCH, HEADS, n, VDIM, generator=gen))
        for _ in range(LAYERS)
    ]


def stacked(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer keys and values as the cache's verbs take them: one group, stacked (L, B, H, n, D)."""
    return [(torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv]))]


def per_layer(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What `gather` gives (per group, stacked), per layer."""
    return [(k, v) for keys, values in kv for k, v in zip(keys, values)]


class Reference:
    """The cache as a list of slots: per slot, its per-layer (key, value) and its RoPE position."""

    def __init__(self) -> None:
        self.slots: list[tuple[list[tuple[torch.Tensor, torch.Tensor]], int]] = []

    def extend(self, kv, positions: list[int]) -> None:
        for i, pos in enumerate(positions):
            self.slots.append(([(k[:, :, i].clone(), v[:, :, i].clone()) for k, v in kv], pos))

    def check(self, cache: KVCache) -> None:
        assert cache.length == len(self.slots)
        assert cache.get_seq_length() == len(self.slots)
        assert cache.rope_positions.tolist() == [pos for _, pos in self.slots]
        assert cache.rope_positions.dtype == torch.long
        for layer_idx, layer in enumerate(cache.layers):
            if not self.slots:
                assert layer.length == 0
                continue
            keys, values = layer.filled()
            assert keys.shape == (BATCH, HEADS, len(self.slots), DIM)
            assert values.shape == (BATCH, HEADS, len(self.slots), VDIM)
            want_k = torch.stack([kv[layer_idx][0] for kv, _ in self.slots], dim=2)
            want_v = torch.stack([kv[layer_idx][1] for kv, _ in self.slots], dim=2)
            assert torch.equal(keys, want_k)
            assert torch.equal(values, want_v)


OPS = st.lists(
    st.tuples(st.sampled_from(["update", "append", "crop", "keep", "replace", "gather"]), st.integers(0, 40)),
    min_size=1,
    max_size=12,
)


@FAST
@given(capacity=st.sampled_from([0, 1, 5, 16]), ops=OPS, seed=st.integers(0, 2**16), data=st.data())
def test_cache_verbs_match_reference(capacity, ops, seed, data):
    gen = torch.Generator().manual_seed(seed)
    cache, ref = KVCache(LAYERS, capacity), Reference()
    for op, n in ops:
        length = len(ref.slots)
        if op == "update":  # the path a model forward takes: layer by layer, then the positions
            n = max(n, 1)
            kv = random_kv(n, gen)
            positions = torch.randint(0, 10_000, (n,), generator=gen)
            for layer_idx, (k, v) in enumerate(kv):
                full_k, full_v = cache.update(k, v, layer_idx)
                assert full_k.shape[2] == length + n and full_v.shape[2] == length + n
                assert torch.equal(full_k[:, :, length:], k)
            cache.note_appended(positions)
            ref.extend(kv, positions.tolist())
        elif op == "append":
            n = max(n, 1)
            kv = random_kv(n, gen)
            positions = torch.randint(0, 10_000, (n,), generator=gen)
            cache.append(stacked(kv), positions)
            ref.extend(kv, positions.tolist())
        elif op == "crop":
            m = n % (length + 3)
            cache.crop(m)
            ref.slots = ref.slots[:m]
        elif op == "keep":
            if not length:
                continue
            slots = sorted(data.draw(st.sets(st.integers(0, length - 1), max_size=length), label="keep"))
            cache.keep(torch.tensor(slots, dtype=torch.long))
            ref.slots = [ref.slots[i] for i in slots]
        elif op == "replace":
            n = max(n, 1)
            kv = random_kv(n, gen)
            positions = torch.randint(0, 10_000, (n,), generator=gen)
            cache.replace(stacked(kv), positions)
            ref.slots = []
            ref.extend(kv, positions.tolist())
        else:  # gather: copies, in the order asked, and leaves the cache untouched
            if not length:
                continue
            slots = data.draw(st.lists(st.integers(0, length - 1), min_size=1, max_size=8), label="gather")
            got = cache.gather(torch.tensor(slots, dtype=torch.long))
            assert len(got) == 1  # one device: one group, one copy per buffer
            for layer_idx, (k, v) in enumerate(per_layer(got)):
                assert torch.equal(k, torch.stack([ref.slots[i][0][layer_idx][0] for i in slots], dim=2))
                assert torch.equal(v, torch.stack([ref.slots[i][0][layer_idx][1] for i in slots], dim=2))
                k.add_(1.0)  # a copy: writing to it must not reach the cache
        ref.check(cache)


def test_growth_keeps_contents():
    gen = torch.Generator().manual_seed(0)
    cache, ref = KVCache(LAYERS, capacity=2), Reference()
    for step in range(12):  # 1 + 2 + ... + 12 = 78 tokens: several doublings past 16
        kv = random_kv(step + 1, gen)
        positions = torch.arange(len(ref.slots), len(ref.slots) + step + 1)
        cache.append(stacked(kv), positions)
        ref.extend(kv, positions.tolist())
        ref.check(cache)
    assert cache.layers[0].keys.shape[2] >= 78


def test_keep_then_gather_equals_original_slots():
    gen = torch.Generator().manual_seed(1)
    cache = KVCache(LAYERS)
    kv = random_kv(20, gen)
    cache.append(stacked(kv), torch.arange(100, 120))
    slots = torch.tensor([0, 3, 4, 11, 19])
    before = per_layer(cache.gather(slots))
    cache.keep(slots)
    after = per_layer(cache.gather(torch.arange(len(slots))))
    for (k0, v0), (k1, v1), (k, v) in zip(before, after, kv):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
        assert torch.equal(k1, k[:, :, slots])
    assert cache.rope_positions.tolist() == [100, 103, 104, 111, 119]
    # new tokens go after the kept ones
    more = random_kv(2, gen)
    cache.append(stacked(more), torch.tensor([7, 8]))
    assert cache.length == 7
    assert torch.equal(cache.layers[1].filled()[0][:, :, 5:], more[1][0])
    assert cache.rope_positions.tolist() == [100, 103, 104, 111, 119, 7, 8]


def test_a_cache_told_its_dtype_keeps_it_and_rounds_what_is_written():
    """`KVCache(dtype=...)` (a numerics setting's cache): fp32 keys and values are kept in bf16 as they are written,
    through the model's update as through the verbs; without it the buffers take the keys' dtype."""
    gen = torch.Generator().manual_seed(4)
    kv = random_kv(6, gen)
    kept = KVCache(LAYERS, dtype=torch.bfloat16)
    kept.append(stacked(kv), torch.arange(6))
    new_k, new_v = random_kv(1, gen)[1]
    full_k, full_v = kept.update(new_k, new_v, 1)  # a forward's write
    assert kept.groups[0].keys.dtype == full_k.dtype == full_v.dtype == torch.bfloat16
    assert torch.equal(full_k, torch.cat([kv[1][0], new_k], 2).bfloat16())
    assert torch.equal(kept.layers[0].filled()[1], kv[0][1].bfloat16())
    plain = KVCache(LAYERS)
    plain.append(stacked(kv), torch.arange(6))
    assert plain.groups[0].keys.dtype == torch.float32


def test_crop_then_update_overwrites_the_dropped_slots():
    gen = torch.Generator().manual_seed(2)
    cache = KVCache(LAYERS)
    cache.append(stacked(random_kv(10, gen)), torch.arange(10))
    cache.crop(4)
    assert cache.length == 4 and cache.rope_positions.tolist() == [0, 1, 2, 3]
    cache.crop(99)  # cropping past the end changes nothing
    assert cache.length == 4
    new = random_kv(3, gen)
    for layer_idx, (k, v) in enumerate(new):
        full_k, full_v = cache.update(k, v, layer_idx)
        assert full_k.shape[2] == 7
        assert torch.equal(full_k[:, :, 4:], k) and torch.equal(full_v[:, :, 4:], v)


def test_layers_share_one_stacked_buffer_and_a_verb_is_one_copy_per_buffer():
    """One device: every layer's keys are views of one buffer, so `keep` moves all layers' slots with one gather
    and one write per buffer (the commit after each step), never one per layer."""
    gen = torch.Generator().manual_seed(3)
    cache = KVCache(LAYERS, capacity=32)
    cache.append(stacked(random_kv(12, gen)), torch.arange(12))
    [group] = cache.groups
    assert all(layer.keys.untyped_storage().data_ptr() == group.keys.untyped_storage().data_ptr() for layer in cache.layers)
    calls = []
    real = torch.Tensor.index_select

    def counted(self, *args, **kwargs):
        calls.append(self.shape)
        return real(self, *args, **kwargs)

    torch.Tensor.index_select = counted
    try:
        cache.keep(torch.tensor([0, 1, 5, 7, 11]))
    finally:
        torch.Tensor.index_select = real
    assert len(calls) == 2  # keys and values, all layers at once
    assert cache.length == 5


def test_layers_on_different_devices_get_a_buffer_each():
    """A model spread over devices: consecutive layers on one device form a group with its own stacked buffer
    (here three layers on two "devices" stood in by distinct labels, all on the CPU)."""
    gen = torch.Generator().manual_seed(4)
    devices = (torch.device("cpu", 0), torch.device("cpu", 0), torch.device("cpu", 1))
    cache = KVCache(3, 8, devices=devices)
    assert [(g.first, g.count) for g in cache.groups] == [(0, 2), (2, 1)]
    kv = [(torch.randn(BATCH, HEADS, 5, DIM, generator=gen), torch.randn(BATCH, HEADS, 5, VDIM, generator=gen))
          for _ in range(3)]
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    cache.note_appended(torch.arange(5))
    got = cache.gather(torch.tensor([4, 0]))
    assert [k.shape[0] for k, _ in got] == [2, 1]
    assert torch.equal(per_layer(got)[2][0], kv[2][0][:, :, [4, 0]])
    cache.keep(torch.tensor([1, 3]))
    assert torch.equal(cache.layers[2].filled()[1], kv[2][1][:, :, [1, 3]])
    assert torch.equal(cache.layers[0].filled()[0], kv[0][0][:, :, [1, 3]])


# ------------------------------------------------------------------------------------------ RoPE

ROPE_CONFIG = LlamaConfig(
    vocab_size=11, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=8192,
)
ROTARY = LlamaRotaryEmbedding(ROPE_CONFIG)  # head_dim 16: inv_freq (8,)
MAX_POS = 4096


def rope(raw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """transformers' own RoPE: the raw (un-rotated) key rotated to `positions` (T,)."""
    cos, sin = ROTARY(raw, positions[None])
    return apply_rotary_pos_emb(raw, raw, cos, sin)[1]


def tolerance(raw: torch.Tensor) -> float:
    # fp32 angles p * inv_freq carry an absolute error of about p * 2**-24 per rotation
    return 1e-5 + 1e-7 * MAX_POS * float(raw.abs().max())


positions_strategy = st.lists(st.integers(0, MAX_POS), min_size=1, max_size=12)


def raw_keys(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, n, 16, generator=gen).to(dtype)


@FAST
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_reposition_equals_transformers_rope_at_new_position(data, seed):
    old = data.draw(positions_strategy, label="old")
    new = data.draw(st.lists(st.integers(0, MAX_POS), min_size=len(old), max_size=len(old)), label="new")
    old_t, new_t = torch.tensor(old), torch.tensor(new)
    raw = raw_keys(len(old), seed)
    values = torch.randn(2, 2, len(old), 5)
    [(keys, vals)] = reposition([(rope(raw, old_t), values)], old_t, new_t, ROTARY.inv_freq)
    torch.testing.assert_close(keys, rope(raw, new_t), atol=tolerance(raw), rtol=0)
    assert torch.equal(vals, values)  # values are never rotated
    assert keys.dtype == torch.float32


@FAST
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_reposition_round_trips_and_composes(data, seed):
    a = data.draw(positions_strategy, label="a")
    n = len(a)
    b = data.draw(st.lists(st.integers(0, MAX_POS), min_size=n, max_size=n), label="b")
    c = data.draw(st.lists(st.integers(0, MAX_POS), min_size=n, max_size=n), label="c")
    a, b, c = torch.tensor(a), torch.tensor(b), torch.tensor(c)
    inv_freq = ROTARY.inv_freq
    keys = rope(raw_keys(n, seed), a)
    kv = [(keys, torch.zeros(2, 2, n, 1))]
    tol = tolerance(keys)
    there = reposition(kv, a, b, inv_freq)
    back = reposition(there, b, a, inv_freq)
    torch.testing.assert_close(back[0][0], keys, atol=tol, rtol=0)
    via_b = reposition(there, b, c, inv_freq)
    direct = reposition(kv, a, c, inv_freq)
    torch.testing.assert_close(via_b[0][0], direct[0][0], atol=tol, rtol=0)
    # a rotation keeps each (i, i + D/2) pair's norm
    half = keys.shape[-1] // 2
    pair_norm = lambda x: x[..., :half] ** 2 + x[..., half:] ** 2  # noqa: E731
    torch.testing.assert_close(pair_norm(there[0][0]), pair_norm(keys), atol=1e-4, rtol=1e-5)


def test_reposition_zero_shift_is_identity_and_keeps_dtype():
    keys = rope(raw_keys(6, 3), torch.arange(6))
    kv = [(keys, torch.ones(2, 2, 6, 2))]
    same = reposition(kv, torch.arange(6), torch.arange(6), ROTARY.inv_freq)
    assert torch.equal(same[0][0], keys)
    half = reposition([(keys.bfloat16(), kv[0][1])], torch.arange(6), torch.arange(6) + 100, ROTARY.inv_freq)
    assert half[0][0].dtype == torch.bfloat16
    torch.testing.assert_close(half[0][0].float(), rope(raw_keys(6, 3), torch.arange(6) + 100), atol=0.05, rtol=0.02)


def test_reposition_differs_from_no_rotation():
    """Guard against a test that passes vacuously: a real shift moves the keys."""
    raw = raw_keys(4, 5)
    a, b = torch.tensor([0, 1, 2, 3]), torch.tensor([10, 20, 30, 40])
    [(moved, _)] = reposition([(rope(raw, a), raw)], a, b, ROTARY.inv_freq)
    assert (moved - rope(raw, a)).abs().max() > 0.1


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_reposition_maps_a_shifted_run_onto_the_unshifted_cache(family):
    """RoPE attention depends on relative positions only, so running the same tokens at positions
    s..s+T-1 gives keys that differ from the run at 0..T-1 by a rotation of s: re-positioning the
    shifted cache must give the unshifted one, in every layer."""
    model = prepare(tiny(family, layers=2, seed=7))
    tokens = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    plan = AttentionPlan("prefill", "eager")
    shift = 700
    base, shifted = KVCache(2), KVCache(2)
    forward(model, base, tokens, torch.arange(24), plan)
    forward(model, shifted, tokens, torch.arange(24) + shift, plan)
    assert shifted.rope_positions.tolist() == list(range(shift, shift + 24))
    inv_freq = rope_inv_freq(model)
    torch.testing.assert_close(inv_freq, ROTARY.inv_freq)  # same head_dim and theta as ROPE_CONFIG
    moved = reposition(shifted.gather(torch.arange(24)), shifted.rope_positions, base.rope_positions, inv_freq)
    for layer, (keys, values) in zip(base.layers, per_layer(moved)):
        want_k, want_v = layer.filled()
        torch.testing.assert_close(keys, want_k, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(values, want_v, atol=2e-4, rtol=1e-4)
    # and the shifted keys really were different before re-positioning
    assert (shifted.layers[0].filled()[0] - base.layers[0].filled()[0]).abs().max() > 0.1
