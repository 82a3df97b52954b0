"""The target's prefill in bf16 (AttentionConfig.bf16_prefill): chosen by measurement like SkinnyLinear's path (a pure
choice over measured times), read by a bf16 copy of the model into a cache handed over in the model's dtype, and
exact across the methods of a race, which share that one prefill (the target alone reads it too)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import VOCAB, tiny
from test_heads import SMALL_CACHE, tiny_head

from specextend import models
from specextend.config import DraftConfig, LookupConfig, RetrievalConfig, preset
from specextend.engine import generate
from specextend.events import Prefilled, Started
from specextend.models import FASTER, choose_prefill_dtype, make_pair, prefill_dtype, prepare
from specextend.signal import resolve
from specextend.target import FeatureRows, SharedPrefill, Target

F32, BF16 = torch.float32, torch.bfloat16
RETRIEVAL = RetrievalConfig(chunk_size=16, top_k=6, retrieve_every=2, prefill_window=64)


def with_prefill(config, setting: str):
    return config.replace(attention=dataclasses.replace(config.attention, bf16_prefill=setting))


def near(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within bf16's rounding, compounded over a few layers: a few percent of the norm."""
    return bool((a - b).norm() <= 0.05 * b.norm())


def prompt_of(n: int, seed: int) -> list[int]:
    return [int(t) for t in torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))]


@pytest.mark.parametrize("setting, dtype, times, chosen", [
    ("auto", F32, (1.0, 0.4), BF16),  # measured 2.5x faster: bf16
    ("auto", F32, (1.0, FASTER), BF16),
    ("auto", F32, (1.0, 0.9), F32),  # not faster by enough
    ("auto", F32, (1.0, 4.5), F32),  # an AVX2 CPU without native bf16
    ("on", F32, None, BF16),
    ("off", F32, (1.0, 0.1), F32),
    ("auto", BF16, None, BF16),  # a model already in half precision reads in its own dtype
    ("on", torch.float16, None, torch.float16),
])
def test_the_prefill_dtype_is_bf16_only_for_an_fp32_model_where_asked_or_measured_faster(setting, dtype, times, chosen):
    assert choose_prefill_dtype(setting, dtype, times) == chosen


def test_a_nonsense_setting_or_auto_without_times_is_refused():
    with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        choose_prefill_dtype("bf16", F32, (1.0, 0.5))
    with pytest.raises(ValueError, match="measured times"):
        choose_prefill_dtype("auto", F32)
    with pytest.raises(ValueError, match="bf16 prefill"):
        preset("specextend").attention.__class__(bf16_prefill="yes")


def test_auto_times_each_shape_once_and_leaves_a_small_model_untimed(monkeypatch):
    timed = []

    def clock(fn, device):
        fn()
        timed.append(fn)
        return 1.0 if len(timed) % 2 else 0.3  # fp32 first, then bf16 (3.3x faster)

    monkeypatch.setattr(models.attention, "best_time", clock)
    monkeypatch.setattr(models, "PREFILL_TIMES", {})
    model = tiny("llama", layers=2, seed=3)
    assert prefill_dtype(model, "auto") == F32 and timed == []  # under MIN_PREFILL_PARAMS: fp32, nothing timed
    monkeypatch.setattr(models, "MIN_PREFILL_PARAMS", 0)
    assert prefill_dtype(model, "auto") == BF16 and len(timed) == 2
    assert prefill_dtype(tiny("llama", layers=3, seed=4), "auto") == BF16 and len(timed) == 2  # same shape: kept
    assert prefill_dtype(model, "off") == F32 and prefill_dtype(model, "on") == BF16
    assert next(model.parameters()).dtype == F32  # timing used a copy


