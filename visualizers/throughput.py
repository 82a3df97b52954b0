"""Throughput panel: tokens generated against time for each run on the same input, where time went, and how many
tokens a step commits as the output grows.

Top left: one curve per method (flat at first while the prefill runs), at most MAX_POINTS points each. Top right:
per-phase time of each run (prefill, drafting, verification, retrieval, the rest). Below: tokens committed per step
in windows of output positions, one bar per drafting method and window, so a long output shows standard speculative
decoding slowing as its draft reads ever more context and CMR holding up. ``throughput_html`` reads out tokens/s
and the speedups, each named by what it compares: over the target alone, and over standard speculative decoding only
where both runs drafted from the same sources (the same draft, lookup in both or neither: what the runs' Started
events say). Knows events and metrics; no gradio, no models.
"""

from __future__ import annotations

import html
import math
from typing import Mapping, Sequence

from specextend.events import Event
from specextend.metrics import committed_curve, phase_seconds, summarize, tokens_per_step_by_window

from .common import (
    CHAR_EM, REFERENCE_WIDTH, TITLE_PAD, TITLE_SIZE, Spec, base_layout, by_source_html, color, draft_name, ending,
    has_draft, label, lookup_on, message_spec, method_of, none_yet, short_label, stop_reason, thinned, title,
    title_height, with_lookup, wrapped,
)

PHASE_COLORS = {
    "prefill": "#adb5bd",
    "drafting": "#9b5de5",
    "verification": "#2a6fdb",
    "retrieval": "#f4a261",
    "other": "#e9ecef",
}
REFERENCES = ("autoregressive", "speculative")  # speedups are read against each of these that ran
COMPARES = {"autoregressive": "speedup over the target alone",
            "speculative": "speedup over standard speculative decoding, same draft and sources"}
MAX_POINTS = 500  # the most points a run's tokens-vs-time curve is drawn with
WINDOW = 16  # the smallest window of output positions the tokens-per-step row averages over (doubled as needed)
MAX_WINDOWS = 40  # the most windows the longest run's output is cut into
# the figure in pixels, top down: the title, the runs' legend over the curves, the top row (curves, phases), its axes,
# the phases' legend under the phases chart, the bottom row's title, the bottom row (tokens per step), its axis
MARGIN_L, MARGIN_R, MARGIN_B = 56, 16, 48
TOP_ROW_PX, AXIS_PX, ROW_TITLE_PX, BOTTOM_ROW_PX = 190, 46, 28, 200
LEGEND_ROW_PX, LEGEND_FONT, SYMBOL_PX = 21, 12, 44  # a legend row; an entry's symbol and the spaces around its text


def phase_breakdown(events: Sequence[Event]) -> dict[str, float]:
    """Seconds per phase of one run; 'other' is the rest of its wall time (bookkeeping, sampling)."""
    p = phase_seconds(events)
    curve = committed_curve(events)
    out = {
        "prefill": p["target_prefill"] + p["draft_prefill"],
        "drafting": p["drafting"],
        "verification": p["verification"],
        "retrieval": p["retrieval"],
    }
    out["other"] = max(0.0, (curve[-1][0] if curve else 0.0) - sum(out.values()))
    return out


def legend_rows(names: Sequence[str], px: float) -> int:
    """The rows a horizontal legend of these entries takes in `px` pixels (entries laid left to right, wrapped)."""
    rows, used = 1, 0.0
    for name in names:
        entry = SYMBOL_PX + CHAR_EM * LEGEND_FONT * len(name)
        if used and used + entry > px:
            rows, used = rows + 1, 0.0
        used += entry
    return rows


def window_size(output_len: int) -> int:
    """The output positions per window of the tokens-per-step row: WINDOW doubled until `output_len` tokens make at
    most MAX_WINDOWS windows (an 8,000-token output: 256)."""
    size = WINDOW
    while math.ceil(output_len / size) > MAX_WINDOWS:
        size *= 2
    return size


def _window_bars(runs: Mapping[str, Sequence[Event]], size: int) -> list[dict]:
    """Per drafting run, a bar per window of `size` output positions at the window's middle: its tokens per step
    there. The target alone commits exactly one token a step; the row draws that as a line, not as bars."""
    bars = []
    for method, events in runs.items():
        if method_of(events) == "autoregressive":
            continue
        windows = tokens_per_step_by_window(events, size)
        name = with_lookup(events, label(method))
        bars.append({
            "type": "bar", "name": name, "x": [w.start + size / 2 for w in windows], "y": [w.per_step for w in windows],
            "customdata": [[w.start, w.start + size, w.steps] for w in windows], "xaxis": "x3", "yaxis": "y3",
            "offsetgroup": method, "marker": {"color": color(method)}, "showlegend": False,
            "hovertemplate": f"{html.escape(name)}, output tokens %{{customdata[0]}}–%{{customdata[1]}}: "
                             "%{y:.2f} tokens per step (%{customdata[2]} steps)<extra></extra>",
        })
    return bars


