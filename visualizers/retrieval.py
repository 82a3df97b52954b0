"""Retrieval panel: which chunks of the sequence the draft's working cache holds, and how that moves.

Top: the sequence (the prompt, then the output so far) as a strip of chunks coloured by the retrieval signal's
latest score (square root, so the long tail shows), the chunks in the working cache outlined; chunks that reach
back (kept, yet outside a recency window of the same size) get a green outline. Hovering a chunk shows its text.
Bottom: one row per retrieval, one column per chunk, navy where the chunk was in the working cache, green where it
reached back, with a mark per row whose hover reads the output so far and, at the right, the draft tokens the
target accepted per step while that working cache served. A StreamingLLM run (no scores) shows the chunks its
sink + recent window covers. `far_html` lists the reaching-back chunks with their text. Where a lookup's copies
were accepted, a second strip row (violet) shows the chunks they were copied from, the latest outlined: CMR
choosing what the draft reads beside lookup copying what the document already says; lookup drafting alone gets
that row and one row per copying step below it. The chunks of the model's own output (on a long output, most of
them) are marked by a band between the strip and the heatmap. However long the run, the figure stays bounded: at
most MAX_COLUMNS columns (chunks binned past that) and MAX_CELLS heatmap cells (the most recent retrievals that
fit). Knows events; no gradio, no models.
"""

from __future__ import annotations

import html
import math
from functools import lru_cache
from typing import Sequence

from specextend.events import Event, Prefilled, Retrieved, Verified
from specextend.metrics import Yield, copies, new_tokens, retrieval_yield, tokens_by_source

from .common import (
    REFERENCE_WIDTH, STATUS_COLORS, TITLE_PAD, TITLE_SIZE, Decode, Spec, base_layout, clipped, draft_name,
    ending_in_colour, hover_text, message_spec, method_of, none_yet, of, prompt_ids, sat_out_note, small, title,
    title_height, wrapped,
)

MAX_COLUMNS = 400  # more chunks than this are binned so a redraw stays small
MAX_ROWS = 240  # the most recent retrievals drawn in the heatmap
MAX_CELLS = 24_000  # and no more rows than keep the heatmap within this many cells (fewer rows for a longer sequence)
STRIP_TEXT = 40_000  # characters of chunk text the strip's hovers share (each gets at least 60, at most 280)
OUTPUT_BAND = "#7d8597"  # the band under the strip's chunks of the model's own output
GAP = 24  # pixels between the strip and the heatmap, where that band runs
STRIP_PX = 44  # pixels per strip row
MARGIN_B = 40
BASE_TOP = 60  # the top margin panel_height allows for (a title of two lines); a taller title makes the panel taller
MARKS_PX = 9  # between the title and the strip, where the + / − marks over the strip reach up
LINE_PX = REFERENCE_WIDTH - 2 * TITLE_PAD  # the headline's lines are wrapped to the narrowest figure's width
LABEL_PX = 14  # the least pixels between two of the numbers at the heatmap's right for them to stay apart
SELECTED = "#1d3557"
OUTLINE = "#e63946"
FAR = "#2a9d8f"  # kept chunks a recency window of the same size would not hold
NEXT_STEP = {"stepOffset": 1}  # a click on a retrieval's row is the step after it, whose draft read that cache


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


def output_chunks(r: Retrieved, prompt_len: int) -> tuple[int, ...]:
    """Chunk ids in the working cache that start at or past `prompt_len`: chunks of the model's own output."""
    grid = chunk_grid(r)
    return tuple(i for i in kept_chunks(r) if grid[i][0] >= prompt_len)


def _first_output_chunk(grid: Sequence[tuple[int, int]], prompt_len: int) -> int | None:
    """The first chunk that starts at or past the prompt's end (None while no chunk does)."""
    return next((i for i, (s, _) in enumerate(grid) if s >= prompt_len), None) if prompt_len else None


