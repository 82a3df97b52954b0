"""Acceptance panel: what the draft proposed each step and how much of it the target kept.

Top: one column per step (the most recent CELL_STEPS of them); from the bottom up, the accepted draft tokens
(green for the draft model's, violet for a lookup's copies), the bonus token the target added (gold), and the
drafted tokens it did not keep (red). The headline splits the tokens per step by who proposed them and says when
and why the draft sat out. Below: acceptance rate by draft position for each proposer (the draft, lookup), tokens
committed per step (a bar per step, or past MAX_BARS steps the mean of each run of steps), and the latest step's
draft tree with its accepted path. However many steps a run takes, the figure stays about the same size.
Knows events; no gradio, no models.
"""

from __future__ import annotations

import math
from collections import defaultdict
from functools import lru_cache
from itertools import accumulate
from typing import Sequence

from specextend.events import Drafted, Event, Verified
from specextend.metrics import acceptance_by_source, node_depths, step_tokens_by_source

from .common import (
    LINE_EM, REFERENCE_WIDTH, STATUS_COLORS, TITLE_PAD, TITLE_SIZE, Decode, Spec, accepted_kind, base_layout,
    draft_name, has_draft, hover_text, message_spec, method_of, none_yet, of, sat_out_note, small, title, title_height,
    wrapped,
)

HOVER_STEPS = 200  # hover text is kept for the most recent steps only, so a redraw stays small
CELL_STEPS = 300  # the most recent steps drawn as columns of cells
MAX_BARS = 300  # past this many steps, the tokens-per-step bars are means over runs of consecutive steps
MEAN_OF = 8  # the line over those bars: the mean of the last MEAN_OF bars' steps
REJECTED, ACCEPTED, COPIED, BONUS = 1, 2, 3, 4
# the figure in pixels, top down: the title (as tall as its lines), the cells, a gap holding the cells' step ticks and
# the row's subplot titles (at most SUB_LINES lines each), the row below, its ticks and axis titles
SUB_SIZE, SUB_LINES = 11, 3  # the subplot titles' font and most lines
CELLS_PX, ROW_PX, BOTTOM_PX = 170, 150, 44
GAP_PX = 22 + math.ceil(SUB_LINES * LINE_EM * SUB_SIZE) + 8  # the cells' step ticks, the subplot titles, a space
MARGIN_L, MARGIN_R = 56, 16
TICK_PX = 14  # the least pixels between a tick and the next for their labels to stay apart
LABEL_CHARS = 8  # a tree node's label is cut past this many characters (its hover keeps the whole token)
# the row below: acceptance rate by draft position, tokens committed per step, the latest draft tree
ROW_DOMAINS = ((0.0, 0.27), (0.36, 0.64), (0.72, 0.97))
CELL_SCALE = [
    [0.0, STATUS_COLORS["rejected"]], [0.24, STATUS_COLORS["rejected"]],
    [0.25, STATUS_COLORS["accepted"]], [0.49, STATUS_COLORS["accepted"]],
    [0.5, STATUS_COLORS["copied"]], [0.74, STATUS_COLORS["copied"]],
    [0.75, STATUS_COLORS["bonus"]], [1.0, STATUS_COLORS["bonus"]],
]


def _token(decode: Decode, token: int) -> str:
    return repr(decode([token]))[1:-1] or "·"


def step_cells(drafted: Drafted | None, verified: Verified) -> list[int]:
    """Cell codes of one step, bottom up: accepted tokens (the draft model's or a lookup's copies), the bonus
    token, then the rest drafted."""
    depth = max(node_depths(drafted.parents), default=0) if drafted else 0
    a = verified.num_accepted
    kinds = [COPIED if accepted_kind(drafted, n) == "copied" else ACCEPTED for n in verified.accepted_nodes]
    return kinds + [BONUS] + [REJECTED] * max(depth - a, 0)


@lru_cache(maxsize=8192)
def _cell_texts(drafted: Drafted | None, verified: Verified, decode: Decode, name: str) -> tuple[str, ...]:
    """Hover text per cell of one step, in the order of `step_cells` (events are frozen, so this caches)."""
    texts = []
    if drafted is not None:
        for i, node in enumerate(verified.accepted_nodes):
            texts.append(f"step {verified.step}, draft token {i + 1}: “{_token(decode, drafted.tokens[node])}” "
                         f"accepted ({_who(drafted, node, name)})")
    texts.append(f"step {verified.step}: bonus token “{_token(decode, verified.bonus_token)}” from the target")
    if drafted is not None:
        depths = node_depths(drafted.parents)
        by_depth: dict[int, list[str]] = defaultdict(list)
        for node, d in enumerate(depths):
            if not verified.accepted[node]:
                by_depth[d].append(_token(decode, drafted.tokens[node]))
        for d in range(verified.num_accepted + 1, max(depths, default=0) + 1):
            tokens = ", ".join(f"“{t}”" for t in by_depth[d][:6])
            texts.append(hover_text(f"step {verified.step}, depth {d}: not kept {tokens}"))
    return tuple(texts)


