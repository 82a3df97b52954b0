"""Trace files: a finished click's runs exported as JSON with the text of every token they mention, so
that it replays with no model or tokenizer loaded. Also reads a plain engine trace (a list of events).
A trace is untrusted input: it is checked whole (types, ranges, structure) before anything replays.
Knows events; knows nothing of gradio or models.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from specextend import events as ev
from specextend.config import METHODS, NUMERICS
from specextend.events import Drafted, Event, Started, Verified

FORMAT = "specextend-studio-trace/1"


class TraceError(ValueError):
    """A file that is not a trace this app can replay, with a message for the user."""


def token_ids(runs: Mapping[str, Sequence[Event]]) -> set[int]:
    """Every token id the runs mention (prompts, drafts, commits)."""
    return {t for events in runs.values() for e in events for ids in event_token_ids(e) for t in ids}


def event_token_ids(e: Event) -> tuple[tuple[int, ...], ...]:
    """The token ids one event carries, as the tuples it holds them in."""
    if isinstance(e, Started):
        return (e.prompt_ids,)
    if isinstance(e, Drafted):
        return (e.tokens,)
    if isinstance(e, Verified):
        return (e.committed, (e.bonus_token,))
    if isinstance(e, ev.Prefilled):
        return ((e.first_token,),)
    if isinstance(e, ev.Finished):
        return (e.token_ids,)
    return ()


def dumps(runs: Mapping[str, Sequence[Event]], decode, meta: Mapping[str, Any]) -> str:
    return json.dumps({
        "format": FORMAT,
        "meta": dict(meta),
        "runs": {m: [ev.to_dict(e) for e in events] for m, events in runs.items()},
        "tokens": {str(i): decode([i]) for i in sorted(token_ids(runs))},
    })


class TableCodec:
    """Decodes ids from a trace's token table; ids it lacks show as ⟨id⟩."""

    eos_ids: tuple[int, ...] = ()

    def __init__(self, table: Mapping[int, str]) -> None:
        self.table = dict(table)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.table.get(i, f"⟨{i}⟩") for i in ids)

    text = decode  # the table keeps each token's text as recorded, special tokens included


MAX_TOKEN_ID = 2**31 - 1  # larger than any vocabulary
MAX_RUN_S = 86_400.0  # a run's clock reads at most a day: later times are not a recorded run's (replay waits on them)
TIME_SLACK_S = 1e-3  # a phase's time and the clock are read a moment apart
MAX_LOAD = 1_000.0  # the largest load per core a recorded machine_load may say
MAX_META_CHARS = 300  # the longest meta text shown on the page (the pair's label, the date it was recorded)


