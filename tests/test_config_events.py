"""Configuration checks, event serialisation and the metric folds.

Every nonsense setting is a ValueError with a message naming the knob; sensible ones resolve to the
right policy and kernels. Events survive JSON (dumps/loads and save_trace/load_trace) unchanged. The
metrics of a small hand-built trace come out exactly as worked out by hand.
"""

from __future__ import annotations

import re

import dataclasses
import json
import math
from dataclasses import asdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specextend import events as ev
from specextend.config import (AttentionConfig, DraftConfig, GenerationConfig, RetrievalConfig, default_chain,
                               draft_defaults, preset)
from specextend.events import Drafted, Finished, Prefilled, Prefilling, Retrieved, Started, Verified
from specextend.metrics import (
    acceptance_by_position,
    committed_curve,
    new_tokens,
    node_depths,
    phase_seconds,
    summarize,
)

# ------------------------------------------------------------------------------------- config

NONSENSE = [
    (lambda: DraftConfig(k=0), "k must be from 1 to 256"),
    (lambda: DraftConfig(k=-2), "k must be from 1 to 256"),
    (lambda: DraftConfig(shape="ring"), "shape"),
    (lambda: DraftConfig(shape="tree", node_budget=0), "node_budget"),
    (lambda: DraftConfig(max_depth=0), "max_depth"),
    (lambda: DraftConfig(branch=0), "branch"),
    (lambda: DraftConfig(children=0), "children"),
    (lambda: DraftConfig(k=10**9), "k must be from 1 to 256"),
    (lambda: DraftConfig(shape="tree", node_budget=10**6), "node_budget must be from 1 to 256"),
    (lambda: DraftConfig(children=257), "children"),
    (lambda: RetrievalConfig(top_k=10**7), "at most 65,536"),
    (lambda: DraftConfig(stop_threshold=1.0), "stop_threshold"),
    (lambda: DraftConfig(stop_threshold=-0.1), "stop_threshold"),
    (lambda: DraftConfig(confidence_floor=1.0), "confidence_floor"),
    (lambda: DraftConfig(confidence_floor=float("nan")), "confidence_floor"),
    (lambda: DraftConfig(shape="tree", confidence_floor=0.1), "stop_threshold instead"),
    (lambda: RetrievalConfig(chunk_size=0), "chunk_size"),
    (lambda: RetrievalConfig(chunk_size=-32), "chunk_size"),
    (lambda: RetrievalConfig(top_k=0), "top_k"),
    (lambda: RetrievalConfig(top_k=1), "top_k"),
    (lambda: RetrievalConfig(retrieve_every=0), "retrieve_every"),
    (lambda: RetrievalConfig(prefill_window=0), "prefill_window"),
    (lambda: RetrievalConfig(sink_tokens=-1), "sink_tokens"),
    (lambda: RetrievalConfig(chunk_size=4, top_k=2, sink_tokens=8), "sink_tokens"),
    (lambda: RetrievalConfig.with_working_cache(16, chunk_size=32), "smaller than one chunk"),
    (lambda: RetrievalConfig.with_working_cache(0), "smaller than one chunk"),
    (lambda: RetrievalConfig.with_working_cache(64, chunk_size=0), "chunk_size"),
    (lambda: AttentionConfig(prefill="flash"), "prefill kernel"),
    (lambda: AttentionConfig(verify="tree"), "verify kernel"),
    (lambda: GenerationConfig(temperature=-0.5), "temperature"),
    (lambda: GenerationConfig(temperature=float("nan")), "temperature"),
    (lambda: GenerationConfig(temperature=1e9), "temperature"),
    (lambda: GenerationConfig(seed=2**80), "seed"),
    (lambda: GenerationConfig(seed=-1), "seed"),
    (lambda: AttentionConfig(steps="fast"), "steps"),
    (lambda: GenerationConfig(top_p=0.0), "top_p"),
    (lambda: GenerationConfig(top_p=1.5), "top_p"),
    (lambda: GenerationConfig(top_p=float("nan")), "top_p"),
    (lambda: GenerationConfig(method="beam"), "method"),
    (lambda: GenerationConfig(max_new_tokens=0), "max_new_tokens"),
    (lambda: GenerationConfig(method="autoregressive", cmr=True), "cmr"),
    (lambda: GenerationConfig(method="streaming", cmr=True), "cmr"),
    (lambda: preset("beam"), "method"),
    (lambda: GenerationConfig().replace(temperature=-1.0), "temperature"),
]


