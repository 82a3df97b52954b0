"""Teaching panels for needle-in-a-haystack: does the draft's cache hold the needle, step by step, and where
in the target do the heads that find it sit?

`needle_spec`: one row per run (CMR's working cache under each retrieval signal, a StreamingLLM window), one
column per retrieval; a cell is the share of the needle's tokens the cache held after that step.
`heads_spec`: the layer x head picture, each head's share of attention on the needle, with the heads each
signal scores with outlined. `answer_html`: each run's answer and what its cache held.
Knows events, token spans and numbers; no gradio, no models.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Mapping, Sequence

from specextend.events import Drafted, Event, Retrieved
from specextend.metrics import PROPOSERS, new_tokens, node_sources, summarize

from .common import (
    STATUS_COLORS, Decode, Spec, base_layout, by_source_html, draft_name, label, message_spec, of, segments, started,
    stop_reason, title,
)

STOPPED = "stopped"  # what a stopped needle run's cells say where it has no answer or figure


def held_share(r: Retrieved, span: tuple[int, int]) -> float:
    """Share of the token span ``[start, end)`` that lies inside the retrieval's kept spans."""
    start, end = span
    if end <= start:
        return 0.0
    inside = sum(max(0, min(end, b) - max(start, a)) for a, b in r.kept_spans)
    return min(1.0, inside / (end - start))


def run_label(method: str, retrievals: Sequence[Retrieved]) -> str:
    """A needle run's name: CMR runs by their retrieval signal, the others by method."""
    signal = next((r.signal for r in retrievals if r.signal), "")
    return f"CMR, {signal} signal" if signal else label(method)


def heads_spec(share: Sequence[Sequence[float]], signals: Mapping[str, Sequence[tuple[int, int]]], rows: int) -> Spec:
    """Layers down, heads across: the share of each head's attention (its last `rows` query rows averaged) on the
    needle's tokens. The heads each signal scores with are outlined, one colour per signal."""
    if not share:
        return message_spec("the layer x head picture needs the real model's attention (not available here)")
    layers, heads = len(share), len(share[0])
    best = max(max(row) for row in share) or 1.0
    heat = {"type": "heatmap", "z": [list(row) for row in share], "x": list(range(heads)), "y": list(range(layers)),
            "zmin": 0.0, "zmax": best, "colorscale": "YlOrRd", "reversescale": True,
            "colorbar": {"title": {"text": "share"}, "thickness": 10},
            "hovertemplate": "layer %{y}, head %{x}: %{z:.1%} of its attention on the needle<extra></extra>"}
    colours = ("#1d3557", "#2a9d8f", "#9b5de5")
    shapes, legend = [], []
    for (name, pairs), colour in zip(signals.items(), colours):
        if len(pairs) == layers * heads:  # a signal of every head: nothing to single out
            legend.append(f"{html.escape(name)}: every head")
            continue
        for layer, head in pairs:
            shapes.append({"type": "rect", "x0": head - 0.45, "x1": head + 0.45, "y0": layer - 0.45, "y1": layer + 0.45,
                           "line": {"color": colour, "width": 2}, "fillcolor": "rgba(0,0,0,0)"})
        legend.append(f"<span style='color:{colour}'>▢ {html.escape(name)}</span>")
    height = max(260, 14 * layers + 120)
    layout = base_layout(
        height,
        title=title(f"Where the target looks for the needle: each head's share of attention on it (last {rows} "
                    f"prompt rows)<br><span style='font-size:12px'>outlined: the heads each signal reads · "
                    + " · ".join(legend) + "</span>", height),
        xaxis={"title": {"text": "head"}, "dtick": 1}, yaxis={"title": {"text": "layer"}, "autorange": "reversed"},
        margin={"l": 48, "r": 16, "t": 64, "b": 40}, shapes=shapes)
    return {"data": [heat], "layout": layout}


def needle_spec(runs: Mapping[str, Sequence[Event]], needle_span: tuple[int, int], prompt_len: int,
                stopped: bool = False) -> Spec:
    """Rows per run, columns per step with a retrieval (of either run): how much of the needle the draft's
    cache held after that step (a run that did not retrieve then still holds its previous selection). `stopped`: the
    click was stopped, so no retrieval is coming."""
    rows = {m: of(ev, Retrieved) for m, ev in runs.items()}
    rows = {m: rs for m, rs in rows.items() if rs}
    if not rows:
        return message_spec(f"{STOPPED} before the first retrieval of any run" if stopped
                            else "waiting for the first retrieval of either run")
    steps = sorted({r.step for rs in rows.values() for r in rs})
    names, z, text = [], [], []
    for method, rs in rows.items():
        # after each step the cache holds what its latest retrieval at or before that step chose
        shares = [next((held_share(r, needle_span) for r in reversed(rs) if r.step <= s), None) for s in steps]
        names.append(run_label(method, rs))
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
    height = 120 + 60 * len(names)
    layout = base_layout(
        height,
        title=title(f"Is the needle (tokens {needle_span[0]}–{needle_span[1]}, {depth:.0%} into the prompt) "
                    "in the draft's cache? green: all of it · red: none", height),
        xaxis={"title": {"text": "after step"}, "type": "category"},
        yaxis={"automargin": True, "autorange": "reversed"},
        margin={"l": 40, "r": 16, "t": 40, "b": 48},
    )
    return {"data": [heat], "layout": layout}


