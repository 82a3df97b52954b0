"""Stepping through a finished run: the run as of one step, and that step told in words.

A pure fold over a trace: every panel drawn from `as_of(events, s)` is that panel at step s, so stepping costs no
model and no engine work. Step 0 is the prefill (the target's first token); step s ends with its verification.
A retrieval after step s belongs to step s + 1, whose draft reads it. The last step's state is the whole trace.
Knows events; no gradio, no models.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Sequence

from specextend.events import Drafted, Event, Finished, Prefilled, Retrieved, Verified
from specextend.metrics import committed_curve, source_of

from .common import (
    STATUS_COLORS, Decode, confidence_floor, draft_name, gate_reason, guessed_nodes, lookup_on, method_of, none_yet,
    of, proposed_by, stop_reason,
)
from .retrieval import changed


def last_step(events: Sequence[Event]) -> int:
    """The run's last step (0: none after the prefill)."""
    verified = of(events, Verified)
    return verified[-1].step if verified else 0


def as_of(events: Sequence[Event], step: int) -> list[Event]:
    """The run's events as of the end of `step`: everything before the first event of a later step (a retrieval
    after `step` included, since the next draft reads it); from the last step on, the whole trace."""
    if step >= last_step(events):
        return list(events)
    out = []
    for e in events:
        later = isinstance(e, Finished) or (isinstance(e, Retrieved) and e.step >= step) or (
            isinstance(e, (Drafted, Verified)) and e.step > step)
        if later:
            break
        out.append(e)
    return out


def moment(events: Sequence[Event], step: int) -> tuple[float, int]:
    """(seconds since the request, tokens generated) at the end of `step` (0: the prefill): the last point of the
    throughput curve as of that step."""
    return ([(0.0, 0)] + committed_curve(as_of(events, step)))[-1]


@dataclass(frozen=True)
class StepFocus:
    """What happened at one step: its draft and verdict, the working cache its draft read, and the one before."""

    step: int
    drafted: Drafted | None
    verified: Verified | None
    read: Retrieved | None  # the latest retrieval before this step's draft
    before: Retrieved | None  # the retrieval before that one


def focus(events: Sequence[Event], step: int) -> StepFocus:
    drafted = next((d for d in of(events, Drafted) if d.step == step), None)
    verified = next((v for v in of(events, Verified) if v.step == step), None)
    earlier = [r for r in of(events, Retrieved) if r.step < step]
    return StepFocus(step, drafted, verified, earlier[-1] if earlier else None, earlier[-2] if len(earlier) > 1 else None)


def _quote(decode: Decode, ids: Sequence[int]) -> str:
    return f"“{html.escape(decode(list(ids)))}”" if ids else "nothing"


SITTING_OUT = ("gate", "on_miss")


def _sat_out(events: Sequence[Event], d: Drafted) -> str:
    """Why the draft proposed nothing beside lookup at this step, in words."""
    if d.sat_out == "gate":
        return f"the {draft_name(events)} sat out, gated off for not paying: {gate_reason(events, d)}"
    return f"the {draft_name(events)} was not asked, since lookup had found a continuation"


def _why_nothing(events: Sequence[Event], d: Drafted | None) -> str:
    """Why a step drafted no token: no room before the token limit, lookup found nothing while the draft sat out, or
    the draft was unsure (its confidence floor)."""
    if d is None:
        return "no room was left before the token limit"
    missed = "lookup found no earlier occurrence of the newest tokens"
    if d.sat_out in SITTING_OUT:
        return f"{missed}, and {_sat_out(events, d)}"
    floor = confidence_floor(events)
    unsure = (f"the {draft_name(events)} was unsure of the next token (no token reached its confidence floor of "
              f"{floor:g})") if floor else f"the {draft_name(events)} proposed no token"
    if lookup_on(events):
        return f"{missed}, and {unsure}" if floor else missed
    return unsure



def _by_source(events: Sequence[Event], d: Drafted, accepted: Sequence[int]) -> str:
    """The accepted tokens of a step counted by who proposed them."""
    counts = {s: sum(source_of(d, n) == s for n in accepted) for s in ("draft", "lookup", "both")}
    words = {"draft": f"the {draft_name(events)}'s", "lookup": "copied by lookup", "both": "proposed by both"}
    return ", ".join(f"{n} {words[s]}" for s, n in counts.items() if n)


def step_html(events: Sequence[Event], step: int, decode: Decode) -> str:
    """One step in words: what the draft read and proposed, what the target kept and added."""
    last = last_step(events)
    ended = stop_reason(events) != "running"
    # a run that ended before its first step has no step to count: it says how it ended instead of "Step 0 of 0"
    said = none_yet(events, "step", "")
    head = f"<b>{said[:1].upper()}{said[1:]}</b>" if ended and last == 0 else f"<b>Step {step} of {last}</b>"
    if step <= 0:
        prefilled = of(events, Prefilled)
        if not prefilled:
            during = "it ended during the prefill" if ended else "the run has not finished its prefill"
            return f"<div class='se-step'>{head}: {during}.</div>"
        p = prefilled[0]
        return (f"<div class='se-step'>{head}: the target read the prompt ({p.prompt_len:,} tokens) and wrote the first "
                f"token {_quote(decode, [p.first_token])}.</div>")
    f = focus(events, step)
    if f.verified is None:
        return f"<div class='se-step'>{head}: this run has no step {step}.</div>"
    v = f.verified
    if method_of(events) == "autoregressive":
        return f"<div class='se-step'>{head}: the target alone wrote {_quote(decode, v.committed)}.</div>"
    parts = []
    if f.read is not None:
        added, dropped = changed(f.read, f.before)
        since = f" (+{len(added)} / −{len(dropped)} chunks since the retrieval after step {f.before.step})" if f.before else ""
        parts.append(f"the draft read a working cache of {f.read.working_cache_len:,} tokens, chosen after step "
                     f"{f.read.step}{since}")
    d = f.drafted
    bonus = f"<span style='color:#9a6700'>{_quote(decode, [v.bonus_token])}</span>"
    if d is None or not d.tokens:
        parts.append(f"nothing was drafted ({_why_nothing(events, d)}), so the target wrote {bonus} itself")
    else:
        shape = "a chain" if all(p == i - 1 for i, p in enumerate(d.parents)) else "a tree"
        kept = v.committed[: v.num_accepted]
        by = _by_source(events, d, v.accepted_nodes[: len(kept)])
        verdict = (f"{proposed_by(events, d)} proposed {len(d.tokens)} token(s) as {shape}; the target "
                   + (f"accepted <span style='color:{STATUS_COLORS['accepted']}'>{v.num_accepted}</span>, "
                      f"{_quote(decode, kept)} ({by}), and added its own {bonus}" if kept else f"kept none and wrote {bonus}"))
        guess = guessed_nodes(d, v)
        if guess:
            verdict += (f" where {proposed_by(events, d, guess)} had guessed <s style='color:{STATUS_COLORS['rejected']}'>"
                        f"{_quote(decode, [d.tokens[n] for n in guess])}</s>")
        parts.append(verdict)
        if d.sat_out in SITTING_OUT:
            parts.append(_sat_out(events, d))
    if step == last and any(r.step >= step for r in of(events, Retrieved)):  # ② shows the end of the run
        parts.append("after it, a last retrieval (the one ② shows) chose a working cache no draft read")
    return f"<div class='se-step'>{head}: {'; '.join(parts)}.</div>"
