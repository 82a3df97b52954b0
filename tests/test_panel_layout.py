"""The panels' layouts, checked from their figure specs at the narrowest width the Studio draws them
(common.REFERENCE_WIDTH): titles stay above the plots and within the width, subplot titles do not run into each
other, tree labels are not clipped, the heatmap's row numbers stay apart, legends stay off the plots. Text widths are
estimated as the panels estimate them (common.CHAR_EM): plotly measures text only in a browser."""

from __future__ import annotations

import html
import re
from dataclasses import replace

import pytest

from fixtures.fake_engine import fake_generate
from specextend.config import LookupConfig, RetrievalConfig, preset
from specextend.events import Started
from visualizers import acceptance_spec, heads_spec, needle_spec, retrieval_spec, throughput_spec
from visualizers.acceptance import LABEL_CHARS
from visualizers.common import CHAR_EM, LINE_EM, REFERENCE_WIDTH, TITLE_PAD, TITLE_SIZE
from visualizers.retrieval import BASE_TOP, LABEL_PX
from visualizers.throughput import LEGEND_ROW_PX, legend_rows

PROMPT = list(range(100, 1300))


def long_words(ids):
    return "".join(f" admiration{i}" for i in ids)


def fake(method: str, **changes):
    changes.setdefault("max_new_tokens", 60)
    changes.setdefault("retrieval", RetrievalConfig(chunk_size=32, top_k=6, retrieve_every=3))
    return list(fake_generate(PROMPT, preset(method, **changes)))


@pytest.fixture(scope="module")
def head_and_lookup(bigram_pair):
    """A real run with lookup beside the draft (two proposers), named as an EAGLE-3 head's: the longest headline."""
    from specextend.engine import generate

    prompt = [(7 * i) % 97 for i in range(260)]
    retrieval = RetrievalConfig(chunk_size=16, top_k=4, retrieve_every=2, prefill_window=32)
    events = list(generate(bigram_pair, prompt, preset("specextend", max_new_tokens=60, retrieval=retrieval,
                                                       lookup=LookupConfig(enabled=True))))
    return [replace(e, draft_name="EAGLE-3 head") if isinstance(e, Started) else e for e in events]


def hamlet():
    from pathlib import Path

    from app.trace import loads

    runs, codec, meta = loads((Path(__file__).parent / "fixtures" / "smollm2_hamlet.trace.json").read_text())
    return runs[meta["primary"]], codec.decode


def lines_of(text: str) -> list[tuple[str, int]]:
    """A title's lines as plain text, each with its font size (a span's, else the title's)."""
    out = []
    for line in text.split("<br>"):
        size = re.search(r"font-size:(\d+)px", line)
        out.append((html.unescape(re.sub(r"<[^>]+>", "", line)), int(size.group(1)) if size else TITLE_SIZE))
    return out


def width_px(text: str, size: float) -> float:
    return len(text) * CHAR_EM * size


def plot_px(layout: dict) -> float:
    m = layout["margin"]
    return layout["height"] - m["t"] - m["b"]


def panels(head_and_lookup):
    events, decode = hamlet()
    race = {m: fake(m) for m in ("specextend", "speculative", "autoregressive")}
    return {
        "acceptance, head and lookup": acceptance_spec(head_and_lookup, long_words),
        "acceptance, recorded": acceptance_spec(events, decode),
        "speed": throughput_spec(race),
        "speed, lookup": throughput_spec({"specextend": head_and_lookup, "speculative": fake("speculative")}),
    }


