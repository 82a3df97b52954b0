"""Trace files: a finished click's runs exported as JSON with the text of every token they mention, so
that it replays with no model or tokenizer loaded. Also reads a plain engine trace (a list of events).
Knows events; knows nothing of gradio or models.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from specextend import events as ev
from specextend.events import Drafted, Event, Started, Verified

FORMAT = "specextend-studio-trace/1"


class TraceError(ValueError):
    """A file that is not a trace this app can replay, with a message for the user."""


def token_ids(runs: Mapping[str, Sequence[Event]]) -> set[int]:
    """Every token id the runs mention (prompts, drafts, commits)."""
    ids: set[int] = set()
    for events in runs.values():
        for e in events:
            if isinstance(e, Started):
                ids.update(e.prompt_ids)
            elif isinstance(e, Drafted):
                ids.update(e.tokens)
            elif isinstance(e, Verified):
                ids.update(e.committed)
                ids.add(e.bonus_token)
            elif isinstance(e, ev.Prefilled):
                ids.add(e.first_token)
    return ids


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


def loads(text: str) -> tuple[dict[str, list[Event]], TableCodec, dict[str, Any]]:
    """(runs by method, a codec for their tokens, meta) from a studio trace or a plain engine trace."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise TraceError(f"not a JSON file: {exc}") from None
    try:
        if isinstance(data, list):
            events = [ev.from_dict(d) for d in data]
            method = next((e.method for e in events if isinstance(e, Started)), "")
            if not method:
                raise TraceError("the trace has no Started event, so its method is unknown")
            return {method: events}, TableCodec({}), {}
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise TraceError(f"not a SpecExtend trace (expected a list of events or format {FORMAT!r})")
        runs = {str(m): [ev.from_dict(d) for d in events] for m, events in data["runs"].items()}
        table = {int(k): str(v) for k, v in data.get("tokens", {}).items()}
    except (KeyError, TypeError, AttributeError) as exc:
        raise TraceError(f"the trace is malformed ({type(exc).__name__}: {exc})") from None
    if not runs or not any(runs.values()):
        raise TraceError("the trace holds no events")
    return runs, TableCodec(table), dict(data.get("meta", {}))
