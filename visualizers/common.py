"""Shared pieces of the visualizers: colours, the `Decode` signature, trace folds and figure plumbing.

A figure here is a plain dict in Plotly's JSON schema (``{"data": [...], "layout": {...}}``): cheap to
build several times a second and to serialise. ``to_figure`` wraps one as a validated
``plotly.graph_objects.Figure``. Knows events and Plotly; knows nothing of gradio, models or tokenizers
(token text comes in through a ``decode`` callable).
"""

from __future__ import annotations

import html
import math
from functools import lru_cache
from typing import Any, Callable, Iterable, Sequence, TypeVar

import plotly.graph_objects as go

from specextend.events import Drafted, Event, Finished, Prefilled, Started, Verified
from specextend.methods import METHOD_TABLE
from specextend.metrics import sat_out, source_of, step_tokens_by_source

Decode = Callable[[Sequence[int]], str]  # token ids -> text
Spec = dict[str, Any]
E = TypeVar("E")

STATUS_COLORS = {
    "accepted": "#2a9d8f",  # draft token the target agreed with
    "copied": "#7b61ff",  # token a lookup copied from the document (or the output) that the target agreed with
    "rejected": "#e76f51",  # draft token the target refused
    "bonus": "#e9c46a",  # the target's own token ending a step
    "target": "#8d99ae",  # token from the target alone (prefill, autoregressive)
}
# each run's colour and label: the methods' own (specextend.methods), and the needle tab's second CMR run
RUN_STYLES = {m.name: (m.colour, m.label, m.short) for m in METHOD_TABLE} | {
    "specextend_paper": ("#8ecae6", "SpecExtend, the paper's retrieval signal", "SpecExtend (paper's signal)")}
FONT = {"family": "Inter, system-ui, sans-serif", "size": 12, "color": "#1f2933"}


def of(events: Iterable[Event], cls: type[E]) -> list[E]:
    """The events of one type, in order."""
    return [e for e in events if isinstance(e, cls)]


def started(events: Sequence[Event]) -> Started | None:
    """The run's Started event (it comes first, so this reads no further than it)."""
    return next((e for e in events if isinstance(e, Started)), None)


def method_of(events: Sequence[Event]) -> str:
    began = started(events)
    return began.method if began else ""


def draft_name(events: Sequence[Event]) -> str:
    """What proposed the run's draft tokens: "draft model", "EAGLE head" or "EAGLE-3 head"."""
    began = started(events)
    return (began.draft_name if began else "") or "draft model"


def has_draft(events: Sequence[Event]) -> bool:
    """Whether a draft (a draft model or an EAGLE head) proposed in the run (not the target alone, not lookup alone)."""
    began = started(events)
    return began is not None and began.draft_layers > 0


def confidence_floor(events: Sequence[Event]) -> float:
    """The confidence floor the run's draft chain ended at (0: none, or no draft drafted in the run)."""
    began = started(events)
    return float(began.config.get("draft", {}).get("confidence_floor", 0.0)) if has_draft(events) else 0.0


def prompt_ids(events: Sequence[Event]) -> tuple[int, ...]:
    began = started(events)
    return began.prompt_ids if began else ()


def stop_reason(events: Sequence[Event]) -> str:
    """How the run ended (its last Finished event, read from the end), or "running"."""
    finished = next((e for e in reversed(events) if isinstance(e, Finished)), None)
    return finished.stop_reason if finished else "running"


def accepted_kind(drafted: Drafted | None, node: int) -> str:
    """'copied' for an accepted node a lookup proposed (alone or with the draft model), else 'accepted'."""
    return "copied" if source_of(drafted, node) != "draft" else "accepted"


def by_source_html(events: Sequence[Event]) -> str:
    """A run's tokens per step by who proposed them (the draft, lookup, both, the target), to go under its total in
    a table ("" for the target alone)."""
    if not (has_draft(events) or lookup_on(events)):
        return ""
    split = step_tokens_by_source(events)
    parts = [f"{html.escape(draft_name(events))} {split['draft']:.2f}"] if has_draft(events) else []
    parts += [f"lookup {split['lookup']:.2f}"] if lookup_on(events) else []
    parts += [f"both {split['both']:.2f}"] if split["both"] else []
    parts.append(f"target {split['target']:.2f}")
    return f"<div class='se-muted'>{' · '.join(parts)}</div>"


def gate_reason(events: Sequence[Event], drafted: Drafted) -> str:
    """Why the gate kept the draft out at this step: its recent accepted tokens per use against the threshold."""
    began = started(events)
    lookup = (began.config.get("lookup") if began else None) or {}
    gate = lookup.get("draft_gate") if isinstance(lookup, dict) else None
    recent = drafted.recent
    got = (f"its last {len(recent)} uses got {', '.join(map(str, recent))} token(s) accepted, "
           f"{sum(recent) / len(recent):.2f} per use" if recent else "its recent uses got too few tokens accepted")
    return f"{got}, below the gate of {gate:g}" if isinstance(gate, (int, float)) else got


