"""Metrics: pure folds over a trace (a list of events). No clocks, no models; same answer on replay."""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from .events import SAT_OUT, SOURCES, Drafted, Event, Finished, Prefilled, Retrieved, Started, Verified

PHASES = ("target_prefill", "draft_prefill", "drafting", "verification", "retrieval")
PROPOSERS = {"draft": ("draft", "both"), "lookup": ("lookup", "both")}  # the node sources each proposer's nodes have


@dataclass(frozen=True)
class Summary:
    method: str
    prompt_len: int
    new_tokens: int
    steps: int
    decode_s: float  # from the end of prefill to the last committed token
    total_s: float  # from the start to the last committed token
    decode_tokens_per_s: float
    e2e_tokens_per_s: float
    mean_accepted: float  # mean tokens committed per step (num_accepted + 1)
    acceptance_by_position: tuple[float, ...]  # P(draft node at depth d accepted | drafted at depth d)
    acceptance_by_source: dict[str, tuple[float, ...]]  # the same per proposer (see acceptance_by_source)
    phase_seconds: dict[str, float]
    cmr_overhead_share: float  # retrieval time / decode time
    retrievals: int  # working-cache rebuilds (CMR or streaming), the one after prefill included
    stop_reason: str
    tokens_by_source: dict[str, int]  # generated tokens by who proposed them (see tokens_by_source)

    def figures(self) -> dict:
        """What a run reports (the CLI's JSON line, the benchmark's rows), as plain JSON values."""
        return {"decode_tokens_per_s": self.decode_tokens_per_s, "e2e_tokens_per_s": self.e2e_tokens_per_s,
                "mean_accepted": self.mean_accepted, "acceptance_by_position": list(self.acceptance_by_position),
                "acceptance_by_source": {k: list(v) for k, v in self.acceptance_by_source.items()},
                "phase_seconds": dict(self.phase_seconds), "cmr_overhead_share": self.cmr_overhead_share,
                "steps": self.steps, "retrievals": self.retrievals, "stop_reason": self.stop_reason,
                "tokens_by_source": dict(self.tokens_by_source)}


def _of(events: Iterable[Event], cls: type) -> list:
    return [e for e in events if isinstance(e, cls)]


def node_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each tree node, 1 for children of the root. Parents always precede children."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def steps_with_trees(events: Sequence[Event]) -> Iterator[tuple[Verified, Drafted | None]]:
    """Per step: its Verified and its Drafted (None when it drafted nothing)."""
    trees = {e.step: e for e in _of(events, Drafted)}
    for v in _of(events, Verified):
        yield v, trees.get(v.step)


def acceptance_by_position(events: Sequence[Event]) -> tuple[float, ...]:
    """For each draft depth d: steps whose accepted path reached depth d / steps that drafted depth d."""
    drafted: dict[int, int] = defaultdict(int)
    accepted: dict[int, int] = defaultdict(int)
    for v, tree in steps_with_trees(events):
        if tree is None:
            continue
        for d in set(node_depths(tree.parents)):
            drafted[d] += 1
        for d in range(1, v.num_accepted + 1):
            accepted[d] += 1
    return tuple(accepted[d] / drafted[d] for d in range(1, max(drafted, default=0) + 1))


def node_sources(tree: Drafted) -> tuple[str, ...]:
    """Who proposed each node of a step's tree (one of SOURCES); a trace without sources: the draft, every node."""
    return tree.sources or ("draft",) * len(tree.tokens)


def source_of(tree: Drafted | None, node: int) -> str:
    """Who proposed an accepted node (one of SOURCES): its tree's source, or the draft where the trace says none."""
    return tree.sources[node] if tree is not None and node < len(tree.sources) else "draft"


def drafted_by(tree: Drafted | None, proposer: str) -> bool:
    """Whether `proposer` ("draft" or "lookup") proposed any node of the step's tree."""
    return tree is not None and any(s in PROPOSERS[proposer] for s in node_sources(tree))