def answer_html(runs: Mapping[str, Sequence[Event]], decode: Decode, expected: str,
                needle_span: tuple[int, int] | None = None) -> str:
    """Each run's answer, whether it contains the expected fact (case-insensitive), how much of the needle its
    cache held after the first retrieval, and how well its draft kept up."""
    rows = []
    for method, events in runs.items():
        if not events:
            continue
        answer = decode(new_tokens(events)).strip()
        s = summarize(events)
        retrievals = of(events, Retrieved)
        right = bool(expected) and expected.lower() in answer.lower()
        ended = stop_reason(events)
        stopped = ended == "stopped"  # a run stopped before its answer: no verdict, and "stopped" where it has no figure
        mark = "✔ right" if right else "…" if ended == "running" else STOPPED if stopped else "✘ does not contain it"
        first = "–" if needle_span is None or not retrievals else f"{held_share(retrievals[0], needle_span):.0%}"
        answer = html.escape(answer) or ("" if stopped else "…")
        if stopped:
            first = first if retrievals else STOPPED
            answer = f"{STOPPED}: {answer}" if answer else STOPPED
        figures = (f"<td>{s.mean_accepted:.2f}{by_source_html(events)}</td><td>{s.decode_tokens_per_s:.1f}</td>"
                   if s.steps or not stopped else f"<td>{STOPPED}</td><td>{STOPPED}</td>")
        verdict = "se-ok" if right else "se-muted" if stopped else "se-bad"
        rows.append(f"<tr><td>{html.escape(run_label(method, retrievals))}</td><td>{answer}</td>"
                    f"<td class='{verdict}'>{mark}</td><td>{first}</td>{figures}</tr>")
    return (f"<p>Expected answer: <b>{html.escape(expected)}</b>. Greedy speculative decoding is exact, so every run "
            "writes the target's own answer; what the draft's cache can change is how many of its guesses the target "
            "accepts, and so the speed (under the table: whether it did in these runs).</p><table class='se-table'>"
            "<thead><tr><th>draft cache</th><th>answer</th>"
            "<th></th><th>needle held after the first retrieval</th><th>tokens per step, by who proposed them</th>"
            "<th>decode tokens/s</th>"
            f"</tr></thead><tbody>{''.join(rows)}</tbody></table>")


@dataclass(frozen=True)
class Guesses:
    """What a needle run's draft guessed, and what of it the target kept."""

    name: str  # the run as the grid names it ("CMR, calibrated signal", "StreamingLLM draft cache")
    per_step: float  # tokens committed per step
    drafted: int  # output tokens the draft proposed and the target accepted (not lookup's copies, not bonus tokens)
    proposals: tuple[tuple[int, ...], ...]  # per step, the tokens the draft proposed (accepted or not)
    value: int  # output tokens the needle's value spans in the answer (0: the answer does not contain it)
    in_value: int  # of those, the ones the draft proposed (the draft read the needle)


def value_positions(events: Sequence[Event], text: Decode, value: str) -> tuple[int, ...]:
    """Output positions (0: the first new token) whose text overlaps the first occurrence of `value` in the run's
    answer, case-insensitive; () when the answer does not contain it."""
    out = new_tokens(events)
    at = text(out).lower().find(value.lower()) if value else -1
    if at < 0:
        return ()
    positions, start = [], 0
    for i in range(len(out)):  # the answer's text grows token by token until the value has been written
        end = len(text(out[: i + 1]))
        if end > at and start < at + len(value):
            positions.append(i)
        if end >= at + len(value):
            break
        start = end
    return tuple(positions)


def draft_positions(events: Sequence[Event]) -> set[int]:
    """Output positions whose token the draft proposed and the target accepted (a lookup's copies and the target's
    own tokens are not the draft's)."""
    out, at = set(), 0
    for kind, ids, _ in segments(events):
        if kind == "accepted":
            out.update(range(at, at + len(ids)))
        at += len(ids)
    return out


def guesses(method: str, events: Sequence[Event], text: Decode, value: str) -> Guesses:
    """A needle run's `Guesses`, `value` being the needle's value (the expected answer)."""
    proposals = tuple(tuple(t for t, s in zip(d.tokens, node_sources(d)) if s in PROPOSERS["draft"])
                      for d in of(events, Drafted))
    inside = value_positions(events, text, value)
    drafted = draft_positions(events)
    return Guesses(run_label(method, of(events, Retrieved)), summarize(events).mean_accepted, len(drafted), proposals,
                   len(inside), len(drafted.intersection(inside)))