def sat_out_note(events: Sequence[Event]) -> str:
    """In words, the steps in which the draft proposed nothing beside lookup, and why ("" when there were none)."""
    counts = sat_out(events)
    steps = len(of(events, Verified))
    name = draft_name(events)
    parts = []
    if counts["gate"]:
        latest = [d for d in of(events, Drafted) if d.sat_out == "gate"][-1]
        parts.append(f"the {name} sat out {counts['gate']} of {steps} steps, gated off for not paying (at step "
                     f"{latest.step}: {gate_reason(events, latest)})")
    if counts["on_miss"]:
        parts.append(f"{'it' if parts else f'the {name}'} was not asked in {counts['on_miss']} steps where lookup "
                     "found a continuation")
    return "; ".join(parts)


def segments(events: Sequence[Event]) -> list[tuple[str, tuple[int, ...], int]]:
    """The generated tokens as runs ``(source, token ids, step)``, source 'target', 'accepted', 'copied' or 'bonus'.

    The prefill's first token is the target's; each step commits its accepted draft tokens (a run per
    kind: the draft model's guesses, 'accepted', or a lookup's copies, 'copied'), then the bonus token
    (either may be cut short at the token limit or EOS). Autoregressive steps commit one target token
    each, reported as 'target'.
    """
    out: list[tuple[str, tuple[int, ...], int]] = []
    for p in of(events, Prefilled):
        out.append(("target", (p.first_token,), -1))
    autoregressive = method_of(events) == "autoregressive"
    trees = {d.step: d for d in of(events, Drafted)}
    for v in of(events, Verified):
        drafted, rest = v.committed[: v.num_accepted], v.committed[v.num_accepted :]
        for token, node in zip(drafted, v.accepted_nodes):
            kind = accepted_kind(trees.get(v.step), node)
            if out and out[-1][0] == kind and out[-1][2] == v.step:
                out[-1] = (kind, out[-1][1] + (token,), v.step)
            else:
                out.append((kind, (token,), v.step))
        if rest:
            out.append(("target" if autoregressive else "bonus", tuple(rest), v.step))
    return out


def proposed_by(events: Sequence[Event], d: Drafted, nodes: Sequence[int] | None = None) -> str:
    """Who proposed a step's tree (or these `nodes` of it): the draft, lookup, or both."""
    sources = {source_of(d, n) for n in (range(len(d.tokens)) if nodes is None else nodes)}
    draft = bool(sources & {"draft", "both"})
    copied = bool(sources & {"lookup", "both"})
    name = f"the {draft_name(events)}"
    return f"{name} and lookup" if draft and copied else "lookup" if copied else name


def guessed_nodes(drafted: Drafted | None, verified: Verified) -> tuple[int, ...]:
    """The tree's continuation past what the target kept (the draft's or a lookup's guess): from the last accepted
    node, the first child at each depth (a chain's rejected tail; a tree's first branch), as node indices."""
    if drafted is None:
        return ()
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(drafted.parents):
        children.setdefault(parent, []).append(node)
    node, out = (verified.accepted_nodes[-1] if verified.accepted_nodes else -1), []
    while children.get(node):
        node = children[node][0]
        out.append(node)
    return tuple(out)


def label(method: str) -> str:
    return RUN_STYLES[method][1] if method in RUN_STYLES else method


def short_label(method: str) -> str:
    return RUN_STYLES[method][2] if method in RUN_STYLES else method


def lookup_on(events: Sequence[Event]) -> bool:
    """Whether lookup drafted in the run: lookup alone, or lookup branches added to a draft-model method."""
    began = started(events)
    if began is None:
        return False
    lookup = began.config.get("lookup")
    return began.method == "lookup" or bool(isinstance(lookup, dict) and lookup.get("enabled"))


def with_lookup(events: Sequence[Event], name: str) -> str:
    """A run's name, marked when lookup branches were added to a draft-model method."""
    return f"{name} + lookup" if lookup_on(events) and method_of(events) != "lookup" else name


STOP_REASONS = {"max_new_tokens": "reached the token limit", "eos": "finished its answer", "stopped": "stopped",
                "error": "failed", "running": "running"}


def ending(events: Sequence[Event]) -> str:
    """How a run ended, in words."""
    reason = stop_reason(events)
    return STOP_REASONS.get(reason, reason)


def none_yet(events: Sequence[Event], what: str, waiting: str) -> str:
    """Why a run shows no `what` yet: `waiting` (what it waits for) while it goes; once it has ended without one, how:
    "stopped before the first step", or "the run ended (reached the token limit) before the first step"."""
    reason = stop_reason(events)
    if reason == "running":
        return waiting
    if reason == "stopped":
        return f"stopped before the first {what}"
    return f"the run ended ({ending(events)}) before the first {what}"


def color(method: str) -> str:
    return RUN_STYLES[method][0] if method in RUN_STYLES else "#444444"