def acceptance_by_source(events: Sequence[Event]) -> dict[str, tuple[float, ...]]:
    """`acceptance_by_position` per proposer: for "draft" (the draft model or head) and "lookup", at each depth d,
    steps whose accepted node at depth d was that proposer's / steps where it proposed a node at depth d. A node
    both proposed counts for each. Only proposers that proposed a node are listed."""
    out = {}
    steps = list(steps_with_trees(events))
    for proposer, mine in PROPOSERS.items():
        drafted: dict[int, int] = defaultdict(int)
        accepted: dict[int, int] = defaultdict(int)
        for v, tree in steps:
            if tree is None:
                continue
            for d in {d for d, s in zip(node_depths(tree.parents), node_sources(tree)) if s in mine}:
                drafted[d] += 1
            for d, node in enumerate(v.accepted_nodes, start=1):
                accepted[d] += source_of(tree, node) in mine
        if drafted:
            out[proposer] = tuple(accepted[d] / drafted[d] if drafted[d] else 0.0 for d in range(1, max(drafted) + 1))
    return out


def accepted_steps(events: Sequence[Event]) -> Iterator[tuple[Verified, Drafted | None, tuple[int, ...]]]:
    """Per step: its Verified, its Drafted (None when it drafted nothing), and the accepted nodes that count
    (a step cut at the token limit or EOS keeps only a prefix of its accepted path)."""
    for v, tree in steps_with_trees(events):
        yield v, tree, v.accepted_nodes[: min(v.num_accepted, len(v.committed))]


def tokens_by_source(events: Sequence[Event]) -> dict[str, int]:
    """Generated tokens by origin: accepted draft nodes by their source ("draft", "lookup", "both") and the
    target's own ("target": the first token and every bonus token). The counts add up to the output."""
    out = dict.fromkeys((*SOURCES, "target"), 0)
    out["target"] = len(_of(events, Prefilled))
    for v, tree, accepted in accepted_steps(events):
        for node in accepted:
            out[source_of(tree, node)] += 1
        out["target"] += len(v.committed) - len(accepted)
    return out


def step_tokens_by_source(events: Sequence[Event]) -> dict[str, float]:
    """Tokens per step by who proposed them: each step's accepted draft nodes by source ("draft", "lookup", "both")
    and its bonus token ("target"), averaged over the steps; they add up to Summary.mean_accepted."""
    counts = dict.fromkeys((*SOURCES, "target"), 0)
    steps = list(steps_with_trees(events))
    for v, tree in steps:
        for node in v.accepted_nodes:
            counts[source_of(tree, node)] += 1
        counts["target"] += 1
    return {k: n / len(steps) if steps else 0.0 for k, n in counts.items()}


def sat_out(events: Sequence[Event]) -> dict[str, int]:
    """Steps in which the draft proposed nothing beside lookup, by reason (events.SAT_OUT: "gate", "on_miss")."""
    out = dict.fromkeys(SAT_OUT[1:], 0)
    for d in _of(events, Drafted):
        if d.sat_out in out:
            out[d.sat_out] += 1
    return out


def copies(events: Sequence[Event]) -> list[tuple[int, tuple[int, ...]]]:
    """(step, sequence positions copied from) for every step that committed tokens a lookup proposed."""
    out = []
    for v, tree, accepted in accepted_steps(events):
        origins = tuple(tree.origins[n] for n in accepted if source_of(tree, n) != "draft" and n < len(tree.origins))
        if origins:
            out.append((v.step, origins))
    return out


@dataclass(frozen=True)
class Yield:
    """What one retrieval's working cache bought over the steps it served (until the next retrieval): the draft's
    own accepted tokens (nodes it proposed, alone or with a lookup; a lookup's copies alone never count), the steps
    in which the draft proposed, and the steps served."""

    step: int
    accepted: int
    drafted: int
    served: int

    @property
    def per_step(self) -> float | None:
        """The draft's accepted tokens per step it proposed in; None while it proposed in none."""
        return self.accepted / self.drafted if self.drafted else None