def test_a_bf16_prefill_hands_over_the_cache_and_captures_in_the_models_dtype():
    """The prompt crosses prefill blocks (512 on CPU) and ends in a block of a few rows. The cache, the query window
    and the streams come out in fp32, close to an fp32 prefill's but not equal to it (the prompt was read in bf16)."""
    model = prepare(tiny("llama", layers=3, seed=1))
    prompt = prompt_of(520, seed=1)
    read = {}
    for setting in ("off", "on"):
        config = with_prefill(preset("specextend", retrieval=RETRIEVAL), setting)
        features = FeatureRows((0, 3), lambda streams: torch.cat(list(streams.values()), -1))
        target = Target(model, config, len(prompt) + 16, resolve("paper", None), features)
        assert list(target.prefill(prompt, None)) == [512, 520]
        read[setting] = target
    fp32, bf16 = read["off"], read["on"]
    assert bf16.prefill_dtype == BF16 and fp32.prefill_dtype == F32
    assert bf16.cache.length == len(prompt) and torch.equal(bf16.cache.rope_positions, torch.arange(len(prompt)))
    for ours, theirs in zip(bf16.cache.layers, fp32.cache.layers):
        for a, b in zip(ours.filled(), theirs.filled()):
            assert a.dtype == F32 and a.shape == b.shape
            assert not torch.equal(a, b) and near(a, b)
    assert not torch.equal(bf16.logits, fp32.logits) and near(bf16.logits, fp32.logits)
    # the logits come out of the model's own fp32 output layer: not rounded to bf16's coarse steps, which tie top tokens
    assert not torch.equal(bf16.logits, bf16.logits.bfloat16().float())
    assert {q.dtype for q in bf16.window.queries.values()} == {F32}
    assert bf16.window.positions.tolist() == fp32.window.positions.tolist()
    streams = bf16.features.queued()
    assert set(streams) == {0, 3} and {h.dtype for h in streams.values()} == {F32}
    assert {h.shape[0] for h in streams.values()} == {len(prompt)}
    assert next(model.parameters()).dtype == F32  # the model itself was never cast


DRAFTED = [("speculative", "chain", False), ("streaming", "chain", False), ("specextend", "chain", False),
           ("specextend", "tree", False), ("specextend", "chain", True), ("specextend", "tree", True)]


@pytest.mark.parametrize("draft", ["model", "eagle3 head"])
def test_methods_sharing_a_bf16_prefill_give_the_target_alones_output(draft):
    """A race reads the prompt once, in bf16: every method (draft model or EAGLE-3 head, chain or tree, with lookup
    or without) gives exactly what the target alone gives over that prefill, and so do runs that read the prompt
    again themselves. The runs say what the prompt was read in."""
    target = tiny("llama", layers=4, seed=11)
    drafter = (tiny("llama", layers=1, hidden=32, heads=2, kv_heads=1, seed=2) if draft == "model"
               else tiny_head("eagle3", target, reduced=True))
    pair = make_pair(target, drafter)
    prompt = prompt_of(600, seed=5)
    cache = SMALL_CACHE if draft != "model" else RETRIEVAL
    configs = {(method, shape, lookup): preset(method, max_new_tokens=24, retrieval=cache, draft=DraftConfig(shape=shape),
                                               lookup=LookupConfig(enabled=lookup or None))
               for method, shape, lookup in DRAFTED}
    shared = SharedPrefill()
    first = list(generate(pair, prompt, with_prefill(configs[DRAFTED[-1]], "on"), shared=shared))  # keeps the most
    alone = list(generate(pair, prompt, with_prefill(preset("autoregressive", max_new_tokens=24), "on"), shared=shared))
    assert alone[0].prefill_dtype == "bfloat16" and alone[0].dtype == "float32"
    assert first[-1].token_ids == alone[-1].token_ids
    for name, config in configs.items():
        for keep in (shared, None):
            run = list(generate(pair, prompt, with_prefill(config, "on"), shared=keep))
            assert next(e for e in run if isinstance(e, Prefilled)).shared == (keep is shared)
            assert run[-1].token_ids == alone[-1].token_ids, (name, keep is shared)
            assert next(e for e in run if isinstance(e, Started)).prefill_dtype == "bfloat16"


def test_an_fp32_prefill_is_not_shared_with_a_bf16_request(llama_pair):
    prompt = prompt_of(90, seed=9)
    shared = SharedPrefill()
    list(generate(llama_pair, prompt, with_prefill(preset("autoregressive", max_new_tokens=4), "off"), shared=shared))
    run = list(generate(llama_pair, prompt, with_prefill(preset("autoregressive", max_new_tokens=4), "on"), shared=shared))
    assert not next(e for e in run if isinstance(e, Prefilled)).shared
    again = list(generate(llama_pair, prompt, with_prefill(preset("speculative", max_new_tokens=4), "on"), shared=shared))
    assert next(e for e in again if isinstance(e, Prefilled)).shared
