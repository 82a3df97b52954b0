"""The online head pipeline at tiny scale (scripts/head_data.py, scripts/head_train_online.py): batched answers equal
one-at-a-time ones and resume where they stopped; the stream's position is all a resume needs; generate -> online
features -> training with training-time test -> checkpoint -> resume continues exactly as an uninterrupted run; the
curve grows; the head is written in the bundled format and loads; training text that shares a run of words with a
figure's document is refused."""

from __future__ import annotations

import argparse
import itertools

import numpy as np
import pytest
import torch
from conftest import VOCAB, tiny
from hypothesis import given, settings
from hypothesis import strategies as st

from scripts import head_data, head_train_online, pd_corpus
from scripts.head_data import Position
from specextend.heads import load_head

STOP = (5,)
PAD = 0


def prompter(passage: list[int], instruction: str) -> list[int]:
    """A stand-in chat template: start, the passage, the instruction's number (a written request's: its genre's, its
    topic's and its voice's), end of turn."""
    if instruction in head_data.INSTRUCTIONS:
        return [1, *passage, 2, 10 + head_data.INSTRUCTIONS.index(instruction), 3]
    if instruction in head_data.TECH_INSTRUCTIONS:
        return [1, *passage, 2, 60 + head_data.TECH_INSTRUCTIONS.index(instruction), 3]
    genre, topic, voice = next((g, t, v) for g in head_data.GENRES for t in head_data.TOPICS for v in head_data.VOICES
                               if g.format(topic=t) + v == instruction)
    number = head_data.TOPICS.index(topic)
    return [1, *passage, 2, 30 + head_data.GENRES.index(genre), 45 + number // 40, 50 + number % 40,
            21 + head_data.VOICES.index(voice), 3]


@pytest.fixture(scope="module")
def target():
    model = tiny("llama", layers=6, seed=3)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@pytest.fixture(scope="module")
def corpus_ids() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(6, VOCAB, size=9 * head_data.BLOCK, dtype=np.uint16)  # 9 blocks: block 7 is held out


def work_folder(folder, corpus_ids):
    """A work folder holding only the corpus's ids."""
    folder.mkdir()
    np.save(folder / "corpus.npy", corpus_ids)
    return folder


def test_batched_answers_are_the_one_at_a_time_answers(target, corpus_ids):
    corpus = head_data.Corpus(corpus_ids)
    prompts = [head_data.request(corpus, prompter, 0, i, False, 12) for i in range(5)]
    assert len({len(p) for p in prompts}) > 1  # left padding is exercised
    batched = head_data.greedy_answers(target, prompts, 6, STOP, PAD, batch=5)
    single = [head_data.greedy_answers(target, [p], 6, STOP, PAD, batch=1)[0] for p in prompts]
    assert batched == single and all(0 < len(a) <= 6 for a in batched)


def test_answers_resume_after_the_last_shard(tmp_path, target, corpus_ids):
    corpus = head_data.Corpus(corpus_ids)
    common = dict(held=False, seed=1, doc_tokens=12, max_new=4, stop=STOP, pad=PAD, batch=3, shard=2, say=lambda _: None)
    budget = iter([1.0, -1.0])  # one shard, then the time is up
    assert head_data.answer_requests(target, corpus, prompter, tmp_path / "a", count=5, time_left=lambda: next(budget),
                                     **common) == 2
    assert head_data.answer_requests(target, corpus, prompter, tmp_path / "a", count=5, **common) == 5
    head_data.answer_requests(target, corpus, prompter, tmp_path / "b", count=5, **common)
    resumed, straight = head_data.read_chats(tmp_path / "a"), head_data.read_chats(tmp_path / "b")
    assert [c.ids for c in resumed] == [c.ids for c in straight] and [c.index for c in resumed] == list(range(5))
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["part-000000.pt", "part-000002.pt", "part-000004.pt"]
    chat = resumed[0]
    assert chat.ids[:chat.prompt_len] == head_data.request(corpus, prompter, 1, 0, False, 12)


