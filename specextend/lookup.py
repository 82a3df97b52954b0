"""Lookup drafting: propose what followed earlier occurrences of the newest n-gram. No model, no forward.

The sequence is the prompt plus the committed output. For n from max_ngram down to min_ngram, every earlier
occurrence of the sequence's last n tokens is a match; the up to max_tokens tokens that followed a match
are a continuation. `choose` ranks the matches and keeps up to `branches` continuations with distinct
first tokens, longer n-grams first. `continuations` finds matches by scanning (the reference);
`NgramIndex` keeps them in a dict updated as tokens are committed (what the engine uses); the tests check
the two agree. `replay` runs lookup drafting on a known greedy output, with no model, for offline sweeps.

`LookupDrafter` proposes those continuations as branches of a draft tree; `MergedDrafter` grafts them onto
the draft's tree (`graft`) so the target verifies both in one forward. A lookup proposal is deterministic:
under sampling its q is a point mass (DraftTree.point), which verification handles exactly.
Knows token ids, positions and trees; knows nothing of models, caches or the target.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

import torch

from .config import LookupConfig
from .drafting import Cacheless, DraftTree, PolicyDrafter, token_path
from .retrieval import Selection
from .verification import verify_greedy


@dataclass(frozen=True)
class Continuation:
    """Tokens a lookup proposes, copied from sequence positions [start, start + len(tokens))."""

    tokens: tuple[int, ...]
    start: int


def rank(starts: list[int], following: Callable[[int], int], order: str) -> list[int]:
    """Match starts, best first: latest, earliest, or commonest next token (ties to the latest)."""
    if order == "first":
        return sorted(starts)
    latest = sorted(starts, reverse=True)
    if order == "recent":
        return latest
    counts = Counter(following(s) for s in starts)
    return sorted(latest, key=lambda s: -counts[following(s)])  # stable: the latest first within a count


def choose(seq: Sequence[int], matches: Callable[[int], list[int]], config: LookupConfig, room: int) -> list[Continuation]:
    """Up to config.branches continuations with distinct first tokens, from the longest matching n-gram down.

    `matches(n)`: starts p < len(seq) - n of earlier occurrences of the last n tokens (seq[p:p+n] == seq[-n:]).
    """
    size = min(config.max_tokens, room)
    out: list[Continuation] = []
    firsts: set[int] = set()
    if size < 1:
        return out
    for n in range(min(config.max_ngram, len(seq) - 1), config.min_ngram - 1, -1):
        for start in rank(matches(n), lambda p: seq[p + n], config.rank):
            first = seq[start + n]
            if first in firsts:
                continue
            firsts.add(first)
            out.append(Continuation(tuple(seq[start + n : start + n + size]), start + n))
            if len(out) == config.branches:
                return out
    return out


def continuations(seq: Sequence[int], config: LookupConfig, room: int) -> list[Continuation]:
    """The reference: `choose` over matches found by scanning the whole sequence."""
    seq = list(seq)

    def matches(n: int) -> list[int]:
        suffix = seq[-n:]
        return [p for p in range(len(seq) - n) if seq[p : p + n] == suffix]

    return choose(seq, matches, config, room)


class NgramIndex:
    """Where each n-gram (min_n..max_n tokens) of a growing sequence starts; `extend` adds tokens."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.seq: list[int] = []
        self.starts: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.seq.append(int(token))
            end = len(self.seq)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.starts.setdefault(tuple(self.seq[end - n :]), []).append(end - n)

    def matches(self, n: int) -> list[int]:
        """Starts of earlier occurrences of the last n tokens (the suffix itself is the newest entry)."""
        return self.starts.get(tuple(self.seq[-n:]), [None])[:-1]

    def continuations(self, config: LookupConfig, room: int) -> list[Continuation]:
        return choose(self.seq, self.matches, config, room)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def branch_tree(found: list[Continuation]) -> DraftTree:
    """The continuations as a draft tree (a trie from the root), every node a lookup node."""
    return graft(DraftTree.empty(), [(c.tokens, c.start) for c in found])