def clipped(text: str, limit: int) -> str:
    """Plain text on one line (each run of whitespace one space), cut with an ellipsis past `limit` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


@lru_cache(maxsize=8192)
def hover_text(text: str, width: int = 64, limit: int = 280) -> str:
    """Escape text for a Plotly hover label and wrap it into lines of about ``width`` characters."""
    lines, line = [], ""
    for word in clipped(text, limit).split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    lines.append(line)
    return "<br>".join(html.escape(x, quote=False) for x in lines)  # Plotly shows &quot; literally


def base_layout(height: int, **changes: Any) -> dict[str, Any]:
    """The layout every panel starts from: no template, compact margins, zoom kept across updates."""
    layout: dict[str, Any] = {
        "height": height,
        "margin": {"l": 56, "r": 16, "t": 36, "b": 40},
        "font": FONT,
        "paper_bgcolor": "white",
        "plot_bgcolor": "#f7f9fb",
        "uirevision": "keep",
        "showlegend": False,
        "hoverlabel": {"align": "left"},
    }
    layout.update(changes)
    return layout


def thinned(points: Sequence[E], most: int) -> list[E]:
    """At most `most` of the points (`most` >= 2): every k-th from the first, and the last, so a curve of thousands of
    steps draws at a bounded size with its ends exact."""
    if len(points) <= most:
        return list(points)
    k = math.ceil((len(points) - 1) / (most - 1))
    return [*points[:-1:k], points[-1]]


# Text is laid out for the narrowest figure the Studio draws (its plot column in a 1,280-pixel window); wider ones
# only gain room. Widths are estimated from the font size: plotly measures text only in the browser.
REFERENCE_WIDTH = 800  # pixels
CHAR_EM = 0.56  # a character's width in em, a little over what the panels' sans-serif fonts take (DejaVu Sans: 0.52)
LINE_EM = 1.3  # plotly's line spacing, in em of the text's base font
TITLE_SIZE = 14
TITLE_PAD = 8  # pixels between the title and the figure's left and top edges


def fits(px: float, size: float) -> int:
    """How many characters of text at font `size` fit in `px` pixels."""
    return max(1, int(px / (CHAR_EM * size)))


def wrapped(text: str, px: float, size: float, limit: int = 10_000) -> list[str]:
    """Plain text (cut with an ellipsis past `limit` characters) escaped and broken at spaces into lines that fit `px`
    pixels at font `size`."""
    return hover_text(text, width=fits(px, size), limit=limit).split("<br>")


def small(lines: Sequence[str]) -> str:
    """Title lines (escaped HTML) in the 12-pixel font of a headline's second lines, each line its own span."""
    return "<br>".join(f"<span style='font-size:12px'>{line}</span>" for line in lines)


def ending_in_colour(text: str, phrase: str, colour: str, px: float, size: float) -> list[str]:
    """Plain `text`, then `phrase` in `colour`, as escaped title lines that fit `px` pixels at font `size`: the phrase
    kept whole in its span, on the last line of the text where it fits there, else on a line of its own."""
    lines = wrapped(text, px, size)
    end = f"<span style='color:{colour}'>{html.escape(phrase, quote=False)}</span>"
    if len(html.unescape(lines[-1])) + 1 + len(phrase) <= fits(px, size):
        return [*lines[:-1], f"{lines[-1]} {end}"]
    return [*lines, end]


def title(text: str, height: int) -> dict[str, Any]:
    """A panel's title in a figure `height` pixels tall, hung from its top left corner: `title_height(text)` pixels.
    Plotly sets a title of several lines by its first line alone and runs the others below it, whatever its yanchor,
    so the first line's foot is placed (TITLE_PAD + TITLE_SIZE pixels down) and the block grows down from there."""
    return {"text": text, "x": 0.0, "xanchor": "left", "y": 1 - (TITLE_PAD + TITLE_SIZE) / height, "yref": "container",
            "yanchor": "bottom", "pad": {"l": TITLE_PAD}, "font": {"size": TITLE_SIZE}}


def title_height(text: str) -> int:
    """Pixels a `title` of this text takes from the figure's top edge: its first line's foot, a line's spacing (of the
    title's font, whatever size a line's own span sets) per further line, then room for descenders and a gap."""
    return math.ceil(TITLE_PAD + TITLE_SIZE + text.count("<br>") * LINE_EM * TITLE_SIZE + 10)


def message_spec(text: str, height: int = 220) -> Spec:
    """An empty panel carrying a sentence that says why it is empty."""
    layout = base_layout(
        height,
        xaxis={"visible": False},
        yaxis={"visible": False},
        annotations=[{"text": html.escape(text), "showarrow": False, "xref": "paper", "yref": "paper",
                      "x": 0.5, "y": 0.5, "font": {"size": 14, "color": "#52606d"}}],
    )
    layout["plot_bgcolor"] = "white"
    return {"data": [], "layout": layout}


def to_figure(spec: Spec) -> go.Figure:
    """A figure dict as a validated Plotly Figure (raises ValueError on a malformed spec)."""
    return go.Figure(spec)