def test_the_stream_is_a_function_of_its_position_and_keeps_held_blocks_out(corpus_ids):
    corpus = head_data.Corpus(corpus_ids)
    chats = [head_data.Chat(i, [7, 8, i], 2) for i in range(3)]
    stream = head_data.Stream(corpus, chats, 32, 0.5, seed=0)
    first, mid = stream.take(Position(), 5)
    second, end = stream.take(mid, 5)
    whole, end2 = stream.take(Position(), 10)
    assert first + second == whole and end == end2 == Position(10, 3, 7, 0)  # chats run out after 3: windows then
    assert [s for s in whole if len(s) == 3] == [c.ids for c in chats]
    held = range(7 * head_data.BLOCK, 8 * head_data.BLOCK)
    assert all(s not in held for s in stream.starts) and len(stream.starts) == 8 * head_data.BLOCK // 32
    assert all(s in held for s in corpus.windows(32, held=True))


def arguments(work, **changes):
    args = head_train_online.parse_args([
        "--work", str(work), "--answers", "6", "--held-chats", "3", "--held-windows", "3", "--doc-tokens", "12",
        "--max-new", "5", "--gen-batch", "4", "--shard", "4", "--window", "24", "--batch", "3", "--unroll", "5",
        "--topk", "4", "--draft-vocab", "40", "--vocab-sample", "6", "--eval-every", "1", "--lr", "3e-3",
        "--warmup-tokens", "50", "--schedule-tokens", "2000", "--threads", "1"])
    for name, value in changes.items():
        setattr(args, name, value)
    return args


def curve(work):
    import json

    return [json.loads(line) for line in (work / head_train_online.CURVE).read_text().splitlines()]


def test_generate_train_checkpoint_resume_and_evaluate(tmp_path, target, corpus_ids):
    say = lambda _: None  # noqa: E731
    straight = work_folder(tmp_path / "straight", corpus_ids)
    record = head_train_online.run(arguments(straight, steps=6), target, prompter, PAD, STOP, say)

    split = work_folder(tmp_path / "split", corpus_ids)
    head_train_online.run(arguments(split, steps=3), target, prompter, PAD, STOP, say)
    first = curve(split)
    resumed = head_train_online.run(arguments(split, steps=6, resume=True), target, prompter, PAD, STOP, say)
    rows, whole = curve(split), curve(straight)

    assert len(rows) > len(first) and [r["step"] for r in rows] == list(range(7))  # the curve grew, one row a step
    assert [r["loss"] for r in rows] == [r["loss"] for r in whole]  # the resumed run continues exactly
    assert [r["held_agree"] for r in rows] == [r["held_agree"] for r in whole]
    assert resumed["data"]["position"] == record["data"]["position"] and resumed["tokens_seen"] == record["tokens_seen"]
    one, two = (torch.load(w / head_train_online.CHECKPOINT, weights_only=False) for w in (straight, split))
    assert all(torch.equal(one["head"][k], two["head"][k]) for k in one["head"])
    assert one["opt"]["state"][0]["step"] == two["opt"]["state"][0]["step"] == 6

    assert record["data"]["answers"]["requests"] == 6 and record["data"]["held"]["requests"] == 3
    assert record["data"]["position"]["chat"] == 6 and record["unroll"] == 5 and record["draft_vocab"] == 40
    assert len(whole[-1]["held_agree"]) == 5 and 0.0 <= whole[-1]["held_chain"] <= 5.0
    last = whole[-1]  # the held-out chats and plain windows apart: the whole set's agreement lies between them
    assert len(last["held_agree_chats"]) == len(last["held_agree_plain"]) == 5
    assert all(min(c, w) - 1e-4 <= a <= max(c, w) + 1e-4
               for a, c, w in zip(last["held_agree"], last["held_agree_chats"], last["held_agree_plain"]))
    assert whole[-1]["loss"] < whole[1]["loss"]  # it learns
    head = load_head(straight / "head", target, torch.device("cpu"), torch.float32)  # the bundled format, loadable
    assert len(head.d2t) == 40 and int(head.t2d.sum()) == 40


