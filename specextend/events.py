"""Events: what the engine tells the world, one small frozen dataclass per happening.

Every event carries `t_s` (seconds since the request started, on the engine's clock) and `elapsed_s`
(the time its own phase took). A list of events (a trace) is enough to redraw every panel of the app and
to compute every metric; it serialises to JSON and back with no model loaded. Knows nothing of models,
tokenizers or figures.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Union, get_args, get_origin, get_type_hints


SOURCES = ("draft", "lookup", "both")  # who proposed a draft node: the draft model, a lookup, or both
# why the draft (a draft model or an EAGLE head) proposed nothing in a step where lookup drafted: "" it proposed (or
# the run has no draft), "gate" (its recent uses got fewer accepted tokens than lookup.draft_gate), "on_miss" (lookup
# found a continuation and lookup.with_draft is "on_miss")
SAT_OUT = ("", "gate", "on_miss")


@dataclass(frozen=True)
class Started:
    """The request as the engine understood it."""

    t_s: float
    elapsed_s: float
    method: str
    prompt_ids: tuple[int, ...]
    config: dict[str, Any]  # GenerationConfig as a plain dict
    target_layers: int
    draft_layers: int  # 0 for autoregressive
    device: str
    dtype: str
    draft_name: str = "draft model"  # what proposes: "draft model", "EAGLE head" or "EAGLE-3 head" ("" for none)
    prefill_dtype: str = ""  # the dtype the target read the prompt in ("": in `dtype`, as traces before it say)

    def __post_init__(self) -> None:  # the config as JSON gives it back, so a saved trace loads equal
        object.__setattr__(self, "config", json.loads(json.dumps(self.config)))

    @property
    def numerics(self) -> str:
        """The target's numerics setting the request ran in (a trace from before the setting existed: fp32)."""
        return self.config.get("attention", {}).get("numerics", "fp32")


@dataclass(frozen=True)
class Prefilling:
    """Progress of a long prefill: `done` of `total` prompt tokens read by `model` (target / draft)."""

    t_s: float
    elapsed_s: float
    model: str
    done: int
    total: int


@dataclass(frozen=True)
class Prefilled:
    """Both models have read the prompt. The first token comes from the target's prefill. `shared`: the target's
    prefill was copied from an earlier request on the same prompt (a race); `target_s` is then what that prefill
    took, and the request's clock counts it, so end-to-end figures stay comparable."""

    t_s: float
    elapsed_s: float
    prompt_len: int
    target_s: float
    draft_s: float
    first_token: int
    shared: bool = False


@dataclass(frozen=True)
class Drafted:
    """The draft proposed a tree (a chain is a tree where each node's parent is the one before). Lookup branches
    are part of the same tree; `sources` says who proposed each node, `origins` where a lookup copied it from.
    Beside lookup, `sat_out` says why the draft proposed nothing and `recent` what its last uses got accepted."""

    t_s: float
    elapsed_s: float
    step: int
    position: int  # sequence position of the root (the last committed token)
    tokens: tuple[int, ...]  # one per draft node
    parents: tuple[int, ...]  # parent node index per node; -1 is the root
    draft_probs: tuple[float, ...]  # q of each node's token given its parent (1.0 for a lookup-only node)
    draft_forwards: int  # draft model forward passes this step
    sources: tuple[str, ...] = ()  # per node: "draft" (the draft model), "lookup" or "both"; empty: all "draft"
    origins: tuple[int, ...] = ()  # per node: the sequence position a lookup copied it from, -1 if none
    sat_out: str = ""  # one of SAT_OUT: why the draft proposed nothing this step
    recent: tuple[int, ...] = ()  # the draft's accepted tokens in each of its last uses (what the gate averages)


@dataclass(frozen=True)
class Verified:
    """The target scored the tree in one forward; the longest agreeing path and a bonus token were committed."""

    t_s: float
    elapsed_s: float
    step: int
    position: int  # sequence position of the first committed token of this step
    accepted_nodes: tuple[int, ...]  # draft node indices on the accepted path, root to leaf
    accepted: tuple[bool, ...]  # per draft node: on the accepted path
    num_accepted: int
    bonus_token: int
    committed: tuple[int, ...]  # tokens committed this step (accepted + bonus), cut at the limit or EOS
    total_new: int  # new tokens after this step


