"""Drafting: a draft (the draft model here; an EAGLE head in feature_drafting.py) proposes a chain or a dynamic
tree from its working cache.

`PolicyDrafter` owns a drafter's two caches: the STORE (every committed token's KV, as the draft first computed
it) and the WORKING cache it drafts from. A draft-cache policy (retrieval.py) says which store positions the
working cache holds; `rebuild` gathers them and re-positions them compactly, so the draft only ever sees RoPE
distances it knows. Under the `full` policy the store is the working cache. `ModelDrafter` drafts with a causal LM.

A tree grows level by level: the `branch` frontier nodes with the highest cumulative draft probability
are fed to the draft together (tree mask) and each gets `children` children, until the node budget, the
depth limit, or the stop threshold; a greedy tree grows past its budget and keeps its most probable nodes
(EAGLE-2's rerank). Children are the top draft tokens (greedy) or drawn without replacement from q
(sampling), which is what keeps recursive rejection sampling exact. A chain is the tree with branch 1 and
children 1; it may end early where the draft is unsure (`confidence_floor`).
Knows drafts and their caches; knows nothing of the target or of verification.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Iterator, Protocol

import torch

from . import numerics
from .attention import AttentionPlan
from .cache import KVCache, reposition
from .config import DraftConfig, GenerationConfig
from .methods import DraftCache
from .models import forward, layer_devices, rope_inv_freq
from .retrieval import DraftCachePolicy, Selection
from .steps import StepRunner, make_runner
from .verification import sampling_probs, tree_mask

if TYPE_CHECKING:
    from .target import FeatureRows


RERANK_GROWTH = 2  # a greedy tree grows to this many times its node budget before the most probable nodes are kept
# the working cache's preallocated room, in working caches: a rebuild fills one, and the tokens committed until the
# next rebuild (and a step's tree) follow it; the buffer still grows if a long schedule outruns it
WORKING_ROOM = 4


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # -1: child of the root
    depths: tuple[int, ...]  # 1 for children of the root
    probs: tuple[float, ...]  # q of each node's token (1.0 for a lookup-only node)
    q: torch.Tensor | None  # (N+1, V) rows for the root and each node (sampling only; zero rows where unexpanded)
    forwards: int
    sources: tuple[str, ...] = ()  # per node, one of events.SOURCES; empty means all "draft"
    origins: tuple[int, ...] = ()  # per node, the sequence position a lookup copied it from (-1: none)
    sat_out: str = ""  # beside lookup: why the draft proposed nothing (one of events.SAT_OUT)
    recent: tuple[int, ...] = ()  # beside lookup: the draft's accepted tokens in each of its last uses

    def __post_init__(self) -> None:
        if not self.sources:
            object.__setattr__(self, "sources", ("draft",) * len(self.tokens))
            object.__setattr__(self, "origins", (-1,) * len(self.tokens))

    @classmethod
    def empty(cls) -> DraftTree:
        return cls((), (), (), (), None, 0)

    @cached_property
    def mask(self) -> torch.Tensor:
        """(N+1, N+1) bool over [root] + nodes: what each row sees (`verification.tree_mask`), built once per tree for
        the verification's attention and its greedy decision."""
        return tree_mask(self.parents)

    @property
    def point(self) -> tuple[bool, ...]:
        """Per node: its proposal is a point mass on its token (a lookup proposed it), not a draw from q."""
        return tuple(s != "draft" for s in self.sources)


def token_path(parents: list[int] | tuple[int, ...], node_tokens: list[int] | tuple[int, ...], tokens: list[int],
               within=None) -> list[int]:
    """The nodes (of `within`, if given) that spell a prefix of `tokens`, root to leaf."""
    path: list[int] = []
    node = -1
    for token in tokens:
        nodes = range(len(parents)) if within is None else within
        node = next((i for i in nodes if parents[i] == node and node_tokens[i] == token), None)
        if node is None:
            break
        path.append(node)
    return path


