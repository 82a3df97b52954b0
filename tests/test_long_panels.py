"""The panels on LONG OUTPUTS (a short prompt, thousands of generated tokens): the output's own chunks marked in the
retrieval panel, tokens per step along the output in the speed panel, and every figure bounded in size (and its
drawing time linear in the trace) through thousands of steps."""

from __future__ import annotations

import re
import time

import orjson
import pytest

from specextend.config import RetrievalConfig, preset
from specextend.events import Prefilled, Retrieved, Started, Verified
from specextend.metrics import retrieval_yield, tokens_per_step_by_window
from visualizers import acceptance_spec, far_html, output_html, retrieval_spec, throughput_spec, to_figure
from visualizers.acceptance import CELL_STEPS, MAX_BARS
from visualizers.common import thinned
from visualizers import output_chunks
from visualizers.retrieval import MAX_CELLS, kept_chunks
from visualizers.steps import as_of, moment
from visualizers.throughput import MAX_POINTS, window_size

from fixtures.fake_engine import fake_generate

PROMPT = list(range(100, 196))  # 96 tokens: a short instruction, three chunks of 32
RETRIEVAL = RetrievalConfig(chunk_size=32, top_k=6, retrieve_every=4)


def decode(ids):
    return "".join(f" w{i}" for i in ids)


def long_run(method: str, new: int, prompt=PROMPT) -> list:
    return list(fake_generate(prompt, preset(method, max_new_tokens=new, retrieval=RETRIEVAL), max_positions=20_000))


def title_words(spec) -> str:
    """A panel's title as plain words, whatever lines it was wrapped into."""
    return " ".join(re.sub(r"<[^>]+>", " ", spec["layout"]["title"]["text"]).split())


def steps(events) -> list[Verified]:
    return [e for e in events if isinstance(e, Verified)]


@pytest.fixture(scope="module")
def race():
    """A race of about 3,000 steps per drafting method (about 10,000 tokens each) after a 96-token prompt."""
    return {m: long_run(m, 10_000) for m in ("specextend", "speculative", "streaming", "autoregressive")}


# ------------------------------------------------------------------------------------ the output's own chunks


def test_the_output_chunks_are_marked_under_the_strip_and_counted_in_the_headline():
    events = long_run("specextend", 600)
    latest = [e for e in events if isinstance(e, Retrieved)][-1]
    from_output = output_chunks(latest, len(PROMPT))
    assert from_output == tuple(i for i in latest.selected if latest.chunk_spans[i][0] >= len(PROMPT))
    assert 0 < len(from_output) < len(latest.selected)  # the sink chunk (document) is always kept
    spec = retrieval_spec(events, decode)
    to_figure(spec)
    band = [s for s in spec["layout"]["shapes"] if s.get("name") == "output chunks"]
    assert len(band) == 1  # from the first chunk that starts past the prompt to the last chunk
    assert band[0]["x0"] == 3 - 0.5 and band[0]["x1"] == len(latest.chunk_spans) - 0.5
    assert band[0]["y1"] < spec["layout"]["yaxis"]["domain"][0]  # under the strip
    assert band[0]["y0"] > spec["layout"]["yaxis2"]["domain"][1]  # over the heatmap
    assert any(a["text"] == "the model's own output ▸" for a in spec["layout"]["annotations"])
    assert f"{len(from_output)} of them from the output" in title_words(spec)
    hovers = spec["data"][0]["text"][0]
    assert hovers[2].startswith("chunk 2 (document tokens 64–96)") and hovers[3].startswith("chunk 3 (output tokens 96–128)")
    assert f"{len(from_output)} of the working cache's {len(latest.selected)} chunks are the model's own output" in (
        far_html(events, decode))
    streaming = retrieval_spec(long_run("streaming", 600), decode)
    assert "of them from the output)" in title_words(streaming)
    assert any(s.get("name") == "output chunks" for s in streaming["layout"]["shapes"])


def test_a_document_whose_output_fills_no_chunk_yet_has_no_output_band():
    prompt = list(range(100, 1300))  # 1,200 tokens: chunks start at 1,184 and 1,216
    events = long_run("specextend", 12, prompt)
    latest = [e for e in events if isinstance(e, Retrieved)][-1]
    assert latest.seq_len <= 1216 and output_chunks(latest, len(prompt)) == ()
    spec = retrieval_spec(events, decode)
    assert not any(s.get("name") == "output chunks" for s in spec["layout"]["shapes"])
    assert "from the output" not in title_words(spec)
    assert "the model's own output" not in far_html(events, decode)