def forget_texts() -> None:
    """Drop the cached hover texts, and with them the decoders they were made with (a dropped pair's tokenizer)."""
    _cell_texts.cache_clear()


def _who(drafted: Drafted, node: int, name: str) -> str:
    """Who proposed a node, for a hover: the draft (`name`: the draft model or an EAGLE head) with its q, a lookup
    with its copy's position, or both."""
    source = drafted.sources[node] if drafted.sources else "draft"
    model = f"{name}, q={drafted.draft_probs[node]:.2f}"
    copy = f"copied by lookup from position {drafted.origins[node]}" if drafted.origins else ""
    return {"draft": model, "lookup": copy, "both": f"{copy}; the {model} too"}[source]


def tree_layout(parents: Sequence[int]) -> list[float]:
    """A y position per node: leaves in depth-first order, each parent centred over its children."""
    children: dict[int, list[int]] = defaultdict(list)
    for node, parent in enumerate(parents):
        children[parent].append(node)
    y: dict[int, float] = {}
    next_leaf = 0.0

    def place(node: int) -> float:
        nonlocal next_leaf
        kids = children.get(node, [])
        if not kids:
            y[node] = next_leaf
            next_leaf += 1.0
        else:
            y[node] = sum(place(k) for k in kids) / len(kids)
        return y[node]

    place(-1)
    return [y[i] for i in range(len(parents))]


def _tree_traces(drafted: Drafted, verified: Verified, decode: Decode, axes: dict[str, str], name: str) -> list[dict]:
    depths = node_depths(drafted.parents)
    ys = tree_layout(drafted.parents)
    root_y = sum(ys[i] for i, p in enumerate(drafted.parents) if p < 0) / max(1, sum(p < 0 for p in drafted.parents))
    ex, ey, gx, gy = [], [], [], []
    for node, parent in enumerate(drafted.parents):
        px, py = (0, root_y) if parent < 0 else (depths[parent], ys[parent])
        xs, ys_ = (gx, gy) if verified.accepted[node] else (ex, ey)
        xs += [px, depths[node], None]
        ys_ += [py, ys[node], None]
    last = verified.accepted_nodes[-1] if verified.accepted_nodes else -1
    bx, by = (depths[last] + 1, ys[last]) if last >= 0 else (1, root_y)
    gx += [bx - 1 if last >= 0 else 0, bx, None]
    gy += [by if last >= 0 else root_y, by, None]
    node_colors = [STATUS_COLORS[accepted_kind(drafted, n)] if ok else STATUS_COLORS["rejected"]
                   for n, ok in enumerate(verified.accepted)]
    symbols = ["diamond" if accepted_kind(drafted, n) == "copied" else "circle" for n in range(len(drafted.tokens))]
    words = [_token(decode, t) for t in drafted.tokens]
    hovers = [f"“{word}” {'accepted' if ok else 'not kept'} ({_who(drafted, n, name)})"
              for n, (word, ok) in enumerate(zip(words, verified.accepted))]
    bonus = _token(decode, verified.bonus_token)
    labels = [cut_label(word) for word in words]
    line = {"type": "scatter", "mode": "lines", "hoverinfo": "skip", **axes}
    return [
        {**line, "x": ex, "y": ey, "line": {"color": "#d0d7de", "width": 1}},
        {**line, "x": gx, "y": gy, "line": {"color": STATUS_COLORS["accepted"], "width": 3}},
        {"type": "scatter", "mode": "markers+text", "x": [0] + depths + [bx], "y": [root_y] + ys + [by],
         "marker": {"size": 9, "color": ["#1f2933"] + node_colors + [STATUS_COLORS["bonus"]],
                    "symbol": ["circle"] + symbols + ["circle"]},
         "text": ["root"] + labels + [cut_label(bonus)], "textfont": {"size": 10}, "cliponaxis": False,
         "textposition": ["bottom center"] + [("top center", "bottom center")[d % 2] for d in depths] + ["top center"],
         "hovertext": ["last committed token"] + hovers + [f"bonus “{bonus}” from the target"],
         "hoverinfo": "text", **axes},
    ]


def cut_label(word: str) -> str:
    """A tree node's label: the token, cut with an ellipsis past LABEL_CHARS characters."""
    return word if len(word) <= LABEL_CHARS else word[: LABEL_CHARS - 1] + "…"