def replay(prompt: Sequence[int], output: Sequence[int], config: LookupConfig, max_new_tokens: int | None = None
           ) -> list[tuple[int, int]]:
    """Lookup drafting alone, replayed on a known greedy output: (num_accepted, nodes proposed) per step.
    The engine's `lookup` method on that output, without the target (offline sweeps): the same drafter."""
    limit = max_new_tokens or len(output)
    drafter = LookupDrafter(config)
    drafter.prefill(list(prompt), None)
    drafter.commit(list(output[:1]))
    done, steps = 1, []
    while done < len(output):
        tree = drafter.propose(limit - done - 1, None)
        wanted = [output[done + d] if done + d < len(output) else -1 for d in (0, *tree.depths)]  # per row
        path, _ = verify_greedy(tree.parents, tree.tokens, wanted)
        committed = list(output[done : done + len(path) + 1])
        drafter.commit(committed)
        done += len(committed)
        steps.append((len(path), len(tree.tokens)))
    return steps


def graft(tree: DraftTree, copied: list[tuple[tuple[int, ...], int]]) -> DraftTree:
    """The tree with lookup branches added at the root: `copied` holds (tokens, first copied position) each.

    Branches become a trie placed BEFORE the draft's nodes, so at every node lookup children are tried first
    (verification treats them as point masses); a draft node with the same parent and token as a lookup
    node is that node ("both"), and keeps its q row for its own children.
    """
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    sources: list[str] = []
    origins: list[int] = []
    child: dict[tuple[int, int], int] = {}

    def add(parent: int, token: int, source: str, origin: int, prob: float) -> int:
        node = child.get((parent, token))
        if node is None:
            node = child[(parent, token)] = len(tokens)
            tokens.append(token)
            parents.append(parent)
            probs.append(prob)
            sources.append(source)
            origins.append(origin)
        elif sources[node] != source:
            sources[node], probs[node] = "both", prob
        return node

    for branch, start in copied:
        parent = -1
        for i, token in enumerate(branch):
            parent = add(parent, token, "lookup", start + i, 1.0)
    merged: dict[int, int] = {-1: -1}  # draft node -> node of the grafted tree
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        merged[i] = add(merged[parent], token, "draft", -1, tree.probs[i])
    q = None
    if tree.q is not None:
        q = tree.q.new_zeros(len(tokens) + 1, tree.q.shape[-1])  # (N+1, V)
        q[[m + 1 for m in merged.values()]] = tree.q[[d + 1 for d in merged]]
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return DraftTree(tuple(tokens), tuple(parents), tuple(depths), tuple(probs), q, tree.forwards, tuple(sources),
                     tuple(origins))


class LookupDrafter(Cacheless):
    """Drafts by lookup alone: no draft model, so no draft cache.

    With `config.adaptive`, a branch is at most 2a + 2 tokens long, a being how many tokens of the last
    proposal were committed (up to max_tokens): long runs while copies hold, two tokens after a miss.
    """

    drafts = True

    def __init__(self, config: LookupConfig) -> None:
        self.config = config
        self.index = NgramIndex(config.min_ngram, config.max_ngram)
        self.size = config.max_tokens  # the next branch's length at most
        self.found: list[Continuation] = []  # this step's proposal

    def prefill(self, prompt: list[int], stop) -> Iterator[int]:
        self.index.extend(prompt)
        return iter(())

    def find(self, room: int) -> list[Continuation]:
        self.found = self.index.continuations(self.config, min(room, self.size))
        return self.found

    def propose(self, room: int, generator: torch.Generator | None) -> DraftTree:
        return branch_tree(self.find(room))

    def commit(self, tokens: list[int]) -> None:
        if self.found and self.config.adaptive:
            copied = max(common_prefix(c.tokens, tokens) for c in self.found)
            self.size = min(self.config.max_tokens, 2 * copied + 2)
        self.found = []
        self.index.extend(tokens)


