"""Pairs decided before weights load: tokenizers compared id by id, padded embeddings accepted and kept out of the
draft's proposals, the usable context read with rope scaling, and a draft shorter-lived than the input."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from conftest import reference_greedy, save_tiny, tiny
from specextend import events as ev
from specextend.compat import check_architecture, context_length
from specextend.config import DraftConfig, RetrievalConfig, preset
from specextend.engine import generate
from specextend.models import load_pair, make_pair
from test_prompting import WORDS, word_tokenizer

IDS = len(WORDS)  # the word tokenizer's ids


def save(path, tokenizer, vocab_rows: int, seed: int, layers: int, weights: bool = True, max_positions: int = 4096):
    """A tiny untied Llama folder whose large random weights make every token depend on the context."""
    return save_tiny(path, tokenizer, vocab_rows, seed, layers, weights, max_positions, initializer_range=0.3,
                     tie_word_embeddings=False)


def test_same_size_tokenizers_that_differ_are_refused_before_any_weights_load(tmp_path):
    other = word_tokenizer(words=[w if w != "w7" else "w70" for w in WORDS])  # id 10 spells another string
    target = save(tmp_path / "target", word_tokenizer(), IDS, 1, 2, weights=False)  # no weights: loading them fails
    draft = save(tmp_path / "draft", other, IDS, 2, 1, weights=False)
    with pytest.raises(ValueError, match=r"tokenizers differ \(1 ids\): id 10 is 'w7' in the target's and 'w70' in"):
        load_pair(target, draft, "cpu", "float32")


def test_the_target_tokenizer_a_caller_gives_load_pair_is_the_one_checked_and_is_not_read_again(tmp_path, monkeypatch):
    import specextend.models as models

    target = save(tmp_path / "target", word_tokenizer(), IDS, 1, 2, weights=False)
    draft = save(tmp_path / "draft", word_tokenizer(), IDS, 2, 1, weights=False)
    read, real = [], models.read_tokenizer
    monkeypatch.setattr(models, "read_tokenizer", lambda source: read.append(source.name) or real(source))
    other = word_tokenizer(words=[w if w != "w7" else "w70" for w in WORDS])
    with pytest.raises(ValueError, match=r"tokenizers differ \(1 ids\): id 10 is 'w70' in the target's"):
        load_pair(target, draft, "cpu", "float32", tokenizer=other)
    assert read == ["draft"]


def test_a_draft_without_a_tokenizer_or_too_few_embedding_rows_is_refused(tmp_path):
    target = save(tmp_path / "target", word_tokenizer(), IDS, 1, 2, weights=False)
    short = save(tmp_path / "short", word_tokenizer(), IDS - 3, 2, 1, weights=False)
    with pytest.raises(ValueError, match=f"embedding has {IDS - 3} rows, fewer than the tokenizer's {IDS} ids"):
        load_pair(target, short, "cpu", "float32")
    bare = tmp_path / "bare"
    LlamaConfig(vocab_size=IDS, hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(bare)
    with pytest.raises(ValueError, match="tokenizer cannot be read"):
        load_pair(target, bare, "cpu", "float32")


def test_a_pair_that_differs_only_in_embedding_padding_runs_lossless_and_never_proposes_padding(tmp_path):
    """Qwen2.5 7B pads its embedding to 152,064 rows, 0.5B to 151,936, over one tokenizer: the same here in small."""
    target = save(tmp_path / "target", word_tokenizer(), IDS + 10, 1, 2)
    draft = save(tmp_path / "draft", word_tokenizer(), IDS + 3, 2, 1, max_positions=64)
    pair = load_pair(target, draft, "cpu", "float32")
    assert pair.vocab_size == IDS + 10 and pair.max_positions == 4096 and pair.draft_positions == 64
    with torch.no_grad():
        logits = pair.draft(input_ids=torch.tensor([[1, 5, 9]])).logits[0]  # (3, IDS + 10)
    assert logits.shape[-1] == IDS + 10 and torch.isneginf(logits[:, IDS:]).all() and torch.isfinite(logits[:, :IDS]).all()
    prompt = torch.randint(3, IDS, (150,), generator=torch.Generator().manual_seed(3)).tolist()  # past the draft's 64
    ref = reference_greedy(pair.target, prompt, 16)
    for method in ("speculative", "streaming", "specextend"):
        for shape in ("chain", "tree"):
            config = preset(method, max_new_tokens=16, draft=DraftConfig(shape=shape),
                            retrieval=RetrievalConfig(chunk_size=8, top_k=4, retrieve_every=2, prefill_window=24))
            trace = list(generate(pair, prompt, config))
            assert list(trace[-1].token_ids) == ref, (method, shape)
            drafted = {t for e in trace if isinstance(e, ev.Drafted) for t in e.tokens}
            assert drafted and max(drafted) < IDS, (method, shape)


def test_in_memory_pairs_without_tokenizers_must_have_one_width():
    from transformers import LlamaForCausalLM

    wider = LlamaForCausalLM(LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match=r"the target's vocabulary \(97 tokens\) and the draft's \(120 tokens\) differ"):
        make_pair(tiny("llama", seed=1), wider)


def test_the_usable_context_honours_rope_scaling_and_length_dependent_rope_is_refused():
    assert context_length(LlamaConfig(max_position_embeddings=4096, rope_scaling={"type": "linear", "factor": 4.0})) == 16384
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    assert context_length(LlamaConfig(max_position_embeddings=131072, rope_scaling=llama3)) == 131072
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert context_length(Qwen2Config(max_position_embeddings=32768, rope_scaling=yarn)) == 131072
    assert context_length(Qwen2Config(max_position_embeddings=32768)) == 32768
    with pytest.raises(ValueError, match="'dynamic' changes the frequencies with the length"):
        check_architecture(LlamaConfig(rope_scaling={"type": "dynamic", "factor": 2.0}))


def test_changing_pairs_frees_the_old_pair_and_a_short_draft_is_named(tmp_path):
    import weakref

    from app.backend import PairCache, real_factory
    from app.settings import PairChoice

    target = save(tmp_path / "target", word_tokenizer(), IDS, 1, 2)
    draft = save(tmp_path / "draft", word_tokenizer(), IDS, 2, 1, max_positions=64)
    cache = PairCache(real_factory)
    first = cache.get(PairChoice("a", "a", str(target), str(draft)), lambda message: None)
    assert first.draft_positions == 64 and first.max_positions == 4096
    old = weakref.ref(first.generate.args[0].target)
    del first
    second = cache.get(PairChoice("b", "b", str(draft), str(draft)), lambda message: None)
    assert old() is None and second.draft_positions is None  # a draft as long-lived as its target is not named