def test_written_requests_keep_held_topics_apart_and_follow_the_answers_in_the_stream(tmp_path, target, corpus_ids):
    topic = lambda ids: head_data.TOPICS[(ids[-4] - 45) * 40 + ids[-3] - 50]  # noqa: E731  (the stand-in's number)
    every = len(head_data.written_instructions(0, held=False))
    train = [head_data.written_request(prompter, 0, i, held=False) for i in range(every)]
    held = [head_data.written_request(prompter, 0, i, held=True) for i in range(400)]
    assert train[:60] == [head_data.written_request(prompter, 0, i, held=False) for i in range(60)]  # pure
    assert len({tuple(p) for p in train}) == every == 10_560  # drawn without replacement: no text written twice
    assert not {topic(p) for p in train} & {topic(p) for p in held}  # no held-out topic is trained on
    assert all(head_data.TOPICS.index(topic(p)) % head_data.HELD_TOPIC_EVERY == 0 for p in held)
    assert len({p[-3] for p in train[:100]}) > 30 and len({p[-2] for p in train[:100]}) == len(head_data.VOICES)
    assert all(len(p) == 7 for p in train)  # no document: start, end of passage, genre, topic (two ids), voice, end
    with pytest.raises(ValueError, match="distinct"):
        head_data.written_request(prompter, 0, every, held=False)

    work = work_folder(tmp_path / "w", corpus_ids)
    say = lambda _: None  # noqa: E731
    record = head_train_online.run(arguments(work, steps=4, answers=2, written=4, write_new=3, held_written=2), target,
                                   prompter, PAD, STOP, say)
    written = head_data.read_chats(work / "written")
    assert [c.ids[:c.prompt_len] for c in written] == train[:4] and all(len(c.ids) - c.prompt_len <= 3 for c in written)
    assert record["data"]["written"]["requests"] == 4 and record["data"]["answers"]["requests"] == 2
    held_written = head_data.read_chats(work / "held-written")  # the curve reads the target's texts on held-out topics
    assert [c.ids[:c.prompt_len] for c in held_written] == held[:2] and record["data"]["held-written"]["requests"] == 2
    last = curve(work)[-1]  # each kind apart: the whole set's agreement lies between the kinds'
    kinds = [last[f"held_agree_{k}"] for k in ("plain", "chats", "written")]  # no technical text in this run
    assert not {f"held_agree_{k}" for k in head_train_online.KINDS} - {f"held_agree_{k}" for k in ("plain", "chats",
                                                                                                  "written")} & set(last)
    assert all(len(k) == 5 for k in kinds) and all(min(ks) - 1e-4 <= a <= max(ks) + 1e-4
                                                   for a, *ks in zip(last["held_agree"], *kinds))
    # 12 items at half chats: the 2 answered requests first, then the 4 written ones
    assert record["data"]["position"] == {"item": 12, "chat": 2, "plain": 6, "written": 4, "tech": 0, "tech_plain": 0}
    # answers added on a resume are read next, and no written chat is read twice
    resumed = head_train_online.run(arguments(work, steps=6, answers=4, written=4, write_new=3, resume=True), target,
                                    prompter, PAD, STOP, say)
    assert resumed["data"]["position"] == {"item": 18, "chat": 4, "plain": 10, "written": 4, "tech": 0,
                                           "tech_plain": 0}
    assert resumed["data"]["distinct_tokens"] == sum(len(c.ids) for c in head_data.read_chats(work / "answers")
                                                     + written) + 10 * 24