def assert_title_fits(name: str, spec) -> None:
    """The title stays above the plots (and the legend over them) and each of its lines within the width."""
    layout, title = spec["layout"], spec["layout"]["title"]
    lines = lines_of(title["text"])
    # plotly places a block of lines by its first line: its foot is hung from the top
    assert title.get("yref") == "container" and title.get("yanchor") == "bottom", name
    first_foot = (1 - title["y"]) * layout["height"]
    last_foot = first_foot + (len(lines) - 1) * LINE_EM * TITLE_SIZE
    over_plots = spec["layout"].get("legend", {}).get("yanchor") == "bottom"  # the runs' legend, over the curves
    legend_px = LEGEND_ROW_PX * legend_rows_of(spec) if over_plots else 0
    assert last_foot + 0.3 * TITLE_SIZE + legend_px <= layout["margin"]["t"], name  # descenders included
    for text, size in lines:
        assert width_px(text, size) <= REFERENCE_WIDTH - 2 * TITLE_PAD, (name, text)


def test_titles_stay_above_the_plots_and_within_the_width(head_and_lookup):
    for name, spec in panels(head_and_lookup).items():
        assert_title_fits(name, spec)


def test_the_retrieval_headline_wraps_to_the_width_and_keeps_its_colour(head_and_lookup, bigram_pair):
    from specextend.engine import generate

    events, decode = hamlet()
    lookup = list(generate(bigram_pair, [(7 * i) % 97 for i in range(260)], preset("lookup", max_new_tokens=60)))
    specs = {
        "recorded": retrieval_spec(events, decode),
        "recorded, needle tab": retrieval_spec(events, decode, ("needle", (300, 340)), height=300),
        "head and lookup": retrieval_spec(head_and_lookup, long_words),  # a third part: the latest copy
        "streaming": retrieval_spec(fake("streaming"), long_words),
        "lookup alone": retrieval_spec(lookup, long_words),
    }
    for name, spec in specs.items():
        assert_title_fits(name, spec)
    for name in ("recorded", "recorded, needle tab", "head and lookup"):
        text = specs[name]["layout"]["title"]["text"]
        assert re.search(r"<span style='color:#2a9d8f'>\d+ reaching back</span>", text), name  # whole, in its span
        assert "lookup copied" in text if name == "head and lookup" else "lookup" not in text
    plain = [line for line, _ in lines_of(specs["recorded"]["layout"]["title"]["text"])]
    assert len(plain) >= 3 and plain[0].startswith("Retrieval after step 36: 8 of 44 chunks")
    assert any("“a grand and beautiful" in line for line in plain)  # the best chunk's text, wrapped, not cut off
    needle = specs["recorded, needle tab"]["layout"]  # a headline of more lines makes the panel taller, not the plots
    assert needle["margin"]["t"] > BASE_TOP and needle["height"] - needle["margin"]["t"] == 300 - BASE_TOP


def legend_rows_of(spec) -> int:
    names = [d["name"] for d in spec["data"] if d.get("legend") == "legend"]
    return legend_rows(names, REFERENCE_WIDTH - spec["layout"]["margin"]["l"] - spec["layout"]["margin"]["r"])


def test_the_acceptance_panels_subplot_titles_stay_apart_and_under_the_cells(head_and_lookup):
    layout = acceptance_spec(head_and_lookup, long_words)["layout"]
    m = layout["margin"]
    plot_w, plot_h = REFERENCE_WIDTH - m["l"] - m["r"], plot_px(layout)
    titles = sorted((a for a in layout["annotations"] if a["yref"] == "paper"), key=lambda a: a["x"])
    assert len(titles) == 3 and "violet: lookup" in titles[0]["text"]  # two proposers: the longest first title
    for a, b in zip(titles, titles[1:]):
        widest = max(width_px(t, a["font"]["size"]) for t, _ in lines_of(a["text"]))
        assert a["x"] * plot_w + widest <= b["x"] * plot_w, (a["text"], b["text"])
    for a in titles:
        top = a["y"] * plot_h + len(lines_of(a["text"])) * LINE_EM * a["font"]["size"]
        assert top + 20 <= layout["yaxis"]["domain"][0] * plot_h, a["text"]  # room for the cells' step ticks
        assert a["y"] >= layout["yaxis2"]["domain"][1]  # above the row they name


