"""Draft-cache policies and the pure math of Cross-model Retrieval.

A policy decides which committed positions the draft's working cache holds. Three policies share one
interface: `full` (every position: standard speculative decoding), `streaming` (sink tokens + recent
window, as StreamingLLM) and `cmr` (the chunks the retrieval signal scores highest, plus the sink chunk and
the signal's recency reserve of newest chunks). Chunking, scoring and selection are pure functions.
Knows positions and scores; knows nothing of models, caches or kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import RetrievalConfig, RetrievalSignal
from .methods import DraftCache


def chunk_spans(seq_len: int, chunk_size: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of [0, seq_len); the last may be partial."""
    return [(s, min(s + chunk_size, seq_len)) for s in range(0, seq_len, chunk_size)]


def chunk_scores(token_scores: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Mean token score per chunk: (T,) -> (ceil(T / chunk_size),), a partial last chunk averaged over its tokens."""
    seq_len = token_scores.shape[0]
    n_chunks = -(-seq_len // chunk_size)
    if n_chunks == 0:
        return torch.zeros(0)
    padded = torch.zeros(n_chunks * chunk_size, dtype=torch.float32)
    padded[:seq_len] = token_scores.float().cpu()
    sums = padded.view(n_chunks, chunk_size).sum(dim=1)
    counts = torch.full((n_chunks,), float(chunk_size))
    counts[-1] = seq_len - (n_chunks - 1) * chunk_size
    return sums / counts


def spread_scores(scores: torch.Tensor, share: float) -> torch.Tensor:
    """Each chunk scores at least `share` of its neighbours' best score: (C,) -> (C,) (share 0: unchanged)."""
    if share == 0.0 or scores.shape[0] < 2:
        return scores
    neighbours = torch.zeros_like(scores)
    neighbours[1:] = scores[:-1]
    neighbours[:-1] = torch.maximum(neighbours[:-1], scores[1:])
    return torch.maximum(scores, share * neighbours)


def select_chunks(scores: torch.Tensor, top_k: int, reserve: int = 1) -> list[int]:
    """The top_k chunks by score, always including the first (attention sink) and the newest `reserve` (at most
    top_k - 1), in order: the rest of the budget goes to the best-scored older chunks."""
    n_chunks = scores.shape[0]
    if n_chunks <= top_k:  # everything fits (also: nothing to choose from)
        return list(range(n_chunks))
    forced = {0, *range(max(1, n_chunks - min(reserve, top_k - 1)), n_chunks)}
    rest = scores.clone()
    rest[list(forced)] = float("-inf")
    best = torch.topk(rest, top_k - len(forced)).indices.tolist()
    return sorted(forced | set(best))


def spans_to_positions(spans: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([torch.arange(s, e) for s, e in spans]) if spans else torch.zeros(0, dtype=torch.long)


def merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Join touching [start, end) spans (input sorted)."""
    merged: list[tuple[int, int]] = []
    for s, e in spans:
        if merged and merged[-1][1] == s:
            merged[-1] = (merged[-1][0], e)
        else:
            merged.append((s, e))
    return merged


@dataclass(frozen=True)
class Selection:
    """What a policy chose: the token spans to keep, and for CMR the chunk scores and ids behind them."""

    kept_spans: tuple[tuple[int, int], ...]
    chunk_spans: tuple[tuple[int, int], ...] = ()
    scores: tuple[float, ...] = ()
    selected: tuple[int, ...] = ()

    @property
    def positions(self) -> torch.Tensor:
        return spans_to_positions(list(self.kept_spans))


class DraftCachePolicy:
    """One interface for every draft-cache policy.

    `prefill_window`: the draft's sliding window during prefill (None: full causal attention).
    `needs_scores`: whether `select` wants the target's attention scores.
    `observe(num_accepted, depth)`: what the latest step accepted of the depth it drafted.
    `due(step, working_len)`: whether the working cache is rebuilt after this step.
    `select(seq_len, token_scores)`: which committed positions [0, seq_len) the working cache holds.
    """

    name = DraftCache.FULL
    prefill_window: int | None = None
    needs_scores = False

    def observe(self, num_accepted: int, depth: int) -> None:
        return None

    def due(self, step: int, working_len: int) -> bool:
        return False

    def select(self, seq_len: int, token_scores: torch.Tensor | None) -> Selection:
        return Selection(kept_spans=((0, seq_len),))


class StreamingPolicy(DraftCachePolicy):
    """StreamingLLM: a few sink tokens plus the most recent window, within the working-cache budget.
    Evicts a chunk at a time: rebuilt once the working cache exceeds the budget by a chunk."""

    name = DraftCache.STREAMING

    def __init__(self, config: RetrievalConfig) -> None:
        self.budget = config.working_cache
        self.slack = config.chunk_size
        self.sink = config.sink_tokens
        self.prefill_window = config.prefill_window

    def due(self, step: int, working_len: int) -> bool:
        return working_len > self.budget + self.slack

    def select(self, seq_len: int, token_scores: torch.Tensor | None) -> Selection:
        if seq_len <= self.budget:
            return Selection(kept_spans=((0, seq_len),))
        recent = self.budget - self.sink
        spans = [(0, self.sink), (seq_len - recent, seq_len)] if self.sink else [(seq_len - recent, seq_len)]
        return Selection(kept_spans=tuple(merge_spans(spans)))


class CMRPolicy(DraftCachePolicy):
    """Cross-model Retrieval: every `retrieve_every` steps keep the top-k chunks by the retrieval signal's scores."""

    name = DraftCache.CMR
    needs_scores = True

    def __init__(self, config: RetrievalConfig) -> None:
        if not isinstance(config.signal, RetrievalSignal):
            raise ValueError(f"CMR needs a resolved retrieval signal, not the name {config.signal!r} (signal.resolve)")
        self.config = config
        self.reserve = config.signal.reserved(config.top_k)
        self.spread = config.signal.spread
        self.prefill_window = config.prefill_window

    def due(self, step: int, working_len: int) -> bool:
        return step % self.config.retrieve_every == 0

    def select(self, seq_len: int, token_scores: torch.Tensor | None) -> Selection:
        size = self.config.chunk_size
        spans = chunk_spans(seq_len, size)
        scores = spread_scores(chunk_scores(token_scores[:seq_len], size), self.spread)
        chosen = select_chunks(scores, self.config.top_k, self.reserve)
        return Selection(
            kept_spans=tuple(merge_spans([spans[i] for i in chosen])),
            chunk_spans=tuple(spans),
            scores=tuple(scores.tolist()),
            selected=tuple(chosen),
        )


class AdaptiveCMRPolicy(CMRPolicy):
    """CMR with an adaptive trigger: retrieve as soon as the acceptance rate over the last
    `acceptance_window` steps falls below `min_acceptance`, and at the latest every 4 x `retrieve_every`
    steps. A draft that keeps agreeing with the target pays for no retrieval."""

    def __init__(self, config: RetrievalConfig) -> None:
        super().__init__(config)
        self.recent: list[float] = []
        self.since = 0  # steps since the last retrieval

    def observe(self, num_accepted: int, depth: int) -> None:
        if depth > 0:
            self.recent = (self.recent + [num_accepted / depth])[-self.config.acceptance_window :]
        self.since += 1

    def due(self, step: int, working_len: int) -> bool:
        full = len(self.recent) == self.config.acceptance_window
        low = full and sum(self.recent) / len(self.recent) < self.config.min_acceptance
        if low or self.since >= 4 * self.config.retrieve_every:
            self.recent, self.since = [], 0
            return True
        return False


def make_policy(name: DraftCache | str, config: RetrievalConfig) -> DraftCachePolicy:
    """The policy of a draft cache (a DraftCache or its name)."""
    try:
        kind = DraftCache(name)
    except ValueError:
        raise ValueError(f"unknown draft-cache policy {name!r}") from None
    if kind is DraftCache.FULL:
        return DraftCachePolicy()
    if kind is DraftCache.STREAMING:
        return StreamingPolicy(config)
    return AdaptiveCMRPolicy(config) if config.trigger == "adaptive" else CMRPolicy(config)