def draw_children(logq: torch.Tensor, n: int, generator: torch.Generator | None) -> torch.Tensor:
    """n distinct tokens per row of log q (..., V): the top-n (greedy), or a draw without replacement from q (Gumbel
    top-n), as ids (..., n) where log q lies. Where fewer than n tokens have nonzero q, the last ids are ones of q 0."""
    score = logq
    if generator is not None:  # the uniforms come from the (CPU) generator, so a seed draws the same on any device
        u = torch.rand(logq.shape, generator=generator).clamp_(min=1e-20).to(logq.device)
        score = logq - torch.log(-torch.log(u))
    return torch.topk(score, min(n, logq.shape[-1])).indices


class Drafter(Protocol):
    """The strategy the engine drafts with (the draft model, lookup, both merged, nothing for the target alone,
    or a scripted one in tests).

    `prefill(prompt, stop)`: read the prompt, yielding tokens done. `propose(room, generator)`: a tree no deeper
    than `room` (tokens left before max_new_tokens). `commit(tokens)`: the tokens the step committed (the accepted
    path, then the bonus token), or the first token after prefill. `due(step, accepted, depth)`: whether its working
    cache is rebuilt now (step 0: right after prefill; later, after a step that accepted `accepted` of `depth`).
    `rebuild(token_scores)`: rebuild it, from the target's scores when `needs_scores`.
    `drafts`: whether it proposes at all (the engine reports a drafting phase only then). `runners`: the step
    runners it holds (steps.py), handed back when the request ends. `features`: the target rows it reads
    (target.FeatureRows, a feature drafter's) or None.
    """

    drafts: bool
    needs_scores: bool
    runners: tuple[StepRunner, ...]
    features: FeatureRows | None

    def prefill(self, prompt: list[int], stop) -> Iterator[int]: ...
    def propose(self, room: int, generator: torch.Generator | None) -> DraftTree: ...
    def commit(self, tokens: list[int]) -> None: ...
    def due(self, step: int, accepted: int = 0, depth: int = 0) -> bool: ...
    def rebuild(self, token_scores: torch.Tensor | None) -> tuple[Selection, int]: ...


class Cacheless:
    """A drafter without a working cache (the target alone, lookup alone, scripted drafts): never rebuilt."""

    needs_scores = False
    runners: tuple[StepRunner, ...] = ()
    features = None

    def due(self, step: int, accepted: int = 0, depth: int = 0) -> bool:
        return False

    def rebuild(self, token_scores: torch.Tensor | None) -> tuple[Selection, int]:
        raise RuntimeError(f"{type(self).__name__} keeps no draft cache: there is nothing to rebuild")


class NoDrafter(Cacheless):
    """The target alone: proposes nothing, so every step verifies just the root (one autoregressive step)."""

    drafts = False

    def prefill(self, prompt: list[int], stop) -> Iterator[int]:
        return iter(())

    def propose(self, room: int, generator: torch.Generator | None) -> DraftTree:
        return DraftTree.empty()

    def commit(self, tokens: list[int]) -> None:
        pass


