"""Retrieval panel: which chunks of the document the draft's working cache holds, and how that moves.

Top: the document as a strip of chunks coloured by the target's latest final-layer attention score,
the chunks in the working cache outlined; hovering a chunk shows its text. Bottom: one row per
retrieval, one column per chunk, filled where the chunk was in the working cache. A StreamingLLM run
(no scores) shows the chunks its sink + recent window covers. Knows events; no gradio, no models.
"""

from __future__ import annotations

import html
import math
from functools import lru_cache
from typing import Sequence

from specextend.events import Event, Retrieved
from specextend.metrics import new_tokens

from .common import Decode, Spec, base_layout, hover_text, message_spec, method_of, of, prompt_ids, title

MAX_COLUMNS = 400  # more chunks than this are binned so a redraw stays small
MAX_ROWS = 240  # the most recent retrievals drawn in the heatmap
SELECTED = "#1d3557"
OUTLINE = "#e63946"


def chunk_grid(r: Retrieved) -> tuple[tuple[int, int], ...]:
    """The chunk spans of a retrieval; for a policy that reports none, fixed chunks over its sequence."""
    if r.chunk_spans:
        return r.chunk_spans
    size = max(r.chunk_size, 1)
    return tuple((s, min(s + size, r.seq_len)) for s in range(0, r.seq_len, size))


def kept_chunks(r: Retrieved) -> tuple[int, ...]:
    """Chunk ids in the working cache: the selection, or the chunks the kept spans overlap."""
    if r.selected:
        return tuple(r.selected)
    grid = chunk_grid(r)
    return tuple(i for i, (s, e) in enumerate(grid) if any(a < e and s < b for a, b in r.kept_spans))