def test_technical_requests_and_windows_come_from_the_technical_corpus_and_resume_where_they_stopped(
        tmp_path, target, corpus_ids):
    tech_ids = np.random.default_rng(1).integers(6, VOCAB, size=9 * head_data.BLOCK, dtype=np.uint16)
    tech = head_data.Corpus(tech_ids)
    asked = [head_data.request(tech, prompter, 0, i, False, 12, kind="tech") for i in range(40)]
    assert {p[-2] for p in asked} <= {60 + i for i in range(len(head_data.TECH_INSTRUCTIONS))}  # its own tasks
    assert len({p[-2] for p in asked}) > 3 and asked[0] != head_data.request(tech, prompter, 0, 0, False, 12)
    held = range(7 * head_data.BLOCK, 8 * head_data.BLOCK)
    text = lambda p: tuple(p[1:-3])  # noqa: E731  (the passage)
    held_texts = {tuple(tech_ids[s:s + 4]) for s in range(held.start, held.stop - 3)}
    assert all(text(p)[:4] not in held_texts for p in asked)  # training requests keep the held-out block out
    with pytest.raises(ValueError, match="no request kind"):
        head_data.answer_requests(target, tech, prompter, tmp_path / "x", count=1, held=False, seed=0, doc_tokens=12,
                                  max_new=3, stop=STOP, pad=PAD, batch=1, shard=1, kind="poem")

    work = work_folder(tmp_path / "t", corpus_ids)
    np.save(work / "tech.npy", tech_ids)
    say = lambda _: None  # noqa: E731
    common = dict(answers=2, written=2, write_new=3, tech=3, held_tech=2, held_tech_windows=2, tech_windows=0.5)
    record = head_train_online.run(arguments(work, steps=4, **common), target, prompter, PAD, STOP, say)
    chats = head_data.read_chats(work / "tech")
    assert [c.ids[:c.prompt_len] for c in chats] == asked[:3] and record["data"]["tech"]["requests"] == 3
    assert record["data"]["held-tech"]["requests"] == 2 and record["data"]["tech_tokens"] == len(tech_ids)
    # 12 items at half chats: the 2 answered requests, then written and technical ones by turns (--tech-share 0.5);
    # half the 6 windows technical
    assert record["data"]["position"] == {"item": 12, "chat": 2, "plain": 3, "written": 2, "tech": 2, "tech_plain": 3}
    last = curve(work)[-1]
    assert len(last["held_agree_tech"]) == len(last["held_agree_tech_chats"]) == 5
    assert last["held_positions"] == sum(len(s) - 1 for s in (
        [c.ids[:24] for c in head_data.read_chats(work / "held")] + head_data.held_out(
            head_data.Corpus(corpus_ids), [], 24, 3) + head_data.held_out(tech, head_data.read_chats(
                work / "held-tech"), 24, 2)))
    stream = head_data.Stream(head_data.Corpus(corpus_ids), [], 24, 0.0, 0, tech=tech, tech_windows=1.0)
    seqs, _ = stream.take(Position(), 3)
    starts = [next(s for s in stream.tech_starts if tech_ids[s:s + 24].tolist() == q) for q in seqs]
    assert starts == stream.tech_starts[:3] and all(s not in held for s in stream.tech_starts)
    mixed = head_data.Stream(head_data.Corpus(corpus_ids), [], 24, 1.0, 0, [head_data.Chat(i, [8, i], 1) for i in range(4)],
                             tech, [head_data.Chat(i, [9, i], 1) for i in range(3)], tech_share=0.25)
    seqs, end = mixed.take(Position(), 8)  # a technical request every 4 chats; once the written run out, technical ones
    assert [s[0] for s in seqs[:7]] == [8, 8, 8, 9, 8, 9, 9] and (end.tech, end.written, end.tech_plain) == (3, 4, 0)
    # a resume with no technical windows left reads the corpus's from where they stopped: 6 items, the last technical
    # request, then windows (the chats run out)
    resumed = head_train_online.run(arguments(work, steps=6, **common | {"tech_windows": 0.0, "tech_share": 1.0},
                                              resume=True), target, prompter, PAD, STOP, say)
    assert resumed["data"]["position"] == {"item": 18, "chat": 2, "plain": 8, "written": 2, "tech": 3,
                                           "tech_plain": 3}
    assert resumed["data"]["distinct_tokens"] == sum(len(c.ids[:24]) for c in head_data.read_chats(work / "answers")
                                                     + chats + head_data.read_chats(work / "written")) + 11 * 24


