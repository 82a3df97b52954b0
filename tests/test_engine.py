"""The engine end to end on tiny random-init models (fp32): lossless greedy output for every method,
ablation, draft shape and retrieval budget; scripted drafts; event invariants; bad input; stop."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import replace
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import VOCAB, reference_greedy, tiny
from specextend import events as ev
from specextend.config import AttentionConfig, DraftConfig, GenerationConfig, RetrievalConfig, RetrievalSignal, preset
from specextend.drafting import Cacheless, DraftTree
from specextend.engine import generate
from specextend.metrics import new_tokens, node_depths, summarize
from specextend.models import make_pair
from specextend.signal import PAPER, UNCALIBRATED

N_NEW = 24


def prompt_of(length: int, seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(pair, prompt, config, **kw) -> list:
    return list(generate(pair, prompt, config, **kw))


def output(trace) -> list[int]:
    return list(trace[-1].token_ids)


@pytest.fixture(scope="module")
def refs(llama_pair):
    cache = {}

    def ref(prompt):
        key = tuple(prompt)
        if key not in cache:
            cache[key] = reference_greedy(llama_pair.target, prompt, N_NEW)
        return cache[key]

    return ref


SETTINGS = [RetrievalConfig(chunk_size=32, top_k=32, retrieve_every=4, prefill_window=512),
            RetrievalConfig(chunk_size=16, top_k=4, retrieve_every=2, prefill_window=48, sink_tokens=4),
            RetrievalConfig(chunk_size=7, top_k=2, retrieve_every=1, prefill_window=5, sink_tokens=1)]  # minimum budget
DRAFTS = [DraftConfig(shape="chain", k=4), DraftConfig(shape="chain", k=1),
          DraftConfig(shape="tree", max_depth=4, node_budget=10, branch=2, children=3, stop_threshold=0.0),
          DraftConfig(shape="tree", max_depth=6, node_budget=6, branch=3, children=2, stop_threshold=0.05)]


@pytest.mark.parametrize("method", ["autoregressive", "speculative", "streaming", "specextend"])
@pytest.mark.parametrize("draft", DRAFTS, ids=["chain4", "chain1", "tree10", "tree6"])
@pytest.mark.parametrize("prompt_len", [1, 77, 301])
def test_greedy_equals_target(llama_pair, refs, method, draft, prompt_len):
    prompt = prompt_of(prompt_len, seed=prompt_len)
    for retrieval in SETTINGS if method in ("streaming", "specextend") else SETTINGS[:1]:
        trace = run(llama_pair, prompt, preset(method, max_new_tokens=N_NEW, draft=draft, retrieval=retrieval))
        assert output(trace) == refs(prompt), (method, draft, retrieval)


@pytest.mark.parametrize("method", ["speculative", "specextend"])
def test_a_confidence_floor_ends_chains_where_the_draft_is_unsure_and_stays_lossless(llama_pair, refs, method):
    prompt = prompt_of(77, seed=77)
    free = run(llama_pair, prompt, preset(method, max_new_tokens=N_NEW, draft=DraftConfig(k=4)))
    firsts = sorted(e.draft_probs[0] for e in free if isinstance(e, ev.Drafted) and e.tokens)
    floor = firsts[len(firsts) // 2]  # the median confidence in a first token: some chains end before it, some not
    trace = run(llama_pair, prompt, preset(method, max_new_tokens=N_NEW, draft=DraftConfig(k=4, confidence_floor=floor)))
    assert output(trace) == refs(prompt)
    chains = [e.draft_probs for e in trace if isinstance(e, ev.Drafted)]
    # greedy: a token's q is the top of its distribution, so every proposed token's path clears the floor
    assert all(math.prod(c[:i + 1]) >= floor * (1 - 1e-5) for c in chains for i in range(len(c)))
    assert any(not c for c in chains) and any(c for c in chains)


@pytest.mark.parametrize("prefill", ["fused", "eager"])
@pytest.mark.parametrize("verify", ["hybrid", "onecall", "masked", "auto"])
@pytest.mark.parametrize("cmr", [True, False])
def test_every_ablation_is_lossless(llama_pair, refs, prefill, verify, cmr):
    prompt = prompt_of(203, seed=5)
    config = GenerationConfig(method="specextend", max_new_tokens=N_NEW, cmr=cmr,
                              attention=AttentionConfig(prefill=prefill, verify=verify),
                              retrieval=RetrievalConfig(chunk_size=16, top_k=3, retrieve_every=2, prefill_window=32))
    assert output(run(llama_pair, prompt, config)) == refs(prompt)


@pytest.mark.parametrize("method", ["autoregressive", "lookup", "speculative", "streaming", "specextend", "specextend+lookup"])
@pytest.mark.parametrize("draft", [DRAFTS[0], DRAFTS[2]], ids=["chain4", "tree10"])
@pytest.mark.parametrize("prompt_len", [77, 500])
def test_static_steps_are_lossless(llama_pair, refs, monkeypatch, method, draft, prompt_len):
    """Every decode-time forward through the static runner (the code a CUDA graph captures), with retrieval
    rebuilding the working cache and, at 500 tokens, the target's keys crossing a bucket edge mid-request."""
    from specextend.steps import StepRunner

    ran = []
    run_static = StepRunner._run
    monkeypatch.setattr(StepRunner, "_run", lambda self, *a: ran.append(1) or run_static(self, *a))
    prompt = prompt_of(prompt_len, seed=prompt_len + 1)
    name, _, lookup = method.partition("+")
    config = preset(name, max_new_tokens=N_NEW, draft=draft, retrieval=SETTINGS[1],
                    attention=AttentionConfig(verify="auto", steps="static"))
    if lookup:
        config = config.replace(lookup=replace(config.lookup, enabled=True))
    trace = run(llama_pair, prompt, config)
    assert output(trace) == refs(prompt)
    assert len(ran) >= sum(isinstance(e, ev.Verified) for e in trace)  # not one step fell back to eager