def test_each_step_is_served_by_the_latest_retrieval_before_it():
    """retrieval_yield finds each retrieval's steps by bisection (once per step, not once per retrieval and step)."""
    for method in ("specextend", "streaming"):
        events = long_run(method, 400)
        retrieved = [e.step for e in events if isinstance(e, Retrieved)]
        steps = [e.step for e in events if isinstance(e, Verified)]
        bounds = retrieved[1:] + [max(steps)]
        served = [sum(a < s <= b for s in steps) for a, b in zip(retrieved, bounds)]
        assert [y.served for y in retrieval_yield(events)] == served and sum(served) == len(steps)


def test_the_heatmap_keeps_the_rows_that_fit_its_cell_budget(race):
    events = race["specextend"]
    spec = retrieval_spec(events, decode)
    strip, heat = spec["data"][:2]
    retrieved = [e for e in events if isinstance(e, Retrieved)]
    columns = len(strip["x"])
    assert len(heat["y"]) == MAX_CELLS // columns < 240  # a long sequence: fewer, still the latest, rows
    assert heat["y"] == [r.step for r in retrieved[-len(heat["y"]):]]
    assert sum(len(row) for row in heat["z"]) <= MAX_CELLS
    kept = kept_chunks(retrieved[-1])
    assert [i for i, v in enumerate(heat["z"][-1]) if v] == list(kept)


# ------------------------------------------------------------------------------------ thousands of steps


