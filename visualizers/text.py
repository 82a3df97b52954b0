"""Text panels as HTML: the output with accepted draft tokens (the draft model's, and lookup's copies)
coloured apart from the target's own,
and the exactness check against the target's own greedy output. All text is escaped.
Knows events; no gradio, no models.
"""

from __future__ import annotations

import html
from typing import Sequence

from specextend.events import Event, Finished, Prefilled, Prefilling, Started

from .common import (
    STATUS_COLORS, Decode, draft_name, guessed_nodes, none_yet, of, proposed_by, segments, started, stop_reason,
)
from .steps import focus

LEGEND = (
    "<div class='se-legend'>"
    f"<span style='background:{STATUS_COLORS['accepted']}33;border-bottom:2px solid {STATUS_COLORS['accepted']}'>"
    "draft token the target accepted</span> "
    f"<span style='background:{STATUS_COLORS['copied']}2e;border-bottom:2px solid {STATUS_COLORS['copied']}'>"
    "copied by lookup from the document or the output, then accepted</span> "
    "<span style='border-bottom:2px solid #c9d1d9'>the target's own token</span>"
    "</div>"
)


def _titled(tag: str, css: str, title: str, body: str, style: str = "") -> str:
    """An element whose hover title is `title`, escaped for an attribute (quotes and apostrophes included)."""
    styled = f" style='{html.escape(style, quote=True)}'" if style else ""
    return f"<{tag} class='{css}' title='{html.escape(title, quote=True)}'{styled}>{body}</{tag}>"


def output_html(events: Sequence[Event], decode: Decode, at_step: int | None = None) -> str:
    """The generated text so far; each accepted draft run is highlighted, hover tells its step and who proposed it.
    With `at_step`, that step's tokens are outlined and the draft's guess the target did not keep follows them, struck
    through."""
    name = draft_name(events)
    parts = []
    for source, ids, step in segments(events):
        text = html.escape(decode(list(ids)))
        if at_step is not None and step == (at_step if at_step > 0 else -1):
            text = _titled("span", "se-focus", f"step {max(at_step, 0)}", text)
        if source == "accepted":
            parts.append(_titled("span", "se-draft", f"step {step}: {len(ids)} token(s) the {name} proposed, accepted",
                                 text, f"background:{STATUS_COLORS['accepted']}33"))
        elif source == "copied":
            parts.append(_titled("span", "se-copy", f"step {step}: {len(ids)} token(s) copied by lookup and accepted",
                                 text, f"background:{STATUS_COLORS['copied']}2e"))
        else:
            where = "first token, from the prefill" if step < 0 else f"step {step}: the target's token"
            parts.append(_titled("span", "se-target", where, text))
    if at_step is not None and at_step > 0:
        step = focus(events, at_step)
        guess = guessed_nodes(step.drafted, step.verified) if step.verified else ()
        if guess:
            parts.append(_titled("s", "se-guess", f"step {at_step}: {proposed_by(events, step.drafted, guess)} guessed "
                                 "this; the target wrote the last token of the step instead",
                                 html.escape(decode([step.drafted.tokens[n] for n in guess]))))
    reason = stop_reason(events)
    note = {"running": "…", "stopped": " ■ stopped", "eos": "", "max_new_tokens": " [token limit]"}.get(reason, "")
    if not parts:  # nothing written: what the run waits for, or how it ended without a token (said once)
        parts, note = [f"<i>{html.escape(waiting_for(events))}</i>"], note if reason == "running" else ""
    body = "".join(parts)
    return f"{LEGEND}<div class='se-output'>{body}<span class='se-note'>{html.escape(note)}</span></div>"


def waiting_for(events: Sequence[Event]) -> str:
    """What a run without output is waiting for, in words."""
    reading = of(events, Prefilling)
    if of(events, Finished):
        said = none_yet(events, "token", "")
        if started(events) and not of(events, Prefilled):  # it ended while the prompt was being read
            last = reading[-1] if reading else None
            said += (f", during the prefill (the {last.model} had read {last.done:,} of {last.total:,} prompt tokens)"
                     if last else ", during the prefill")
        return said
    if reading:
        last = reading[-1]
        return (f"waiting for the first token: the {last.model} has read {last.done:,} of {last.total:,} prompt tokens "
                f"({last.elapsed_s:.0f} s so far)")
    began = started(events)
    if began:
        return f"waiting for the first token: the target is reading {len(began.prompt_ids):,} prompt tokens"
    return "waiting for the run to start: the model is loading, or the request waits its turn in the queue"


def first_divergence(ours: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first differing token over the common length; None when one is a prefix of the other."""
    for i, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            return i
    return None


def exactness_html(ours: Sequence[int], reference: Sequence[int], decode: Decode, what: str = "this run",
                   reading: str = "", numerics: str = "") -> str:
    """Compare a run's tokens with the target's own greedy tokens; show the first divergence if any. `reading`
    says what the two continued from (the prompt's reading: `prompt_reading`), `numerics` what they decoded in
    (`run_numerics`)."""
    i = first_divergence(ours, reference)
    n = min(len(ours), len(reference))
    said = f" {html.escape(reading)}" if reading else ""
    decoded = f" ({html.escape(numerics)})" if numerics else ""
    if i is None:
        if len(ours) == len(reference):
            return (f"<div class='se-ok'>✔ Exact: {html.escape(what)} produced the same {n} tokens as the "
                    f"target's own greedy decoding{decoded}.{said}</div>")
        return (f"<div class='se-ok'>✔ Exact over the {n} tokens both produced ({len(ours)} vs "
                f"{len(reference)}: one run ended earlier{'; ' + html.escape(numerics) if numerics else ''}).{said}</div>")
    before = html.escape(decode(list(ours[max(0, i - 24) : i])))
    a = html.escape(decode([ours[i]]))
    b = html.escape(decode([reference[i]]))
    return (
        f"<div class='se-bad'>✘ {html.escape(what)} first differs from the target's greedy output{decoded} at new token "
        f"{i}: …{before}<b style='color:{STATUS_COLORS['rejected']}'>[{a}]</b> where the target wrote "
        f"<b>[{b}]</b>. (Tiny numeric differences between batched and one-token forwards can flip a near-tie.){said}</div>"
    )


def run_numerics(ours: Started | None, reference: Started | None) -> str:
    """The target's numerics setting two runs decoded in, in words: "both in bf16-kv numerics" (a race's runs share
    the pair's), or both settings where they differ (a near-tie may then differ)."""
    if ours is None or reference is None:
        return ""
    if ours.numerics == reference.numerics:
        return f"both in {ours.numerics} numerics"
    return f"in different numerics, {ours.numerics} and {reference.numerics}, so a near-tie may differ"


def prompt_reading(ours: Started | None, reference: Started | None) -> str:
    """What two runs continued from, in words: the dtype each read the prompt in (a race's runs share one reading;
    reading it in bfloat16 can change the target's own answer against a float32 reading, so the line says which)."""
    if ours is None or reference is None:
        return ""
    mine, theirs = ours.prefill_dtype or ours.dtype, reference.prefill_dtype or reference.dtype
    if mine != theirs:
        return f"They read the prompt in different dtypes ({mine} and {theirs}), so a near-tie may differ."
    decoding = f"; decoding in {ours.dtype}" if mine != ours.dtype else ""
    return f"Both continued from a reading of the prompt in {mine}{decoding}."