def test_a_fresh_start_and_an_init_from_a_head_folder_share_the_vocabulary(tmp_path, target, corpus_ids):
    work = work_folder(tmp_path / "a", corpus_ids)
    head_train_online.run(arguments(work, steps=1, answers=0), target, prompter, PAD, STOP, lambda _: None)
    again = work_folder(tmp_path / "b", corpus_ids)
    record = head_train_online.run(arguments(again, steps=1, answers=0, init=work / "head"), target, prompter, PAD,
                                   STOP, lambda _: None)
    one, two = (torch.load(w / head_train_online.CHECKPOINT, weights_only=False) for w in (work, again))
    assert torch.equal(one["vocab_ids"], two["vocab_ids"]) and record["draft_vocab"] == 40
    assert set(STOP) <= set(one["vocab_ids"].tolist())  # the end ids are always draftable


def test_training_text_sharing_a_run_of_words_with_a_figures_document_is_refused(monkeypatch):
    figure = [("doc", "The quality of mercy is not strained; it droppeth as the gentle rain from heaven upon the place")]
    quoting = [("play", "PORTIA. the quality of MERCY is not strained, it droppeth as the gentle rain from heaven.")]
    assert pd_corpus.shared_runs(quoting, figure) == [
        ("play", "doc", "the quality of mercy is not strained it droppeth as the gentle")]  # the first run of 12 words
    assert pd_corpus.shared_runs([("play", "the quality of mercy is not strained at all")], figure) == []
    monkeypatch.setattr(pd_corpus, "figure_texts", lambda: figure)
    with pytest.raises(ValueError, match="play shares 'the quality of mercy"):
        pd_corpus.check_disjoint(quoting)
    pd_corpus.check_disjoint([("play", "the quality of mercy is not strained at all")])


def test_a_run_out_of_time_still_writes_its_curve_checkpoint_and_head(tmp_path, target, corpus_ids):
    work = work_folder(tmp_path / "late", corpus_ids)
    clock = head_train_online.Clock(minutes=0, reserve_s=0)
    clock.stop()  # as SIGTERM does: every phase is skipped, the end still runs
    record = head_train_online.run(arguments(work), target, prompter, PAD, STOP, lambda _: None, clock)
    assert record["steps"] == 0 and record["data"]["answers"]["requests"] == 0  # no answer, no step
    assert len(curve(work)) == 1 and (work / head_train_online.CHECKPOINT).is_file()
    assert curve(work)[0]["held_positions"] == 3 * 23  # three held-out windows of 24 tokens, 23 positions each
    assert load_head(work / "head", target, torch.device("cpu"), torch.float32) is not None


def test_written_requests_stop_at_the_splits_distinct_instructions(tmp_path, target, corpus_ids, monkeypatch):
    """Asked for more written requests than a split has distinct instructions, the target answers each once."""
    few = head_data.written_instructions(0, held=False)[:3]
    monkeypatch.setattr(head_data, "written_instructions", lambda seed, held: few)
    done = head_data.answer_requests(target, head_data.Corpus(corpus_ids), prompter, tmp_path / "written", count=5,
                                     held=False, seed=0, doc_tokens=12, max_new=3, stop=STOP, pad=PAD, batch=4, shard=2,
                                     say=lambda _: None, kind="written")
    chats = head_data.read_chats(tmp_path / "written")
    assert done == len(chats) == 3 and len({tuple(c.ids[:c.prompt_len]) for c in chats}) == 3