def retrieval_yield(events: Sequence[Event]) -> list[Yield]:
    """Per retrieval, what its working cache bought for the draft (see Yield). Each step is read once: the steps
    served are found by bisection (a long output has thousands of retrievals)."""
    retrieved = [r.step for r in _of(events, Retrieved)]
    steps = list(accepted_steps(events))  # in step order
    numbers = [v.step for v, _, _ in steps]
    out = []
    for i, step in enumerate(retrieved):
        until = bisect_right(numbers, retrieved[i + 1]) if i + 1 < len(retrieved) else len(steps)
        served = [(v, tree) for v, tree, _ in steps[bisect_right(numbers, step):until]]
        drafted = [(v, tree) for v, tree in served if drafted_by(tree, "draft")]
        accepted = sum(source_of(tree, n) in PROPOSERS["draft"] for v, tree in drafted for n in v.accepted_nodes)
        out.append(Yield(step, accepted, len(drafted), len(served)))
    return out


def committed_curve(events: Sequence[Event]) -> list[tuple[float, int]]:
    """(t_s, tokens generated so far) after prefill and after every step: the throughput curve."""
    points = [(e.t_s, 1) for e in _of(events, Prefilled)]
    points += [(v.t_s, v.total_new) for v in _of(events, Verified)]
    return points


@dataclass(frozen=True)
class Window:
    """The steps whose first new token fell in output positions [start, start + size): how many, and what they
    committed (a step is counted whole in the window it starts in)."""

    start: int
    size: int
    steps: int
    tokens: int

    @property
    def per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


def tokens_per_step_by_window(events: Sequence[Event], size: int = 256) -> list[Window]:
    """Tokens committed per step along the output, in windows of `size` output positions: how acceptance moves as
    the output grows (the first token, the prefill's, belongs to no step; windows without a step are left out)."""
    if size < 1:
        raise ValueError(f"a window holds at least one output position, got {size}")
    windows: dict[int, list[int]] = {}
    for v in _of(events, Verified):
        start = (v.total_new - len(v.committed)) // size * size  # where the step's first token landed
        steps_tokens = windows.setdefault(start, [0, 0])
        steps_tokens[0] += 1
        steps_tokens[1] += len(v.committed)
    return [Window(start, size, n, t) for start, (n, t) in sorted(windows.items())]


def phase_seconds(events: Sequence[Event]) -> dict[str, float]:
    out = dict.fromkeys(PHASES, 0.0)
    for e in events:
        if isinstance(e, Prefilled):
            out["target_prefill"] += e.target_s
            out["draft_prefill"] += e.draft_s
        elif isinstance(e, Drafted):
            out["drafting"] += e.elapsed_s
        elif isinstance(e, Verified):
            out["verification"] += e.elapsed_s
        elif isinstance(e, Retrieved):
            out["retrieval"] += e.elapsed_s
    return out


def new_tokens(events: Sequence[Event]) -> list[int]:
    """The generated tokens: the prefill's first token and every step's committed tokens."""
    out = [e.first_token for e in _of(events, Prefilled)]
    for v in _of(events, Verified):
        out.extend(v.committed)
    return out


def summarize(events: Sequence[Event]) -> Summary:
    started = _of(events, Started)
    prefilled = _of(events, Prefilled)
    verified = _of(events, Verified)
    finished = _of(events, Finished)
    generated = len(new_tokens(events))
    last_t = verified[-1].t_s if verified else (prefilled[0].t_s if prefilled else 0.0)
    prefill_end = prefilled[0].t_s if prefilled else 0.0
    # Decode rate counts the tokens committed by steps (the first token belongs to the prefill).
    decode_s = last_t - prefill_end
    decode_tokens = generated - (1 if prefilled else 0)
    phases = phase_seconds(events)
    return Summary(
        method=started[0].method if started else "",
        prompt_len=prefilled[0].prompt_len if prefilled else 0,
        new_tokens=generated,
        steps=len(verified),
        decode_s=decode_s,
        total_s=last_t,
        decode_tokens_per_s=decode_tokens / decode_s if decode_s > 0 else 0.0,
        e2e_tokens_per_s=generated / last_t if last_t > 0 else 0.0,
        mean_accepted=sum(v.num_accepted + 1 for v in verified) / len(verified) if verified else 0.0,
        acceptance_by_position=acceptance_by_position(events),
        acceptance_by_source=acceptance_by_source(events),
        phase_seconds=phases,
        cmr_overhead_share=phases["retrieval"] / decode_s if decode_s > 0 else 0.0,
        retrievals=len(_of(events, Retrieved)),
        stop_reason=finished[-1].stop_reason if finished else "running",
        tokens_by_source=tokens_by_source(events),
    )