def throughput_spec(runs: Mapping[str, Sequence[Event]], at: tuple[str, float, int] | None = None) -> Spec:
    """Tokens-vs-time curves and per-phase bars for runs keyed by method, over tokens per step along the output, as a
    Plotly figure dict. `at` = (method, seconds, tokens) marks one moment of one run (a step being looked at)."""
    runs = {m: ev for m, ev in runs.items() if ev}
    if not runs:
        return message_spec("run a generation to see its speed (tick race mode to compare methods)")
    if all(stop_reason(ev) != "running" and not committed_curve(ev) for ev in runs.values()):  # ended without a token
        first = next(iter(runs.values()))
        return message_spec(f"{none_yet(first, 'token', '')} ({max(ev[-1].t_s for ev in runs.values()):.1f} s in): "
                            "no tokens to draw; the table below gives each run's time")
    data = []
    longest = 0
    for method, events in runs.items():
        curve = [(0.0, 0)] + committed_curve(events)
        longest = max(longest, curve[-1][1])
        curve = thinned(curve, MAX_POINTS)  # a step-shaped curve: every k-th point keeps its shape, its ends exact
        data.append({
            "type": "scatter", "mode": "lines", "name": with_lookup(events, label(method)), "x": [round(t, 4) for t, _ in curve],
            "y": [n for _, n in curve], "line": {"color": color(method), "width": 3, "shape": "hv"},
            "hovertemplate": f"{html.escape(with_lookup(events, label(method)))}: %{{y}} tokens at %{{x:.2f}} s"
                             "<extra></extra>",
            "legend": "legend", "showlegend": True,
        })
    size = window_size(longest)
    # every step commits at least one token, so 1.0 is the floor and what the target alone gets at every length
    shapes: list[dict] = [{"type": "line", "xref": "x3 domain", "yref": "y3", "x0": 0, "x1": 1, "y0": 1, "y1": 1,
                           "line": {"color": color("autoregressive"), "width": 2, "dash": "dash"}}]
    marker: list[dict] = []
    if at is not None:
        method, seconds, tokens = at
        shapes.append({"type": "line", "xref": "x", "yref": "y domain", "x0": seconds, "x1": seconds, "y0": 0, "y1": 1,
                       "line": {"color": color(method), "width": 1, "dash": "dot"}})
        shapes.append({"type": "line", "xref": "x3", "yref": "y3 domain", "x0": tokens, "x1": tokens, "y0": 0, "y1": 1,
                       "line": {"color": color(method), "width": 2, "dash": "dot"}})
        marker = [{"type": "scatter", "mode": "markers", "x": [seconds], "y": [tokens], "showlegend": False,
                   "marker": {"size": 11, "color": color(method), "line": {"color": "white", "width": 2}},
                   "hovertemplate": "the step shown: %{y} tokens at %{x:.2f} s<extra></extra>"}]
    names = [with_lookup(ev, short_label(m)) for m, ev in runs.items()]
    breakdowns = [phase_breakdown(ev) for ev in runs.values()]
    for phase, shade in PHASE_COLORS.items():
        data.append({
            "type": "bar", "orientation": "h", "name": phase, "y": names, "x": [b[phase] for b in breakdowns],
            "marker": {"color": shade}, "xaxis": "x2", "yaxis": "y2", "legend": "legend2", "showlegend": True,
            "hovertemplate": f"{phase}: %{{x:.2f}} s<extra>%{{y}}</extra>",
        })
    windows = _window_bars(runs, size)
    data += windows + marker
    plot_w = REFERENCE_WIDTH - MARGIN_L - MARGIN_R
    heading = "<br>".join(wrapped("Tokens generated over time (same input, same limit) · where each run spent its time",
                                  REFERENCE_WIDTH - 2 * TITLE_PAD, TITLE_SIZE))
    top = title_height(heading) + legend_rows([d["name"] for d in data if d.get("legend") == "legend"], plot_w) * LEGEND_ROW_PX
    phase_rows = legend_rows(list(PHASE_COLORS), plot_w)
    plot_px = TOP_ROW_PX + AXIS_PX + phase_rows * LEGEND_ROW_PX + ROW_TITLE_PX + BOTTOM_ROW_PX
    top_row = [1 - TOP_ROW_PX / plot_px, 1.0]
    bottom_row = [0.0, BOTTOM_ROW_PX / plot_px]
    row = {"xref": "paper", "yref": "paper", "x": 0.0, "xanchor": "left", "showarrow": False, "font": {"size": 12}}
    annotations = [
        {**row, "y": bottom_row[1] + 4 / plot_px, "yanchor": "bottom",
         "text": f"Tokens per step along the output (windows of {size} output tokens) · dashed: the target alone, 1 "
                 "token per step"},
    ]
    if not windows:
        annotations.append({**row, "x": 0.5, "xanchor": "center", "y": 0.18, "font": {"size": 12, "color": "#52606d"},
                            "text": "race a drafting method beside the target alone to see its tokens per step"})
    layout = base_layout(
        top + plot_px + MARGIN_B,
        title=title(heading, top + plot_px + MARGIN_B),
        xaxis={"domain": [0, 0.55], "anchor": "y", "title": {"text": "seconds since the request started"},
               "rangemode": "tozero"},
        yaxis={"domain": top_row, "anchor": "x", "title": {"text": "tokens generated"}, "rangemode": "tozero"},
        xaxis2={"domain": [0.72, 1.0], "anchor": "y2", "title": {"text": "seconds"}, "rangemode": "tozero"},
        yaxis2={"domain": top_row, "anchor": "x2"},
        xaxis3={"domain": [0, 1.0], "anchor": "y3", "title": {"text": "output position (tokens generated)"},
                "range": [0, math.ceil(max(longest, 1) / size) * size]},
        yaxis3={"domain": bottom_row, "anchor": "x3", "title": {"text": "tokens per step"}, "rangemode": "tozero"},
        barmode="stack",  # the phases of a run stack; the windows' bars stand side by side (one offsetgroup per run)
        showlegend=True,
        # the runs over the curves, outside them (inside, the legend hid a curve); the phases under the top row, from
        # its right edge; each in the room kept for it (left to push the margins, a legend shrank the plots instead)
        legend={"orientation": "h", "x": 0.0, "xanchor": "left", "y": 1.0, "yanchor": "bottom",
                "traceorder": "normal", "font": {"size": LEGEND_FONT}},  # the race's order
        legend2={"orientation": "h", "x": 1.0, "xanchor": "right", "y": top_row[0] - AXIS_PX / plot_px,
                 "yanchor": "top", "font": {"size": LEGEND_FONT}},
        margin={"l": MARGIN_L, "r": MARGIN_R, "t": top, "b": MARGIN_B, "autoexpand": False},
        shapes=shapes,
        annotations=annotations,
    )
    return {"data": data, "layout": layout}