def test_captured_steps_need_cuda(llama_pair):
    config = preset("specextend", attention=AttentionConfig(steps="captured"))
    if llama_pair.device.type != "cuda":
        with pytest.raises(ValueError, match="CUDA"):
            run(llama_pair, prompt_of(20), config)


def test_qwen2_family_is_lossless(qwen_pair):
    prompt = prompt_of(150, seed=9)
    ref = reference_greedy(qwen_pair.target, prompt, N_NEW)
    for method in ("speculative", "streaming", "specextend"):
        for shape in ("chain", "tree"):
            config = preset(method, max_new_tokens=N_NEW, draft=DraftConfig(shape=shape),
                            retrieval=RetrievalConfig(chunk_size=16, top_k=3, retrieve_every=2, prefill_window=40))
            assert output(run(qwen_pair, prompt, config)) == ref


@pytest.mark.parametrize("family", ["qwen3", "mistral", "llama3", "linear"])
def test_every_supported_family_is_lossless(family):
    """Qwen3 (per-head query and key norms), Mistral (no sliding window), Llama with Llama 3's rope scaling and with
    linear rope scaling (the draft's keys re-rotated under the scaled frequencies): every method, chain and tree."""
    pair = make_pair(tiny(family, layers=2, seed=5), tiny(family, layers=1, hidden=32, heads=2, kv_heads=1, seed=6))
    prompt = prompt_of(150, seed=10)
    ref = reference_greedy(pair.target, prompt, N_NEW)
    for method in ("autoregressive", "speculative", "streaming", "specextend"):
        for shape in ("chain", "tree"):
            config = preset(method, max_new_tokens=N_NEW, draft=DraftConfig(shape=shape),
                            retrieval=RetrievalConfig(chunk_size=16, top_k=3, retrieve_every=2, prefill_window=40))
            assert output(run(pair, prompt, config)) == ref, (family, method, shape)