def test_a_resumed_head_grows_its_vocabulary_by_the_targets_most_written_tokens(tmp_path, target, corpus_ids):
    say = lambda _: None  # noqa: E731
    work = work_folder(tmp_path / "g", corpus_ids)
    head_train_online.run(arguments(work, steps=3, answers=6, written=4, write_new=4), target, prompter, PAD, STOP, say)
    before = torch.load(work / head_train_online.CHECKPOINT, weights_only=False)
    chats = head_data.read_chats(work / "answers") + head_data.read_chats(work / "written")
    written = [t for c in chats for t in c.ids[c.prompt_len:]]
    missing = {t for t in written if t not in set(before["vocab_ids"].tolist())}
    assert missing  # the tiny run's vocabulary (40 of VOCAB ids) lacks some of the answers' tokens

    extra = head_train_online.most_written(chats, before["vocab_ids"], VOCAB, 1000)
    assert set(extra.tolist()) == missing  # only ids the answers hold and the vocabulary lacks, however many are asked
    counts = [written.count(int(t)) for t in extra]
    assert counts == sorted(counts, reverse=True)  # most written first

    record = head_train_online.run(arguments(work, steps=5, resume=True, grow_vocab=3), target, prompter, PAD, STOP,
                                   say)
    after = torch.load(work / head_train_online.CHECKPOINT, weights_only=False)
    ids, old = after["vocab_ids"], before["vocab_ids"]
    assert record["draft_vocab"] == len(ids) == 43 and torch.equal(ids, torch.sort(ids).values)
    assert set(ids.tolist()) == set(old.tolist()) | set(extra[:3].tolist())
    assert after["state"]["step"] == 5 and all(r["loss"] is None or r["loss"] == r["loss"] for r in curve(work))
    head = load_head(work / "head", target, torch.device("cpu"), torch.float32)  # written and loadable at its new size
    assert len(head.d2t) == 43 and int(head.t2d.sum()) == 43


def test_growing_the_vocabulary_keeps_the_old_rows_and_their_moments_and_adds_the_targets(target):
    from scripts.train_head import draft_index, make_head

    old = torch.tensor([i for i in range(2, VOCAB) if i != 7][:80])
    head = make_head(target, old).float()
    rows = target.get_output_embeddings().weight
    assert len(old) >= rows.shape[1]  # enough old rows to fix the map they went through
    turn = 1.5 * torch.linalg.qr(torch.randn(rows.shape[1], rows.shape[1], dtype=torch.float64)).Q  # a rotation, scaled
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params)
    head.draft_logits(torch.randn(1, 3, head.config.hidden_size)).sum().backward()
    opt.step()  # moments to carry over
    with torch.no_grad():  # trained rows: the target's through one linear map
        head.lm_head.weight.copy_((rows[old].double() @ turn).float())
    extra = torch.tensor([7, 1])
    grown, ids, state = head_train_online.grow_vocab(head, old, extra, target, opt.state_dict())
    assert ids.tolist() == sorted([*old.tolist(), 7, 1])
    at = draft_index(ids, VOCAB)
    assert torch.equal(grown.lm_head.weight[at[old]], head.lm_head.weight)  # each old id keeps its trained row
    # a new id's row: the target's through the same map (what training did to the old rows)
    want = rows[extra].double() @ turn
    assert (grown.lm_head.weight[at[extra]].double() - want).norm() < 1e-3 * want.norm()
    assert (rows[extra] - want).norm() > 0.5 * want.norm()  # not the target's own rows
    assert torch.equal(grown.fc.weight, head.fc.weight)
    k = [p is head.lm_head.weight for p in params].index(True)
    moments, before = state["state"][k], opt.state_dict()["state"][k]
    assert moments["exp_avg"].shape == (82, head.config.hidden_size)
    assert torch.equal(moments["exp_avg"][at[old]], before["exp_avg"]) and not moments["exp_avg"][at[extra]].any()
    fresh = torch.optim.AdamW([p for p in grown.parameters() if p.requires_grad])
    fresh.load_state_dict(state)  # the grown state fits the grown head's parameters
    assert torch.equal(grown.d2t + torch.arange(82), ids)


def test_the_share_in_the_draft_vocabulary_counts_the_first_draft_tokens_positions():
    from scripts.head_measure import in_vocab
    from scripts.train_head import draft_index

    top = torch.tensor([[[9], [3], [4], [3]], [[3], [4], [8], [0]]])  # (B, T, K=1): the target's argmax per position
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])  # the second row padded at its end
    to_draft = draft_index(torch.tensor([3, 8]), VOCAB)
    # the first draft token's positions are 1.. where the position before is real: ids 3, 4, 3 and 4, 8
    assert in_vocab([{"top_id": top, "mask": mask}], to_draft) == round(3 / 5, 4)


