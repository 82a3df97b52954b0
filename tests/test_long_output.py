"""Long outputs: a short prompt and a generation many times its length. The sequence grows by generation, so CMR's
chunks come more and more from the output; the draft's working cache and the cost of a step must not grow with it,
and greedy output stays the target's own."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

import specextend.target
from conftest import reference_greedy
from specextend.config import DraftConfig, RetrievalConfig, preset
from specextend.engine import generate, make_drafter
from specextend.events import Retrieved, Verified
from specextend.signal import resolve

PROMPT_LEN = 40
NEW = 900
RETRIEVAL = RetrievalConfig(chunk_size=16, top_k=4, retrieve_every=2, prefill_window=32)
DRAFT = DraftConfig(shape="chain", k=4)


def long_run(pair, method: str, monkeypatch=None):
    """One long generation with the drafter held here, so its working cache can be read after every step: the events,
    the working cache's length before each step's draft, and (with `monkeypatch`) each retrieval's scoring work."""
    rng = random.Random(7)
    prompt = [rng.randrange(3, pair.vocab_size) for _ in range(PROMPT_LEN)]
    signal = resolve(RETRIEVAL.signal, pair.calibrated)  # as the engine resolves it
    config = preset(method, max_new_tokens=NEW, draft=DRAFT, retrieval=replace(RETRIEVAL, signal=signal))
    drafter = make_drafter(pair, config, PROMPT_LEN + NEW + config.tree_budget + 2)
    scored: list[tuple[int, int]] = []  # (query rows, keys) of each scoring layer's attention, per retrieval
    if monkeypatch is not None:
        scoring = specextend.target.head_scores

        def counted(queries, kv_of, keys, positions, scale):
            scored.append((queries.shape[1], keys.shape[2]))
            return scoring(queries, kv_of, keys, positions, scale)

        monkeypatch.setattr(specextend.target, "head_scores", counted)
    events, working = [], []
    for event in generate(pair, prompt, config, drafter=drafter):
        events.append(event)
        if isinstance(event, Verified):
            working.append(drafter.working.length)  # what the next step's draft attends to
    return prompt, events, working, scored


@pytest.fixture(scope="module")
def cmr_run(llama_pair):
    with pytest.MonkeyPatch.context() as patch:
        return long_run(llama_pair, "specextend", patch)


def test_greedy_output_over_a_long_generation_is_the_targets_own(llama_pair, cmr_run):
    prompt, events, _, _ = cmr_run
    out = list(events[-1].token_ids)
    assert len(out) == NEW and out == reference_greedy(llama_pair.target, prompt, NEW, cached=True)


def test_the_working_cache_stays_within_its_budget_while_the_sequence_grows(cmr_run):
    _, events, working, _ = cmr_run
    budget = RETRIEVAL.chunk_size * RETRIEVAL.top_k
    per_step = DRAFT.k + 1  # the most a step adds to the working cache
    bound = budget + RETRIEVAL.retrieve_every * per_step
    retrievals = [e for e in events if isinstance(e, Retrieved)]
    assert retrievals[-1].seq_len > 14 * budget  # the sequence outgrew the budget many times over
    assert all(r.working_cache_len <= budget for r in retrievals)
    assert max(working) <= bound
    # flat, not creeping: the last few hundred steps read no more than the first hundred after the budget filled
    assert max(working[-200:]) <= max(working[20:120]) + per_step


def test_cmr_reads_chunks_of_the_output_back(cmr_run):
    _, events, _, _ = cmr_run
    late = [r for r in events if isinstance(r, Retrieved) and r.seq_len > 10 * PROMPT_LEN]
    from_output = [sum(r.chunk_spans[i][0] >= PROMPT_LEN for i in r.selected) for r in late]
    assert min(from_output) >= 1  # at least the newest chunk, always kept
    # beyond the newest: older output chunks chosen by the target's attention (the sink is the prompt's)
    reached = [sum(PROMPT_LEN <= r.chunk_spans[i][0] < r.chunk_spans[-1][0] for i in r.selected) for r in late]
    assert sum(reached) > len(late)


def test_each_retrieval_reads_a_fixed_window_of_queries_once_over_the_sequence(cmr_run):
    """The retrieval's work: the same few query rows every time, against each committed key once (linear in the
    sequence, every `retrieve_every` steps); nothing accumulates across retrievals."""
    _, events, _, scored = cmr_run
    retrievals = [e for e in events if isinstance(e, Retrieved)]
    layers = len(scored) // len(retrievals)
    assert layers >= 1 and len(scored) == layers * len(retrievals)
    assert len({rows for rows, _ in scored}) == 1  # the query window does not grow
    keys = [scored[i * layers][1] for i in range(len(retrievals))]
    # the target's committed keys, each once: as many as the draft's store holds (one more right after prefill, when
    # the draft has not yet read the prompt's last token)
    assert all(0 <= k - r.seq_len <= 1 for k, r in zip(keys, retrievals))


@pytest.mark.parametrize("method, flat", [("streaming", True), ("speculative", False)])
def test_streaming_stays_flat_and_the_full_draft_cache_grows_with_the_output(llama_pair, method, flat):
    _, events, working, _ = long_run(llama_pair, method)
    budget = RETRIEVAL.chunk_size * RETRIEVAL.top_k
    if flat:
        assert max(working) <= budget + RETRIEVAL.chunk_size + DRAFT.k + 1
    else:
        assert working[-1] >= PROMPT_LEN + NEW - 2 * (DRAFT.k + 1) and working[-1] > 10 * budget


def test_with_lookup_every_retrieval_reads_the_whole_sequence_even_after_the_draft_sat_out(bigram_pair):
    """A long output that repeats itself: lookup finds copies, so the draft sits out for long stretches (on_miss). Its
    store waits for the tokens it skipped; a retrieval due meanwhile waits for the draft's next step, so no working
    cache is ever chosen from a stale sequence."""
    from specextend.config import LookupConfig

    rng = random.Random(3)
    prompt = [rng.randrange(3, bigram_pair.vocab_size) for _ in range(PROMPT_LEN)]
    config = preset("specextend", max_new_tokens=600, draft=DRAFT, retrieval=RETRIEVAL, lookup=LookupConfig(enabled=True))
    events = list(generate(bigram_pair, prompt, config))
    steps = {e.step: e for e in events if isinstance(e, Verified)}
    drafts = {e.step: e for e in events if type(e).__name__ == "Drafted"}
    assert sum(bool(d.sat_out) for d in drafts.values()) > 20  # the draft sat out for many steps
    for r in (e for e in events if isinstance(e, Retrieved) and e.step > 0):
        v = steps[r.step]
        assert r.seq_len >= PROMPT_LEN + v.total_new - len(v.committed) - 1, (r.step, r.seq_len, v.total_new)
        assert not drafts[r.step].sat_out  # a retrieval comes right after a step the draft drafted in
    assert events[-1].token_ids == tuple(reference_greedy(bigram_pair.target, prompt, 600, cached=True))