@pytest.fixture(scope="module")
def self_pair():
    """The target drafting for itself: with a full cache every draft token should be accepted."""
    target = tiny("llama", layers=3, seed=1)
    return make_pair(target, copy.deepcopy(target))


def test_self_draft_accepts_everything_with_full_cache(self_pair, refs):
    prompt = prompt_of(120, seed=3)
    trace = run(self_pair, prompt, preset("speculative", max_new_tokens=N_NEW, draft=DraftConfig(shape="chain", k=5)))
    assert output(trace) == refs(prompt)
    verified = [e for e in trace if isinstance(e, ev.Verified)]
    generated = 1
    for v in verified:  # every step accepts its whole chain (cut only by the room left under max_new_tokens)
        assert v.num_accepted == min(5, N_NEW - generated - 1)
        generated += len(v.committed)
    tree = DraftConfig(shape="tree", max_depth=5, node_budget=12, branch=2, children=3, stop_threshold=0.0)
    trace = run(self_pair, prompt, preset("speculative", max_new_tokens=N_NEW, draft=tree))
    assert output(trace) == refs(prompt)
    assert summarize(trace).mean_accepted >= 3.0


def test_working_cache_that_holds_everything_drafts_like_the_full_cache(self_pair, refs):
    """Rebuilding, re-positioning and retrieval must not change a draft that keeps every position."""
    prompt = prompt_of(300, seed=4)
    chain = DraftConfig(shape="chain", k=4)
    full = summarize(run(self_pair, prompt, preset("speculative", max_new_tokens=N_NEW, draft=chain)))
    roomy = RetrievalConfig(chunk_size=8, top_k=64, retrieve_every=1, prefill_window=512, sink_tokens=2)
    tight = RetrievalConfig(chunk_size=8, top_k=4, retrieve_every=1, prefill_window=16, sink_tokens=2)
    for method in ("streaming", "specextend"):
        trace = run(self_pair, prompt, preset(method, max_new_tokens=N_NEW, draft=chain, retrieval=roomy))
        assert output(trace) == refs(prompt)
        assert summarize(trace).mean_accepted == full.mean_accepted > 4.0
        assert output(run(self_pair, prompt, preset(method, max_new_tokens=N_NEW, draft=chain, retrieval=tight))) == refs(prompt)


class ScriptedDrafter(Cacheless):
    """Proposes from the known reference output: right, wrong, or right for the first j tokens."""

    drafts = True

    def __init__(self, reference: list[int], right_for: int, branching: bool = False) -> None:
        self.reference, self.right_for, self.branching = reference, right_for, branching
        self.generated: list[int] = []
        self.proposed: list[int] = []

    def prefill(self, prompt, stop):
        return iter(())

    def propose(self, room, generator):
        i = len(self.generated)
        tokens, parents = [], []
        for d in range(min(room, 4)):
            right = self.reference[i + d]
            token = right if d < self.right_for else (right + 1) % VOCAB
            parent = 2 * d - 1 if self.branching else d - 1  # the previous level's scripted token
            if self.branching:  # a wrong sibling first, so the scripted token is its parent's second child
                tokens.append((right + 2) % VOCAB)
                parents.append(parent)
            tokens.append(token)
            parents.append(parent)
        self.proposed = tokens
        n = len(tokens)
        return DraftTree(tuple(tokens), tuple(parents), tuple(_depths(parents)), (1.0,) * n, None, 0)

    def commit(self, tokens):
        self.generated += tokens

    def rebuild(self, scores):
        raise AssertionError("the full policy never rebuilds")


def _depths(parents):
    out = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