def test_acceptance_cells_show_the_latest_steps_and_the_bars_are_binned_means(race):
    events = race["specextend"]
    verified = steps(events)
    assert len(verified) > 3000
    spec = acceptance_spec(events, decode)
    cells, bars = spec["data"][0], next(d for d in spec["data"] if d["type"] == "bar" and d["xaxis"] == "x3")
    assert cells["x"] == [v.step for v in verified[-CELL_STEPS:]]  # real step numbers: a click still names a step
    assert f"The last {CELL_STEPS} of {len(verified):,} steps" in spec["layout"]["title"]["text"]
    width = -(-len(verified) // MAX_BARS)
    assert len(bars["x"]) <= MAX_BARS and bars["width"] == width
    committed = [v.num_accepted + 1 for v in verified]
    for i in (0, 17, len(bars["x"]) - 1):
        group = committed[i * width : (i + 1) * width]
        assert bars["y"][i] == pytest.approx(sum(group) / len(group))
        first, last = bars["customdata"][i]
        assert (first, last) == (verified[i * width].step, verified[min((i + 1) * width, len(verified)) - 1].step)
        assert bars["x"][i] == (first + last) / 2
    assert f"mean of each {width}" in str(spec["layout"]["annotations"])


def test_thinned_keeps_the_ends_and_every_kth_point():
    points = list(range(1001))
    kept = thinned(points, 500)
    assert len(kept) <= 500 and kept[0] == 0 and kept[-1] == 1000
    assert len({b - a for a, b in zip(kept, kept[1:-1])}) == 1  # evenly spaced, but for the last step
    assert thinned(points[:500], 500) == points[:500]


def test_speed_curves_are_thinned_with_exact_ends(race):
    spec = throughput_spec(race)
    to_figure(spec)
    curves = [d for d in spec["data"] if d["type"] == "scatter"]
    assert [c["name"] for c in curves] == ["SpecExtend", "speculative (full draft cache)", "StreamingLLM draft cache",
                                           "target alone"]
    for curve, events in zip(curves, race.values()):
        last = steps(events)[-1]
        assert len(curve["x"]) <= MAX_POINTS and (curve["x"][0], curve["y"][0]) == (0.0, 0)
        assert curve["y"][-1] == last.total_new == 10_000 and curve["x"][-1] == round(last.t_s, 4)
        assert curve["y"] == sorted(curve["y"])


# ------------------------------------------------------------------------------------ tokens per step along the output


def synthetic(method: str, accepted) -> list:
    """A made-up run of 400 steps of a 4-token chain, `accepted(step)` of them accepted at each."""
    out = [Started(0.0, 0.0, method, tuple(PROMPT), {}, 30, 4, "cpu", "float32"),
           Prefilled(0.1, 0.1, len(PROMPT), 0.1, 0.0, 7)]
    total = 1
    for step in range(1, 401):
        a = accepted(step)
        total += a + 1
        out.append(Verified(0.1 + step / 100, 0.01, step, len(PROMPT) + total - a - 1, tuple(range(a)),
                            tuple(i < a for i in range(4)), a, 7, (7,) * (a + 1), total))
    return out


def test_window_size_makes_at_most_forty_windows():
    assert [window_size(n) for n in (1, 48, 640, 641, 1_280, 1_281, 10_000)] == [16, 16, 16, 32, 32, 64, 256]


def test_tokens_per_step_along_the_output_shows_each_drafting_run_by_window():
    runs = {"specextend": synthetic("specextend", lambda s: 3),
            "speculative": synthetic("speculative", lambda s: 3 if s <= 100 else 0),  # falls off as the output grows
            "autoregressive": synthetic("autoregressive", lambda s: 0)}
    longest = steps(runs["specextend"])[-1].total_new
    size = window_size(longest)
    assert (longest, size) == (1601, 64)
    spec = throughput_spec(runs)
    to_figure(spec)
    bars = {d["name"]: d for d in spec["data"] if d.get("xaxis") == "x3"}
    assert list(bars) == ["SpecExtend", "speculative (full draft cache)"]  # the target alone: the dashed line at 1.0
    for method, name in (("specextend", "SpecExtend"), ("speculative", "speculative (full draft cache)")):
        windows = tokens_per_step_by_window(runs[method], size)
        assert bars[name]["x"] == [w.start + size / 2 for w in windows]
        assert bars[name]["y"] == [w.per_step for w in windows]
    assert set(bars["SpecExtend"]["y"]) == {4.0}
    falling = bars["speculative (full draft cache)"]["y"]
    assert falling[0] == 4.0 and falling[-1] == 1.0  # the decline with length, visible
    assert [s for s in spec["layout"]["shapes"] if s["yref"] == "y3" and s["y0"] == s["y1"] == 1]
    assert "windows of 64 output tokens" in str(spec["layout"]["annotations"])
    assert spec["layout"]["height"] > 340 and spec["layout"]["yaxis3"]["domain"][1] < spec["layout"]["yaxis"]["domain"][0]
    seconds, tokens = moment(runs["speculative"], 150)
    looked = throughput_spec(runs, ("speculative", seconds, tokens))
    marks = [s for s in looked["layout"]["shapes"] if s["xref"] == "x3"]
    assert [(m["x0"], m["line"]["color"]) for m in marks] == [(tokens, bars["speculative (full draft cache)"]["marker"]["color"])]


def test_the_target_alone_gets_a_note_instead_of_bars():
    spec = throughput_spec({"autoregressive": synthetic("autoregressive", lambda s: 0)})
    assert not [d for d in spec["data"] if d.get("xaxis") == "x3"]
    assert "race a drafting method" in str(spec["layout"]["annotations"])


# ------------------------------------------------------------------------------------ bounded through thousands of steps


def drawings(runs):
    """Every figure of the main tab, and its two HTML readouts, for one race as of some step."""
    events = runs["specextend"]
    return {
        "retrieval": lambda: retrieval_spec(events, decode),
        "retrieval (streaming)": lambda: retrieval_spec(runs["streaming"], decode),
        "acceptance": lambda: acceptance_spec(events, decode),
        "throughput": lambda: throughput_spec(runs),
        "throughput at a step": lambda: throughput_spec(runs, ("specextend", *moment(events, 500))),
        "far": lambda: far_html(events, decode),
        "output": lambda: output_html(events, decode),
    }


def fastest(draw, tries: int = 5) -> float:
    """The least CPU time of a few draws (this thread's own time: a busy machine's other work is not counted)."""
    times = []
    for _ in range(tries):
        began = time.thread_time()
        draw()
        times.append(time.thread_time() - began)
    return min(times)


def test_figures_stay_the_same_size_from_1000_to_3000_steps(race):
    at = {n: {m: as_of(ev, n) for m, ev in race.items()} for n in (1000, 3000)}
    assert len(steps(at[3000]["specextend"])) == 3000
    sizes = {}
    for n, runs in at.items():
        for name, draw in drawings(runs).items():
            if name not in ("far", "output"):  # HTML: the output grows with its text, as it must
                spec = draw()
                to_figure(spec)
                sizes[name, n] = len(orjson.dumps(spec))
    for name in {name for name, _ in sizes}:
        small, large = sizes[name, 1000], sizes[name, 3000]
        assert large <= 1.3 * small and large < 400_000, (name, small, large)


def test_drawing_time_grows_with_the_trace_not_its_square(race):
    """Folds over the whole trace (each headline's means) make a draw linear in its steps: 6x the steps (500 to
    3,000), 5-10x the CPU time here (a bigger trace also misses the CPU's caches more); anything quadratic would take
    about 36x."""
    at = {n: {m: as_of(ev, n) for m, ev in race.items()} for n in (500, 3000)}
    small, large = drawings(at[500]), drawings(at[3000])
    for name in small:
        small[name]()  # warm the caches of decoded hover text
        large[name]()
        ratio = fastest(large[name]) / fastest(small[name])
        assert ratio < 16, (name, ratio)
