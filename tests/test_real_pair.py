"""The engine on the bundled SmolLM2-135M-Instruct target with each of its bundled drafts, the EAGLE-3 head and the
distilled draft model (fp32, CPU): greedy output equals the target's own greedy output on a short real prompt, for
every method, with the prompt read in fp32; read in bf16, every method agrees with the target alone over that reading."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import reference_greedy
from specextend.tools import bundled, prompting
from specextend import events as ev
from specextend import numerics
from specextend.config import AttentionConfig, DraftConfig, RetrievalConfig, preset
from specextend.engine import generate
from specextend.models import load_pair, read_tokenizer

NEW = 20


@pytest.fixture(scope="module", params=[bundled.HEAD_NAME, bundled.DRAFT_NAME])
def real(request):
    target, draft = bundled.target_dir(), bundled.draft_dir(request.param)
    tokenizer = read_tokenizer(target)
    pair = load_pair(target, draft, device="cpu", dtype="float32", tokenizer=tokenizer)
    text = bundled.documents("eval")[0].text()[:1500]
    prompt = prompting.encode(tokenizer, text, prompting.DEFAULT_INSTRUCTION).ids
    return pair, prompt, prompting.stop_ids(tokenizer, pair.target)


def test_real_pair_is_lossless_for_every_method(real):
    pair, prompt, eos = real
    assert 250 < len(prompt) < 600
    ref = reference_greedy(pair.target, prompt, NEW, cached=True)
    if any(t in eos for t in ref):
        ref = ref[: next(i for i, t in enumerate(ref) if t in eos) + 1]
    retrieval = RetrievalConfig(chunk_size=16, top_k=6, retrieve_every=2, prefill_window=64)
    for method, shape in [("autoregressive", "chain"), ("speculative", "chain"), ("streaming", "chain"),
                          ("specextend", "chain"), ("specextend", "tree")]:
        config = preset(method, max_new_tokens=NEW, eos_token_ids=eos, retrieval=retrieval, draft=DraftConfig(shape=shape))
        trace = list(generate(pair, prompt, fp32_prefill(config)))
        assert list(trace[-1].token_ids) == ref, (method, shape)


def test_real_pair_reading_the_prompt_in_bf16_agrees_across_methods(real):
    """Read in bf16 (what "auto" chooses on a CPU where it is faster), the prompt gives the target alone another
    reading to continue from; every method continues exactly as the target alone does from that same reading."""
    pair, prompt, eos = real
    retrieval = RetrievalConfig(chunk_size=16, top_k=6, retrieve_every=2, prefill_window=64)
    outputs = {}
    for method, shape in [("autoregressive", "chain"), ("specextend", "chain"), ("specextend", "tree")]:
        config = preset(method, max_new_tokens=NEW, eos_token_ids=eos, retrieval=retrieval, draft=DraftConfig(shape=shape))
        trace = list(generate(pair, prompt, config.replace(attention=replace(config.attention, bf16_prefill="on"))))
        assert trace[0].prefill_dtype == "bfloat16"
        outputs[(method, shape)] = trace[-1].token_ids
    assert len(set(outputs.values())) == 1, outputs


@pytest.mark.skipif(not numerics.packs_here(), reason="this CPU runs no oneDNN bf16 products (bf16-kv is not its default)")
def test_real_pair_in_the_cpu_default_numerics_is_lossless_for_chains_and_trees(real):
    """bf16-kv (the CPU default): every method and draft shape continues exactly as the target alone does in the same
    numerics, trees included: there a tree once left the target alone's output (hamlet at ~2K, token 40), since its
    nodes' keys sat in other slots than their tokens' would; now a node is attended as it will be once committed."""
    pair, prompt, eos = real
    retrieval = RetrievalConfig(chunk_size=16, top_k=6, retrieve_every=2, prefill_window=64)
    outputs, moved = {}, 0
    try:
        for method, shape in [("autoregressive", "chain"), ("specextend", "chain"), ("specextend", "tree"),
                              ("speculative", "tree")]:
            config = preset(method, max_new_tokens=2 * NEW, eos_token_ids=eos, retrieval=retrieval,
                            draft=DraftConfig(shape=shape), attention=AttentionConfig(numerics="bf16-kv"))
            trace = list(generate(pair, prompt, config))
            outputs[(method, shape)] = trace[-1].token_ids
            moved += sum(list(e.accepted_nodes) != list(range(len(e.accepted_nodes)))
                         for e in trace if isinstance(e, ev.Verified))
    finally:
        numerics.apply(pair.target, "fp32")
    assert len(set(outputs.values())) == 1, outputs
    assert moved >= 1  # some accepted path ran through nodes laid out after a sibling's


def fp32_prefill(config):
    """The prompt read in the model's own fp32, as reference_greedy reads it."""
    return config.replace(attention=replace(config.attention, bf16_prefill="off"))
