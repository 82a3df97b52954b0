"""The draft-training script's data helpers (scripts/train_draft.py), on a tiny random Llama.

They decide what the bundled draft learns from, so their windows and masks must be exact: random
windows are real slices of the training stream, and on-policy windows hold the prompt, then the
draft's own answer from its output vocabulary, cut at eos, with a loss mask over real next tokens.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scripts import compact_weights, train_draft
from specextend import compact
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
    names = set(compact.shapes(out / compact.COMPACT_FILE))  # its weights compact, no safetensors beside them
    assert not (out / compact_weights.ORDINARY).exists()
    assert "model.layers.0.mlp.up_proj.weight" in names
    assert not names & {"model.embed_tokens.weight", "lm_head.weight"}

    with pytest.raises(ValueError, match="together with the target"):
        load_model(out, torch.device("cpu"), torch.float32)
    loaded = load_model(out, torch.device("cpu"), torch.float32, target=target)
    assert loaded.get_input_embeddings() is target.get_input_embeddings()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


def training_target(folder):
    """A tiny random target with the bundled target's tokenizer (its chat template makes the on-policy
    prompts), saved under `folder` as the script reads a target."""
    import shutil

    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    real = AutoConfig.from_pretrained(bundled.target_dir())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=real.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=real.bos_token_id, eos_token_id=real.eos_token_id,
                      pad_token_id=real.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(bundled.target_dir() / name, folder / name)


def teacher_shards(folder, window: int):
    """Random teacher rows as the data scripts write them: 10 text rows (8 held back) and 3 chat rows."""
    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    for name, n in (("plain-0000", 10), ("chat-0000", 3)):
        shard = {"input_ids": torch.randint(0, 5000, (n, window), generator=g, dtype=torch.int32),
                 "topk_ids": torch.randint(0, 5000, (n, window, 4), generator=g, dtype=torch.int32),
                 "topk_logp": -torch.rand(n, window, 4, generator=g).sort(-1).values.half()}
        if name.startswith("chat"):
            shard["mask"] = torch.arange(window).expand(n, window) >= window // 2
        torch.save(shard, folder / f"{name}.pt")


def test_a_training_run_draws_every_batch_kind_saves_a_loadable_draft_and_repeats_with_its_seed(tmp_path, monkeypatch):
    """The script end to end on a tiny target: every batch kind (on-policy answers, online and text windows,
    teacher rows, replay) trains, the counters add up, a seed repeats a run exactly, and --init continues it."""
    from specextend.models import SHARED_TOKENIZER, load_model
    from specextend.vocab import read_output_vocab

    target = tmp_path / "target"
    training_target(target)
    teacher_shards(tmp_path / "teacher", 512)
    words = "the king and his court rode out at dawn to meet the army of the north while the queen waited".split()
    rng = random.Random(0)
    texts = {name: [(f"{name}:1", "\n".join(" ".join(rng.choices(words, k=12)) for _ in range(400)))]
             for name in ("a", "b")}
    monkeypatch.setattr(train_draft.bundled, "target_dir", lambda: target)
    monkeypatch.setattr(train_draft.pd_corpus, "CACHE", tmp_path)
    monkeypatch.setattr(train_draft.pd_corpus, "SOURCES", {k: (lambda v=v: v) for k, v in texts.items()})

    def run(out, *flags):
        argv = ["train_draft", "--teacher", str(tmp_path / "teacher"), "--out", str(tmp_path / out), "--batch", "2",
                "--warmup", "2", "--minutes", "1e9", *flags]  # a budget this long keeps the cosine at its top
        monkeypatch.setattr("sys.argv", argv)
        train_draft.main()
        folder = tmp_path / out
        return folder, json.loads((folder / "train_record.json").read_text()), compact.read(folder / compact.COMPACT_FILE)

    fresh = ["--layers", "1", "--hidden", "16", "--heads", "2", "--kv-heads", "1", "--ff", "32", "--vocab", "300",
             "--policy-share", "0.3", "--online-share", "0.3", "--text-share", "0.2", "--replay", "1",
             "--offsets", "random", "--corpus", "a:1,b:1", "--max-steps", "12", "--seed", "3"]
    folder, record, weights = run("a", *fresh)
    seen = {k: record[f"{k}_seen"] for k in ("tokens", "text_tokens", "online_tokens", "policy_tokens", "replay_tokens")}
    assert record["steps"] == 12 and record["log"][-1]["step"] == 12
    assert all(seen.values()), seen  # every kind drew at least one batch
    assert seen["tokens"] > seen["text_tokens"] + seen["online_tokens"] + seen["policy_tokens"]  # and teacher rows
    assert record["output_vocabulary"] == 300 and len(read_output_vocab(folder)) == 300
    draft = load_model(folder, torch.device("cpu"), torch.float32)
    assert draft.config.num_hidden_layers == 1 and draft.config.hidden_size == 16
    config = json.loads((folder / "config.json").read_text())  # it ships no tokenizer: it reads its target's
    assert config[SHARED_TOKENIZER] == compact_weights.target_digest(target) and not (folder / "tokenizer.json").exists()

    _, again, same = run("a-again", *fresh)
    assert again["log"][-1] == {**record["log"][-1], **{k: again["log"][-1][k] for k in ("minutes", "tok_per_s")}}
    assert all(torch.equal(same[name], w) for name, w in weights.items())

    _, continued, _ = run("b", "--init", str(folder), "--hidden", "64", "--text-share", "1", "--corpus", "a:1",
                          "--max-steps", "3")
    assert continued["hidden"] == 16 and continued["output_vocabulary"] == 300  # the folder's, not the flags'
    assert continued["text_tokens_seen"] == continued["tokens_seen"] > 0
