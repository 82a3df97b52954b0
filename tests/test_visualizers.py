"""Visualizers on synthetic traces (from the fake engine) and on a trace recorded from the real engine:
every figure validates against Plotly's schema, and each panel shows what the trace says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from specextend.config import DraftConfig, RetrievalConfig, preset
from specextend.events import Drafted, Retrieved, Verified
from specextend.metrics import new_tokens
from visualizers import (
    acceptance_spec, answer_html, exactness_html, far_chunks, far_html, first_divergence, heads_spec, held_share,
    kept_chunks, needle_spec,
    output_html, retrieval_spec, segments, throughput_html, throughput_spec, to_figure,
)
from visualizers.acceptance import ACCEPTED, BONUS, REJECTED, step_cells, tree_layout
from visualizers.retrieval import FAR

from fixtures.fake_engine import fake_generate

FIXTURES = Path(__file__).parent / "fixtures"
PROMPT = list(range(100, 1300))  # 1,200 tokens: not a multiple of the chunk size


def decode(ids):
    return "".join(f" w{i}" for i in ids)


def trace(method="specextend", **changes):
    changes.setdefault("max_new_tokens", 60)
    changes.setdefault("retrieval", RetrievalConfig(chunk_size=32, top_k=6, retrieve_every=3))
    return list(fake_generate(PROMPT, preset(method, **changes)))


def recorded_traces():
    from app.trace import loads

    return [loads(p.read_text()) for p in sorted(FIXTURES.glob("*.trace.json"))]


def traces_to_check():
    out = [(m, {m: trace(m)}, decode) for m in ("specextend", "speculative", "streaming", "autoregressive")]
    out.append(("tree", {"specextend": trace(draft=DraftConfig(shape="tree", max_depth=4, node_budget=8))}, decode))
    for runs, codec, _ in recorded_traces():
        out.append(("recorded", runs, codec.decode))
    return out


@pytest.mark.parametrize("name,runs,dec", traces_to_check(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_panel_is_a_valid_plotly_figure(name, runs, dec):
    for events in runs.values():
        for spec in (retrieval_spec(events, dec), acceptance_spec(events, dec)):
            to_figure(spec)  # raises on anything Plotly does not know
            json.dumps(spec, allow_nan=False)  # the browser's JSON.parse accepts no NaN
    to_figure(throughput_spec(runs))
    json.dumps(throughput_spec(runs), allow_nan=False)


def test_retrieval_heatmap_has_a_row_per_retrieval_and_outlines_the_working_cache():
    events = trace()
    retrievals = [e for e in events if isinstance(e, Retrieved)]
    spec = retrieval_spec(events, decode)
    strip, heat, said, bought = spec["data"]
    assert heat["y"] == [r.step for r in retrievals]
    assert retrievals[0].step == 0 and all(r.step % 3 == 0 for r in retrievals)
    latest = retrievals[-1]
    assert len(strip["z"][0]) == len(latest.chunk_spans)
    for row, r in zip(heat["z"], retrievals):
        assert [i for i, v in enumerate(row) if v is not None and v >= 1.0] == list(r.selected)
        n = len(r.chunk_spans)  # green (2): kept, but neither the sink nor among the newest len(kept) - 1 chunks
        assert [i for i, v in enumerate(row) if v == 2.0] == [i for i in r.selected if 0 < i < n - len(r.selected) + 1]
        assert far_chunks(r) == tuple(i for i, v in enumerate(row) if v == 2.0)
    assert any(far_chunks(r) for r in retrievals)  # the fake signal follows the output a third into the prompt
    outlined = {c for shape in spec["layout"]["shapes"] if shape["type"] == "rect" and shape.get("name") != "output chunks"
                for c in range(int(shape["x0"] + 0.5), int(shape["x1"] + 0.5))}
    assert outlined == set(latest.selected)
    green = {c for shape in spec["layout"]["shapes"] if shape["type"] == "rect" and shape["line"]["color"] == FAR
             for c in range(int(shape["x0"] + 0.5), int(shape["x1"] + 0.5))}
    assert green == set(far_chunks(latest))
    # what each retrieval bought: draft tokens accepted per step until the next retrieval, at the right of its row
    verified = [e for e in events if isinstance(e, Verified)]
    rows = len(retrievals)
    for i, (text, words, r, nxt) in enumerate(zip(bought["text"], bought["hovertext"], retrievals, [*retrievals[1:], None])):
        served = [v.num_accepted for v in verified if r.step < v.step <= (nxt.step if nxt else 10**9)]
        written = (rows - 1 - i) % 2 == 0  # 8 rows about 9 px tall: every other number, from the latest row back
        assert text == (f"{sum(served) / len(served):.1f}" if served and written else "")
        assert (f"accepted {sum(served) / len(served):.2f}" if served else "no step has read") in words
    assert rows == 8 and sum(bool(t) for t in bought["text"]) >= 3
    assert bought["y"] == heat["y"]
    assert "chunk 0" in strip["text"][0][0] and "w100" in strip["text"][0][0]  # hover shows the chunk's text
    assert said["y"] == heat["y"] and said["hovertext"][-1].startswith(f"output after step {latest.step}")


def test_far_html_lists_the_chunks_that_reach_back_with_their_text():
    events = trace()
    latest = [e for e in events if isinstance(e, Retrieved)][-1]
    page = far_html(events, decode)
    far = far_chunks(latest)
    assert f"{len(far)} chunk(s)" in page
    best = max(far, key=lambda i: latest.scores[i])
    s, e = latest.chunk_spans[best]
    assert f"<b>chunk {best}</b>" in page and decode((PROMPT + [0] * 100)[s:s + 2]).strip() in page
    assert "after retrievals that reached back" in page
    assert far_html(trace("streaming"), decode) == "" and far_html(trace("speculative"), decode) == ""


def test_streaming_window_is_drawn_from_kept_spans():
    events = trace("streaming", max_new_tokens=80)
    r = [e for e in events if isinstance(e, Retrieved)][-1]
    assert r.selected == () and r.kept_spans
    kept = kept_chunks(r)
    assert kept[0] == 0 and kept[-1] == -(-r.seq_len // r.chunk_size) - 1
    assert "StreamingLLM" in retrieval_spec(events, decode)["layout"]["title"]["text"]


@pytest.mark.parametrize("method", ["speculative", "autoregressive"])
def test_methods_without_retrieval_say_so(method):
    spec = retrieval_spec(trace(method), decode)
    assert spec["data"] == [] and "no retrieval" in spec["layout"]["annotations"][0]["text"]


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_acceptance_has_a_column_per_step_with_accepted_then_bonus_then_rejected(shape):
    draft = DraftConfig(shape=shape, k=4, max_depth=4, node_budget=8)
    events = trace(draft=draft)
    verified = [e for e in events if isinstance(e, Verified)]
    drafted = {e.step: e for e in events if isinstance(e, Drafted)}
    spec = acceptance_spec(events, decode)
    cells = spec["data"][0]
    assert cells["x"] == [v.step for v in verified]
    for col, v in enumerate(verified):
        column = [row[col] for row in cells["z"] if row[col] is not None]
        assert column == step_cells(drafted[v.step], v)
        assert column.count(ACCEPTED) == v.num_accepted and column.count(BONUS) == 1
        assert column.count(REJECTED) == 4 - v.num_accepted
    if shape == "tree":
        assert any(d["type"] == "scatter" and "root" in d.get("text", []) for d in spec["data"])


def test_tree_layout_centres_parents_over_children():
    ys = tree_layout([-1, -1, 0, 0, 2])
    assert ys[0] == (ys[2] + ys[3]) / 2 and ys[2] == ys[4]
    assert len(set(ys[i] for i in (1, 3, 4))) == 3


def test_autoregressive_acceptance_is_a_message():
    assert acceptance_spec(trace("autoregressive"), decode)["data"] == []


def test_throughput_has_one_curve_per_method_ending_at_its_token_count():
    runs = {m: trace(m) for m in ("specextend", "speculative", "autoregressive")}
    spec = throughput_spec(runs)
    curves = [d for d in spec["data"] if d["type"] == "scatter"]
    assert [c["name"] for c in curves] == ["SpecExtend", "speculative (full draft cache)", "target alone"]
    assert all(c["y"][0] == 0 and c["y"][-1] == 60 for c in curves)
    bars = {d["name"] for d in spec["data"] if d["type"] == "bar" and d["xaxis"] == "x2"}
    assert bars == {"prefill", "drafting", "verification", "retrieval", "other"}
    windows = [d["name"] for d in spec["data"] if d["type"] == "bar" and d["xaxis"] == "x3"]
    assert windows == ["SpecExtend", "speculative (full draft cache)"]  # the target alone is the dashed 1.0 line
    table = throughput_html(runs)
    assert table.count("<tr>") == 4 and "speedup over the target alone" in table
    assert "speedup over standard speculative decoding, same draft and sources" in table
    assert table.split("<table")[1].count("×") == 3  # SpecExtend over both, speculative over the target alone
    assert "busy" not in table and "busy" in throughput_html(runs, load=2.5)
    alone = throughput_html({"specextend": runs["specextend"]})
    assert "speedup" not in alone.split("</thead>")[0] and "×" not in alone


def test_the_speed_table_names_what_each_ratio_compares_and_claims_no_unfair_one():
    from specextend.config import LookupConfig
    from specextend.metrics import summarize

    on = LookupConfig(enabled=True)
    fair = {"specextend": trace(lookup=on), "speculative": trace("speculative", lookup=on),
            "autoregressive": trace("autoregressive")}
    rate = {m: summarize(ev).e2e_tokens_per_s for m, ev in fair.items()}
    head, table = throughput_html(fair).split("<table")
    assert (f"SpecExtend over standard speculative decoding, both with lookup, the same draft model: "
            f"<b>{rate['specextend'] / rate['speculative']:.2f}×</b>") in head  # the paper's comparison leads
    assert (f"over the target alone: SpecExtend + lookup <b>{rate['specextend'] / rate['autoregressive']:.2f}×</b>, "
            f"speculative (full draft cache) + lookup <b>{rate['speculative'] / rate['autoregressive']:.2f}×</b>") in head
    assert "not comparable" not in table
    without = {m: trace(m) for m in ("specextend", "speculative")}
    assert "both without lookup, the same draft model: <b>" in throughput_html(without)

    unfair = {**fair, "speculative": trace("speculative")}  # lookup for SpecExtend only: the race issue 39 found
    head, table = throughput_html(unfair).split("<table")
    comparison = head.split(" · ")[0]
    assert comparison.endswith("SpecExtend over standard speculative decoding, not comparable: SpecExtend drafted with "
                               "lookup, speculative without")
    assert "×" not in comparison  # no ratio claimed between them
    spec_row = next(r for r in table.split("<tr>") if "SpecExtend + lookup" in r)
    assert spec_row.count("×") == 1 and ">not comparable</span>" in spec_row  # over the target alone only
    alone = {"lookup": trace("lookup"), "speculative": trace("speculative")}
    assert ("not comparable: lookup drafting alone drafted from lookup only; speculative from the draft model"
            in throughput_html(alone))
    alone["speculative"] = trace("speculative", lookup=on)
    assert ("not comparable: lookup drafting alone drafted from lookup only; speculative from the draft model and "
            "lookup") in throughput_html(alone)


def test_output_html_colours_accepted_draft_tokens_and_escapes_text():
    events = trace()
    html = output_html(events, lambda ids: "<script>x</script>")
    assert "<script>" not in html and "&lt;script&gt;" in html
    accepted_runs = [s for s in segments(events) if s[0] == "accepted"]
    assert html.count("class='se-draft'") == len(accepted_runs) > 0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 6), new=st.integers(1, 40), shape=st.sampled_from(["chain", "tree"]),
       method=st.sampled_from(["specextend", "speculative", "streaming", "autoregressive"]))
def test_segments_rebuild_exactly_the_generated_tokens(seed, k, new, shape, method):
    draft = DraftConfig(shape=shape, k=k, max_depth=k, node_budget=2 * k)
    events = list(fake_generate(PROMPT[:300], preset(method, max_new_tokens=new, seed=seed, draft=draft)))
    rebuilt = [t for _, ids, _ in segments(events) for t in ids]
    assert rebuilt == new_tokens(events) and len(rebuilt) == new


def test_exactness_reports_the_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3, 4]) is None
    assert first_divergence([1, 2, 9], [1, 2, 3]) == 2
    assert "✔ Exact" in exactness_html([1, 2, 3], [1, 2, 3], decode)
    bad = exactness_html([1, 2, 9], [1, 2, 3], decode)
    assert "new token 2" in bad and "w9" in bad and "w3" in bad


def test_needle_grid_shows_which_cache_held_the_needle():
    paper = RetrievalConfig(chunk_size=32, top_k=6, retrieve_every=3, signal="paper")
    runs = {"specextend": trace(), "specextend_paper": trace(retrieval=paper), "streaming": trace("streaming")}
    cmr = [e for e in runs["specextend"] if isinstance(e, Retrieved)][-1]
    span = cmr.chunk_spans[cmr.selected[1]]  # a retrieved chunk away from the sink
    assert held_share(cmr, span) == 1.0 and held_share(cmr, (span[0], span[0])) == 0.0
    spec = needle_spec(runs, span, len(PROMPT))
    heat = spec["data"][0]
    assert heat["y"] == ["CMR, default signal", "CMR, paper signal", "StreamingLLM draft cache"]  # rows by signal
    to_figure(spec)
    answers = answer_html(runs, decode, "w500", span)
    assert answers.count("<tr>") == 4
    first = [e for e in runs["specextend"] if isinstance(e, Retrieved)][0]
    assert f"<td>{held_share(first, span):.0%}</td>" in answers  # what the first retrieval held


def test_heads_picture_outlines_each_signals_heads():
    share = [[0.01, 0.02, 0.03], [0.20, 0.01, 0.05], [0.02, 0.02, 0.01]]
    spec = heads_spec(share, {"calibrated signal": [(1, 0), (1, 2)], "paper's signal": [(2, 0), (2, 1), (2, 2)]}, 32)
    to_figure(spec)
    heat = spec["data"][0]
    assert heat["z"] == share and heat["zmax"] == 0.20
    boxes = [(s["y0"] + 0.45, s["x0"] + 0.45, s["line"]["color"]) for s in spec["layout"]["shapes"]]
    assert [(round(y), round(x)) for y, x, _ in boxes] == [(1, 0), (1, 2), (2, 0), (2, 1), (2, 2)]
    assert len({c for *_, c in boxes[:2]} | {c for *_, c in boxes[2:]}) == 2  # one colour per signal
    assert "calibrated signal" in spec["layout"]["title"]["text"]
    assert "not available" in heads_spec((), {}, 0)["layout"]["annotations"][0]["text"]


def test_visualizers_import_no_gradio():
    code = "import sys, visualizers; assert 'gradio' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


@pytest.mark.skipif(not list(FIXTURES.glob("*.trace.json")), reason="no recorded trace in tests/fixtures")
def test_panels_on_the_recorded_trace_match_its_events():
    runs, codec, meta = recorded_traces()[0]
    events = runs[meta["primary"]]
    retrievals = [e for e in events if isinstance(e, Retrieved)]
    verified = [e for e in events if isinstance(e, Verified)]
    steps = [r.step for r in retrievals]
    assert steps[0] == 0 and steps == sorted(set(steps))  # after prefill, then on the engine's schedule
    retrieval = retrieval_spec(events, codec.decode)
    assert retrieval["data"][1]["y"] == [r.step for r in retrievals]
    assert any("Hamlet" in t or "BERNARDO" in t.upper() for t in retrieval["data"][0]["text"][0])  # chunk text on hover
    assert acceptance_spec(events, codec.decode)["data"][0]["x"] == [v.step for v in verified]
    assert [t for _, ids, _ in segments(events) for t in ids] == new_tokens(events)
    if "autoregressive" in runs:  # recorded greedy in fp32: the race's outputs agree token for token
        assert "✔ Exact" in exactness_html(new_tokens(events), new_tokens(runs["autoregressive"]), codec.decode)


# ------------------------------------------------------------------------------------ lookup's copies


@pytest.fixture(scope="module")
def lookup_traces(bigram_pair):
    """Engine traces on the repeating tiny target: lookup alone, and SpecExtend with lookup branches."""
    from specextend.config import LookupConfig
    from specextend.engine import generate

    prompt = [(7 * i) % 97 for i in range(260)]  # several CMR chunks; the tiny models' vocabulary is 97
    retrieval = RetrievalConfig(chunk_size=16, top_k=4, retrieve_every=2, prefill_window=32)
    return {m: list(generate(bigram_pair, prompt, preset(m, max_new_tokens=60, retrieval=retrieval,
                                                            lookup=LookupConfig(enabled=m != "lookup" or None))))
            for m in ("lookup", "specextend")}


@pytest.mark.parametrize("method", ["lookup", "specextend"])
def test_copied_tokens_are_their_own_kind_in_text_and_cells(lookup_traces, method):
    from specextend.metrics import tokens_by_source
    from visualizers.acceptance import COPIED

    events = lookup_traces[method]
    runs = segments(events)
    assert [t for _, ids, _ in runs for t in ids] == new_tokens(events)
    counts = tokens_by_source(events)
    copied = sum(len(ids) for kind, ids, _ in runs if kind == "copied")
    assert copied == counts["lookup"] + counts["both"] > 10
    assert sum(len(ids) for kind, ids, _ in runs if kind == "accepted") == counts["draft"]
    assert output_html(events, decode).count("class='se-copy'") == sum(kind == "copied" for kind, _, _ in runs)
    cells = acceptance_spec(events, decode)["data"][0]
    assert sum(v == COPIED for row in cells["z"] for v in row) == copied
    for spec in (retrieval_spec(events, decode), acceptance_spec(events, decode)):
        to_figure(spec)
        json.dumps(spec, allow_nan=False)


def test_retrieval_strip_shows_where_copies_came_from(lookup_traces):
    from specextend.metrics import copies

    events = lookup_traces["specextend"]
    spec = retrieval_spec(events, decode)
    strip, heat, said, _, copied = spec["data"]  # the fourth: what each retrieval bought
    size = [e for e in events if isinstance(e, Retrieved)][-1].chunk_size
    found = copies(events)
    sources = {p // size for _, origins in found for p in origins if p // size < len(strip["z"][0])}
    assert copied["y"] == [1] and {i for i, v in enumerate(copied["z"][0]) if v > 0} == sources
    violet = [s for s in spec["layout"]["shapes"] if s["type"] == "rect" and s["y0"] == 0.5]
    assert {c for s in violet for c in range(int(s["x0"] + 0.5), int(s["x1"] + 0.5))} == {p // size for p in found[-1][1]}
    assert "lookup copied" in spec["layout"]["title"]["text"]


def test_lookup_alone_gets_a_row_per_copying_step(lookup_traces):
    from specextend.metrics import copies

    events = lookup_traces["lookup"]
    spec = retrieval_spec(events, decode)
    strip, heat = spec["data"]
    found = copies(events)
    assert heat["y"] == [step for step, _ in found]
    for row, (_, origins) in zip(heat["z"], found):
        assert {i for i, v in enumerate(row) if v} == {p // 32 for p in origins}
    assert spec["layout"]["title"]["text"].startswith("Lookup:")


def test_speed_panel_names_a_run_with_lookup_added(lookup_traces):
    spec = throughput_spec(lookup_traces)
    curves = [t["name"] for t in spec["data"] if t["type"] == "scatter"]
    assert curves == ["lookup drafting alone", "SpecExtend + lookup"]
    assert "SpecExtend + lookup" in throughput_html(lookup_traces)


def test_an_empty_output_says_what_it_waits_for():
    from specextend.events import Prefilling, Started

    from visualizers.text import waiting_for

    assert "waits its turn in the queue" in output_html([], str)
    started = Started(0.0, 0.0, "specextend", tuple(range(7575)), {}, 30, 6, "cpu", "float32")
    assert "reading 7,575 prompt tokens" in waiting_for([started])
    reading = [started, Prefilling(4.1, 4.0, "target", 2048, 7575)]
    assert "the target has read 2,048 of 7,575 prompt tokens (4 s so far)" in output_html(reading, str)


def test_the_exactness_line_says_what_the_runs_continued_from():
    """A race's runs share one reading of the prompt; when it was read in bfloat16 (which can change the target's own
    answer against a float32 reading) the line says so, and runs that read it differently are told apart."""
    from specextend.events import Started
    from visualizers.text import prompt_reading

    def began(dtype: str, prefill: str) -> Started:
        return Started(0.0, 0.0, "specextend", (1, 2), {}, 30, 2, "cpu", dtype, prefill_dtype=prefill)

    shared = prompt_reading(began("float32", "bfloat16"), began("float32", "bfloat16"))
    assert shared == "Both continued from a reading of the prompt in bfloat16; decoding in float32."
    assert prompt_reading(began("float32", ""), began("float32", "float32")) == (
        "Both continued from a reading of the prompt in float32.")  # a trace from before the field: its dtype
    assert "different dtypes (bfloat16 and float32)" in prompt_reading(began("float32", "bfloat16"),
                                                                     began("float32", ""))
    line = exactness_html([1, 2], [1, 2], lambda ids: "x", "SpecExtend", shared)
    assert "✔ Exact" in line and "in bfloat16; decoding in float32" in line


def test_the_exactness_line_names_the_numerics_both_runs_decoded_in():
    """A race's runs decode in the loaded pair's numerics setting; the line names it (a trace from before the setting
    ran fp32), and runs in different settings are told apart."""
    from specextend.events import Started
    from visualizers.text import run_numerics

    def began(config: dict) -> Started:
        return Started(0.0, 0.0, "specextend", (1, 2), config, 30, 2, "cpu", "float32")

    packed = began({"attention": {"numerics": "bf16-kv"}})
    both = run_numerics(packed, packed)
    assert both == "both in bf16-kv numerics" and run_numerics(None, packed) == ""
    assert run_numerics(began({}), began({"attention": {}})) == "both in fp32 numerics"
    assert "in different numerics, bf16-kv and fp32" in run_numerics(packed, began({}))
    decode = lambda ids: "x"  # noqa: E731
    assert "the same 2 tokens as the target's own greedy decoding (both in bf16-kv numerics)." in exactness_html(
        [1, 2], [1, 2], decode, "SpecExtend", "", both)
    assert "(2 vs 3: one run ended earlier; both in bf16-kv numerics)." in exactness_html([1, 2], [1, 2, 3], decode,
                                                                                           numerics=both)
    assert "greedy output (both in bf16-kv numerics) at new token 1" in exactness_html([1, 9], [1, 2], decode,
                                                                                        numerics=both)
