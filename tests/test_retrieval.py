"""Chunking, chunk scoring, chunk selection and the three draft-cache policies.

Property tests (hypothesis) on the pure functions: chunks tile the sequence, a chunk's score is the mean
of its tokens (a partial last chunk included), the selection is sorted, unique, in range, within budget,
always holds the sink chunk and the newest chunk, and holds the best-scoring of the other chunks; spans
merge without losing or inventing positions. Then each policy made by `make_policy` selects what it
promises and is due when it says.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from specextend.config import RetrievalConfig
from specextend.signal import PAPER
from specextend.retrieval import (
    CMRPolicy,
    DraftCachePolicy,
    Selection,
    StreamingPolicy,
    chunk_scores,
    chunk_spans,
    make_policy,
    merge_spans,
    select_chunks,
    spans_to_positions,
    spread_scores,
)

FAST = settings(max_examples=80, deadline=None)
finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32)


@FAST
@given(seq_len=st.integers(0, 300), chunk_size=st.integers(1, 40))
def test_chunk_spans_tile_the_sequence(seq_len, chunk_size):
    spans = chunk_spans(seq_len, chunk_size)
    assert len(spans) == -(-seq_len // chunk_size)
    assert spans_to_positions(spans).tolist() == list(range(seq_len))
    for i, (start, end) in enumerate(spans):
        assert start == i * chunk_size
        assert end - start == (chunk_size if i < len(spans) - 1 else seq_len - start)
        assert 0 < end - start <= chunk_size


@FAST
@given(scores=st.lists(st.floats(0, 1, width=32), min_size=1, max_size=120), chunk_size=st.integers(1, 20))
def test_chunk_scores_are_means_over_each_chunk(scores, chunk_size):
    token_scores = torch.tensor(scores)
    got = chunk_scores(token_scores, chunk_size)
    spans = chunk_spans(len(scores), chunk_size)
    assert got.shape == (len(spans),)
    assert got.dtype == torch.float32
    for value, (start, end) in zip(got.tolist(), spans):
        part = scores[start:end]
        assert value == pytest.approx(sum(part) / len(part), abs=1e-6)


def test_chunk_scores_partial_last_chunk_by_hand():
    scores = torch.tensor([1.0, 3.0, 0.0, 0.0, 5.0, 7.0, 9.0])  # chunks of 3: [1,3,0] [0,5,7] [9]
    assert chunk_scores(scores, 3).tolist() == pytest.approx([4 / 3, 4.0, 9.0])
    assert chunk_scores(scores[:6], 3).tolist() == pytest.approx([4 / 3, 4.0])
    assert chunk_scores(scores, 10).tolist() == pytest.approx([25 / 7])  # one partial chunk
    assert chunk_scores(scores[:0], 3).shape == (0,)


@FAST
@given(scores=st.lists(finite, min_size=1, max_size=60), top_k=st.integers(2, 70), reserve=st.integers(1, 8))
def test_select_chunks_properties(scores, top_k, reserve):
    n = len(scores)
    chosen = select_chunks(torch.tensor(scores), top_k, reserve)
    assert chosen == sorted(set(chosen))  # sorted, unique
    assert all(0 <= c < n for c in chosen)
    assert len(chosen) == min(n, top_k)  # the whole budget is used
    forced = {0, *range(max(0, n - min(reserve, top_k - 1)), n)}  # sink and the newest `reserve` (at most top_k - 1)
    assert forced <= set(chosen)
    picked = [scores[c] for c in chosen if c not in forced]
    passed = [scores[c] for c in range(n) if c not in chosen and c not in forced]
    if picked and passed:
        assert max(passed) <= min(picked)  # no left-out chunk beats a chosen one


@FAST
@given(scores=st.lists(st.floats(0, 1), min_size=1, max_size=40), share=st.sampled_from([0.0, 0.25, 0.5, 1.0]))
def test_spread_scores_lifts_each_chunk_to_a_share_of_its_best_neighbour(scores, share):
    got = spread_scores(torch.tensor(scores), share).tolist()
    for i, value in enumerate(scores):
        neighbours = [scores[j] for j in (i - 1, i + 1) if 0 <= j < len(scores)]
        assert got[i] == pytest.approx(max([value] + [share * n for n in neighbours]))


def test_spread_keeps_a_passage_that_straddles_a_chunk_boundary():
    scores = torch.tensor([0.0, 0.05, 0.1, 0.001, 0.9, 0.002, 0.2, 0.0])  # the hot chunk 4 between two cold ones
    assert select_chunks(scores, 5) == [0, 2, 4, 6, 7]
    assert select_chunks(spread_scores(scores, 0.5), 5) == [0, 3, 4, 5, 7]  # its neighbours inherit half its score


def test_select_chunks_by_hand():
    scores = torch.tensor([0.0, 0.9, 0.1, 0.8, 0.2, 0.7, 0.0])
    assert select_chunks(scores, 2) == [0, 6]
    assert select_chunks(scores, 3) == [0, 1, 6]
    assert select_chunks(scores, 4) == [0, 1, 3, 6]
    assert select_chunks(scores, 7) == list(range(7))
    assert select_chunks(scores, 100) == list(range(7))
    assert select_chunks(torch.tensor([0.5]), 2) == [0]
    # a reserve of 3 keeps chunks 4-6 whatever their scores; the one chunk left goes to the best older chunk
    assert select_chunks(scores, 5, reserve=3) == [0, 1, 4, 5, 6]
    assert select_chunks(scores, 4, reserve=3) == [0, 4, 5, 6]


@st.composite
def sorted_spans(draw):
    """Sorted, non-overlapping, non-empty spans (some touching, some not)."""
    cuts = sorted(draw(st.sets(st.integers(0, 200), max_size=30)))
    spans = list(zip(cuts[:-1], cuts[1:]))
    keep = draw(st.lists(st.booleans(), min_size=len(spans), max_size=len(spans)))
    return [s for s, k in zip(spans, keep) if k]


@FAST
@given(spans=sorted_spans())
def test_merge_spans_joins_touching_spans_only(spans):
    merged = merge_spans(spans)
    assert spans_to_positions(merged).tolist() == spans_to_positions(spans).tolist()
    for (s0, e0), (s1, e1) in zip(merged, merged[1:]):
        assert s0 < e0 < s1 < e1  # sorted, and no two merged spans touch
    gaps = sum(1 for (_, end), (start, _) in zip(spans, spans[1:]) if end != start)
    assert len(merged) == (1 + gaps if spans else 0)


def test_merge_spans_by_hand():
    assert merge_spans([(0, 4), (4, 8), (12, 16), (16, 17), (20, 21)]) == [(0, 8), (12, 17), (20, 21)]
    assert merge_spans([]) == []


# ----------------------------------------------------------------------------------- policies


def test_full_policy_keeps_everything_and_is_never_due():
    policy = make_policy("full", RetrievalConfig())
    assert type(policy) is DraftCachePolicy and policy.name == "full"
    assert policy.prefill_window is None and not policy.needs_scores
    assert not any(policy.due(step, working) for step in range(20) for working in (0, 10_000))
    selection = policy.select(137, None)
    assert selection.kept_spans == ((0, 137),)
    assert selection.positions.tolist() == list(range(137))


def test_unknown_policy_is_a_value_error():
    with pytest.raises(ValueError, match="policy"):
        make_policy("adaptive", RetrievalConfig())


@FAST
@given(
    chunk_size=st.integers(1, 16),
    top_k=st.integers(2, 8),
    sink=st.integers(0, 10),
    seq_len=st.integers(0, 400),
    step=st.integers(0, 50),
    working=st.integers(0, 400),
)
def test_streaming_policy_keeps_sink_and_recent_window(chunk_size, top_k, sink, seq_len, step, working):
    budget = chunk_size * top_k
    assume(sink < budget)
    config = RetrievalConfig(chunk_size=chunk_size, top_k=top_k, sink_tokens=sink, prefill_window=77)
    policy = make_policy("streaming", config)
    assert isinstance(policy, StreamingPolicy) and policy.name == "streaming"
    assert policy.prefill_window == 77 and not policy.needs_scores
    assert policy.due(step, working) == (working > budget + chunk_size)  # evicts a chunk at a time
    positions = policy.select(seq_len, None).positions.tolist()
    if seq_len <= budget:
        assert positions == list(range(seq_len))
        return
    recent = budget - sink
    assert positions == list(range(sink)) + list(range(seq_len - recent, seq_len))
    assert len(positions) == budget


def test_streaming_by_hand():
    policy = make_policy("streaming", RetrievalConfig(chunk_size=4, top_k=2, sink_tokens=2))  # budget 8
    assert policy.select(8, None).kept_spans == ((0, 8),)
    assert policy.select(9, None).kept_spans == ((0, 2), (3, 9))
    assert policy.select(100, None).kept_spans == ((0, 2), (94, 100))
    no_sink = make_policy("streaming", RetrievalConfig(chunk_size=4, top_k=2, sink_tokens=0))
    assert no_sink.select(100, None).kept_spans == ((92, 100),)


@FAST
@given(
    chunk_size=st.integers(1, 12),
    top_k=st.integers(2, 6),
    every=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    seq_len=st.integers(1, 200),
    extra=st.integers(0, 5),
)
def test_cmr_policy_selects_top_chunks_within_budget(chunk_size, top_k, every, seed, seq_len, extra):
    config = RetrievalConfig(chunk_size=chunk_size, top_k=top_k, retrieve_every=every, prefill_window=33, sink_tokens=1,
                             signal=PAPER)
    policy = make_policy("cmr", config)
    assert isinstance(policy, CMRPolicy) and policy.name == "cmr"
    assert policy.needs_scores and policy.prefill_window == 33
    assert [s for s in range(1, 25) if policy.due(s, 0)] == list(range(every, 25, every))
    # scores over more tokens than committed: only the first seq_len count
    token_scores = torch.softmax(torch.randn(seq_len + extra, generator=torch.Generator().manual_seed(seed)) * 3, 0)
    selection = policy.select(seq_len, token_scores)
    assert isinstance(selection, Selection)
    spans = chunk_spans(seq_len, chunk_size)
    assert list(selection.chunk_spans) == spans
    assert list(selection.scores) == pytest.approx(chunk_scores(token_scores[:seq_len], chunk_size).tolist())
    assert list(selection.selected) == select_chunks(torch.tensor(selection.scores), top_k)
    positions = selection.positions.tolist()
    assert positions == sorted(set(positions))
    assert all(0 <= p < seq_len for p in positions)
    assert len(positions) <= config.working_cache
    assert positions == spans_to_positions([spans[i] for i in selection.selected]).tolist()
    assert set(range(*spans[0])) <= set(positions)  # the sink chunk
    assert set(range(*spans[-1])) <= set(positions)  # the newest chunk, partial or not
    assert list(selection.kept_spans) == merge_spans(list(selection.kept_spans))  # already merged


def test_cmr_by_hand():
    config = RetrievalConfig(chunk_size=4, top_k=3, retrieve_every=4, signal=PAPER)
    token_scores = torch.zeros(18)  # chunks [0,4) [4,8) [8,12) [12,16) [16,18)
    token_scores[9] = 0.5  # chunk 2 is the hot one
    token_scores[5] = 0.1
    selection = make_policy("cmr", config).select(18, token_scores)
    assert selection.selected == (0, 2, 4)
    assert selection.kept_spans == ((0, 4), (8, 12), (16, 18))
    assert selection.positions.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17]
    touching = make_policy("cmr", RetrievalConfig(chunk_size=4, top_k=3, signal=PAPER)).select(12, token_scores)
    assert touching.selected == (0, 1, 2) and touching.kept_spans == ((0, 12),)
    empty = make_policy("cmr", config).select(0, token_scores)
    assert empty.positions.tolist() == [] and empty.selected == ()


def test_adaptive_trigger_retrieves_when_acceptance_drops_and_at_the_latest_cap():
    config = RetrievalConfig(chunk_size=8, top_k=4, retrieve_every=2, trigger="adaptive", min_acceptance=0.5,
                             acceptance_window=2, signal=PAPER)
    policy = make_policy("cmr", config)
    fired = []
    for step, accepted in enumerate([4, 4, 4, 4, 4, 4, 4, 4, 4, 0, 1, 4, 4], start=1):
        policy.observe(accepted, 4)
        if policy.due(step, 0):
            fired.append(step)
    # all accepted: only the cap (4 x retrieve_every = 8 steps); then two poor steps fire at once
    assert fired == [8, 11]
    with pytest.raises(ValueError, match="trigger"):
        RetrievalConfig(trigger="sometimes")