PAPER_EFFECT = ("Where the paper's effect is expected: published draft models and EAGLE heads on long inputs (16K "
                "tokens and more) on the GPU presets, where a draft that reads its full cache guesses worse as the "
                "context grows and CMR's working cache keeps its guesses accepted.")


def guesses_html(runs: Mapping[str, Sequence[Event]], text: Decode, value: str, stopped: bool = False) -> str:
    """Whether the draft's guesses changed between the needle runs' draft caches, said from the finished runs: the
    tokens it proposed at each step, the tokens per step the target kept, and whether any draft-proposed token fell
    inside the needle's value; when nothing the target kept changed, why (what the draft reads) and where the
    paper's effect is expected instead. `stopped`: the click was stopped, so the runs are not compared."""
    runs = {m: ev for m, ev in runs.items() if ev}
    if stopped or any(stop_reason(ev) == "stopped" for ev in runs.values()):
        return (f"<p class='se-muted'><b>{STOPPED.capitalize()}</b>: the runs did not all finish, so whether the "
                "draft's guesses changed with its cache is not said.</p>")
    if len(runs) < 2 or any(stop_reason(ev) == "running" for ev in runs.values()):
        return ""
    seen = [guesses(m, ev, text, value) for m, ev in runs.items()]
    draft = draft_name(next(iter(runs.values())))
    rates = ", ".join(f"{g.name} {g.per_step:.2f}" for g in seen)
    kept = ", ".join(f"{g.name} {g.drafted}" for g in seen)
    read = [g for g in seen if g.in_value]
    if read:
        value_words = "; inside the needle's value the target kept the draft's own guesses under " + ", ".join(
            f"{g.name} ({g.in_value} of its {g.value} tokens)" for g in read)
    elif any(g.value for g in seen):
        value_words = ("; no token of the needle's value was the draft's guess under any cache: the target wrote "
                       "each of them itself")
    else:
        value_words = "; no run's answer contains the needle's value"
    same_kept = len({(g.per_step, g.drafted, g.in_value) for g in seen}) == 1
    if not same_kept:
        return (f"<p><b>Did the draft's cache change its guesses?</b> Yes. Tokens per step: {html.escape(rates)}; the "
                f"{html.escape(draft)}'s accepted tokens: {html.escape(kept)}{html.escape(value_words)}.</p>")
    steps = max(len(g.proposals) for g in seen)
    differing = sum(len({g.proposals[i] if i < len(g.proposals) else None for g in seen}) > 1 for i in range(steps))
    proposed = (f"proposed the very same tokens at every one of the {steps} steps" if not differing else
                f"proposed otherwise under one cache than under another at {differing} of {steps} steps, but the "
                "target kept as many of its guesses under each")
    if "head" in draft:
        why = ("An EAGLE head drafts from the target's own hidden states, and those already carry what the target "
               "read of the whole document: the head's own working cache matters little, so which chunks it holds "
               "changes little.")
    else:
        why = ("At this size the draft model does not read the needle back out of its cache: whether its cache held "
               "the needle (the grid above) or not, it guessed the answer no better.")
    answer = "Not in what the target kept." if differing else "Not in these runs."
    return (f"<p><b>Did the draft's cache change its guesses?</b> {answer} The {html.escape(draft)} {proposed}: "
            f"{seen[0].per_step:.2f} tokens per step, {seen[0].drafted} of its guesses kept in all"
            f"{html.escape(value_words)}. {why}</p><p class='se-muted'>{PAPER_EFFECT}</p>")


def describe_signal(signal: Mapping) -> str:
    """A retrieval signal (as a trace records it) in words."""
    if signal.get("heads"):
        layers = sorted({layer for layer, _ in signal["heads"]})
        heads = f"{len(signal['heads'])} heads in layers {', '.join(map(str, layers))}"
    elif signal.get("layers"):
        heads = "every head of layer" + ("s " if len(signal["layers"]) > 1 else " ") + ", ".join(
            "final" if x == -1 else str(x) for x in signal["layers"])
    else:
        heads = "every head of every layer"
    rows = "the last token's row" if signal["rows"] == 1 else f"the rows of the last {signal['rows']} tokens read"
    how = "averaged" if signal["combine"] == "mean" else "each chunk by its best head"
    reserve = "only the newest chunk" if not signal["reserve"] else f"{signal['reserve']:.0%} of the cache"
    return f"{heads}, {rows}, {how}; kept for the newest text: {reserve}"


def signal_html(runs: Mapping[str, Sequence[Event]]) -> str:
    """What each CMR run's retrieval signal reads, from the config its trace recorded."""
    items = []
    for events in runs.values():
        began = started(events)
        signal = began.config.get("retrieval", {}).get("signal") if began else None
        if isinstance(signal, Mapping) and began.config.get("method") == "specextend":
            items.append(f"<li><b>{html.escape(signal['name'])} signal</b>: {html.escape(describe_signal(signal))}</li>")
    return f"<ul class='se-muted'>{''.join(items)}</ul>" if items else ""
