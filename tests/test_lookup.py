"""Lookup drafting: matching (pure, and the incremental index against it), grafting lookup branches onto a
draft tree, and the engine with lookup alone and merged with the draft model, lossless in greedy.

Random tiny targets rarely repeat themselves, so lookup would never be tested on them: the `bigram_pair`
target (conftest) has its attention and MLP outputs zeroed, so its next token is a function of the last
one. Its greedy output runs into a cycle within a few dozen tokens, and lookup must then commit long runs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import VOCAB, reference_greedy
from specextend import events as ev
from specextend.config import MAX_DRAFT, DraftConfig, GenerationConfig, LookupConfig, RetrievalConfig, preset
from specextend.drafting import DraftTree
from specextend.lookup import graft
from specextend.engine import generate
from specextend.lookup import (
    GATE_RETRY, GATE_USES, Continuation, LookupDrafter, NgramIndex, continuations, replay,
)
from specextend.metrics import sat_out, summarize, tokens_by_source

N_NEW = 40


# ------------------------------------------------------------------------------------ matching


def test_longest_ngram_wins_and_the_continuation_is_what_followed():
    seq = [1, 2, 3, 9, 9, 5, 2, 3, 7, 7, 7, 1, 2, 3]
    # [1, 2, 3] occurred at 0 (followed by 9 9 5 ...); [2, 3] also at 6 (followed by 7): the 3-gram comes first
    got = continuations(seq, LookupConfig(max_ngram=3, min_ngram=2, max_tokens=3, branches=2), room=10)
    assert got == [Continuation((9, 9, 5), 3), Continuation((7, 7, 7), 8)]


def test_no_match_and_no_room():
    assert continuations([1, 2, 3, 4], LookupConfig(), room=8) == []
    assert continuations([5, 6, 5, 6], LookupConfig(min_ngram=2), room=0) == []
    assert continuations([5], LookupConfig(min_ngram=1), room=8) == []


def test_room_and_the_sequence_end_cut_the_continuation():
    seq = [4, 5, 6, 7, 8, 4, 5]
    assert continuations(seq, LookupConfig(min_ngram=2, max_tokens=8), room=2) == [Continuation((6, 7), 2)]
    # the latest earlier [4, 5] is followed only by what the sequence has so far
    assert continuations([4, 5, 4, 5], LookupConfig(min_ngram=2, max_tokens=8), room=8) == [Continuation((4, 5), 2)]


def test_recent_first_and_frequent_ranks():
    # [1, 2] is followed by 3, then 4, then 4, then 5 (latest): recent says 5, first 3, frequent 4
    seq = [1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 4, 0, 1, 2, 5, 0, 1, 2]
    first_of = lambda rank: continuations(seq, LookupConfig(min_ngram=2, max_ngram=2, rank=rank), 4)[0].tokens[0]  # noqa: E731
    assert (first_of("recent"), first_of("first"), first_of("frequent")) == (5, 3, 4)
    # branches have distinct first tokens; frequent ties fall to the latest
    got = continuations(seq, LookupConfig(min_ngram=2, max_ngram=2, rank="frequent", branches=3), 1)
    assert [c.tokens for c in got] == [(4,), (5,), (3,)]
    assert [c.start for c in got] == [10, 14, 2]


@settings(max_examples=200, deadline=None)
@given(
    seq=st.lists(st.integers(0, 4), min_size=1, max_size=60),
    split=st.integers(0, 60),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
    tokens=st.integers(1, 6),
    branches=st.integers(1, 3),
    order=st.sampled_from(["recent", "frequent", "first"]),
    room=st.integers(0, 8),
)
def test_index_agrees_with_the_scan(seq, split, min_n, extra, tokens, branches, order, room):
    config = LookupConfig(min_ngram=min_n, max_ngram=min_n + extra, max_tokens=tokens, branches=branches, rank=order)
    index = NgramIndex(config.min_ngram, config.max_ngram)
    index.extend(seq[:split])  # in two pieces, as prefill then steps
    index.extend(seq[split:])
    got = index.continuations(config, room)
    assert got == continuations(seq, config, room)
    for c in got:  # every continuation is a real copy of what followed a match
        assert list(c.tokens) == seq[c.start : c.start + len(c.tokens)] and 1 <= len(c.tokens) <= min(tokens, room)
    assert len({c.tokens[0] for c in got}) == len(got) <= branches


# ------------------------------------------------------------------------------------ grafting


def chain(tokens, probs=None) -> DraftTree:
    n = len(tokens)
    return DraftTree(tuple(tokens), tuple(range(-1, n - 1)), tuple(range(1, n + 1)), tuple(probs or [0.5] * n), None, 1)


def test_graft_shares_agreeing_nodes_and_puts_lookup_children_first():
    tree = graft(chain([7, 8, 9]), [((7, 8, 4), 20), ((5,), 30)])
    # lookup trie 7 -> 8 -> 4 and 5, then the draft's 7 -> 8 merge into it and its 9 hangs below 8
    assert tree.tokens == (7, 8, 4, 5, 9)
    assert tree.parents == (-1, 0, 1, -1, 1)
    assert tree.depths == (1, 2, 3, 1, 3)
    assert tree.sources == ("both", "both", "lookup", "lookup", "draft")
    assert tree.origins == (20, 21, 22, 30, -1)
    assert tree.point == (True, True, True, True, False)
    assert tree.probs == (0.5, 0.5, 1.0, 1.0, 0.5)


def test_graft_maps_the_draft_q_rows():
    q = torch.arange(4 * 3, dtype=torch.float32).view(4, 3)  # rows: root, 7, 8, 9
    tree = graft(DraftTree((7, 8, 9), (-1, 0, 1), (1, 2, 3), (0.5,) * 3, q, 1), [((6, 8), 0), ((7, 1), 2)])
    # nodes: 6, 8 (under 6), 7 (both), 1 (under 7), then the draft's 8 (under 7) and 9
    assert tree.tokens == (6, 8, 7, 1, 8, 9) and tree.parents == (-1, 0, -1, 2, 2, 4)
    assert tree.q.shape == (7, 3)
    for row, want in ((0, 0), (3, 1), (5, 2), (6, 3)):
        assert torch.equal(tree.q[row], q[want])
    assert not tree.q[[1, 2, 4]].any()  # lookup-only nodes have no q row


@settings(max_examples=150, deadline=None)
@given(
    draft=st.lists(st.tuples(st.integers(-1, 8), st.integers(0, 3)), max_size=10),
    branches=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), max_size=3),
)
def test_graft_keeps_every_path_once(draft, branches):
    parents, tokens, seen = [], [], set()
    for parent, token in draft:  # a random valid draft tree with distinct sibling tokens
        parent = parent if parent < len(parents) else -1
        if (parent, token) not in seen:
            seen.add((parent, token))
            parents.append(parent)
            tokens.append(token)
    depths = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    tree = graft(DraftTree(tuple(tokens), tuple(parents), tuple(depths), (0.5,) * len(tokens), None, 1),
                 [(tuple(b), 10 * i) for i, b in enumerate(branches)])

    def paths(t: DraftTree) -> set[tuple[int, ...]]:
        out = []
        for i, p in enumerate(t.parents):
            out.append((out[p] if p >= 0 else ()) + (t.tokens[i],))
        return set(out)

    want = paths(DraftTree(tuple(tokens), tuple(parents), tuple(depths), (), None, 0))
    want |= {tuple(b[:k]) for b in branches for k in range(1, len(b) + 1)}
    assert paths(tree) == want and len(tree.tokens) == len(want)  # every path once: siblings are distinct
    assert all(p < i for i, p in enumerate(tree.parents))
    for i, p in enumerate(tree.parents):  # among siblings, lookup (point-mass) nodes come first
        later = [j for j in range(i) if tree.parents[j] == p]
        assert not (tree.point[i] and any(not tree.point[j] for j in later))


# ------------------------------------------------------------------------------------ the engine


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


LOOKUPS = [LookupConfig(enabled=True),
           LookupConfig(enabled=True, min_ngram=1, max_tokens=3, branches=3, rank="frequent", adaptive=True),
           LookupConfig(enabled=True, min_ngram=2, max_ngram=2, max_tokens=12, rank="first", with_draft="always",
                        draft_gate=0.0)]
RETRIEVAL = RetrievalConfig(chunk_size=16, top_k=4, retrieve_every=2, prefill_window=32)


@pytest.mark.parametrize("method", ["lookup", "speculative", "streaming", "specextend"])
@pytest.mark.parametrize("lookup", LOOKUPS, ids=["default", "short3", "always"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_equals_target_with_lookup(bigram_pair, llama_pair, method, lookup, shape):
    draft = DraftConfig(shape=shape, k=3, max_depth=4, node_budget=8, stop_threshold=0.0)
    config = preset(method, max_new_tokens=N_NEW, draft=draft, retrieval=RETRIEVAL, lookup=lookup)
    by_source = {}
    for pair, prompt in ((bigram_pair, prompt_of(150, seed=3)), (llama_pair, prompt_of(77, seed=4) * 2)):
        trace = list(generate(pair, prompt, config))
        assert list(trace[-1].token_ids) == reference_greedy(pair.target, prompt, N_NEW)
        counts = tokens_by_source(trace)
        assert sum(counts.values()) == len(trace[-1].token_ids)
        for source, n in counts.items():
            by_source[source] = by_source.get(source, 0) + n
    assert by_source["lookup"] + by_source["both"] >= 10  # lookup committed real runs on the repeating target
    if method == "lookup":
        assert by_source["draft"] == by_source["both"] == 0


def test_lookup_alone_commits_long_runs_and_reports_its_copies(bigram_pair):
    prompt = prompt_of(120, seed=5)
    trace = list(generate(bigram_pair, prompt, preset("lookup", max_new_tokens=N_NEW, lookup=LookupConfig(max_tokens=8))))
    assert list(trace[-1].token_ids) == reference_greedy(bigram_pair.target, prompt, N_NEW)
    summary = summarize(trace)
    assert summary.mean_accepted > 2.0 and summary.tokens_by_source["lookup"] > N_NEW // 2
    sequence = prompt + list(trace[-1].token_ids)
    for d in (e for e in trace if isinstance(e, ev.Drafted)):
        assert set(d.sources) <= {"lookup"} and d.draft_forwards == 0
        for token, origin in zip(d.tokens, d.origins):  # each node is a copy of the token at its origin
            assert 0 <= origin < d.position + 1 and sequence[origin] == token
    assert not any(isinstance(e, ev.Retrieved) or isinstance(e, ev.Prefilling) and e.model == "draft" for e in trace)


@pytest.mark.parametrize("lookup", LOOKUPS[:2], ids=["default", "short3"])
def test_replay_is_what_the_engine_does(bigram_pair, lookup):
    prompt = prompt_of(90, seed=7)
    trace = list(generate(bigram_pair, prompt, preset("lookup", max_new_tokens=N_NEW, lookup=lookup)))
    drafted = {e.step: e for e in trace if isinstance(e, ev.Drafted)}  # a step with no room left drafts nothing
    steps = [(v.num_accepted, len(drafted[v.step].tokens) if v.step in drafted else 0)
             for v in trace if isinstance(v, ev.Verified)]
    assert replay(prompt, list(trace[-1].token_ids), lookup, N_NEW) == steps
    assert sum(a for a, _ in steps) > 0


def test_a_draft_model_that_does_not_pay_sits_out_and_is_retried(bigram_pair):
    prompt = prompt_of(120, seed=8)
    asked, traces = {}, {}
    for gate in (1.0, 0.0):
        lookup = LookupConfig(enabled=True, with_draft="always", draft_gate=gate)
        traces[gate] = list(generate(bigram_pair, prompt, preset("speculative", max_new_tokens=60, lookup=lookup)))
        assert list(traces[gate][-1].token_ids) == reference_greedy(bigram_pair.target, prompt, 60)
        asked[gate] = [e.draft_forwards > 0 for e in traces[gate] if isinstance(e, ev.Drafted)]
    assert all(asked[0.0])  # no gate: asked every step
    drafted = [e for e in traces[1.0] if isinstance(e, ev.Drafted)]
    verified = {e.step: e for e in traces[1.0] if isinstance(e, ev.Verified)}
    # the gate, step by step: asked while its last GATE_USES uses averaged >= 1 accepted token (or it has fewer
    # uses), else only after sitting out GATE_RETRY steps
    gains, idle, want = [], 0, []
    for d in drafted:
        paying = len(gains) < GATE_USES or sum(gains[-GATE_USES:]) / GATE_USES >= 1.0
        want.append(paying or idle >= GATE_RETRY)
        idle = 0 if want[-1] else idle + 1
        if want[-1]:
            gains.append(sum(d.sources[n] != "lookup" for n in verified[d.step].accepted_nodes))
    assert asked[1.0] == want
    assert want[:GATE_USES] == [True] * GATE_USES and want.count(False) > len(want) // 2  # the random draft sits out


@pytest.mark.parametrize("with_draft,reason", [("always", "gate"), ("on_miss", "on_miss")])
def test_each_step_says_why_the_draft_model_sat_out_and_what_its_last_uses_got(bigram_pair, with_draft, reason):
    prompt = prompt_of(120, seed=8)
    lookup = LookupConfig(enabled=True, with_draft=with_draft, draft_gate=1.0)
    trace = list(generate(bigram_pair, prompt, preset("speculative", max_new_tokens=60, lookup=lookup)))
    verified = {e.step: e for e in trace if isinstance(e, ev.Verified)}
    gains = []  # the draft model's accepted tokens per use, as the gate counts them
    for d in (e for e in trace if isinstance(e, ev.Drafted)):
        assert d.recent == tuple(gains[-GATE_USES:])
        if d.draft_forwards > 0:  # asked
            assert d.sat_out == ""
            gains.append(sum(d.sources[n] != "lookup" for n in verified[d.step].accepted_nodes))
        elif with_draft == "on_miss" and d.tokens:  # lookup found a continuation, so the model was not asked
            assert d.sat_out == "on_miss" and set(d.sources) == {"lookup"}
        else:
            assert d.sat_out == "gate" and len(d.recent) == GATE_USES and sum(d.recent) / GATE_USES < 1.0
    assert sat_out(trace)[reason] > 0
    again = ev.loads(ev.dumps(trace))  # the reasons travel with a saved trace
    assert [e.sat_out for e in again if isinstance(e, ev.Drafted)] == [e.sat_out for e in trace if isinstance(e, ev.Drafted)]


def test_adaptive_branch_length_follows_what_was_copied():
    drafter = LookupDrafter(LookupConfig(min_ngram=2, max_tokens=6, adaptive=True))
    drafter.prefill([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], None)
    assert drafter.propose(10, None).tokens == (3, 4, 5, 6, 7, 8)  # the first proposal: max_tokens
    drafter.commit([9])  # a miss: the next branch is 2 tokens at most
    assert drafter.size == 2
    drafter.commit([3, 4])  # nothing was proposed: the length stays
    assert drafter.size == 2
    assert drafter.propose(10, None).tokens == (5, 6)  # after [.., 3, 4]: what followed 3, 4, cut to 2
    drafter.commit([5, 6, 7])  # both copied: 2 * 2 + 2 = 6, the cap
    assert drafter.size == 6
    fixed = LookupDrafter(LookupConfig(min_ngram=2, max_tokens=6, adaptive=False))
    fixed.prefill([1, 2, 3, 1, 2], None)
    fixed.propose(10, None)
    fixed.commit([9])
    assert fixed.size == 6  # not adaptive: always max_tokens


def test_merged_sampling_runs_reproducibly(bigram_pair):
    config = preset("specextend", max_new_tokens=N_NEW, temperature=0.1, seed=3, retrieval=RETRIEVAL,
                    lookup=LookupConfig(enabled=True, branches=2), draft=DraftConfig(shape="tree", node_budget=6))
    prompt = prompt_of(100, seed=6)
    a, b = (list(generate(bigram_pair, prompt, config)) for _ in range(2))
    assert a[-1].token_ids == b[-1].token_ids and len(a[-1].token_ids) == N_NEW
    assert tokens_by_source(a)["lookup"] + tokens_by_source(a)["both"] > 0


def test_lookup_settings_are_checked():
    with pytest.raises(ValueError, match="min_ngram"):
        LookupConfig(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError, match="max_tokens"):
        LookupConfig(max_tokens=0)
    with pytest.raises(ValueError, match="max_tokens"):  # a longer branch would verify more rows than bf16 numerics
        LookupConfig(max_tokens=MAX_DRAFT + 1)  # are exact for (numerics.VERIFY_ROWS)
    with pytest.raises(ValueError, match="branches"):
        LookupConfig(branches=MAX_DRAFT + 1)
    with pytest.raises(ValueError, match=f"at most {MAX_DRAFT} draft tokens"):  # branches side by side add up
        preset("lookup", lookup=LookupConfig(branches=2, max_tokens=MAX_DRAFT // 2 + 1))
    with pytest.raises(ValueError, match=f"at most {MAX_DRAFT} draft tokens"):
        preset("specextend", draft=DraftConfig(shape="tree", node_budget=MAX_DRAFT),
               lookup=LookupConfig(enabled=True, with_draft="always", max_tokens=1))
    longest = preset("specextend", draft=DraftConfig(k=MAX_DRAFT), lookup=LookupConfig(enabled=True, max_tokens=MAX_DRAFT))
    assert not longest.branching  # lookup's chain or the draft's, never both in one step: each within MAX_DRAFT
    with pytest.raises(ValueError, match="rank"):
        LookupConfig(rank="best")
    with pytest.raises(ValueError, match="target alone"):
        GenerationConfig(method="autoregressive", lookup=LookupConfig(enabled=True))
    with pytest.raises(ValueError, match="cannot be switched off"):
        GenerationConfig(method="lookup", lookup=LookupConfig(enabled=False))
    assert preset("lookup").uses_lookup and not preset("lookup").uses_draft
    assert not preset("specextend").uses_lookup
    assert preset("specextend", lookup=LookupConfig(enabled=True, branches=2, max_tokens=8)).tree_budget == 4 + 16


def test_a_chain_the_draft_model_ended_before_its_first_token_is_not_counted_as_a_use(bigram_pair):
    prompt = prompt_of(120, seed=8)
    lookup = LookupConfig(enabled=True, with_draft="always", draft_gate=1.0)
    config = preset("speculative", max_new_tokens=60, lookup=lookup, draft=DraftConfig(k=3, confidence_floor=0.3))
    trace = list(generate(bigram_pair, prompt, config))
    assert list(trace[-1].token_ids) == reference_greedy(bigram_pair.target, prompt, 60)
    verified = {e.step: e for e in trace if isinstance(e, ev.Verified)}
    gains, unsure = [], 0  # the gate counts the uses where the draft model proposed a token, and only those
    for d in (e for e in trace if isinstance(e, ev.Drafted)):
        assert d.recent == tuple(gains[-GATE_USES:])
        if any(s != "lookup" for s in d.sources):
            gains.append(sum(d.sources[n] != "lookup" for n in verified[d.step].accepted_nodes))
        unsure += d.draft_forwards > 0 and all(s == "lookup" for s in d.sources)
    assert unsure > 0 and gains