def test_the_first_tokens_agreement_by_the_targets_confidence_splits_the_positions_evaluate_counts(target):
    from scripts.head_measure import by_confidence, first_token_hits
    from scripts.train_head import draft_index, make_head

    hits = torch.tensor([True, False, True, True, False])
    sure = torch.tensor([0.1, 0.2, 0.95, 0.6, 0.9])
    got = by_confidence(hits, sure, (0.0, 0.5, 0.9))
    assert got == [{"from": 0.0, "share": 0.4, "agree": 0.5}, {"from": 0.5, "share": 0.2, "agree": 1.0},
                   {"from": 0.9, "share": 0.4, "agree": 0.5}]
    assert by_confidence(hits[:1], sure[:1], (0.0, 0.5))[1] == {"from": 0.5, "share": 0.0, "agree": None}

    torch.manual_seed(1)
    ids = torch.arange(6, 46)
    head = make_head(target, ids)
    reader = head_train_online.Reader(target, torch.float32, 4)
    seqs = [torch.randint(6, VOCAB, (n,)).tolist() for n in (12, 9, 12)]  # the second one padded
    batches = [head_train_online.labelled(reader, seqs, PAD, "cpu")]
    to_draft = draft_index(ids, VOCAB)
    hit, sure = first_token_hits(head, batches, to_draft)
    assert len(hit) == len(sure) == 11 + 8 + 11  # the positions with a real token before and after
    assert ((sure > 0) & (sure <= 1)).all()
    assert round(float(hit.float().mean()), 4) == head_train_online.evaluate(head, batches, to_draft, 1)["held_agree"][0]
    buckets = by_confidence(hit, sure)
    assert abs(sum(b["share"] for b in buckets) - 1) < 1e-3


def test_misread_inputs_move_one_input_and_keep_the_labels():
    from scripts.head_measure import INPUTS, misread

    ids = torch.arange(10).reshape(2, 5)
    feats = torch.arange(30, dtype=torch.float).reshape(2, 5, 3)
    batch = {"ids": ids, "feats": feats, "mask": torch.ones(2, 5, dtype=torch.bool), "top_id": ids + 1}
    gen = torch.Generator().manual_seed(0)
    got = {how: misread(batch, how, 7, gen) for how in INPUTS}
    assert torch.equal(got["as read"]["ids"], ids) and torch.equal(got["as read"]["feats"], feats)
    assert torch.equal(got["features one position later"]["feats"][:, :4], feats[:, 1:])
    assert torch.equal(got["features one position earlier"]["feats"][:, 1:], feats[:, :4])
    assert torch.equal(got["the token one position earlier"]["ids"][:, 1:], ids[:, :4])
    assert not got["no features"]["feats"].any()
    assert got["random tokens"]["ids"].max() < 7 and not torch.equal(got["random tokens"]["ids"], ids)
    assert all(torch.equal(g["top_id"], ids + 1) and g["mask"].all() for g in got.values())
    assert all(torch.equal(g["ids"], ids) for how, g in got.items() if "token" not in how)


@given(st.lists(st.integers(1, 600), max_size=9), st.integers(1, 3))
@settings(max_examples=200, deadline=None)
def test_length_groups_cut_a_batch_where_it_pads_least(lengths, parts):
    groups = head_data.length_groups(lengths, parts)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths))) and len(groups) <= parts
    area = lambda gs: sum(len(g) * max(lengths[i] for i in g) for g in gs)  # noqa: E731
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    cuts = [c for k in range(parts) for c in itertools.combinations(range(1, len(order)), k)]
    every = [[order[a:b] for a, b in zip((0, *c), (*c, len(order)))] for c in cuts] if lengths else [[]]
    assert area(groups) == min(area(gs) for gs in every)  # the least padding any cut of the sorted batch gives


