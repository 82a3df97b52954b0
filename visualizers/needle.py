"""Teaching panel for needle-in-a-haystack: does the draft's cache hold the needle, step by step?

One row per run (CMR's working cache, a StreamingLLM window), one column per retrieval; a cell is
the share of the needle's tokens the cache held after that step. Plus a verdict on each answer.
Knows events and token spans; no gradio, no models.
"""

from __future__ import annotations

import html
from typing import Mapping, Sequence

from specextend.events import Event, Retrieved
from specextend.metrics import new_tokens, summarize

from .common import STATUS_COLORS, Decode, Spec, base_layout, label, message_spec, of, stop_reason, title


def held_share(r: Retrieved, span: tuple[int, int]) -> float:
    """Share of the token span ``[start, end)`` that lies inside the retrieval's kept spans."""
    start, end = span
    if end <= start:
        return 0.0
    inside = sum(max(0, min(end, b) - max(start, a)) for a, b in r.kept_spans)
    return min(1.0, inside / (end - start))


def needle_spec(runs: Mapping[str, Sequence[Event]], needle_span: tuple[int, int], prompt_len: int) -> Spec:
    """Rows per run, columns per step with a retrieval (of either run): how much of the needle the draft's
    cache held after that step (a run that did not retrieve then still holds its previous selection)."""
    rows = {m: of(ev, Retrieved) for m, ev in runs.items()}
    rows = {m: rs for m, rs in rows.items() if rs}
    if not rows:
        return message_spec("waiting for the first retrieval of either run")
    steps = sorted({r.step for rs in rows.values() for r in rs})
    names, z, text = [], [], []
    for method, rs in rows.items():
        # after each step the cache holds what its latest retrieval at or before that step chose
        shares = [next((held_share(r, needle_span) for r in reversed(rs) if r.step <= s), None) for s in steps]
        names.append(label(method))
        z.append(shares)
        text.append(["" if v is None else ("holds the needle" if v >= 1.0 else f"holds {v:.0%} of the needle")
                     for v in shares])
    depth = needle_span[0] / prompt_len if prompt_len else 0.0
    heat = {
        "type": "heatmap", "x": steps, "y": names, "z": z, "text": text, "zmin": 0.0, "zmax": 1.0,
        "colorscale": [[0.0, STATUS_COLORS["rejected"]], [0.5, "#f1f5f9"], [1.0, STATUS_COLORS["accepted"]]],
        "showscale": False, "xgap": 2, "ygap": 4, "texttemplate": "%{z:.0%}" if len(steps) <= 24 else "",
        "hovertemplate": "%{y}, after step %{x}: %{text}<extra></extra>",
    }
    layout = base_layout(
        120 + 60 * len(names),
        title=title(f"Is the needle (tokens {needle_span[0]}–{needle_span[1]}, {depth:.0%} into the prompt) "
                    "in the draft's cache? green: all of it · red: none"),
        xaxis={"title": {"text": "after step"}, "type": "category"},
        yaxis={"automargin": True, "autorange": "reversed"},
        margin={"l": 40, "r": 16, "t": 40, "b": 48},
    )
    return {"data": [heat], "layout": layout}


def answer_html(runs: Mapping[str, Sequence[Event]], decode: Decode, expected: str) -> str:
    """Each run's answer, whether it contains the expected fact (case-insensitive), and how well its draft kept up."""
    rows = []
    for method, events in runs.items():
        if not events:
            continue
        answer = decode(new_tokens(events)).strip()
        s = summarize(events)
        right = bool(expected) and expected.lower() in answer.lower()
        mark = "✔ right" if right else ("…" if stop_reason(events) == "running" else "✘ does not contain it")
        rows.append(f"<tr><td>{html.escape(label(method))}</td><td>{html.escape(answer) or '…'}</td>"
                    f"<td class='{'se-ok' if right else 'se-bad'}'>{mark}</td><td>{s.mean_accepted:.2f}</td>"
                    f"<td>{s.decode_tokens_per_s:.1f}</td></tr>")
    return (f"<p>Expected answer: <b>{html.escape(expected)}</b>. Greedy speculative decoding is exact, so both runs "
            "write the target's own answer; what the draft's cache changes is how many of its guesses the target "
            "accepts, and so the speed.</p><table class='se-table'><thead><tr><th>draft cache</th><th>answer</th>"
            "<th></th><th>tokens per step</th><th>decode tokens/s</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>")