def _rows_that_fit(columns: int) -> int:
    """How many of the most recent rows the heatmap draws at this many columns."""
    return max(1, min(MAX_ROWS, MAX_CELLS // max(columns, 1)))


def panel_height(n_rows: int, strips: int, height: int | None = None) -> int:
    """The panel's height in pixels under a title of two lines: `height` where the caller sets it, else grown with
    the heatmap's rows."""
    return height or 170 + STRIP_PX * (strips - 1) + min(260, 4 * n_rows + 40)


def frame(headline: str, n_rows: int, strips: int, height: int | None = None) -> tuple[int, int]:
    """(the panel's height, its top margin) in pixels: panel_height, grown by what the headline's lines take over
    two lines', so the strip and the heatmap keep their pixels however many lines the headline wraps into."""
    top = title_height(headline) + MARKS_PX
    return panel_height(n_rows, strips, height) + top - BASE_TOP, top


def heat_pixels(height: int, top: int, strips: int) -> int:
    """The heatmap's height in pixels in a panel `height` pixels tall, `top` of them over the plots, with `strips`
    strip rows over it."""
    return height - top - MARGIN_B - STRIP_PX * strips - GAP


def _label_every(n_rows: int, pixels: float) -> int:
    """Every how many rows (counted back from the latest) the heatmap's numbers at the right are written, so that
    no two are closer than LABEL_PX in a heatmap `pixels` tall."""
    return max(1, math.ceil(LABEL_PX * n_rows / max(pixels, 1)))


def changed(read: Retrieved | None, before: Retrieved | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(chunks added, chunks dropped) in the working cache from retrieval `before` to retrieval `read`."""
    if read is None or before is None:
        return (), ()
    now, then = set(kept_chunks(read)), set(kept_chunks(before))
    return tuple(sorted(now - then)), tuple(sorted(then - now))


def _change_marks(added: Sequence[int], dropped: Sequence[int], width: int) -> list[dict]:
    """Above the strip, + over runs of chunks the latest retrieval brought in and − over those it let go."""
    marks = []
    for sign, ids, colour in (("+", added, "#9a6700"), ("−", dropped, "#52606d")):
        for a, b in _runs([c // width * width for c in ids]):
            marks.append({"text": sign, "xref": "x", "yref": "y", "x": (a + b) / 2, "y": 0.5, "yanchor": "bottom",
                          "showarrow": False, "font": {"size": 12, "color": colour},
                          "hovertext": f"chunks {a}–{b}: {'brought in' if sign == '+' else 'let go'} by this retrieval"})
    return marks


def _runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive ids merged into inclusive (first, last) runs."""
    out: list[tuple[int, int]] = []
    for i in sorted(set(ids)):
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def far_chunks(r: Retrieved) -> tuple[int, ...]:
    """Kept chunks that reach back: neither the sink chunk nor among the newest len(kept) - 1 chunks, so a recency
    window of the same size (sink + newest) would not hold them."""
    kept = kept_chunks(r)
    n = len(chunk_grid(r))
    return tuple(i for i in kept if 0 < i < n - (len(kept) - 1))


@lru_cache(maxsize=4096)
def _held_row(r: Retrieved, n: int, width: int) -> tuple[int | None, ...]:
    """One heatmap row: 2 for chunks that reach back, 1 for the other chunks in the working cache, 0 for the rest,
    None past the sequence then."""
    held, far = set(kept_chunks(r)), set(far_chunks(r))
    size = len(chunk_grid(r))
    return tuple(_binned([(2 if i in far else 1 if i in held else 0) if i < size else None for i in range(n)], width))


def _output_tails(events: Sequence[Event], steps: Sequence[int], size: int = 16) -> dict[int, list[int]]:
    """The last `size` tokens generated by the end of each of `steps` (0: the prefill's first token), in one pass."""
    wanted = sorted(set(steps))
    out: dict[int, list[int]] = {}
    tail = [e.first_token for e in of(events, Prefilled)]
    verified = iter(of(events, Verified))
    v = next(verified, None)
    for step in wanted:
        while v is not None and v.step <= step:
            tail = (tail + list(v.committed))[-size:]
            v = next(verified, None)
        out[step] = tail
    return out


def _binned(values: Sequence[float | None], width: int) -> list[float | None]:
    if width == 1:
        return list(values)
    out: list[float | None] = []
    for i in range(0, len(values), width):
        group = [v for v in values[i : i + width] if v is not None]
        out.append(max(group) if group else None)
    return out


def _text_limit(columns: int) -> int:
    """Characters of chunk text each of the strip's hovers shows, so that all of them share STRIP_TEXT."""
    return max(60, min(280, STRIP_TEXT // max(columns, 1)))


def _copy_row(found: Sequence[tuple[int, tuple[int, ...]]], size: int, n: int, columns: Sequence[int],
              sequence: Sequence[int], decode: Decode) -> tuple[list[int], list[str]]:
    """Tokens a lookup copied (`found`: metrics.copies) from each of n chunks, and a hover per column."""
    counts = [0] * n
    for _, origins in found:
        for p in origins:
            if p // size < n:
                counts[p // size] += 1
    texts = []
    for i in columns:
        s, e = i * size, min((i + 1) * size, len(sequence))
        texts.append(f"chunk {i} (tokens {s}–{e}): lookup copied {counts[i]} accepted token(s) from here"
                     f"<br>{hover_text(decode(sequence[s:e]), limit=_text_limit(len(columns)))}")
    return counts, texts


def _copied_outline(latest: tuple[int, tuple[int, ...]] | None, size: int, width: int) -> list[dict]:
    """A violet box around the chunks the latest accepted copy came from (on the copy row, y = 1)."""
    if latest is None:
        return []
    return [{"type": "rect", "xref": "x", "yref": "y", "x0": a - 0.5, "x1": b + 0.5, "y0": 0.5, "y1": 1.5,
             "line": {"color": STATUS_COLORS["copied"], "width": 2}, "fillcolor": "rgba(0,0,0,0)"}
            for a, b in _runs([p // size // width * width for p in latest[1]])]


def _copy_headline(latest: tuple[int, tuple[int, ...]] | None, total: int, sequence: Sequence[int], prompt_len: int,
                   decode: Decode) -> str:
    """The latest accepted copy in words (plain text)."""
    if latest is None:
        return "lookup has copied nothing the target accepted yet"
    step, origins = latest
    where = "the document" if origins[0] < prompt_len else "the output itself"
    text = clipped(decode(sequence[origins[0] : origins[-1] + 1]), limit=60)
    return (f"lookup copied {total} accepted token(s) so far; step {step} copied “{text}” from {where} "
            f"(tokens {origins[0]}–{origins[-1] + 1})")


def lookup_spec(events: Sequence[Event], decode: Decode, chunk_size: int = 32) -> Spec:
    """The retrieval panel of lookup drafting alone: where in the document (or the output) its accepted copies
    came from. Top: the chunks by tokens copied, the latest copy outlined; below: one row per step that copied."""
    sequence = list(prompt_ids(events)) + new_tokens(events)
    prompt_len = len(prompt_ids(events))
    n = max(1, math.ceil(len(sequence) / chunk_size))
    width = max(1, math.ceil(n / MAX_COLUMNS))
    columns = list(range(0, n, width))
    found = copies(events)
    latest = found[-1] if found else None
    counts, texts = _copy_row(found, chunk_size, n, columns, sequence, decode)
    top = max(counts) or 1
    strip = {"type": "heatmap", "x": columns, "y": [1], "z": [_binned([c / top for c in counts], width)],
             "text": [texts], "hovertemplate": "%{text}<extra></extra>",
             "colorscale": [[0.0, "#f1f5f9"], [1.0, STATUS_COLORS["copied"]]], "zmin": 0.0, "zmax": 1.0,
             "showscale": False, "xgap": 1 if n <= 120 else 0, "yaxis": "y"}
    shown = found[-_rows_that_fit(len(columns)):]
    rows = []
    for _, origins in shown:
        held = {p // chunk_size for p in origins}
        rows.append(_binned([1 if i in held else 0 for i in range(n)], width))
    heat = {"type": "heatmap", "x": columns, "y": [step for step, _ in shown], "z": rows,
            "colorscale": [[0.0, "#e9eef3"], [1.0, STATUS_COLORS["copied"]]], "zmin": 0.0, "zmax": 1.0,
            "showscale": False, "xgap": 1 if n <= 120 else 0, "ygap": 1 if len(shown) <= 60 else 0,
            "hovertemplate": "step %{y} copied from chunk %{x}: %{z:.0f}<extra></extra>", "yaxis": "y2",
            "meta": {"stepOffset": 0}}  # a click on a row is that step
    total = sum(len(o) for _, o in found)
    headline = "<br>".join([
        *wrapped(f"Lookup: {total} accepted token(s) copied, from {sum(c > 0 for c in counts)} of {n} chunks",
                 LINE_PX, TITLE_SIZE),
        small(wrapped(_copy_headline(latest, total, sequence, prompt_len, decode), LINE_PX, 12)),
    ])
    first_output = math.ceil(prompt_len / chunk_size)
    height, top = frame(headline, len(shown), 1)
    return {"data": [strip, heat], "layout": _layout(events, headline, height, top, width, columns, len(shown), chunk_size,
                                                     [r[0] for r in shown], _copied_outline(latest, chunk_size, width),
                                                     [], rows_title="step that copied", strip_rows=(1,),
                                                     output_from=first_output if prompt_len and first_output < n else None)}


def _output_marks(output_from: int, boundary: float, last: float, band: tuple[float, float]) -> tuple[dict, dict]:
    """A band (paper y `band`) under the strip's chunks of the model's own output, from chunk `output_from` to x
    `last`, and its label: on the band where the output is the wider part of the sequence, else left of it."""
    shape = {"type": "rect", "name": "output chunks", "xref": "x", "yref": "paper", "x0": output_from - 0.5,
             "x1": last, "y0": band[0], "y1": band[1], "fillcolor": OUTPUT_BAND,
             "line": {"color": OUTPUT_BAND, "width": 0}}
    on_band = last - boundary >= boundary
    note = {"text": "the model's own output ▸", "xref": "x", "yref": "paper", "x": output_from - 0.5,
            "y": sum(band) / 2, "xanchor": "left" if on_band else "right", "xshift": 4 if on_band else -4,
            "yanchor": "middle", "showarrow": False, "font": {"size": 10, "color": "white" if on_band else OUTPUT_BAND}}
    return shape, note


def _layout(events: Sequence[Event], headline: str, height: int, top: int, width: int, columns: list[int],
            n_rows: int, chunk_size: int, row_ticks: list[int], shapes: list[dict], annotations: list[dict],
            rows_title: str, strip_rows: tuple[int, ...], right: float = 0.5, output_from: int | None = None) -> dict:
    """The panel's layout, `height` pixels tall with `top` over the plots (`frame`): the strip rows (0: CMR's chunks,
    1: lookup's copies) over the history heatmap; from chunk `output_from` on, the chunks are the model's own output."""
    prompt_len = len(prompt_ids(events))
    seq_len = prompt_len + len(new_tokens(events))
    plot = height - top - MARGIN_B
    strip_share = STRIP_PX * len(strip_rows) / plot
    gap = GAP / plot
    if 0 < prompt_len < seq_len:
        boundary = prompt_len / max(chunk_size, 1) - 0.5
        shapes = shapes + [{"type": "line", "xref": "x", "yref": "paper", "x0": boundary, "x1": boundary, "y0": 0,
                            "y1": 1, "line": {"color": "#52606d", "width": 1, "dash": "dot"}}]
        if output_from is not None:
            band = (1 - strip_share - gap + 4 / plot, 1 - strip_share - 4 / plot)  # in the gap
            shape, note = _output_marks(output_from, boundary, columns[-1] + width / 2, band)
            shapes, annotations = shapes + [shape], annotations + [note]
    if len(strip_rows) > 1:  # name the two rows at their left
        annotations = annotations + [{"text": name, "xref": "x", "yref": "y", "x": -1.0 * width, "y": row,
                                      "xanchor": "right", "showarrow": False, "font": {"size": 10, "color": "#52606d"}}
                                     for row, name in ((0, "CMR"), (1, "copied"))]
    return base_layout(
        height,
        title=title(headline, height),
        margin={"l": 56, "r": 16, "t": top, "b": MARGIN_B},
        xaxis={"title": {"text": "chunk of the sequence (the prompt, then the output)"},
               "range": [-2.2 * width, columns[-1] + right * width], "anchor": "y2", "zeroline": False, "showgrid": False},
        yaxis={"domain": [1 - strip_share, 1.0], "visible": False, "range": [min(strip_rows) - 0.5, max(strip_rows) + 0.5],
               "fixedrange": True},
        yaxis2={"domain": [0.0, 1 - strip_share - gap], "title": {"text": rows_title}, "autorange": "reversed",
                "anchor": "x", "zeroline": False, "showgrid": False,
                **({"tickmode": "array", "tickvals": row_ticks} if n_rows <= 8 else {})},
        shapes=shapes,
        annotations=annotations,
    )


def retrieval_spec(events: Sequence[Event], decode: Decode, mark: tuple[str, tuple[int, int]] | None = None,
                   height: int | None = None) -> Spec:
    """The retrieval panel for one run (its Retrieved events), as a Plotly figure dict.

    `mark` = (name, token span) flags a passage (the needle) above the chunks that hold it. When a lookup's
    copies were accepted, a second strip row shows which chunks they came from; lookup drafting alone, which
    retrieves nothing, gets `lookup_spec`.
    """
    retrievals = of(events, Retrieved)
    if not retrievals:
        method = method_of(events)
        if copies(events):
            return lookup_spec(events, decode)
        if method == "lookup":
            return message_spec(none_yet(events, "copy", "waiting for the first copy: lookup proposes what followed "
                                                         "earlier occurrences of the newest words"))
        if method in ("autoregressive", "speculative"):
            why = "this method keeps the full prefix in the draft cache: there is no retrieval to show"
            if method == "autoregressive":
                why = "the target alone uses no draft: there is no retrieval to show"
            return message_spec(why)
        return message_spec(none_yet(events, "retrieval", "waiting for the first retrieval (it comes right after prefill)"))

    latest = retrievals[-1]
    grid = chunk_grid(latest)
    n = len(grid)  # the sequence only grows: the latest retrieval has the most chunks
    width = max(1, math.ceil(n / MAX_COLUMNS))  # chunks per column
    columns = list(range(0, n, width))
    sequence = list(prompt_ids(events)) + new_tokens(events)
    prompt_len = len(prompt_ids(events))
    output_from = _first_output_chunk(grid, prompt_len)

    scores: list[float | None] = list(latest.scores) if latest.scores else [None] * n
    top = max((s for s in scores if s is not None), default=0.0) or 1.0
    kept = set(kept_chunks(latest))
    far = set(far_chunks(latest))
    from_output = output_chunks(latest, prompt_len)
    limit = _text_limit(len(columns))
    texts = []
    for i in columns:
        s, e = grid[i]
        where = "output" if s >= prompt_len else "document"
        score = "" if scores[i] is None else f" · score {scores[i]:.4f}"
        held = " · <b>in working cache</b>" if i in kept else ""
        held += " · <b>reaches back</b> (a recency window would not hold it)" if i in far else ""
        texts.append(f"chunk {i} ({where} tokens {s}–{e}){score}{held}<br>{hover_text(decode(sequence[s:e]), limit=limit)}")

    strip_z = [None if s is None else math.sqrt(max(s, 0.0) / top) for s in scores]  # sqrt: attention is heavy-tailed
    if latest.policy == "streaming" or not latest.scores:
        strip_z = [1.0 if i in kept else 0.0 for i in range(n)]
    strip = {
        "type": "heatmap",
        "x": columns,
        "y": [0],
        "z": [_binned(strip_z, width)],
        "text": [texts],
        "hovertemplate": "%{text}<extra></extra>",
        "colorscale": [[0.0, "#f1f5f9"], [1.0, "#f4a261"]],
        "zmin": 0.0,
        "zmax": 1.0,
        "showscale": False,
        "xgap": 1 if n <= 120 else 0,
        "yaxis": "y",
    }

    shown = retrievals[-_rows_that_fit(len(columns)):]
    rows = [list(_held_row(r, n, width)) for r in shown]  # (retrieval shown, column)
    heat = {
        "type": "heatmap",
        "x": columns,
        "y": [r.step for r in shown],
        "z": rows,
        "colorscale": [[0.0, "#e9eef3"], [0.5, SELECTED], [1.0, FAR]],
        "zmin": 0.0,
        "zmax": 2.0,
        "showscale": False,
        "xgap": 1 if n <= 120 else 0,
        "ygap": 1 if len(shown) <= 60 else 0,
        "hovertemplate": "after step %{y}, chunk %{x}: %{z:.0f} (1 = in working cache, 2 = reached back)<extra></extra>",
        "yaxis": "y2",
        "meta": NEXT_STEP,
    }
    tails = _output_tails(events, [r.step for r in shown])
    said = {  # a mark left of each row: hover it to read what the output said by then
        "type": "scatter", "mode": "markers", "x": [-1.5 * width] * len(shown), "y": [r.step for r in shown],
        "yaxis": "y2", "marker": {"symbol": "triangle-right", "size": 8, "color": "#52606d"},
        "hovertext": [f"output after step {r.step}: …{hover_text(decode(tails[r.step]), limit=120)}" for r in shown],
        "hoverinfo": "text", "meta": NEXT_STEP,
    }
    found = copies(events)
    added, dropped = changed(latest, retrievals[-2] if len(retrievals) > 1 else None)
    of_output = f", {len(from_output)} of them from the output" if output_from is not None else ""
    if latest.scores:
        # the attention sink (chunk 0) always scores high and is always kept: name the best chunk after it
        best = max(range(min(1, n - 1), n), key=lambda i: latest.scores[i] if i < len(latest.scores) else -1.0)
        s, e = grid[best]
        snippet = clipped(decode(sequence[s:e]), limit=40 if height else 64)  # the needle tab's panels set a height
        signal = f" ({latest.signal} signal)" if latest.signal else ""
        moved = f", +{len(added)} / −{len(dropped)} since step {retrievals[-2].step}" if len(retrievals) > 1 else ""
        lines = [*ending_in_colour(f"Retrieval after step {latest.step}{signal}: {len(kept)} of {n} chunks in the "
                                   f"draft's working cache{of_output},", f"{len(far)} reaching back", FAR, LINE_PX,
                                   TITLE_SIZE),
                 small(wrapped(f"{latest.working_cache_len} tokens{moved} · after the sink, the signal scores chunk "
                               f"{best} highest: “{snippet}”", LINE_PX, 12))]
    else:
        lines = [*wrapped(f"StreamingLLM window after step {latest.step}: {latest.working_cache_len} tokens "
                          f"({len(kept)} of {n} chunks{of_output})", LINE_PX, TITLE_SIZE),
                 small(wrapped("the attention sink plus the most recent tokens, whatever the output is about", LINE_PX,
                               12))]
    if found:  # the latest accepted copy, under CMR's choice
        total = sum(len(o) for _, o in found)
        lines.append(small(wrapped(_copy_headline(found[-1], total, sequence, prompt_len, decode), LINE_PX, 12)))
    headline = "<br>".join(lines)
    strip_rows = (0, 1) if found else (0,)  # lookup's copies, where any were accepted, get a strip row under CMR's
    height, top = frame(headline, len(shown), len(strip_rows), height and height + STRIP_PX * (len(strip_rows) - 1))
    right, data = 0.5, []
    if latest.scores:  # what each retrieval bought: the draft's own tokens accepted per step it drafted
        right = 3.5
        name = draft_name(events)
        bought = {y.step: y for y in retrieval_yield(events)}
        every = _label_every(len(shown), heat_pixels(height, top, len(strip_rows)))
        data.append({"type": "scatter", "mode": "text", "x": [columns[-1] + 2.2 * width] * len(shown),
                     "y": [r.step for r in shown], "yaxis": "y2", "cliponaxis": False, "showlegend": False,
                     "text": [_yield_mark(bought.get(r.step)) if (len(shown) - 1 - i) % every == 0 else ""
                              for i, r in enumerate(shown)],
                     "textfont": {"size": 10, "color": "#52606d"}, "hoverinfo": "text",
                     "hovertext": [_yield_words(bought.get(r.step), r.step, name) for r in shown]})
    data = [strip, heat, said, *data]

    shapes = [
        {"type": "rect", "xref": "x", "yref": "y", "x0": a - 0.5, "x1": b + 0.5, "y0": -0.5, "y1": 0.5,
         "line": {"color": OUTLINE, "width": 2}, "fillcolor": "rgba(0,0,0,0)"}
        for a, b in _runs([c // width * width for c in kept])
    ] + [
        {"type": "rect", "xref": "x", "yref": "y", "x0": a - 0.5, "x1": b + 0.5, "y0": -0.62, "y1": 0.62,
         "line": {"color": FAR, "width": 3}, "fillcolor": "rgba(0,0,0,0)"}
        for a, b in _runs([c // width * width for c in far])
    ]
    annotations = _change_marks(added, dropped, width)
    if latest.scores:
        annotations.append({"text": "draft tokens<br>per step", "xref": "x", "yref": "paper", "x": columns[-1] + 2.2 * width,
                            "y": 1 - 44 / 300, "yanchor": "bottom", "showarrow": False, "font": {"size": 9,
                                                                                                   "color": "#52606d"}})
    if mark is not None:
        name, (a, b) = mark
        size = max(latest.chunk_size, 1)
        first, last = a // size, max(a, b - 1) // size
        shapes.append({"type": "rect", "xref": "x", "yref": "paper", "x0": first - 0.5, "x1": last + 0.5, "y0": 0,
                       "y1": 1, "line": {"color": "#d4a017", "width": 1, "dash": "dot"}, "fillcolor": "rgba(233,196,106,0.3)"})
        annotations.append({"text": f"▼ {html.escape(name)}", "xref": "x", "yref": "paper", "x": (first + last) / 2,
                            "y": 1.0, "yanchor": "bottom", "showarrow": False, "font": {"size": 11, "color": "#9a6700"}})

    if found:  # lookup's copies beside CMR's choice: two kinds of retrieval on one strip
        size = max(latest.chunk_size, 1)
        counts, copy_texts = _copy_row(found, size, n, columns, sequence, decode)
        most = max(counts) or 1
        data.append({**strip, "y": [1], "z": [_binned([c / most for c in counts], width)], "text": [copy_texts],
                     "colorscale": [[0.0, "#f1f5f9"], [1.0, STATUS_COLORS["copied"]]]})
        shapes += _copied_outline(found[-1], size, width)
    layout = _layout(events, headline, height, top, width, columns, len(shown), latest.chunk_size,
                     [r.step for r in shown], shapes, annotations, rows_title="retrieval after step",
                     strip_rows=strip_rows, right=right, output_from=output_from)
    return {"data": data, "layout": layout}


def _yield_mark(y: Yield | None) -> str:
    """The number beside a retrieval's row: the draft's accepted tokens per step it drafted ("–": it drafted in
    none of the steps served; "": no step served yet)."""
    if y is None or not y.served:
        return ""
    return "–" if y.per_step is None else f"{y.per_step:.1f}"


def _yield_words(y: Yield | None, step: int, name: str) -> str:
    """A retrieval's yield in words, for its hover."""
    if y is None or not y.served:
        return f"after the retrieval at step {step}: no step has read this working cache yet"
    if y.per_step is None:
        return (f"after the retrieval at step {step}: the {name} drafted in none of the {y.served} step(s) this working "
                "cache served")
    return (f"after the retrieval at step {step}: the target accepted {y.per_step:.2f} of the {name}'s own tokens per "
            f"step it drafted ({y.drafted} of {y.served} step(s); lookup's copies not counted)")


def far_html(events: Sequence[Event], decode: Decode, limit: int = 6) -> str:
    """The chunks the latest CMR retrieval reached back for (best scored first, with their text), how many of the
    working cache's chunks are the model's own output, and what the retrievals that reached back bought against
    those that did not."""
    retrievals = [r for r in of(events, Retrieved) if r.scores]
    if not retrievals:
        return ""
    latest = retrievals[-1]
    grid = chunk_grid(latest)
    sequence = list(prompt_ids(events)) + new_tokens(events)
    prompt_len = len(prompt_ids(events))
    far = sorted(far_chunks(latest), key=lambda i: -latest.scores[i])
    bought = {y.step: y for y in retrieval_yield(events)}
    reached = [bought[r.step] for r in retrievals if far_chunks(r) and r.step in bought]
    stayed = [bought[r.step] for r in retrievals if not far_chunks(r) and r.step in bought]
    name = draft_name(events)
    lines = [f"<li><b>chunk {i}</b> ({'output ' if grid[i][0] >= prompt_len else ''}tokens {grid[i][0]:,}–{grid[i][1]:,}, "
             f"score {latest.scores[i]:.4f}): "
             f"“{html.escape(hover_text(decode(sequence[grid[i][0]:grid[i][1]]), width=10_000, limit=160))}”</li>"
             for i in far[:limit]]
    more = f"<li>…and {len(far) - limit} more</li>" if len(far) > limit else ""
    head = (f"<b>Reaching back</b> after step {latest.step}: {len(far)} chunk(s) in the draft's working cache that a "
            "recency window of the same size would not hold" if far else
            f"<b>Reaching back</b> after step {latest.step}: none; the working cache is the sink and the newest chunks")
    from_output = output_chunks(latest, prompt_len)
    if from_output:
        head += (f"; {len(from_output)} of the working cache's {len(kept_chunks(latest))} chunks are the model's own "
                 "output")
    notes = []
    copied = tokens_by_source(events)["lookup"]
    if copied:
        notes.append(f"Lookup's {copied} accepted cop{'y' if copied == 1 else 'ies'} (the {name} did not propose "
                     f"{'it' if copied == 1 else 'them'}) {'is' if copied == 1 else 'are'} not counted here.")
    sat_out = sat_out_note(events)
    if sat_out:
        notes.append(f"{sat_out[0].upper()}{sat_out[1:]}.")
    return (f"<div class='se-far'>{head}.<ul>{''.join(lines)}{more}</ul>The {html.escape(name)}'s own tokens the target "
            f"accepted per step it drafted, after retrievals that reached back: {_pooled(reached)}; after those that "
            f"did not: {_pooled(stayed)}.{''.join(' ' + html.escape(n) for n in notes)}</div>")


def _pooled(yields: Sequence[Yield]) -> str:
    """The draft's accepted tokens per step it drafted, pooled over retrievals, with the steps it rests on."""
    drafted = sum(y.drafted for y in yields)
    served = sum(y.served for y in yields)
    if not served:
        return "<b>–</b> (no step read such a working cache)"
    if not drafted:
        return f"<b>–</b> (it drafted in none of the {served} step(s) they served)"
    accepted = sum(y.accepted for y in yields)
    retrievals = sum(y.served > 0 for y in yields)
    return f"<b>{accepted / drafted:.2f}</b> ({retrievals} retrievals; it drafted in {drafted} of {served} steps)"