def test_the_tree_labels_are_cut_not_clipped_and_the_hover_keeps_the_word(head_and_lookup):
    spec = acceptance_spec(head_and_lookup, long_words)
    nodes = next(d for d in spec["data"] if d.get("mode") == "markers+text")
    assert nodes.get("cliponaxis") is False
    labels, hovers = nodes["text"][1:-1], nodes["hovertext"][1:-1]
    assert labels and all(len(label) <= LABEL_CHARS for label in labels)
    assert any(label.endswith("…") for label in labels)  # " admiration57" is longer than a label
    for label, hover in zip(labels, hovers):
        assert label.rstrip("…") in hover and "admiration" in hover  # the hover has the whole token
    layout = spec["layout"]
    xs, ys = nodes["x"], nodes["y"]
    low, high = layout["xaxis4"]["range"]
    assert low <= min(xs) - 0.5 and high >= max(xs) + 0.5  # half a column beside the outer nodes for their labels
    bottom, top = layout["yaxis4"]["range"]  # reversed: leaves top down
    assert bottom >= max(ys) + 0.5 and top <= min(ys) - 0.5


@pytest.mark.parametrize("trace", ["recorded", "long", "short"])
def test_the_heatmaps_row_numbers_stay_apart(trace):
    if trace == "recorded":
        events, decode = hamlet()
    else:
        retrieval = RetrievalConfig(chunk_size=32, top_k=6, retrieve_every=1 if trace == "long" else 3)
        events, decode = fake("specextend", max_new_tokens=300 if trace == "long" else 30, retrieval=retrieval), long_words
    for height in (None, 300):  # the main tab's panel, the needle tab's
        layout_spec = retrieval_spec(events, decode, height=height)
        layout = layout_spec["layout"]
        numbers = next(d for d in layout_spec["data"] if d.get("mode") == "text" and d.get("yaxis") == "y2")
        rows = len(numbers["y"])
        domain = layout["yaxis2"]["domain"]
        row_px = plot_px(layout) * (domain[1] - domain[0]) / rows
        written = [i for i, t in enumerate(numbers["text"]) if t]
        assert len(written) >= min(3, rows - 1)
        gaps = [b - a for a, b in zip(written, written[1:])]
        assert all(g * row_px >= LABEL_PX for g in gaps), (trace, height, rows, row_px, gaps)


def test_the_speed_legends_stay_off_the_plots():
    race = {m: fake(m) for m in ("specextend", "speculative", "streaming", "autoregressive")}
    layout = throughput_spec(race)["layout"]
    plot_h = plot_px(layout)
    rows = [layout[a]["domain"] for a in ("yaxis", "yaxis3")]  # the top row (curves, phases), the bottom row
    runs, phases = layout["legend"], layout["legend2"]
    assert runs.get("orientation") == "h" and runs["y"] >= rows[0][1] and runs["yanchor"] == "bottom"  # over the curves
    assert phases["yanchor"] == "top"
    phases_bottom = phases["y"] - LEGEND_ROW_PX / plot_h
    assert phases["y"] <= rows[0][0] - 40 / plot_h  # under the top row's tick labels and axis titles
    row_title = next(a for a in layout["annotations"] if "Tokens per step" in a["text"])
    assert phases_bottom >= row_title["y"] + LINE_EM * row_title["font"]["size"] / plot_h  # over the bottom row's title
    assert row_title["y"] >= rows[1][1]
    assert layout["margin"]["autoexpand"] is False  # a legend may not shrink the plots: each has its room


def test_the_needle_panels_titles_fit_their_margins():
    share = [[0.01] * 9 for _ in range(30)]
    cmr = fake("specextend")
    for spec in (heads_spec(share, {"calibrated signal": [(3, 1)]}, 32),
                 needle_spec({"specextend": cmr, "streaming": fake("streaming")}, (400, 416), len(PROMPT))):
        layout = spec["layout"]
        lines = lines_of(layout["title"]["text"])
        last_foot = (1 - layout["title"]["y"]) * layout["height"] + (len(lines) - 1) * LINE_EM * TITLE_SIZE
        assert last_foot + 0.3 * TITLE_SIZE <= layout["margin"]["t"]