def tree_ranges(drafted: Drafted) -> tuple[list[float], list[float]]:
    """The tree's x range (depth, from the root at 0 to the bonus token one past the deepest node) and reversed y
    range (leaf order), each padded so the labels above and below the outer nodes stay inside the subplot."""
    ys = tree_layout(drafted.parents)
    depth = max(node_depths(drafted.parents), default=0)
    return [-0.5, depth + 1.5], [max(ys, default=0.0) + 0.8, min(ys, default=0.0) - 0.8]


def subplot_titles(titles: Sequence[Sequence[str]]) -> list[list[str]]:
    """The row's subplot titles, each given as phrases that start lines, cut into lines that fit its subplot's width
    at REFERENCE_WIDTH."""
    plot_px = REFERENCE_WIDTH - MARGIN_L - MARGIN_R
    return [[line for phrase in phrases for line in wrapped(phrase, (b - a) * plot_px, SUB_SIZE)]
            for phrases, (a, b) in zip(titles, ROW_DOMAINS)]


def per_step_words(events: Sequence[Event], name: str) -> str:
    """Tokens committed per step, split by who proposed them (the draft, lookup, both, the target's bonus token)."""
    split = step_tokens_by_source(events)
    parts = [f"{split['draft']:.2f} the {name}'s"] if has_draft(events) else []
    if split["lookup"] or split["both"] or not has_draft(events):
        parts.append(f"{split['lookup']:.2f} lookup's")
    if split["both"]:
        parts.append(f"{split['both']:.2f} proposed by both")
    parts.append(f"{split['target']:.2f} the target's")
    return f"{sum(split.values()):.2f} tokens committed per step: {' + '.join(parts)}"


def _length_traces(verified: Sequence[Verified], width: int) -> tuple[dict, dict]:
    """Tokens committed per step as bars at their steps, or with `width` > 1 the mean of each run of `width`
    consecutive steps as a bar `width` steps wide at the run's middle; and as a line, the mean over the last MEAN_OF
    bars' steps at each bar."""
    committed = [v.num_accepted + 1 for v in verified]
    total = [0, *accumulate(committed)]  # total[i]: tokens committed by the first i steps
    runs = [(i, min(i + width, len(verified))) for i in range(0, len(verified), width)]  # [first, end) step indices
    back = MEAN_OF * width
    mean = [(total[e] - total[max(0, e - back)]) / (e - max(0, e - back)) for _, e in runs]
    line = {"type": "scatter", "mode": "lines", "y": mean, "xaxis": "x3", "yaxis": "y3",
            "line": {"color": "#1d3557", "width": 2},
            "hovertemplate": f"mean of the last {back} steps: %{{y:.2f}}<extra></extra>"}
    bars = {"type": "bar", "xaxis": "x3", "yaxis": "y3", "marker": {"color": "#a8dadc"}}
    if width == 1:
        steps = [v.step for v in verified]
        return ({**bars, "x": steps, "y": committed, "hovertemplate": "step %{x}: %{y} tokens committed<extra></extra>"},
                {**line, "x": steps})
    ends = [(verified[a].step, verified[e - 1].step) for a, e in runs]
    middles = [(first + last) / 2 for first, last in ends]
    return ({**bars, "x": middles, "y": [(total[e] - total[a]) / (e - a) for a, e in runs], "width": width,
             "customdata": [list(pair) for pair in ends],
             "hovertemplate": "steps %{customdata[0]}–%{customdata[1]}: %{y:.2f} tokens committed per step"
                              "<extra></extra>"},
            {**line, "x": middles})