def test_a_batch_learned_in_length_groups_has_the_loss_and_gradient_of_the_batch_padded_whole(target):
    from scripts.train_head import draft_index, head_loss, make_head

    torch.manual_seed(2)
    ids = torch.arange(6, 46)
    head = make_head(target, ids)
    reader = head_train_online.Reader(target, torch.float32, 4)
    seqs = [torch.randint(6, VOCAB, (n,)).tolist() for n in (24, 7, 9, 24, 5)]
    to_draft = draft_index(ids, VOCAB)
    whole = head_train_online.labelled(reader, seqs, PAD, "cpu")
    groups = head_data.length_groups([len(s) for s in seqs])
    assert groups == [[4, 1, 2], [0, 3]]
    parts = [head_train_online.labelled(reader, [seqs[i] for i in g], PAD, "cpu") for g in groups]
    assert sum(p["ids"].numel() for p in parts) == 3 * 9 + 2 * 24 < whole["ids"].numel() == 5 * 24
    grads = []
    for batch in (whole, parts):
        head.zero_grad()
        loss, agree = head_loss(head, batch, to_draft, 3)
        loss.backward()
        grads.append(([p.grad.clone() for p in head.parameters() if p.requires_grad], float(loss.detach()), agree))
    (g1, l1, a1), (g2, l2, a2) = grads
    assert abs(l1 - l2) < 1e-5 and a1 == a2
    assert all(torch.allclose(x, y, atol=1e-6, rtol=1e-4) for x, y in zip(g1, g2))


def test_the_decay_holds_the_schedule_then_falls_linearly_to_the_floor_by_the_budgets_end():
    args = argparse.Namespace(decay_share=0.25, lr_floor=0.1)
    assert [head_train_online.decayed(args, p) for p in (0.0, 0.5, 0.75)] == [1.0, 1.0, 1.0]
    assert head_train_online.decayed(args, 0.875) == pytest.approx(0.55)  # half way down
    assert head_train_online.decayed(args, 1.0) == pytest.approx(0.1)
    assert head_train_online.decayed(argparse.Namespace(decay_share=0.0, lr_floor=0.1), 1.0) == 1.0  # none asked
    clock = head_train_online.Clock(minutes=10, reserve_s=60)  # 540 s of training before the reserve
    assert clock.passed(clock.start) == pytest.approx(0.0, abs=0.01)
    assert clock.passed(clock.start - 270) == pytest.approx(270 / 810, abs=0.01)  # 270 s gone of 810
    assert head_train_online.Clock(minutes=0, reserve_s=0).passed(0.0) == 0.0  # no budget: no decay


def test_the_groups_measure_times_the_runs_next_batches_both_ways_and_leaves_the_head_as_it_was(
        tmp_path, target, corpus_ids, capsys):
    import json
    import types

    from scripts import head_measure

    work = work_folder(tmp_path / "w", corpus_ids)
    head_train_online.run(arguments(work, steps=2), target, prompter, PAD, STOP, lambda _: None)
    ckpt = torch.load(work / head_train_online.CHECKPOINT, weights_only=False)
    corpus = head_data.load_corpus(work)
    args = argparse.Namespace(work=work, repeats=3, groups=2)
    head_measure.measure_groups(args, types.SimpleNamespace(pad_token_id=PAD), target, corpus)
    row = json.loads(capsys.readouterr().out)

    stream = head_train_online.open_stream(argparse.Namespace(**ckpt["args"]), corpus, None)
    batches = [stream.take(Position(**ckpt["state"]["pos"]), 3 * 3)[0][i:i + 3] for i in range(0, 9, 3)]
    assert row["positions"] == sum(len(q) for b in batches for q in b)
    assert row["padded"]["whole"] == sum(len(b) * max(map(len, b)) for b in batches)
    grouped = sum(len(g) * max(len(b[i]) for i in g) for b in batches
                  for g in head_data.length_groups([len(q) for q in b], 2))
    assert row["positions"] <= row["padded"]["grouped"] == grouped <= row["padded"]["whole"]
    assert all(len(v) == 3 and min(v) > 0 for v in row["seconds"].values())
    after = torch.load(work / head_train_online.CHECKPOINT, weights_only=False)
    assert all(torch.equal(ckpt["head"][k], after["head"][k]) for k in ckpt["head"])  # the measure writes nothing
