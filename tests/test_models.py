"""models.prepare: the few-row product path (SkinnyLinear) computes what nn.Linear computes, and swapping it in
keeps a model's parameters, names and tied weights. A draft folder with an output vocabulary loads a
ReducedVocabHead: its logits are the full head's on those tokens and -inf elsewhere, and greedy
decoding with it still equals the target's."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import VOCAB, reference_greedy, tiny
from specextend.config import DraftConfig, preset
from specextend.engine import generate
from specextend.events import Drafted
from specextend.models import SKINNY_ROWS, SkinnyLinear, load_model, make_pair, prepare
from specextend.vocab import DRAFT_VOCAB_FILE, ReducedVocabHead


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5, SKINNY_ROWS, SKINNY_ROWS + 1, 300])
@pytest.mark.parametrize("weight_major", [False, True, None], ids=["stock", "weight-major", "timed"])
def test_skinny_linear_equals_linear(rows, bias, weight_major, monkeypatch):
    torch.manual_seed(rows)
    stock = torch.nn.Linear(48, 80, bias=bias)
    skinny = torch.nn.Linear(48, 80, bias=bias)
    skinny.load_state_dict(stock.state_dict())
    skinny.__class__ = SkinnyLinear
    monkeypatch.setattr(SkinnyLinear, "weight_major", {})
    key = (80, 48, rows, torch.float32)
    if weight_major is not None:  # force one path; None lets the first call time both and keep the faster
        SkinnyLinear.weight_major[key] = weight_major
    x = torch.randn(1, rows, 48)  # (batch, rows, features), as a decoder layer feeds it
    got, want = skinny(x), stock(x)
    assert got.shape == want.shape == (1, rows, 80)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.sum().backward()  # the path stays differentiable
    assert skinny.weight.grad is not None and skinny.weight.grad.abs().sum() > 0
    assert (key in SkinnyLinear.weight_major) == (1 < rows <= SKINNY_ROWS or weight_major is not None)


def test_prepare_swaps_every_linear_and_keeps_names_and_ties():
    torch.manual_seed(0)
    tied = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    before = {k: v.clone() for k, v in tied.state_dict().items()}
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        want = tied(input_ids=ids).logits
    prepare(tied)
    linears = [m for m in tied.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is SkinnyLinear for m in linears)
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    after = tied.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    with torch.no_grad():
        torch.testing.assert_close(tied(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    untied = prepare(tiny("llama", layers=1))
    assert all(type(m) is SkinnyLinear for m in untied.modules() if isinstance(m, torch.nn.Linear))


def test_reduced_vocab_draft_loads_drafts_only_its_tokens_and_stays_lossless(tmp_path):
    full = tiny("llama", layers=1, hidden=32, heads=2, kv_heads=1, seed=2)
    full.save_pretrained(tmp_path)
    ids = list(range(0, VOCAB, 3)) + [VOCAB - 1]
    (tmp_path / DRAFT_VOCAB_FILE).write_text(json.dumps({"size": len(ids), "ids": ids}))
    draft = load_model(tmp_path, torch.device("cpu"), torch.float32)
    assert isinstance(draft.get_output_embeddings(), ReducedVocabHead)
    prompt = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = full(input_ids=prompt).logits, draft(input_ids=prompt).logits  # (1, 40, VOCAB)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    torch.testing.assert_close(got[..., ids], want[..., ids], rtol=1e-5, atol=1e-5)
    assert torch.isneginf(got[..., outside]).all()

    target = tiny("llama", layers=3, seed=1)
    pair = make_pair(target, draft)  # the vocabularies still match: the head speaks for all VOCAB tokens
    assert type(draft.get_output_embeddings().rows) is SkinnyLinear
    ref = reference_greedy(target, prompt[0].tolist(), 20)
    for method in ("speculative", "specextend"):
        for shape in ("chain", "tree"):
            trace = list(generate(pair, prompt[0].tolist(), preset(method, max_new_tokens=20,
                                                                     draft=DraftConfig(shape=shape))))
            assert list(trace[-1].token_ids) == ref, (method, shape)
            drafted = {t for e in trace if isinstance(e, Drafted) for t in e.tokens}
            assert drafted and drafted <= set(ids), (method, shape)


def test_an_older_transformers_is_refused_with_a_clear_message():
    from specextend.models import check_transformers

    check_transformers("5.24.0")
    check_transformers("6.1.0")
    with pytest.raises(RuntimeError, match="5.17.0 is too old"):
        check_transformers("5.17.0")


def test_fused_rms_norm_is_the_families_formula_and_stays_off_the_cpu():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from specextend.models import FUSED_ROWS, FusedRMSNorm, fuses_norms, prepare

    norm = LlamaRMSNorm(48, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(1, FUSED_ROWS + 1, 48)  # prefill-sized: the eager formula
    want = norm(x)
    norm.__class__ = FusedRMSNorm
    assert torch.equal(norm(x), want)
    model = prepare(tiny("llama", layers=1, seed=5))
    assert not fuses_norms(model)
    assert not any(isinstance(m, FusedRMSNorm) for m in model.modules())



def test_architectures_the_engine_cannot_run_exactly_are_refused_with_the_reason():
    from transformers import GemmaConfig, MistralConfig, Qwen3Config

    from specextend.compat import check_architecture

    check_architecture(MistralConfig(sliding_window=None))
    check_architecture(Qwen3Config())  # its window is off (use_sliding_window=False)
    with pytest.raises(ValueError, match="sliding window of 4096 tokens"):
        check_architecture(MistralConfig(sliding_window=4096, max_position_embeddings=32768))
    with pytest.raises(ValueError, match="model type 'gemma' is not supported"):
        check_architecture(GemmaConfig())
    windowed = tiny("mistral")
    windowed.config.sliding_window = 16
    with pytest.raises(ValueError, match="sliding window of 16 tokens"):
        make_pair(windowed, None)  # models built in memory are checked too