def acceptance_spec(events: Sequence[Event], decode: Decode) -> Spec:
    """The acceptance panel for one run, as a Plotly figure dict."""
    verified = of(events, Verified)
    if method_of(events) == "autoregressive":
        return message_spec("the target alone drafts nothing: each step commits one token of its own")
    if not verified:
        return message_spec(none_yet(events, "step", "waiting for the first step"))
    trees = {d.step: d for d in of(events, Drafted)}
    name = draft_name(events)
    shown = verified[-CELL_STEPS:]
    columns = [step_cells(trees.get(v.step), v) for v in shown]
    cell_rows = max(len(c) for c in columns)
    z = [[c[row] if row < len(c) else None for c in columns] for row in range(cell_rows)]  # (cell row, step shown)
    hover_from = len(shown) - HOVER_STEPS
    texts_by_step = [_cell_texts(trees.get(v.step), v, decode, name) if i >= hover_from else ()
                     for i, v in enumerate(shown)]
    text = [[t[row] if row < len(t) else "" for t in texts_by_step] for row in range(cell_rows)]
    cells = {
        "type": "heatmap", "x": [v.step for v in shown], "y": list(range(1, cell_rows + 1)), "z": z, "text": text,
        "hovertemplate": "%{text}<extra></extra>", "colorscale": CELL_SCALE, "zmin": 1, "zmax": 4,
        "showscale": False, "xgap": 1 if len(shown) <= 150 else 0, "ygap": 1,
    }

    rate_bars = []
    for proposer, rates in acceptance_by_source(events).items():
        who = f"the {name}" if proposer == "draft" else "lookup"
        rate_bars.append({
            "type": "bar", "name": who, "x": list(range(1, len(rates) + 1)), "y": list(rates), "xaxis": "x2",
            "yaxis": "y2", "marker": {"color": STATUS_COLORS["accepted" if proposer == "draft" else "copied"]},
            "hovertemplate": f"{who}, draft position %{{x}}: accepted in %{{y:.0%}} of the steps it proposed one "
                             "there<extra></extra>",
        })
    width = math.ceil(len(verified) / MAX_BARS)  # steps per bar
    length_bars, length_mean = _length_traces(verified, width)
    data = [cells, *rate_bars, length_bars, length_mean]
    last = next((v for v in reversed(verified) if v.step in trees and trees[v.step].tokens), verified[-1])
    if last.step in trees:  # the latest step that drafted anything (the last step may have had no room)
        data += _tree_traces(trees[last.step], last, decode, {"xaxis": "x4", "yaxis": "y4"}, name)

    columns_are = (f"The last {len(shown):,} of {len(verified):,} steps, one column each" if len(shown) < len(verified)
                   else f"{len(verified):,} steps, one column each")
    line_px = REFERENCE_WIDTH - 2 * TITLE_PAD
    note = sat_out_note(events)
    headline = "<br>".join([
        *wrapped(f"{columns_are} · {per_step_words(events, name)}", line_px, TITLE_SIZE),
        small(wrapped(f"green: the {name}'s tokens the target accepted · violet: tokens a lookup copied, accepted · "
                      "gold: the target's bonus token · red: drafted, not kept", line_px, 12)),
        *([small(wrapped(note[:1].upper() + note[1:], line_px, 12, limit=400))] if note else []),
    ])
    top = title_height(headline)
    plot_px = CELLS_PX + GAP_PX + ROW_PX
    row_top = ROW_PX / plot_px
    sub = {"xref": "paper", "yref": "paper", "y": row_top + 4 / plot_px, "yanchor": "bottom", "showarrow": False,
           "xanchor": "left", "align": "left", "font": {"size": SUB_SIZE}}
    titles = subplot_titles([
        ["acceptance rate by position", *([f"(green: the {name}, violet: lookup)"] if len(rate_bars) > 1 else [])],
        ["tokens committed per step", *([f"(mean of each {width})"] if width > 1 else [])],
        [f"step {last.step}: draft tree and accepted path"],
    ])
    positions = max((len(b["x"]) for b in rate_bars), default=1)
    rate_px = (ROW_DOMAINS[0][1] - ROW_DOMAINS[0][0]) * (REFERENCE_WIDTH - MARGIN_L - MARGIN_R)
    tree_x, tree_y = tree_ranges(trees[last.step]) if last.step in trees else ([-0.5, 1.5], [0.8, -0.8])
    layout = base_layout(
        top + plot_px + BOTTOM_PX,
        margin={"l": MARGIN_L, "r": MARGIN_R, "t": top, "b": BOTTOM_PX},
        title=title(headline, top + plot_px + BOTTOM_PX),
        xaxis={"domain": [0, 1], "anchor": "y", "showgrid": False, "zeroline": False},
        yaxis={"domain": [(ROW_PX + GAP_PX) / plot_px, 1.0], "title": {"text": "token in step"}, "showgrid": False,
               **({"dtick": 1} if CELLS_PX / cell_rows >= TICK_PX else {})},
        xaxis2={"domain": list(ROW_DOMAINS[0]), "anchor": "y2", "title": {"text": "draft position"},
                **({"dtick": 1} if rate_px / positions >= 2 * TICK_PX else {})},
        yaxis2={"domain": [0, row_top], "anchor": "x2", "range": [0, 1.05], "tickformat": ".0%"},
        xaxis3={"domain": list(ROW_DOMAINS[1]), "anchor": "y3", "title": {"text": "step"}},
        yaxis3={"domain": [0, row_top], "anchor": "x3", "rangemode": "tozero"},
        xaxis4={"domain": list(ROW_DOMAINS[2]), "anchor": "y4", "visible": False, "range": tree_x},
        yaxis4={"domain": [0, row_top], "anchor": "x4", "visible": False, "range": tree_y},
        annotations=[{**sub, "x": a, "text": "<br>".join(lines)} for lines, (a, _) in zip(titles, ROW_DOMAINS)],
        bargap=0.15,
    )
    return {"data": data, "layout": layout}