class PolicyDrafter:
    """What every drafter with a policy-managed working cache shares: the STORE (every committed position's KV, as
    the drafter first computed it), the WORKING cache it drafts from, when to rebuild it, the rebuild, and growing a
    tree level by level. Subclasses (the draft model here, a feature drafter in feature_drafting.py) say how a
    forward runs and what they keep after a step."""

    drafts = True
    features = None

    def __init__(self, config: GenerationConfig, policy: DraftCachePolicy, inv_freq: torch.Tensor, store: KVCache,
                 working: KVCache) -> None:
        self.draft = config.draft
        self.temperature, self.top_p = config.temperature, config.top_p
        self.kernels = config.attention
        self.policy = policy
        self.inv_freq = inv_freq
        self.store, self.working = store, working

    @property
    def needs_scores(self) -> bool:
        return self.policy.needs_scores

    def due(self, step: int, accepted: int = 0, depth: int = 0) -> bool:
        """After prefill, a working cache to build unless the drafter keeps its full cache; after a step, as its
        policy says."""
        if step == 0:
            return self.policy.name is not DraftCache.FULL
        self.policy.observe(accepted, depth)
        return self.policy.due(step, self.working.length)

    def _logq(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature == 0.0:
            return torch.log_softmax(logits, dim=-1)
        return torch.log(sampling_probs(logits, self.temperature, self.top_p))

    def grow(self, tree: GrowingTree, logits: torch.Tensor, room: int, generator: torch.Generator | None, run) -> GrowingTree:
        """Grow `tree` (fresh) to at most min(config depth, `room`) levels from the root's `logits` (V,): the `branch` frontier
        nodes with the highest cumulative log q are fed together through `run(nodes, tokens, positions, plan)` ->
        logits (len(nodes), V), each getting `children` children, until the node budget, the depth, the threshold, or
        (a chain) the confidence floor, which may leave the tree empty."""
        cfg: DraftConfig = self.draft
        branch, children = cfg.width
        # EAGLE-2's dynamic tree (greedy): grow past the node budget, then keep the most probable nodes. A sampled
        # tree keeps what it drew: keeping a subset chosen by probability would bias recursive rejection sampling.
        rerank = cfg.shape == "tree" and generator is None
        budget = RERANK_GROWTH * cfg.budget if rerank else cfg.budget
        threshold = math.log(cfg.stop_threshold) if cfg.shape == "tree" and cfg.stop_threshold > 0 else -math.inf
        floor = math.log(cfg.confidence_floor) if cfg.shape == "chain" and cfg.confidence_floor > 0 else -math.inf
        logq = self._logq(logits[None])
        if confident(0.0, logq, floor):
            tree.expand([-1], logq, children, budget, generator)
        for level in range(1, min(cfg.depth, room)):
            room_left = budget - len(tree.tokens)
            frontier = sorted((i for i, d in enumerate(tree.depths) if d == level), key=lambda i: -tree.cum[i])[:branch]
            frontier = [i for i in frontier if tree.cum[i] >= threshold]
            if room_left <= 0 or not frontier:
                break
            logq = self._logq(tree.feed(run, frontier, self.kernels.verify))
            if not confident(tree.cum[frontier[0]], logq, floor):
                break
            tree.expand(frontier, logq, children, budget, generator)
        if rerank:
            tree.prune(cfg.budget)
        tree.vocab = logits.shape[-1]
        return tree

    def settle(self, slot0: int, fed_slots: list[int], new_from: int) -> None:
        """After a step: the working cache keeps its first `slot0` slots and the fed nodes' `fed_slots`; in a working
        cache apart from the store, the slots from `new_from` on (this step's new entries) join the store."""
        self.working.keep(torch.cat([torch.arange(slot0), torch.tensor(fed_slots, dtype=torch.long)]))
        if self.working is not self.store:
            new = torch.arange(new_from, self.working.length)
            self.store.append(self.working.gather(new), self.working.rope_positions[new])

    def rebuild(self, token_scores: torch.Tensor | None) -> tuple[Selection, int]:
        """Rebuild the working cache from the store as the policy selects: returns (selection, store length)."""
        seq_len = self.store.length
        selection = self.policy.select(seq_len, token_scores)
        positions = selection.positions
        compact = torch.arange(positions.shape[0])
        if seq_len == 0:  # a one-token prompt: nothing is stored yet
            self.working.crop(0)
            return selection, seq_len
        kv = self.store.gather(positions)
        self.working.replace(reposition(kv, self.store.rope_positions[positions], compact, self.inv_freq), compact)
        return selection, seq_len


def confident(cum: float, logq: torch.Tensor, floor: float) -> bool:
    """Whether a chain goes on from a node of cumulative log q `cum` whose next distribution is `logq` (1, V): its
    likeliest next token keeps the path's probability at or above `floor` (log). It looks at the distribution, not at
    a draw, so a sampled chain's tokens stay draws from q."""
    return floor == -math.inf or cum + float(logq.max()) >= floor


def working_room(config: GenerationConfig, capacity: int) -> int:
    """Slots a working cache apart from the store is made with (it grows if a long schedule outruns them)."""
    return min(capacity, WORKING_ROOM * config.retrieval.working_cache)


class ModelDrafter(PolicyDrafter):
    """Drafts with a causal LM from a policy-managed working cache."""

    def __init__(self, model, config: GenerationConfig, policy: DraftCachePolicy, capacity: int) -> None:
        # the draft's products in bf16 when the target's are; its caches stay in its dtype, for CMR re-positions them
        self.model = numerics.apply(model, "fp32" if config.attention.numerics == "fp32" else "bf16")
        largest = max(config.draft.depth + 1, config.draft.width[0])  # the pending tokens, or one tree level
        steps = config.attention.steps
        if policy.name is DraftCache.FULL:
            self.runner = make_runner(model, capacity, steps, largest)
            store = self.runner.cache
        else:
            store = KVCache(model.config.num_hidden_layers, capacity, layer_devices(model))
            self.runner = make_runner(model, working_room(config, capacity), steps, largest)
        super().__init__(config, policy, rope_inv_freq(model), store, self.runner.cache)
        self.runners = (self.runner,)
        self.pending: list[int] = []  # committed tokens whose KV the draft has not computed yet
        self._tree: GrowingTree | None = None

    # -- prefill ---------------------------------------------------------------------------------------
    def prefill(self, prompt: list[int], stop, block: int = 2048) -> Iterator[int]:
        """Compute the store's KV for all but the last prompt token (sliding window per the policy).
        Yields the number of tokens done after each block; returns early when `stop` is set."""
        window = self.policy.prefill_window
        block = min(block, window) if window else block
        body = prompt[:-1]
        plan = AttentionPlan("prefill", self.kernels.prefill, window=window)
        for start in range(0, len(body), block):
            if stop is not None and stop.is_set():
                return
            chunk = body[start : start + block]
            forward(self.model, self.store, chunk, torch.arange(start, start + len(chunk)), plan, logits_to_keep=1)
            yield start + len(chunk)
        self.pending = prompt[-1:]

    # -- one step --------------------------------------------------------------------------------------
    def propose(self, room: int, generator: torch.Generator | None) -> DraftTree:
        """Feed the pending tokens, then grow a tree of at most min(config depth, `room`) levels from the last one."""
        base = self.working.length
        m = len(self.pending)
        plan = AttentionPlan("tree", self.kernels.verify, tree_mask=torch.ones(m, m, dtype=torch.bool).tril())
        logits = self.runner.forward(self.pending, torch.arange(base, base + m), plan, 1)

        def run(nodes: list[int], tokens: list[int], positions: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
            return self.runner.forward(tokens, positions, plan, len(nodes))

        tree = self._tree = self.grow(GrowingTree(base + m - 1, base + m), logits[-1], room, generator, run)
        return tree.freeze(sampling=generator is not None)

    def commit(self, tokens: list[int]) -> None:
        """Keep the KV of the pending tokens and of the fed nodes the committed tokens follow; the rest is pending.
        Without a tree this step (the first token; a step the draft sat out) every token becomes pending."""
        tree, self._tree = self._tree, None
        if tree is None:
            self.pending.extend(tokens)
            return
        fed = token_path(tree.parents, tree.tokens, tokens, within=tree.slot)  # a fed node's ancestors are fed
        self.settle(tree.slot0, [tree.slot[n] for n in fed], tree.slot0 - len(self.pending))
        self.pending = list(tokens[len(fed):])


class GrowingTree:
    """A tree while it grows: node lists plus the draft-cache slot of every node fed to the draft."""

    def __init__(self, root_position: int, slot0: int) -> None:
        self.root_position, self.slot0 = root_position, slot0
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.cum: list[float] = []  # cumulative log q
        self.probs: list[float] = []
        self.q_rows: dict[int, torch.Tensor] = {}  # row (0 root, i+1 node i) -> q the children were drawn from
        self.slot: dict[int, int] = {}  # node -> draft cache slot
        self.forwards = 1
        self.vocab = 0  # the width of the q rows

    def expand(self, nodes: list[int], logq: torch.Tensor, children: int, budget: int, generator) -> None:
        """Give each of `nodes` (-1: the root), in turn, up to `children` children drawn from its row of log q (k, V)
        (kept as the node's q row when sampling), while the tree has fewer than `budget` nodes. The draws of a level are
        made at once where log q lies and come to the host in one copy."""
        room = budget - len(self.tokens)
        if room <= 0:
            return
        picked = draw_children(logq, min(children, room), generator)  # (k, n)
        ids, values = torch.stack((picked.double(), logq.gather(-1, picked).double())).tolist()  # (2, k, n)
        for i, node in enumerate(nodes):
            n = min(children, budget - len(self.tokens))
            if n <= 0:
                break
            if generator is not None:
                self.q_rows[node + 1] = logq[i].exp()
            parent_cum = 0.0 if node < 0 else self.cum[node]
            depth = 1 if node < 0 else self.depths[node] + 1
            for token, value in zip(ids[i][:n], values[i][:n]):
                if value == -math.inf:  # never a token of q 0
                    continue
                self.tokens.append(int(token))
                self.parents.append(node)
                self.depths.append(depth)
                self.cum.append(parent_cum + value)
                self.probs.append(math.exp(value))

    def prune(self, budget: int) -> None:
        """Keep the `budget` nodes of highest cumulative log q, renumbered in order. The kept set is a tree: a child's
        cumulative log q never exceeds its parent's, and ties go to the earlier node (the parent, the likelier
        sibling)."""
        if len(self.tokens) <= budget:
            return
        keep = sorted(sorted(range(len(self.tokens)), key=lambda i: (-self.cum[i], i))[:budget])
        new = {old: i for i, old in enumerate(keep)}
        self.parents = [new[self.parents[o]] if self.parents[o] >= 0 else -1 for o in keep]
        for name in ("tokens", "depths", "cum", "probs"):
            setattr(self, name, [getattr(self, name)[o] for o in keep])
        self.slot = {new[o]: slot for o, slot in self.slot.items() if o in new}

    def feed(self, run, nodes: list[int], kernel: str) -> torch.Tensor:
        """One draft forward `run(nodes, tokens, positions, plan)` over `nodes` (all at one depth); each sees its fed
        ancestors and itself."""
        fed_before = len(self.slot)
        mask = torch.zeros(len(nodes), fed_before + len(nodes), dtype=torch.bool)
        for row, node in enumerate(nodes):
            parent = self.parents[node]
            while parent >= 0:
                mask[row, self.slot[parent] - self.slot0] = True
                parent = self.parents[parent]
            mask[row, fed_before + row] = True
            self.slot[node] = self.slot0 + fed_before + row
        positions = torch.tensor([self.root_position + self.depths[n] for n in nodes])
        self.forwards += 1
        return run(nodes, [self.tokens[n] for n in nodes], positions, AttentionPlan("tree", kernel, tree_mask=mask))

    def freeze(self, sampling: bool) -> DraftTree:
        q = None
        if sampling:
            q = torch.zeros(len(self.tokens) + 1, self.vocab)
            for row, probs in self.q_rows.items():
                q[row] = probs.cpu()
        return DraftTree(tuple(self.tokens), tuple(self.parents), tuple(self.depths), tuple(self.probs), q, self.forwards)