def sources(events: Sequence[Event]) -> tuple[str, bool]:
    """What a run drafted from, as its Started event says: its draft ("draft model", "EAGLE head"...; "" for none) and
    whether lookup added copies."""
    return (draft_name(events) if has_draft(events) else "", lookup_on(events))


def sources_words(events: Sequence[Event]) -> str:
    """What a run drafted from, in words ("the draft model and lookup", "lookup only", "nothing" for the target
    alone)."""
    draft, lookup = sources(events)
    return " and ".join([f"the {draft}"] * bool(draft) + ["lookup"] * lookup) + " only" * (lookup and not draft) or \
        "nothing"


def like_for_like(runs: Mapping[str, Sequence[Event]], method: str, reference: str) -> tuple[bool, str]:
    """Whether two runs drafted from the same sources (the same draft; lookup in both or in neither), so that their
    speeds compare what differs between the methods alone; and in words: "both with lookup, the same draft model", or
    "not comparable: SpecExtend drafted with lookup, speculative without", or "not comparable: lookup drafting alone
    drafted from lookup only; speculative from the EAGLE-3 head and lookup" (a run of lookup alone by its full name:
    its short one is the source's)."""
    (draft, lookup), (ref_draft, ref_lookup) = sources(runs[method]), sources(runs[reference])
    if (draft, lookup) == (ref_draft, ref_lookup):
        return True, f"both {'with' if lookup else 'without'} lookup" + (f", the same {draft}" if draft else "")
    name, ref_name = short_label(method), short_label(reference)
    if draft == ref_draft:
        return False, (f"not comparable: {name} drafted {'with' if lookup else 'without'} lookup, {ref_name} "
                       f"{'with' if ref_lookup else 'without'}")
    name, ref_name = (label(m) if sources(runs[m]) == ("", True) else short_label(m) for m in (method, reference))
    return False, (f"not comparable: {name} drafted from {sources_words(runs[method])}; {ref_name} from "
                   f"{sources_words(runs[reference])}")