GATE_USES = 4  # the draft model's last uses the gate averages over
GATE_RETRY = 8  # a gated-off draft model is asked again after sitting out this many steps


class MergedDrafter:
    """The draft model's tree with lookup branches grafted on at the root: one tree, one target forward.

    The draft model is asked every step (`with_draft="always"`) or only where lookup found nothing
    (`"on_miss"`), and in either case only while it pays: once its last GATE_USES proposals averaged fewer
    than `draft_gate` accepted tokens, it sits out until GATE_RETRY steps have passed, then is tried again.
    Its working cache still follows every committed token: they wait as pending tokens, fed when it drafts next. A
    retrieval due while it sits out waits for that step too (its store would lack the pending tokens: a working cache
    chosen from a stale sequence, and work for a draft that reads nothing), and comes right after it.
    Each tree says why the draft model sat out (`sat_out`) and what its last uses got accepted (`recent`).
    """

    drafts = True

    def __init__(self, model: PolicyDrafter, lookup: LookupDrafter, config: LookupConfig) -> None:
        self.model, self.lookup, self.config = model, lookup, config
        self.runners = model.runners
        self.features = model.features
        self.gains: deque[int] = deque(maxlen=GATE_USES)  # accepted draft-model tokens per use
        self.idle = 0  # steps sat out since the gate closed
        self._tree: DraftTree | None = None  # this step's tree, when the draft model helped build it
        self.drafted = False  # whether the draft model drafted in the latest step
        self.owed = False  # a retrieval fell due while it sat out

    @property
    def needs_scores(self) -> bool:
        return self.model.needs_scores

    def due(self, step: int, accepted: int = 0, depth: int = 0) -> bool:
        """The draft model's schedule, held back while it sits out (see the class)."""
        wanted = self.model.due(step, accepted, depth)
        if step == 0 or self.drafted:
            wanted, self.owed = wanted or self.owed, False
            return wanted
        self.owed = self.owed or wanted
        return False

    def prefill(self, prompt: list[int], stop) -> Iterator[int]:
        self.lookup.prefill(prompt, stop)
        return self.model.prefill(prompt, stop)

    def sits_out(self, found: bool) -> str:
        """Why the draft model does not draft this step (one of events.SAT_OUT; "" when it drafts)."""
        if found and self.config.with_draft == "on_miss":
            return "on_miss"
        paying = len(self.gains) < GATE_USES or sum(self.gains) / GATE_USES >= self.config.draft_gate
        if paying or self.idle >= GATE_RETRY:
            self.idle = 0
            return ""
        self.idle += 1
        return "gate"

    def propose(self, room: int, generator: torch.Generator | None) -> DraftTree:
        found = self.lookup.find(room)
        recent = tuple(self.gains)
        sat_out = self.sits_out(bool(found))
        tree = graft(DraftTree.empty() if sat_out else self.model.propose(room, generator),
                     [(c.tokens, c.start) for c in found])
        self._tree = None if sat_out else tree
        self.drafted = not sat_out
        return replace(tree, sat_out=sat_out, recent=recent)

    def commit(self, tokens: list[int]) -> None:
        # how many committed tokens the draft model proposed (alone or with a lookup), where it proposed any: a chain
        # it ended before its first token (its confidence floor) cost no verified row and says nothing of its pay
        if self._tree is not None and any(s != "lookup" for s in self._tree.sources):
            path = token_path(self._tree.parents, self._tree.tokens, tokens)
            self.gains.append(sum(self._tree.sources[n] != "lookup" for n in path))
            self._tree = None
        self.model.commit(tokens)
        self.lookup.commit(tokens)

    def rebuild(self, token_scores: torch.Tensor | None) -> tuple[Selection, int]:
        return self.model.rebuild(token_scores)