def loads(text: str, max_new_tokens: int | None = None) -> tuple[dict[str, list[Event]], TableCodec, dict[str, Any]]:
    """(runs by method, a codec for their tokens, meta) from a studio trace or a plain engine trace. Everything
    is checked before anything is replayed: types and ranges per field (events.from_dict), then each run's
    structure and times (`check_run`), the recorded machine's load and the texts the page shows in meta, and, given
    the server's `max_new_tokens`, that no run asked for or wrote more (`check_limits`); the first problem is a
    TraceError that says where it is."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise TraceError("the file is nested too deeply to be a trace") from None
    except ValueError as exc:
        raise TraceError(f"not a JSON file: {exc}") from None
    try:
        if isinstance(data, list):
            events = [event(d, i) for i, d in enumerate(data)]
            method = next((e.method for e in events if isinstance(e, Started)), "")
            if not method:
                raise TraceError("the trace has no Started event, so its method is unknown")
            runs, table, meta = {method: events}, {}, {}
        elif isinstance(data, dict) and data.get("format") == FORMAT:
            runs, table, meta = _studio(data)
        else:
            raise TraceError(f"not a SpecExtend trace (expected a list of events or format {FORMAT!r})")
    except ValueError as exc:
        raise TraceError(str(exc)) from None
    if not runs or not any(runs.values()):
        raise TraceError("the trace holds no events")
    for method, events in runs.items():
        check_run(method, events)
    load = meta.get("machine_load")
    if load is not None and (isinstance(load, bool) or not isinstance(load, (int, float)) or not 0 <= load <= MAX_LOAD):
        raise TraceError(f"'meta.machine_load' should be the recorded machine's load per core, a number from 0 to "
                         f"{MAX_LOAD:,.0f}, got {load!r:.40}")
    for key in ("pair", "recorded"):  # shown on the page while the trace replays
        said = meta.get(key)
        if said is not None and (not isinstance(said, str) or len(said) > MAX_META_CHARS):
            raise TraceError(f"'meta.{key}' should be text of up to {MAX_META_CHARS} characters, got {said!r:.40}")
    if max_new_tokens is not None:
        check_limits(runs, max_new_tokens)
    return runs, TableCodec(table), meta


def check_limits(runs: Mapping[str, Sequence[Event]], max_new_tokens: int) -> None:
    """What this server lets a run do: a run that asked for more new tokens than `max_new_tokens`, or wrote more,
    is not one of its runs (the panels are sized by what a run asked for)."""
    for method, events in runs.items():
        asked = events[0].config.get("max_new_tokens")  # events[0] is the run's Started event (check_run)
        if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or not 1 <= asked <= max_new_tokens):
            raise TraceError(f"the {method} run asked for {asked!r:.30} new tokens, but this server runs from 1 to "
                             f"{max_new_tokens:,} (its operator sets SPECEXTEND_MAX_NEW_TOKENS)")
        wrote = max([len(e.token_ids) for e in events if isinstance(e, ev.Finished)]
                    + [e.total_new for e in events if isinstance(e, Verified)], default=0)
        if wrote > max_new_tokens:
            raise TraceError(f"the {method} run wrote {wrote:,} new tokens, but this server runs at most "
                             f"{max_new_tokens:,} (its operator sets SPECEXTEND_MAX_NEW_TOKENS)")


def _studio(data: dict) -> tuple[dict[str, list[Event]], dict[int, str], dict[str, Any]]:
    runs, tokens, meta = data.get("runs"), data.get("tokens", {}), data.get("meta", {})
    if not isinstance(runs, dict) or not all(isinstance(e, list) for e in runs.values()):
        raise TraceError("'runs' should map each method's name to a list of events")
    if not isinstance(tokens, dict) or not all(isinstance(v, str) for v in tokens.values()):
        raise TraceError("'tokens' should map token ids to their text")
    if not isinstance(meta, dict):
        raise TraceError("'meta' should be an object")
    table = {}
    for key, value in tokens.items():
        if not key.isdigit() or int(key) > MAX_TOKEN_ID:
            raise TraceError(f"'tokens' has the key {key!r:.30}, which is not a token id")
        table[int(key)] = value
    return {m: [event(d, i, m) for i, d in enumerate(events)] for m, events in runs.items()}, table, meta


def event(data: Any, index: int, method: str = "") -> Event:
    try:
        return ev.from_dict(data)
    except ValueError as exc:
        raise TraceError(f"{method + ' ' if method else ''}event {index}: {exc}") from None


def check_run(method: str, events: Sequence[Event]) -> None:
    """The structure the panels rely on: a known method that starts with its Started event; token ids, node
    indices, chunk spans and selections in range; every node list as long as its tree."""
    if method not in METHODS:
        raise TraceError(f"{method!r:.40} is not a method this app runs ({', '.join(METHODS)})")
    if not events or not isinstance(events[0], Started) or events[0].method != method:
        raise TraceError(f"the {method} run should begin with its Started event")
    trees: dict[int, int] = {}  # step -> nodes drafted
    clock = 0.0  # the run's time so far
    for i, e in enumerate(events):
        where = f"{method} event {i} ({type(e).__name__})"
        if isinstance(e, Started) and i:
            raise TraceError(f"{where}: a run starts once")
        if isinstance(e, Started):  # the numerics it ran in are shown (a trace from before them: fp32)
            attention = e.config.get("attention", {})
            if not isinstance(attention, dict) or attention.get("numerics", "fp32") not in NUMERICS:
                raise TraceError(f"{where}: its config's attention.numerics should be one of {', '.join(NUMERICS)}")
        check_times(where, e, clock)
        clock = e.t_s
        for ids in event_token_ids(e):
            if any(not 0 <= t <= MAX_TOKEN_ID for t in ids):
                raise TraceError(f"{where}: token ids must lie in [0, {MAX_TOKEN_ID}]")
        if any(getattr(e, name, 0) < 0 for name in ("step", "position", "prompt_len", "done", "total", "total_new",
                                                    "seq_len", "steps", "working_cache_len")):
            raise TraceError(f"{where}: counts and positions cannot be negative")
        if isinstance(e, Drafted):
            n = len(e.tokens)
            if len(e.parents) != n or len(e.draft_probs) != n or len(e.sources) not in (0, n) or len(e.origins) not in (0, n):
                raise TraceError(f"{where}: tokens, parents, probabilities, sources and origins must be as long as each other")
            if any(not -1 <= p < k for k, p in enumerate(e.parents)):
                raise TraceError(f"{where}: a node's parent must be an earlier node or the root (-1)")
            if any(s not in ev.SOURCES for s in e.sources):
                raise TraceError(f"{where}: sources must be one of {', '.join(ev.SOURCES)}")
            trees[e.step] = n
        elif isinstance(e, Verified):
            n = trees.get(e.step, len(e.accepted))
            if len(e.accepted) != n or any(not 0 <= k < n for k in e.accepted_nodes):
                raise TraceError(f"{where}: the verdict must cover the step's drafted nodes")
            if e.num_accepted != len(e.accepted_nodes):
                raise TraceError(f"{where}: num_accepted must count the accepted nodes")
        elif isinstance(e, ev.Retrieved):
            n = len(e.chunk_spans)
            if not n:
                raise TraceError(f"{where}: a retrieval covers at least one chunk")
            if e.chunk_size < 1 or any(not 0 <= a < b for a, b in (*e.chunk_spans, *e.kept_spans)):
                raise TraceError(f"{where}: chunks need a positive size and spans [start, end) with start < end")
            if len(e.scores) not in (0, n) or any(not 0 <= c < n for c in e.selected):
                raise TraceError(f"{where}: scores and selected chunks must refer to the trace's chunks")


def check_times(where: str, e: Event, clock: float) -> None:
    """Times a recorded run can have: its clock within a day and never going back (`clock`: the event before's), no
    phase negative or longer than the run so far. Replay at recorded pace waits on them, the speed table divides by
    them."""
    if not 0 <= e.t_s <= MAX_RUN_S:
        raise TraceError(f"{where}: its time is {e.t_s:.3g} s, but a recorded run's clock reads from 0 to "
                         f"{MAX_RUN_S:,.0f} s (a day): these are not a recorded run's times")
    if e.t_s < clock:
        raise TraceError(f"{where}: its time, {e.t_s:.3f} s, is earlier than the event before it ({clock:.3f} s): "
                         "a run's clock never goes back")
    phases = {"elapsed_s": e.elapsed_s, **({"target_s": e.target_s, "draft_s": e.draft_s}
                                           if isinstance(e, ev.Prefilled) else {})}
    for name, seconds in phases.items():
        if not 0 <= seconds <= e.t_s + TIME_SLACK_S:
            raise TraceError(f"{where}: {name} is {seconds:.3g} s, but the run had taken {e.t_s:.3f} s by then: "
                             "a phase takes from 0 to the run's time so far")