def speedup_headline(runs: Mapping[str, Sequence[Event]], rates: Mapping[str, float]) -> str:
    """The race's headline, in words: SpecExtend over standard speculative decoding where both drafted from the same
    sources (the paper's comparison), beside each method over the target alone. `rates`: end-to-end tokens/s by
    method (the runs that made any)."""
    parts = []
    if "specextend" in rates and "speculative" in rates:
        same, words = like_for_like(runs, "specextend", "speculative")
        ratio = f": <b>{rates['specextend'] / rates['speculative']:.2f}×</b>" if same else ""
        parts.append(f"SpecExtend over standard speculative decoding, {html.escape(words)}{ratio}")
    if "autoregressive" in rates:
        over = [f"{html.escape(with_lookup(runs[m], label(m)))} <b>{rate / rates['autoregressive']:.2f}×</b>"
                for m, rate in rates.items() if m != "autoregressive"]
        parts += [f"over the target alone: {', '.join(over)}"] if over else []
    return f"<div>Speedup, end to end: {' · '.join(parts)}</div>" if parts else ""


def throughput_html(runs: Mapping[str, Sequence[Event]], load: float | None = None,
                    not_run: Mapping[str, str] | None = None) -> str:
    """The race's headline (`speedup_headline`) over a table of tokens, time and tokens/s per run, with the speedup
    against each reference that ran (the target alone; standard speculative decoding where the run drafted from the
    same sources, else "not comparable"), and a note on how far one run's timings can be trusted. `load`: the
    machine's load per core while it ran, when known (above 1, runs waited for a core). A run that made no token shows
    its clock when it ended (its prefill's time counts); `not_run`: the click's methods that never started, each with
    why ("stopped"), listed as not run."""
    summaries = {m: summarize(ev) for m, ev in runs.items() if ev}
    if not summaries:
        return ""
    references = [m for m in REFERENCES if m in summaries and summaries[m].e2e_tokens_per_s > 0]
    rows = []
    for method, s in summaries.items():
        cells = "".join(_speedup_cell(runs, method, r, s.e2e_tokens_per_s / summaries[r].e2e_tokens_per_s)
                        if r != method and s.e2e_tokens_per_s > 0 else "<td></td>" for r in references)
        made = s.new_tokens > 0
        took = s.total_s if made else runs[method][-1].t_s  # no token yet: the run's clock (a stopped prefill's time)
        speeds = (f"<td><b>{s.e2e_tokens_per_s:.1f}</b></td><td>{s.decode_tokens_per_s:.1f}</td>"
                  f"<td>{s.mean_accepted:.2f}{by_source_html(runs[method])}</td>") if made else "<td>—</td>" * 3
        rows.append(
            f"<tr><td><span style='color:{color(method)}'>■</span> {html.escape(with_lookup(runs[method], label(method)))}</td>"
            f"<td>{html.escape(ending(runs[method]))}</td><td>{s.new_tokens}</td><td>{took:.2f} s</td>{speeds}{cells}</tr>"
        )
    for method, why in (not_run or {}).items():
        rows.append(f"<tr><td><span style='color:{color(method)}'>■</span> {html.escape(label(method))}</td>"
                    f"<td>did not run ({html.escape(why)})</td>{'<td></td>' * (5 + len(references))}</tr>")
    heads = "".join(f"<th>{html.escape(COMPARES[r])}</th>" for r in references)
    note = ("Speedups are end to end (prefill included) from one run of each method on the same input; on a shared "
            "machine a single run can be off by 10% or more.")
    if load is not None and load > 1.0:
        note += f" The machine was busy while this ran (load {load:.1f} per core): expect more noise than that."
    rates = {m: s.e2e_tokens_per_s for m, s in summaries.items() if s.e2e_tokens_per_s > 0}
    return (
        f"{speedup_headline(runs, rates)}<table class='se-table'><thead><tr><th>method</th><th>status</th>"
        "<th>tokens</th><th>time</th><th>tokens/s (incl. prefill)</th><th>decode tokens/s</th>"
        "<th>tokens per step, by who proposed them</th>"
        f"{heads}</tr></thead><tbody>{''.join(rows)}</tbody></table><div class='se-muted'>{html.escape(note)}</div>"
    )


def _speedup_cell(runs: Mapping[str, Sequence[Event]], method: str, reference: str, ratio: float) -> str:
    """A table cell: `method`'s speedup over `reference`; over standard speculative decoding, where the two drafted
    from other sources, why it is not comparable (the target alone, which drafts nothing, is left blank there)."""
    if reference == "speculative" and method == "autoregressive":
        return "<td></td>"
    if reference == "speculative":
        same, words = like_for_like(runs, method, reference)
        if not same:
            return f"<td><span class='se-muted' title='{html.escape(words, quote=True)}'>not comparable</span></td>"
    return f"<td><b>{ratio:.2f}×</b></td>"
