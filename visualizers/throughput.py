"""Throughput panel: tokens generated against time for each run on the same input, and where time went.

Left: one curve per method (flat at first while the prefill runs). Right: per-phase time of each run
(prefill, drafting, verification, retrieval, the rest). ``throughput_html`` reads out tokens/s and the
speedup over the target alone (or, failing that,
standard speculative decoding). Knows events and metrics; no gradio, no models.
"""

from __future__ import annotations

import html
from typing import Mapping, Sequence

from specextend.events import Event
from specextend.metrics import committed_curve, phase_seconds, summarize

from .common import (
    Spec, base_layout, by_source_html, color, ending, label, message_spec, short_label, title, with_lookup,
)

PHASE_COLORS = {
    "prefill": "#adb5bd",
    "drafting": "#9b5de5",
    "verification": "#2a6fdb",
    "retrieval": "#f4a261",
    "other": "#e9ecef",
}
REFERENCES = ("autoregressive", "speculative")  # speedups are read against each of these that ran


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


def throughput_spec(runs: Mapping[str, Sequence[Event]], at: tuple[str, float, int] | None = None) -> Spec:
    """Tokens-vs-time curves and per-phase bars for runs keyed by method, as a Plotly figure dict. `at` = (method,
    seconds, tokens) marks one moment of one run (a step being looked at)."""
    runs = {m: ev for m, ev in runs.items() if ev}
    if not runs:
        return message_spec("run a generation to see its speed (tick race mode to compare methods)")
    data = []
    for method, events in runs.items():
        curve = [(0.0, 0)] + committed_curve(events)
        data.append({
            "type": "scatter", "mode": "lines", "name": with_lookup(events, label(method)), "x": [t for t, _ in curve],
            "y": [n for _, n in curve], "line": {"color": color(method), "width": 3, "shape": "hv"},
            "hovertemplate": f"{html.escape(with_lookup(events, label(method)))}: %{{y}} tokens at %{{x:.2f}} s"
                             "<extra></extra>",
            "legend": "legend", "showlegend": True,
        })
    shapes: list[dict] = []
    marker: list[dict] = []
    if at is not None:
        method, seconds, tokens = at
        shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": seconds, "x1": seconds, "y0": 0, "y1": 1,
                       "line": {"color": color(method), "width": 1, "dash": "dot"}})
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
    data += marker
    layout = base_layout(
        340,
        title=title("Tokens generated over time (same input, same limit) · where each run spent its time"),
        xaxis={"domain": [0, 0.55], "title": {"text": "seconds since the request started"}, "rangemode": "tozero"},
        yaxis={"title": {"text": "tokens generated"}, "rangemode": "tozero"},
        xaxis2={"domain": [0.72, 1.0], "anchor": "y2", "title": {"text": "seconds"}, "rangemode": "tozero"},
        yaxis2={"anchor": "x2", "automargin": True},
        barmode="stack",
        showlegend=True,
        legend={"x": 0.01, "y": 0.99, "bgcolor": "rgba(255,255,255,0.8)"},
        legend2={"orientation": "h", "x": 0.62, "y": -0.25, "xanchor": "left"},
        margin={"l": 56, "r": 16, "t": 36, "b": 80},
        shapes=shapes,
    )
    return {"data": data, "layout": layout}


def throughput_html(runs: Mapping[str, Sequence[Event]], load: float | None = None) -> str:
    """A table of tokens, time and tokens/s per run, with the speedup against each reference that ran (the target
    alone, standard speculative decoding), and a note on how far one run's timings can be trusted. `load`: the
    machine's load per core while it ran, when known (above 1, runs waited for a core)."""
    summaries = {m: summarize(ev) for m, ev in runs.items() if ev}
    if not summaries:
        return ""
    references = [m for m in REFERENCES if m in summaries and summaries[m].e2e_tokens_per_s > 0]
    rows = []
    for method, s in summaries.items():
        cells = "".join(
            f"<td><b>{s.e2e_tokens_per_s / summaries[r].e2e_tokens_per_s:.2f}×</b></td>"
            if r != method and s.e2e_tokens_per_s > 0 else "<td></td>" for r in references)
        rows.append(
            f"<tr><td><span style='color:{color(method)}'>■</span> {html.escape(with_lookup(runs[method], label(method)))}</td>"
            f"<td>{html.escape(ending(runs[method]))}</td><td>{s.new_tokens}</td><td>{s.total_s:.2f} s</td>"
            f"<td><b>{s.e2e_tokens_per_s:.1f}</b></td><td>{s.decode_tokens_per_s:.1f}</td>"
            f"<td>{s.mean_accepted:.2f}{by_source_html(runs[method])}</td>{cells}</tr>"
        )
    heads = "".join(f"<th>speedup vs {html.escape(label(r))}</th>" for r in references)
    note = ("Speedups are end to end (prefill included) from one run of each method on the same input; on a shared "
            "machine a single run can be off by 10% or more.")
    if load is not None and load > 1.0:
        note += f" The machine was busy while this ran (load {load:.1f} per core): expect more noise than that."
    return (
        "<table class='se-table'><thead><tr><th>method</th><th>status</th><th>tokens</th><th>time</th>"
        "<th>tokens/s (incl. prefill)</th><th>decode tokens/s</th><th>tokens per step, by who proposed them</th>"
        f"{heads}</tr></thead><tbody>{''.join(rows)}</tbody></table><div class='se-muted'>{html.escape(note)}</div>"
    )
