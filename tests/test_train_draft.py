"""The draft-training script's data helpers (scripts/train_draft.py), on a tiny random Llama.

They decide what the bundled draft learns from, so their windows and masks must be exact: random
windows are real slices of the training stream, and on-policy windows hold the prompt, then the
draft's own answer from its output vocabulary, cut at eos, with a loss mask over real next tokens.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scripts import train_draft
from specextend.tools import bundled

EOS = 2
ROWS = torch.tensor([0, 2, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43])  # an output vocabulary


@given(n=st.integers(8, 200), window=st.integers(1, 8), count=st.integers(1, 5), seed=st.integers(0, 10_000))
@settings(max_examples=60, deadline=None)
def test_random_windows_are_slices_of_the_stream(n, window, count, seed):
    stream = torch.arange(1000, 1000 + n, dtype=torch.int32)  # distinct values: a row's start is its offset
    rows = train_draft.random_windows(stream, count, window, random.Random(seed))
    assert rows.shape == (count, window) and rows.dtype == torch.long
    for row in rows:
        start = int(row[0]) - 1000
        assert 0 <= start <= n - window
        assert torch.equal(row, stream[start:start + window].long())


def tiny_llama(uniform: bool = False):
    """A tiny random Llama. Large untied weights make the next token depend on the whole context;
    `uniform` zeroes the output layer, so every token (eos included) is equally likely."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, initializer_range=0.5, bos_token_id=1, eos_token_id=EOS,
                      pad_token_id=EOS)
    model = LlamaForCausalLM(cfg).eval()
    if uniform:
        model.lm_head.weight.data.zero_()
    return model


def prompts_of(seed: int, count: int, longest: int = 12) -> list[list[int]]:
    """Prompts of distinct lengths from ids 3..46: never eos (2) nor the pad id 47 used below."""
    rng = random.Random(seed)
    lengths = rng.sample(range(2, longest + 1), count)
    return [[1] + [rng.randrange(3, 47) for _ in range(n - 1)] for n in lengths]


@pytest.mark.parametrize("pad", [EOS, 47])  # the bundled pair pads with eos; 47 tells padding from eos
@pytest.mark.parametrize("rows", [None, ROWS, torch.tensor([5, EOS])])  # the last: eos half the time
@pytest.mark.parametrize("window", [24, 14])  # 14: the longest prompts leave room for fewer than max_new
def test_draft_answers_are_prompt_then_answer_cut_at_eos(pad, rows, window):
    model = tiny_llama(uniform=True)
    torch.manual_seed(1)
    prompts = prompts_of(0, 8)
    ids, mask = train_draft.draft_answers(model, prompts, rows, window=window, max_new=8, pad=pad, eos=EOS)
    assert ids.shape == mask.shape == (8, window)
    ended = 0
    for j, p in enumerate(prompts):
        assert ids[j, :len(p)].tolist() == p
        room = min(8, window - len(p))
        answer = ids[j, len(p):len(p) + room].tolist()
        answer = answer[: answer.index(EOS) + 1] if EOS in answer else answer
        assert len(answer) >= 1
        if rows is not None:
            assert set(answer) <= set(rows.tolist())
        length = len(p) + len(answer)
        assert (ids[j, length:] == pad).all()  # with pad 47, an eos left after the cut would show here
        assert torch.equal(mask[j], torch.arange(window) < length - 1)  # every real token predicts the next
        ended += answer[-1] == EOS
    if rows is not None and len(rows) == 2:
        assert ended >= 1  # all 8 answers running 8 (or their room) tokens without eos: about 1 in 10^10


def test_batched_left_padded_sampling_matches_one_prompt_at_a_time():
    """A near-zero temperature makes sampling greedy; the batch pads prompts of different lengths on the
    left, so its answers equal each prompt's own only if the attention mask hides the padding."""
    model = tiny_llama()
    prompts = prompts_of(3, 5)
    assert len({len(p) for p in prompts}) == 5
    together, _ = train_draft.draft_answers(model, prompts, None, 32, 10, EOS, EOS, temperature=1e-4)
    for j, p in enumerate(prompts):
        alone, _ = train_draft.draft_answers(model, [p], None, 32, 10, EOS, EOS, temperature=1e-4)
        assert torch.equal(together[j], alone[0])


def test_draft_answers_leave_the_model_in_its_mode():
    model = tiny_llama()
    for mode in (True, False):
        model.train(mode)
        train_draft.draft_answers(model, prompts_of(5, 2), None, 16, 3, EOS, EOS)
        assert model.training is mode


def test_parse_mix_normalises_shares_and_rejects_unknown_sources():
    assert train_draft.parse_mix("shakespeare:1") == [("shakespeare", 1.0)]
    assert train_draft.parse_mix("shakespeare:3,sotu:1") == [("shakespeare", 0.75), ("sotu", 0.25)]
    for bad in ("gutenberg:1", "shakespeare:0", "shakespeare:-1,sotu:2"):
        with pytest.raises(ValueError, match="bad --corpus"):
            train_draft.parse_mix(bad)