@pytest.mark.parametrize("right_for", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("branching", [False, True])
def test_scripted_drafts(llama_pair, refs, right_for, branching):
    prompt = prompt_of(90, seed=11)
    ref = refs(prompt)
    drafter = ScriptedDrafter(ref + [0] * 8, right_for, branching)
    trace = run(llama_pair, prompt, preset("speculative", max_new_tokens=N_NEW, draft=DraftConfig(k=4)), drafter=drafter)
    assert output(trace) == ref
    steps = [e for e in trace if isinstance(e, ev.Verified)]
    full_depth = [v for v in steps[:-1]]  # the last step's depth is cut by max_new_tokens
    assert all(v.num_accepted == min(right_for, 4) for v in full_depth)


def test_event_invariants(llama_pair):
    prompt = prompt_of(260, seed=2)
    config = preset("specextend", max_new_tokens=40, draft=DraftConfig(shape="tree"),
                    retrieval=RetrievalConfig(chunk_size=16, top_k=4, retrieve_every=3, prefill_window=32))
    trace = run(llama_pair, prompt, config)
    assert isinstance(trace[0], ev.Started) and isinstance(trace[-1], ev.Finished)
    verified = [e for e in trace if isinstance(e, ev.Verified)]
    # committed tokens add up, and equal the output
    assert new_tokens(trace) == output(trace)
    assert all(len(v.committed) == v.num_accepted + 1 for v in verified[:-1])
    assert [v.total_new for v in verified] == list(torch.cumsum(torch.tensor([len(v.committed) for v in verified]), 0) + 1)
    # positions only grow, and each step starts where the last one ended
    assert all(b.position == a.position + len(a.committed) for a, b in zip(verified, verified[1:]))
    assert verified[0].position == len(prompt) + 1
    times = [e.t_s for e in trace]
    assert times == sorted(times)
    # retrieval on schedule: after prefill, then every 3 steps
    retrieved = [e for e in trace if isinstance(e, ev.Retrieved)]
    assert [r.step for r in retrieved] == [0] + [s for s in range(1, len(verified)) if s % 3 == 0]
    for r in retrieved:
        assert r.selected[0] == 0 and r.selected[-1] == len(r.chunk_spans) - 1
        assert len(r.selected) <= 4 and r.working_cache_len == sum(e - s for s, e in r.kept_spans)
    # the trace survives JSON and summarises the same
    assert ev.loads(ev.dumps(trace)) == trace
    assert summarize(ev.loads(ev.dumps(trace))) == summarize(trace)


def test_long_then_short_request(llama_pair, refs):
    config = preset("specextend", max_new_tokens=N_NEW,
                    retrieval=RetrievalConfig(chunk_size=16, top_k=4, retrieve_every=2, prefill_window=64))
    for length in (1500, 5, 700, 1):
        prompt = prompt_of(length, seed=length)
        assert output(run(llama_pair, prompt, config)) == refs(prompt)


def test_eos_stops_and_nothing_past_it_counts(llama_pair, refs):
    prompt = prompt_of(64, seed=13)
    ref = refs(prompt)
    eos = ref[7]
    trace = run(llama_pair, prompt, preset("speculative", max_new_tokens=N_NEW, eos_token_ids=(eos,)))
    assert output(trace) == ref[: ref.index(eos) + 1]
    assert trace[-1].stop_reason == "eos"
    assert summarize(trace).new_tokens == ref.index(eos) + 1


def test_stop_between_steps_and_during_prefill(llama_pair):
    stop = threading.Event()
    trace = []
    for event in generate(llama_pair, prompt_of(100), preset("specextend", max_new_tokens=N_NEW), stop=stop):
        trace.append(event)
        if isinstance(event, ev.Verified) and event.step == 2:
            stop.set()
    assert trace[-1].stop_reason == "stopped" and trace[-1].steps == 2
    stop = threading.Event()
    stop.set()
    trace = run(llama_pair, prompt_of(3000), preset("specextend", max_new_tokens=8), stop=stop)
    assert trace[-1].stop_reason == "stopped" and trace[-1].token_ids == ()


def test_bad_requests_raise_before_any_work(llama_pair):
    with pytest.raises(ValueError, match="empty"):
        next(generate(llama_pair, [], preset("specextend")))
    with pytest.raises(ValueError, match=r"4090 tokens.*max_new_tokens \(10\).*4096"):
        next(generate(llama_pair, prompt_of(4090), preset("specextend", max_new_tokens=10)))
    with pytest.raises(ValueError, match="token ids"):
        next(generate(llama_pair, [VOCAB + 5], preset("specextend")))
    other = tiny("llama", layers=1)
    other.resize_token_embeddings(VOCAB + 3)
    with pytest.raises(ValueError, match="vocabular"):
        make_pair(tiny("llama"), other)


def test_sampling_runs_reproducibly_and_respects_limits(llama_pair):
    prompt = prompt_of(180, seed=21)
    for method in ("autoregressive", "speculative", "specextend"):
        for shape in ("chain", "tree"):
            config = preset(method, max_new_tokens=N_NEW, temperature=0.8, top_p=0.9, seed=7, draft=DraftConfig(shape=shape),
                            retrieval=RetrievalConfig(chunk_size=16, top_k=4, prefill_window=32))
            a, b = output(run(llama_pair, prompt, config)), output(run(llama_pair, prompt, config))
            assert a == b and len(a) == N_NEW


def test_adaptive_retrieval_is_lossless_and_off_the_fixed_schedule(llama_pair, refs):
    prompt = prompt_of(240, seed=17)
    retrieval = RetrievalConfig(chunk_size=16, top_k=4, retrieve_every=1, prefill_window=32, trigger="adaptive",
                                min_acceptance=0.9, acceptance_window=1)
    trace = run(llama_pair, prompt, preset("specextend", max_new_tokens=N_NEW, retrieval=retrieval))
    assert output(trace) == refs(prompt)
    steps = {e.step: e.num_accepted for e in trace if isinstance(e, ev.Verified)}
    retrieved = [e.step for e in trace if isinstance(e, ev.Retrieved)]
    # after prefill, then exactly after the steps that accepted under 90% of their chain (or 4 quiet steps)
    assert retrieved[0] == 0 and all(steps[s] < 4 or s >= 4 for s in retrieved[1:])


SIGNALS = [PAPER, UNCALIBRATED, RetrievalSignal("custom", heads=((0, 1), (2, 3), (2, 0)), rows=5, combine="max", reserve=0.5),
           RetrievalSignal("middle", layers=(1,), rows=64, reserve=0.9)]


@pytest.mark.parametrize("sig", SIGNALS, ids=[s.name for s in SIGNALS])
@pytest.mark.parametrize("draft", DRAFTS[::2], ids=["chain4", "tree10"])
def test_greedy_equals_target_under_every_retrieval_signal(llama_pair, refs, sig, draft):
    prompt = prompt_of(301, seed=301)
    for retrieval in SETTINGS:
        config = preset("specextend", max_new_tokens=N_NEW, draft=draft, retrieval=replace(retrieval, signal=sig))
        trace = run(llama_pair, prompt, config)
        assert output(trace) == refs(prompt), (sig, retrieval)
        retrieved = [e for e in trace if isinstance(e, ev.Retrieved)]
        assert retrieved and all(e.signal == sig.name for e in retrieved)
        assert all(e.reserved == sig.reserved(retrieval.top_k) for e in retrieved)
        started = trace[0].config["retrieval"]["signal"]
        assert started["name"] == sig.name and started["rows"] == sig.rows  # the trace records the resolved signal


def test_default_signal_resolves_to_the_pairs_calibration(llama_pair):
    calibrated = RetrievalSignal("calibrated", heads=((1, 2),), rows=3, reserve=0.5)
    pair = dataclasses.replace(llama_pair, calibrated=calibrated)
    retrieval = RetrievalConfig(chunk_size=16, top_k=4, prefill_window=32)
    names = {}
    for name in ("default", "calibrated", "paper"):
        trace = run(pair, prompt_of(200, seed=3), preset("specextend", max_new_tokens=8,
                                                         retrieval=replace(retrieval, signal=name)))
        names[name] = {e.signal for e in trace if isinstance(e, ev.Retrieved)}
    assert names == {"default": {"calibrated"}, "calibrated": {"calibrated"}, "paper": {"paper"}}
    uncalibrated = run(llama_pair, prompt_of(200, seed=3), preset("specextend", max_new_tokens=8, retrieval=retrieval))
    assert {e.signal for e in uncalibrated if isinstance(e, ev.Retrieved)} == {UNCALIBRATED.name}
    with pytest.raises(ValueError, match="calibrated"):
        run(llama_pair, prompt_of(200), preset("specextend", retrieval=replace(retrieval, signal="calibrated")))


def test_the_target_alone_and_lookup_run_no_draft_model(llama_pair, refs):
    """The target alone drafts nothing (a do-nothing drafter: no drafting or retrieval events); lookup drafts
    without the draft model, so neither reports draft layers even when the pair has a draft."""
    prompt = prompt_of(90, seed=4)
    alone = run(llama_pair, prompt, preset("autoregressive", max_new_tokens=N_NEW))
    assert output(alone) == refs(prompt)
    assert not any(isinstance(e, (ev.Drafted, ev.Retrieved)) for e in alone)
    assert sum(isinstance(e, ev.Verified) for e in alone) == N_NEW - 1
    lookup = run(llama_pair, prompt, preset("lookup", max_new_tokens=N_NEW))
    assert alone[0].draft_layers == lookup[0].draft_layers == 0
    assert run(llama_pair, prompt, preset("speculative", max_new_tokens=2))[0].draft_layers == 1


def test_a_race_prefills_the_target_once(llama_pair, refs):
    """The first request on a prompt keeps the target's prefill; later ones on the same prompt copy it (their
    Prefilled says so and counts the original's time), outputs unchanged. A request that needs the query window
    the copy lacks, or another prompt, prefills again."""
    from specextend.target import SharedPrefill

    prompt = prompt_of(301, seed=7)
    shared = SharedPrefill()
    retrieval = SETTINGS[1]
    first = run(llama_pair, prompt, preset("specextend", max_new_tokens=N_NEW, retrieval=retrieval), shared=shared)
    later = [run(llama_pair, prompt, preset(m, max_new_tokens=N_NEW, retrieval=retrieval), shared=shared)
             for m in ("speculative", "autoregressive", "specextend")]
    prefilled = [next(e for e in t if isinstance(e, ev.Prefilled)) for t in (first, *later)]
    assert [p.shared for p in prefilled] == [False, True, True, True]
    assert all(p.target_s == prefilled[0].target_s and p.t_s >= p.target_s for p in prefilled[1:])
    assert all(output(t) == refs(prompt) for t in (first, *later))
    alone = SharedPrefill()
    run(llama_pair, prompt, preset("autoregressive", max_new_tokens=4), shared=alone)  # keeps no query window
    again = run(llama_pair, prompt, preset("specextend", max_new_tokens=N_NEW, retrieval=retrieval), shared=alone)
    assert not next(e for e in again if isinstance(e, ev.Prefilled)).shared and output(again) == refs(prompt)
    other = run(llama_pair, prompt_of(120, seed=8), preset("autoregressive", max_new_tokens=4), shared=shared)
    assert not next(e for e in other if isinstance(e, ev.Prefilled)).shared


def test_prefill_progress_moves_in_small_blocks_on_cpu(llama_pair):
    """On CPU the target reads the prompt 512 tokens at a time, so its progress moves every block."""
    from specextend.target import prefill_block

    assert prefill_block(torch.device("cpu")) == 512 and prefill_block(torch.device("cuda")) == 2048
    trace = run(llama_pair, prompt_of(1300, seed=3), preset("autoregressive", max_new_tokens=2))
    done = [e.done for e in trace if isinstance(e, ev.Prefilling) and e.model == "target"]
    assert done == [512, 1024, 1300]


def test_a_shared_prefill_serves_a_window_only_when_it_holds_its_rows(llama_pair, refs):
    """A copied prefill must give retrieval the rows a fresh one would: a window of the same heads and at least as
    many rows serves (trimmed to the request's rows); one of fewer rows does not, and the prompt is read again."""
    from specextend.target import SharedPrefill

    prompt = prompt_of(301, seed=11)
    wide, narrow = (RetrievalSignal("w", layers=(), rows=rows) for rows in (16, 4))
    retrieval = replace(SETTINGS[1], signal=narrow)
    fresh = run(llama_pair, prompt, preset("specextend", max_new_tokens=N_NEW, retrieval=retrieval))
    shared = SharedPrefill()
    run(llama_pair, prompt, preset("specextend", max_new_tokens=N_NEW, retrieval=replace(retrieval, signal=wide)),
        shared=shared)
    copied = run(llama_pair, prompt, preset("specextend", max_new_tokens=N_NEW, retrieval=retrieval), shared=shared)
    assert next(e for e in copied if isinstance(e, ev.Prefilled)).shared
    first = lambda t: next(e for e in t if isinstance(e, ev.Retrieved))  # noqa: E731
    assert first(copied).scores == first(fresh).scores and output(copied) == refs(prompt)
    narrow_shared = SharedPrefill()
    run(llama_pair, prompt, preset("specextend", max_new_tokens=4, retrieval=retrieval), shared=narrow_shared)
    again = run(llama_pair, prompt, preset("specextend", max_new_tokens=4, retrieval=replace(retrieval, signal=wide)),
                shared=narrow_shared)
    assert not next(e for e in again if isinstance(e, ev.Prefilled)).shared


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.floats(0.01, 1.0)), min_size=1, max_size=40), st.integers(1, 30))
def test_a_pruned_tree_keeps_the_most_probable_nodes_and_stays_a_tree(nodes, budget):
    """EAGLE-2's rerank (greedy trees): the kept nodes are the `budget` of highest cumulative probability, every kept
    node's parent is kept and comes before it, and fed nodes keep their draft-cache slots."""
    from specextend.drafting import GrowingTree

    tree = GrowingTree(root_position=10, slot0=11)
    for i, (parent, prob) in enumerate(nodes):
        parent = parent % (i + 1) - 1  # -1 (the root) or an earlier node
        tree.tokens.append(i)
        tree.parents.append(parent)
        tree.depths.append(1 if parent < 0 else tree.depths[parent] + 1)
        tree.cum.append((0.0 if parent < 0 else tree.cum[parent]) + math.log(prob))
        tree.probs.append(prob)
        tree.slot[i] = 11 + i
    cum = list(tree.cum)
    tree.prune(budget)
    kept = tree.tokens  # tokens are the original node ids
    assert len(kept) == min(budget, len(nodes)) and kept == sorted(kept)
    assert sorted(cum[o] for o in kept) == sorted(cum)[::-1][: len(kept)][::-1] or len(kept) == len(nodes)
    assert all(p < i for i, p in enumerate(tree.parents))
    assert all(p < 0 or tree.tokens[p] == nodes_parent for p, nodes_parent in
               zip(tree.parents, (nodes[o][0] % (o + 1) - 1 for o in kept)))
    assert tree.slot == {i: 11 + o for i, o in enumerate(kept)}


def test_a_greedy_tree_grows_past_its_budget_and_keeps_the_likeliest_nodes(llama_pair):
    """With the rerank a greedy tree may reach deeper than growing level by level until the budget would."""
    prompt = list(range(5, 40))
    tree = DraftConfig(shape="tree", max_depth=6, node_budget=8, branch=2, children=2, stop_threshold=0.0)
    trace = generate(llama_pair, prompt, preset("speculative", max_new_tokens=40, draft=tree))
    drafted = [e for e in trace if isinstance(e, ev.Drafted)][:4]  # steps with room for the whole depth
    assert all(len(d.tokens) == 8 for d in drafted)
    depths = [max(node_depths(d.parents)) for d in drafted]
    assert max(depths) > 3  # growing level by level, 2 + 4 nodes fill two levels and the budget ends the third