@pytest.mark.parametrize("make,message", NONSENSE, ids=[m for _, m in NONSENSE])
def test_nonsense_settings_are_value_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_sensible_settings_resolve():
    assert RetrievalConfig.with_working_cache(1024).top_k == 32
    assert RetrievalConfig.with_working_cache(100, chunk_size=32).working_cache == 96
    assert RetrievalConfig(chunk_size=4, top_k=2, sink_tokens=7).working_cache == 8
    chain = DraftConfig(k=3)
    assert (chain.depth, chain.budget, chain.width) == (3, 3, (1, 1))
    # the chain a device drafts unless told: 2 on the CPU (measured), the engine's own 4 where verification is cheap
    assert (default_chain("cpu"), default_chain("cuda"), default_chain("cuda:1"), DraftConfig().k) == (2, 4, 4, 4)
    assert draft_defaults("cpu") == DraftConfig(k=2) and draft_defaults("cuda").shape == "tree"
    tree = DraftConfig(shape="tree", max_depth=4, node_budget=9, branch=2, children=3)
    assert (tree.depth, tree.budget, tree.width) == (4, 9, (2, 3))
    assert preset("specextend").draft_cache == "cmr"
    assert preset("specextend").attention == AttentionConfig(prefill="fused", verify="auto", steps="auto")
    assert preset("specextend", cmr=False).draft_cache == "full"
    assert preset("speculative").draft_cache == "full"
    assert preset("speculative").attention == AttentionConfig(prefill="fused", verify="masked", steps="eager")
    assert preset("speculative", cmr=True).draft_cache == "cmr"
    assert preset("streaming").draft_cache == "streaming"
    assert not preset("autoregressive").uses_draft and preset("speculative").uses_draft
    assert GenerationConfig().greedy and not GenerationConfig(temperature=0.7).greedy
    assert GenerationConfig(eos_token_ids=[2, 3]).eos_token_ids == (2, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        GenerationConfig().temperature = 1.0  # type: ignore[misc]


# ------------------------------------------------------------------------------------- events

JSON_CONFIG = json.loads(json.dumps(asdict(GenerationConfig())))  # a config as JSON gives it back


def one_of_each(config=JSON_CONFIG) -> list:
    return [
        Started(0.0, 0.0, "specextend", (5, 6, 7), config, 3, 1, "cpu", "float32"),
        Prefilling(0.25, 0.25, "target", 2048, 4000),
        Prefilled(1.0, 0.9, 10, 0.6, 0.3, 5),
        Retrieved(1.05, 0.05, 0, "cmr", 9, 4, ((0, 4), (4, 8), (8, 9)), (0.5, 0.2, 0.1 + 0.2), (0, 2),
                  ((0, 4), (8, 9)), 5),
        Drafted(1.2, 0.1, 1, 10, (7, 8, 9), (-1, 0, 0), (0.9, 1 / 3, 1e-7), 2),
        Verified(1.5, 0.2, 1, 11, (0, 1), (True, True, False), 2, 4, (7, 8, 4), 4),
        Finished(3.0, 3.0, (5, 7, 8, 4), "eos", 1, 10, "done"),
    ]


def test_events_json_round_trip(tmp_path):
    trace = one_of_each()
    again = ev.loads(ev.dumps(trace))
    assert again == trace
    assert [type(e) for e in again] == [type(e) for e in trace]
    assert isinstance(again[3].chunk_spans[0], tuple)  # nested tuples come back as tuples
    path = tmp_path / "trace.json"
    ev.save_trace(trace, path)
    assert ev.load_trace(path) == trace
    assert json.loads(path.read_text())[0]["type"] == "Started"


def test_started_with_engine_config_round_trips():
    """The engine fills Started.config with asdict(config), whose eos_token_ids is a tuple."""
    config = asdict(GenerationConfig(eos_token_ids=(2,)))
    started = Started(0.0, 0.0, "specextend", (5,), config, 3, 1, "cpu", "float32")
    assert ev.loads(ev.dumps([started])) == [started]


def test_a_drafted_event_says_why_the_draft_sat_out_and_older_traces_still_load():
    gated = Drafted(1.2, 0.0, 3, 10, (7,), (-1,), (1.0,), 0, ("lookup",), (4,), "gate", (0, 1, 0, 0))
    assert ev.loads(ev.dumps([gated])) == [gated]
    older = ev.to_dict(gated)
    del older["sat_out"], older["recent"]  # a trace saved before the draft's reasons were recorded
    assert ev.from_dict(older) == dataclasses.replace(gated, sat_out="", recent=())


def test_from_dict_rejects_unknown_types_and_ignores_unknown_fields():
    with pytest.raises(ValueError, match="'Exploded' is not a kind of event"):
        ev.from_dict({"type": "Exploded", "t_s": 0.0})
    with pytest.raises(ValueError, match="None is not a kind of event"):
        ev.from_dict({"t_s": 0.0})
    data = ev.to_dict(Prefilling(0.1, 0.1, "draft", 3, 9))
    data["added_later"] = [1, 2]
    assert ev.from_dict(data) == Prefilling(0.1, 0.1, "draft", 3, 9)


@pytest.mark.parametrize("change,message", [
    ({"done": "3"}, "Prefilling.done should be a whole number, got str"),
    ({"done": 3.5}, "Prefilling.done should be a whole number"),
    ({"done": True}, "Prefilling.done should be a whole number, got bool"),
    ({"t_s": float("inf")}, "Prefilling.t_s is inf: out of range"),
    ({"t_s": 1e300}, "out of range"),
    ({"model": ["target"]}, "Prefilling.model should be a string"),
    ({"total": None}, "Prefilling.total should be a whole number, got NoneType"),
])
def test_from_dict_names_the_first_wrong_field(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ev.from_dict({**ev.to_dict(Prefilling(0.1, 0.1, "draft", 3, 9)), **change})
    with pytest.raises(ValueError, match="Prefilling has no 'total'"):
        ev.from_dict({"type": "Prefilling", "t_s": 0.0, "elapsed_s": 0.0, "model": "draft", "done": 1})
    with pytest.raises(ValueError, match=re.escape("Verified.committed[1] should be a whole number")):
        ev.from_dict({**ev.to_dict(Verified(0.0, 0.0, 1, 5, (), (), 0, 7, (7,), 1)), "committed": [7, "x"]})
    with pytest.raises(ValueError, match=re.escape("Retrieved.chunk_spans[0] should be a list of 2 items")):
        ev.from_dict({**ev.to_dict(Retrieved(0.0, 0.0, 0, "cmr", 64, 32, ((0, 32),), (1.0,), (0,), ((0, 32),), 32)),
                      "chunk_spans": [[0, 32, 64]]})
    deep: dict = {}
    for _ in range(40):
        deep = {"x": deep}
    with pytest.raises(ValueError, match="nested more than"):
        ev.from_dict({**ev.to_dict(Started(0.0, 0.0, "specextend", (1,), {}, 2, 1, "cpu", "float32")), "config": deep})


floats = st.floats(-ev.LIMIT, ev.LIMIT)  # what an event's numbers may be
ints = st.integers(-ev.LIMIT, ev.LIMIT)
int_tuples = st.lists(ints, max_size=6).map(tuple)
span_tuples = st.lists(st.tuples(ints, ints), max_size=5).map(tuple)
random_events = st.one_of(
    st.builds(Drafted, floats, floats, ints, ints, int_tuples, int_tuples, st.lists(floats, max_size=6).map(tuple),
              ints),
    st.builds(Verified, floats, floats, ints, ints, int_tuples, st.lists(st.booleans(), max_size=6).map(tuple), ints,
              ints, int_tuples, ints),
    st.builds(Retrieved, floats, floats, ints, st.text(max_size=8), ints, ints, span_tuples,
              st.lists(floats, max_size=5).map(tuple), int_tuples, span_tuples, ints),
    st.builds(Finished, floats, floats, int_tuples, st.text(max_size=12), ints, ints, st.text(max_size=20)),
)


@settings(max_examples=40, deadline=None)
@given(trace=st.lists(random_events, max_size=5))
def test_random_events_round_trip(trace):
    assert ev.loads(ev.dumps(trace)) == trace


# ------------------------------------------------------------------------------------ metrics


def hand_trace() -> list:
    """Prompt of 10, first token 5 at t=1.0, then three steps; the last step hit max_new_tokens, so its
    bonus token was cut and only 1 of its 2 tokens counts."""
    return [
        Started(0.0, 0.0, "specextend", tuple(range(10)), JSON_CONFIG, 3, 1, "cpu", "float32"),
        Prefilling(0.5, 0.5, "target", 10, 10),
        Prefilled(1.0, 0.9, 10, 0.6, 0.3, 5),
        Retrieved(1.05, 0.05, 0, "cmr", 9, 4, ((0, 4), (4, 8), (8, 9)), (0.5, 0.2, 0.3), (0, 1, 2), ((0, 9),), 9),
        Drafted(1.2, 0.1, 1, 10, (7, 8, 9), (-1, 0, 1), (0.9, 0.8, 0.7), 3),
        Verified(1.5, 0.2, 1, 11, (0, 1), (True, True, False), 2, 4, (7, 8, 4), 4),
        Drafted(1.7, 0.1, 2, 13, (1, 2, 3), (-1, 0, 1), (0.5, 0.5, 0.5), 3),
        Verified(2.0, 0.25, 2, 14, (), (False, False, False), 0, 6, (6,), 5),
        Retrieved(2.1, 0.1, 2, "cmr", 14, 4, ((0, 4), (4, 8), (8, 12), (12, 14)), (0.4, 0.1, 0.2, 0.3), (0, 3),
                  ((0, 4), (12, 14)), 6),
        Drafted(2.4, 0.1, 3, 14, (1, 2, 3), (-1, -1, 0), (0.6, 0.3, 0.5), 2),
        Verified(3.0, 0.2, 3, 15, (0,), (True, False, False), 1, 2, (1,), 6),
        Finished(3.1, 3.1, (5, 7, 8, 4, 6, 1), "max_new_tokens", 3, 10),
    ]


def test_summarize_hand_trace():
    s = summarize(hand_trace())
    assert s.method == "specextend" and s.prompt_len == 10 and s.stop_reason == "max_new_tokens"
    assert s.new_tokens == 6 and s.steps == 3
    assert s.decode_s == pytest.approx(2.0)  # from the end of prefill (1.0) to the last step (3.0)
    assert s.total_s == pytest.approx(3.0)
    assert s.decode_tokens_per_s == pytest.approx(5 / 2.0)  # 5 step tokens; the cut bonus does not count
    assert s.e2e_tokens_per_s == pytest.approx(6 / 3.0)
    assert s.mean_accepted == pytest.approx((3 + 1 + 2) / 3)
    # depth 1 drafted in 3 steps, accepted in 2; depth 2 drafted 3, accepted 1; depth 3 drafted 2, accepted 0
    assert s.acceptance_by_position == pytest.approx((2 / 3, 1 / 3, 0.0))
    assert s.phase_seconds == pytest.approx(
        {"target_prefill": 0.6, "draft_prefill": 0.3, "drafting": 0.3, "verification": 0.65, "retrieval": 0.15}
    )
    assert s.cmr_overhead_share == pytest.approx(0.15 / 2.0)


def test_metric_folds_agree_with_the_trace():
    trace = hand_trace()
    assert new_tokens(trace) == list(trace[-1].token_ids)
    assert committed_curve(trace) == [(1.0, 1), (1.5, 4), (2.0, 5), (3.0, 6)]
    assert phase_seconds(trace)["retrieval"] == pytest.approx(0.15)
    assert acceptance_by_position(trace[:6]) == pytest.approx((1.0, 1.0, 0.0))
    assert node_depths((-1, 0, 1, -1, 3, 0)) == [1, 2, 3, 1, 2, 2]
    # metrics are pure: a replayed trace gives the same summary
    assert summarize(ev.loads(ev.dumps(trace))) == summarize(trace)


def test_summarize_autoregressive_and_empty_traces():
    trace = [
        Started(0.0, 0.0, "autoregressive", (1, 2), JSON_CONFIG, 3, 0, "cpu", "float32"),
        Prefilled(0.5, 0.5, 2, 0.5, 0.0, 9),
        Verified(1.0, 0.5, 1, 3, (), (), 0, 4, (4,), 2),
        Verified(1.5, 0.5, 2, 4, (), (), 0, 4, (4,), 3),
        Finished(1.6, 1.6, (9, 4, 4), "max_new_tokens", 2, 2),
    ]
    s = summarize(trace)
    assert s.acceptance_by_position == () and s.mean_accepted == 1.0
    assert s.decode_tokens_per_s == pytest.approx(2 / 1.0) and s.e2e_tokens_per_s == pytest.approx(3 / 1.5)
    assert s.phase_seconds["drafting"] == 0.0 and s.phase_seconds["verification"] == pytest.approx(1.0)
    empty = summarize([])
    assert (empty.new_tokens, empty.steps, empty.decode_tokens_per_s, empty.e2e_tokens_per_s) == (0, 0, 0.0, 0.0)
    assert empty.stop_reason == "running" and empty.acceptance_by_position == ()
    assert not any(math.isnan(v) for v in (empty.mean_accepted, empty.cmr_overhead_share))


def test_one_table_of_methods_drives_the_config_the_figures_and_the_app():
    from app.ui import METHOD_CHOICES
    from specextend.methods import METHOD_TABLE, DraftCache
    from visualizers.common import color, label

    for m in METHOD_TABLE:
        config = preset(m.name)
        assert config.uses_draft == m.draft_model and (config.draft_cache if m.draft_model else None) == m.cache
        assert (config.attention.steps == "auto") == m.fast and (label(m.name), color(m.name)) == (m.label, m.colour)
    assert preset("speculative", cmr=True).draft_cache is DraftCache.CMR  # the CMR ablation of the full cache
    assert preset("specextend", cmr=False).draft_cache is DraftCache.FULL
    assert [name for _, name in METHOD_CHOICES] == [m.name for m in reversed(METHOD_TABLE)]
    assert len({m.colour for m in METHOD_TABLE}) == len(METHOD_TABLE)  # each method its own colour