@dataclass(frozen=True)
class Retrieved:
    """The draft's working cache was rebuilt: for CMR from the chunks the retrieval signal scored highest."""

    t_s: float
    elapsed_s: float
    step: int  # retrieval after this many steps (0: right after prefill)
    policy: str  # cmr / streaming
    seq_len: int  # committed tokens the chunks cover
    chunk_size: int
    chunk_spans: tuple[tuple[int, int], ...]  # [start, end) per chunk
    scores: tuple[float, ...]  # per chunk; empty for streaming
    selected: tuple[int, ...]  # chunk ids in the working cache, in document order (streaming: ())
    kept_spans: tuple[tuple[int, int], ...]  # token spans [start, end) in the working cache
    working_cache_len: int
    signal: str = ""  # CMR: the retrieval signal's name
    reserved: int = 0  # CMR: how many of the newest chunks were kept whatever their scores (the recency reserve)


@dataclass(frozen=True)
class Finished:
    """The request ended: how, and what it produced."""

    t_s: float
    elapsed_s: float
    token_ids: tuple[int, ...]
    stop_reason: str  # max_new_tokens / eos / stopped / error
    steps: int
    prompt_len: int
    message: str = ""


Event = Union[Started, Prefilling, Prefilled, Drafted, Verified, Retrieved, Finished]
EVENT_TYPES: dict[str, type] = {
    cls.__name__: cls for cls in (Started, Prefilling, Prefilled, Drafted, Verified, Retrieved, Finished)}


def to_dict(event: Event) -> dict[str, Any]:
    return {"type": type(event).__name__, **asdict(event)}


LIMIT = 10**12  # the largest magnitude a number in an event may have (timestamps, ids, counts)
MAX_DEPTH = 12  # the deepest nesting a config may have


def _kind(hint) -> str:
    """A type hint in words, for messages."""
    if hint is float:
        return "a number"
    if hint is int:
        return "a whole number"
    if hint is bool:
        return "true or false"
    if hint is str:
        return "a string"
    if get_origin(hint) is tuple:
        args = get_args(hint)
        inner = args[0] if len(args) == 2 and args[1] is Ellipsis else None
        return f"a list of {_kind(inner)}s" if inner is not None else f"a list of {len(args)} items"
    return "an object"


def _checked(value: Any, hint, where: str, depth: int = 0) -> Any:
    """`value` as the type `hint` wants it (lists become tuples), or a ValueError saying where it is wrong."""
    bad = ValueError(f"{where} should be {_kind(hint)}, got {type(value).__name__} {value!r:.40}")
    if hint is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if hint in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (hint is int and not isinstance(value, int)):
            raise bad
        if not math.isfinite(value) or abs(value) > LIMIT:
            raise ValueError(f"{where} is {value!r:.40}: out of range (at most {LIMIT:.0e} in size)")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise bad
        return value
    if get_origin(hint) is tuple:
        if not isinstance(value, (list, tuple)):
            raise bad
        args = get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_checked(v, args[0], f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
        if len(value) != len(args):
            raise bad
        return tuple(_checked(v, a, f"{where}[{i}]", depth + 1) for i, (v, a) in enumerate(zip(value, args)))
    if not isinstance(value, dict):  # dict[str, Any]: a config, any JSON, bounded in depth
        raise bad
    _bounded(value, where, depth)
    return value


def _bounded(value: Any, where: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ValueError(f"{where} is nested more than {MAX_DEPTH} levels deep")
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for child in children:
        _bounded(child, where, depth + 1)


def from_dict(data: dict[str, Any]) -> Event:
    """An event from its JSON form, every field checked against the event's types (a ValueError names the first
    field that is wrong); fields the event does not have are ignored."""
    if not isinstance(data, dict):
        raise ValueError(f"an event should be an object, got {type(data).__name__}")
    data = dict(data)
    kind = data.pop("type", None)
    cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"{kind!r:.40} is not a kind of event ({', '.join(EVENT_TYPES)})")
    hints = get_type_hints(cls)
    values = {}
    for f in fields(cls):
        if f.name in data:
            values[f.name] = _checked(data[f.name], hints[f.name], f"{kind}.{f.name}")
        elif f.default is MISSING:
            raise ValueError(f"{kind} has no {f.name!r}")
    return cls(**values)


def dumps(events: Iterable[Event]) -> str:
    return json.dumps([to_dict(e) for e in events])


def loads(text: str) -> list[Event]:
    return [from_dict(d) for d in json.loads(text)]


def save_trace(events: Iterable[Event], path: str | Path) -> None:
    Path(path).write_text(dumps(events))


def load_trace(path: str | Path) -> list[Event]:
    return loads(Path(path).read_text())