def _runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive ids merged into inclusive (first, last) runs."""
    out: list[tuple[int, int]] = []
    for i in sorted(set(ids)):
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


@lru_cache(maxsize=4096)
def _held_row(r: Retrieved, n: int, width: int) -> tuple[int | None, ...]:
    """One heatmap row: 1 for chunks in the working cache, 0 for the others, None past the sequence then."""
    held = set(kept_chunks(r))
    size = len(chunk_grid(r))
    return tuple(_binned([(1 if i in held else 0) if i < size else None for i in range(n)], width))


def _binned(values: Sequence[float | None], width: int) -> list[float | None]:
    if width == 1:
        return list(values)
    out: list[float | None] = []
    for i in range(0, len(values), width):
        group = [v for v in values[i : i + width] if v is not None]
        out.append(max(group) if group else None)
    return out


def retrieval_spec(events: Sequence[Event], decode: Decode, mark: tuple[str, tuple[int, int]] | None = None,
                   height: int | None = None) -> Spec:
    """The retrieval panel for one run (its Retrieved events), as a Plotly figure dict.

    `mark` = (name, token span) flags a passage (the needle) above the chunks that hold it.
    """
    retrievals = of(events, Retrieved)
    if not retrievals:
        method = method_of(events)
        if method in ("autoregressive", "speculative"):
            why = "this method keeps the full prefix in the draft cache: there is no retrieval to show"
            if method == "autoregressive":
                why = "the target alone uses no draft: there is no retrieval to show"
            return message_spec(why)
        return message_spec("waiting for the first retrieval (it comes right after prefill)")

    latest = retrievals[-1]
    grid = chunk_grid(latest)
    n = len(grid)
    width = max(1, math.ceil(max(len(chunk_grid(r)) for r in retrievals) / MAX_COLUMNS))
    sequence = list(prompt_ids(events)) + new_tokens(events)
    prompt_len = len(prompt_ids(events))

    scores: list[float | None] = list(latest.scores) if latest.scores else [None] * n
    top = max((s for s in scores if s is not None), default=0.0) or 1.0
    kept = set(kept_chunks(latest))
    texts = []
    for i, (s, e) in enumerate(grid):
        where = "output" if s >= prompt_len else "document"
        score = "" if scores[i] is None else f" · score {scores[i]:.4f}"
        held = " · <b>in working cache</b>" if i in kept else ""
        texts.append(f"chunk {i} ({where} tokens {s}–{e}){score}{held}<br>{hover_text(decode(sequence[s:e]))}")

    strip_z = [None if s is None else s / top for s in scores]
    if latest.policy == "streaming" or not latest.scores:
        strip_z = [1.0 if i in kept else 0.0 for i in range(n)]
    columns = list(range(0, n, width))
    strip = {
        "type": "heatmap",
        "x": columns,
        "y": [0],
        "z": [_binned(strip_z, width)],
        "text": [[texts[c] for c in columns]],
        "hovertemplate": "%{text}<extra></extra>",
        "colorscale": [[0.0, "#f1f5f9"], [1.0, "#f4a261"]],
        "zmin": 0.0,
        "zmax": 1.0,
        "showscale": False,
        "xgap": 1 if n <= 120 else 0,
        "yaxis": "y",
    }

    shown = retrievals[-MAX_ROWS:]
    rows = [list(_held_row(r, n, width)) for r in shown]
    heat = {
        "type": "heatmap",
        "x": columns,
        "y": [r.step for r in shown],
        "z": rows,
        "colorscale": [[0.0, "#e9eef3"], [1.0, SELECTED]],
        "zmin": 0.0,
        "zmax": 1.0,
        "showscale": False,
        "xgap": 1 if n <= 120 else 0,
        "ygap": 1 if len(shown) <= 60 else 0,
        "hovertemplate": "after step %{y}, chunk %{x}: %{z:.0f} (1 = in working cache)<extra></extra>",
        "yaxis": "y2",
    }

    shapes = [
        {"type": "rect", "xref": "x", "yref": "y", "x0": a - 0.5, "x1": b + 0.5, "y0": -0.5, "y1": 0.5,
         "line": {"color": OUTLINE, "width": 2}, "fillcolor": "rgba(0,0,0,0)"}
        for a, b in _runs([c // width * width for c in kept])
    ]
    annotations = []
    if 0 < prompt_len < latest.seq_len:
        boundary = prompt_len / max(latest.chunk_size, 1) - 0.5
        shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": boundary, "x1": boundary, "y0": 0,
                       "y1": 1, "line": {"color": "#52606d", "width": 1, "dash": "dot"}})
        annotations.append({"text": "output starts ▸", "xref": "x", "yref": "paper", "x": boundary, "y": 1.0,
                            "xanchor": "right", "yanchor": "bottom", "showarrow": False, "font": {"size": 11}})
    if mark is not None:
        name, (a, b) = mark
        size = max(latest.chunk_size, 1)
        first, last = a // size, max(a, b - 1) // size
        shapes.append({"type": "rect", "xref": "x", "yref": "paper", "x0": first - 0.5, "x1": last + 0.5, "y0": 0,
                       "y1": 1, "line": {"color": "#d4a017", "width": 1, "dash": "dot"}, "fillcolor": "rgba(233,196,106,0.3)"})
        annotations.append({"text": f"▼ {html.escape(name)}", "xref": "x", "yref": "paper", "x": (first + last) / 2,
                            "y": 1.0, "yanchor": "bottom", "showarrow": False, "font": {"size": 11, "color": "#9a6700"}})

    if latest.scores:
        best = max(range(n), key=lambda i: latest.scores[i] if i < len(latest.scores) else -1.0)
        s, e = grid[best]
        snippet = hover_text(decode(sequence[s:e]), width=1000, limit=60 if height else 90)
        headline = (f"Retrieval after step {latest.step}: {len(kept)} of {n} chunks in the draft's working cache "
                    f"({latest.working_cache_len} tokens)<br><span style='font-size:12px'>the target attends "
                    f"most to chunk {best}: “{snippet}”</span>")
    else:
        headline = (f"StreamingLLM window after step {latest.step}: {latest.working_cache_len} tokens "
                    f"({len(kept)} of {n} chunks)<br><span style='font-size:12px'>the attention sink plus the "
                    "most recent tokens, whatever the output is about</span>")

    height = height or 170 + min(260, 4 * len(shown) + 40)
    strip_share = 44 / (height - 100)
    layout = base_layout(
        height,
        title=title(headline),
        margin={"l": 56, "r": 16, "t": 60, "b": 40},
        xaxis={"title": {"text": "chunk of the document (then of the output)"},
               "range": [-width / 2, columns[-1] + width / 2],
               "anchor": "y2", "zeroline": False, "showgrid": False},
        yaxis={"domain": [1 - strip_share, 1.0], "visible": False, "range": [-0.5, 0.5], "fixedrange": True},
        yaxis2={"domain": [0.0, 1 - strip_share - 0.08], "title": {"text": "retrieval after step"},
                "autorange": "reversed", "anchor": "x", "zeroline": False, "showgrid": False,
                **({"tickmode": "array", "tickvals": [r.step for r in shown]} if len(shown) <= 8 else {})},
        shapes=shapes,
        annotations=annotations,
    )
    return {"data": [strip, heat], "layout": layout}