def test_corpus_windows_are_one_sources_text_cut_and_cached(tmp_path, monkeypatch):
    """Each source is tokenized on its own, cut into whole windows, and cached under its own name."""
    from transformers import AutoTokenizer

    tok_dir = bundled.target_dir()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    texts = {"a": [("a:1", "The first text. " * 40), ("a:2", "A second one, shorter. " * 30)],
             "b": [("b:1", "Quite another source altogether. " * 50)]}
    monkeypatch.setattr(train_draft.pd_corpus, "CACHE", tmp_path)
    monkeypatch.setattr(train_draft.pd_corpus, "SOURCES", {k: (lambda v=v: v) for k, v in texts.items()})
    for name, pairs in texts.items():
        windows = train_draft.corpus_windows(tok_dir, 16, name)
        expect = []
        for _, text in pairs:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            expect += [ids[i:i + 16] for i in range(0, len(ids) - 15, 16)]
        assert windows.tolist() == expect
        assert (tmp_path / f"corpus-ids-{name}-16.pt").is_file()
    monkeypatch.setattr(train_draft.pd_corpus, "SOURCES", {})  # a second call reads the cache only
    assert train_draft.corpus_windows(tok_dir, 16, "b").shape[1] == 16


def test_a_draft_cut_from_the_target_ships_without_its_embedding_and_loads_with_the_target(tmp_path, monkeypatch):
    from safetensors import safe_open

    from specextend.models import load_model

    target = tiny_llama()
    for p in target.parameters():  # bf16-exact weights: saving loses nothing (buffers such as RoPE's stay float32)
        p.data = p.data.bfloat16().float()
    target.config.tie_word_embeddings = True
    target.tie_weights()
    draft = train_draft.cut_target(target, [1])
    assert target.config.num_hidden_layers == 2 and len(target.model.layers) == 2  # the target is untouched
    assert draft.config.num_hidden_layers == 1 and draft.model.layers[0].self_attn.layer_idx == 0
    assert torch.equal(draft.model.layers[0].mlp.up_proj.weight, target.model.layers[1].mlp.up_proj.weight)
    ids = torch.randint(3, 47, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = draft(input_ids=ids).logits  # (1, 12, 48)

    monkeypatch.setattr(train_draft.bundled, "target_dir", lambda: tmp_path / "no-tokenizer")
    out = tmp_path / "draft"
    train_draft.save(draft, out, {"steps": 0}, sub=None)
    assert draft.model.embed_tokens.weight.dtype == torch.float32  # saving leaves the trained model alone
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.up_proj.weight" in names
    assert not names & {"model.embed_tokens.weight", "lm_head.weight"}

    with pytest.raises(ValueError, match="together with the target"):
        load_model(out, torch.device("cpu"), torch.float32)
    loaded = load_model(out, torch.device("cpu"), torch.float32, target=target)
    assert loaded.get_input_embeddings() is target.get_input_embeddings()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("total, order", [(2, [0, 1]), (3, [0, 0, 1]), (5, [0, 0, 0, 1, 1]), (4, [0, 0, 1, 1])])
def test_growing_a_draft_deepens_it_without_changing_its_output(tmp_path, monkeypatch, total, order):
    from specextend.models import load_model

    model = tiny_llama()
    for p in model.parameters():  # bf16-exact weights: saving loses nothing
        p.data = p.data.bfloat16().float()
    old = list(model.model.layers)
    ids = torch.randint(3, 47, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(input_ids=ids).logits  # (2, 12, 48)
    train_draft.grow_layers(model, total)
    layers = model.model.layers
    assert model.config.num_hidden_layers == len(layers) == total
    assert [j.self_attn.layer_idx for j in layers] == list(range(total))
    kept = [j for j in layers if any(j is o for o in old)]
    assert kept == old  # the old blocks, in order
    for j, source in zip(layers, order):  # each new block copies the input side of the block before it
        assert torch.equal(j.self_attn.q_proj.weight, old[source].self_attn.q_proj.weight)
        new = not any(j is o for o in old)
        assert new == bool((j.self_attn.o_proj.weight == 0).all() and (j.mlp.down_proj.weight == 0).all())
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cannot grow"):
        train_draft.grow_layers(model, total - 1)

    monkeypatch.setattr(train_draft.bundled, "target_dir", lambda: tmp_path / "no-tokenizer")
    train_draft.save(model, tmp_path / "grown", {"steps": 0}, sub=None)
    loaded = load_model(tmp_path / "grown", torch.device("cpu"), torch.float32)
    assert loaded.config.num_hidden_layers == total
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
