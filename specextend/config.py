"""Frozen configuration for one generation request.

Knows the knobs of the method (drafting, verification, retrieval, attention kernels) and checks them.
Knows nothing of models, tokenizers or the UI. Every nonsense setting is a ValueError raised here,
before any model work.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from .methods import METHOD_INFO, METHODS, DraftCache

Method = Literal["autoregressive", "lookup", "speculative", "streaming", "specextend"]
# retrieval signals by name: the paper's recipe; the pair's calibrated signal (an error for a pair without one);
# "default": the calibrated signal where the pair has one, else a calibration-free one (specextend/signal.py)
SIGNAL_NAMES: tuple[str, ...] = ("paper", "calibrated", "default")
PrefillKernel = Literal["fused", "eager"]
VerifyKernel = Literal["hybrid", "onecall", "masked", "auto"]
StepMode = Literal["auto", "eager", "static", "captured"]
Bf16Prefill = Literal["auto", "on", "off"]
Numerics = Literal["fp32", "bf16", "bf16-kv"]  # the target's products and KV cache on the CPU (numerics.py)
NUMERICS: tuple[str, ...] = ("fp32", "bf16", "bf16-kv")
NUMERICS_CHOICES = ("auto", *NUMERICS)  # what an operator or a command line may ask for: "auto" is numerics.choose's


MAX_DRAFT = 256  # the most draft tokens (and tree levels, branches, children, lookup tokens) one step may send the
# target: a verification of more costs memory and time no speculative step pays back, and bf16 numerics' exactness is
# measured up to it (numerics.VERIFY_ROWS)
MAX_CHUNK = 65_536  # the largest chunk and the most chunks a working cache may have


@dataclass(frozen=True)
class DraftConfig:
    """How the draft proposes. A chain of k is the tree with branch 1, top_k 1, depth k, budget k."""

    shape: Literal["chain", "tree"] = "chain"
    k: int = 4  # chain length
    max_depth: int = 5  # tree: deepest level grown
    node_budget: int = 12  # tree: most draft nodes sent to the target
    branch: int = 2  # tree: frontier nodes expanded per level
    children: int = 3  # tree: children drawn per expanded node
    stop_threshold: float = 0.02  # tree: stop growing when the best frontier cumulative probability falls below
    # chain: end the chain before a token whose path probability (the chain's draft probabilities so far times the
    # top of the next one's distribution, which is decided before any draw) would fall below this; 0: never. As
    # EAGLE-2 reads it, the draft's confidence stands for the chance the target accepts: a token that is unlikely
    # to be kept costs a verified row and a draft round for little.
    confidence_floor: float = 0.0

    def __post_init__(self) -> None:
        if self.shape not in ("chain", "tree"):
            raise ValueError(f"draft shape must be 'chain' or 'tree', got {self.shape!r}")
        if not 1 <= self.k <= MAX_DRAFT:
            raise ValueError(f"chain length k must be from 1 to {MAX_DRAFT}, got {self.k}")
        if not 1 <= self.max_depth <= MAX_DRAFT:
            raise ValueError(f"tree max_depth must be from 1 to {MAX_DRAFT}, got {self.max_depth}")
        if not 1 <= self.node_budget <= MAX_DRAFT:
            raise ValueError(f"tree node_budget must be from 1 to {MAX_DRAFT}, got {self.node_budget}")
        if not (1 <= self.branch <= MAX_DRAFT and 1 <= self.children <= MAX_DRAFT):
            raise ValueError(f"tree branch and children must be from 1 to {MAX_DRAFT}, got {self.branch} and {self.children}")
        if not 0.0 <= self.stop_threshold < 1.0:
            raise ValueError(f"tree stop_threshold must be in [0, 1), got {self.stop_threshold}")
        if not 0.0 <= self.confidence_floor < 1.0:
            raise ValueError(f"chain confidence_floor must be in [0, 1), got {self.confidence_floor}")
        if self.confidence_floor and self.shape != "chain":
            raise ValueError("confidence_floor ends a chain; a tree stops growing at its stop_threshold instead")

    @property
    def depth(self) -> int:
        return self.k if self.shape == "chain" else self.max_depth

    @property
    def budget(self) -> int:
        return self.k if self.shape == "chain" else self.node_budget

    @property
    def width(self) -> tuple[int, int]:
        """(frontier nodes expanded per level, children per expanded node)."""
        return (1, 1) if self.shape == "chain" else (self.branch, self.children)


# The draft's defaults on a GPU, from the verification cost curve gpu_check measured on an H200 (7B-shaped target,
# 16K tokens, captured steps; docs/RESULTS.md, "GPU path"): verifying 1 / 8 / 16 / 32 / 64 tokens took 7.5 / 8.4 /
# 8.7 / 11.0 / 13.4 ms. Forwards are padded to powers of two, and 16 tokens cost 1.16x one token while 32 cost
# 1.47x: a tree of 15 nodes (16 tokens with its root) is the most a step can verify nearly free. The CPU drafts a
# chain of CPU_CHAIN.
GPU_DRAFT = DraftConfig(shape="tree", max_depth=5, node_budget=15)

# SpecExtend + lookup, bundled pair, bf16-kv, greedy, median of 3 documents, speed-up over the target alone at ~7K / ~1K:
# k=1 1.28x / 2.36x, k=2 1.41x / 2.36x, k=3 1.37x / 2.31x, k=4 1.33x / 2.08x (a verified row costs ~2.4 ms of a 30 ms
# step at 7.5K; the head's later tokens are rarely kept): python -m scripts.head_race --numerics bf16-kv --chains 1,2,3
# --lengths 7168,1024 --docs 3. Trees (exact in bf16-kv since its attention lays a node's ancestors out as committed)
# raise tokens per step (1.75 -> 1.95-2.23 at ~7K) and run no faster: 1.06-1.33x against the chain's 1.34x at ~7K,
# within a round's noise of it at ~2K, slower on unseen text (docs/RESULTS.md, "Trees in the CPU default")
CPU_CHAIN = 2


def default_chain(device: str) -> int:
    """The chain length k a device drafts unless the user sets it: CPU_CHAIN on the CPU ("cpu"), DraftConfig's own
    elsewhere ("cuda", "cuda:1", ...), where verifying more rows is nearly free."""
    return CPU_CHAIN if str(device).split(":")[0] == "cpu" else DraftConfig().k


def draft_defaults(device_type: str) -> DraftConfig:
    """The draft settings a device gets unless the user sets them."""
    return GPU_DRAFT if device_type == "cuda" else DraftConfig(k=default_chain(device_type))


@dataclass(frozen=True)
class RetrievalSignal:
    """Where CMR's chunk scores come from: which of the target's attention heads, reading which query rows, combined
    how; and how much of the working cache is kept for the newest chunks whatever the scores (the recency reserve:
    a share of top_k, at least the newest chunk, so it scales with the budget).

    The paper's recipe ("paper"): the final layer's heads, the row of the last accepted token, averaged, with only
    the newest chunk reserved. `spread` lets a chunk inherit part of its neighbours' score, so a passage that
    straddles a chunk boundary comes whole (the heads that find a fact look at its value, not at its first words).
    A query row is a token the target has read (prompt or committed output): `rows` counts back from the newest.
    `heads` names (layer, head) pairs; when empty every head of `layers` scores (of every layer when `layers` is
    empty too). Negative layers count from the end (-1 is the final layer).
    """

    name: str = "paper"
    layers: tuple[int, ...] = (-1,)
    heads: tuple[tuple[int, int], ...] = ()
    rows: int = 1
    combine: Literal["mean", "max"] = "mean"
    reserve: float = 0.0  # share of top_k kept for the newest chunks; the rest is chosen among older chunks
    spread: float = 0.0  # a chunk scores at least this share of its neighbours' best score (0: no spreading)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        object.__setattr__(self, "heads", tuple((int(a), int(b)) for a, b in self.heads))
        if self.rows < 1:
            raise ValueError(f"retrieval signal rows must be at least 1 query row, got {self.rows}")
        if self.combine not in ("mean", "max"):
            raise ValueError(f"retrieval signal combine must be 'mean' or 'max', got {self.combine!r}")
        if not 0.0 <= self.reserve < 1.0:  # also rejects NaN
            raise ValueError(f"retrieval signal reserve is a share of the working cache in [0, 1), got {self.reserve}")
        if not 0.0 <= self.spread <= 1.0:  # also rejects NaN
            raise ValueError(f"retrieval signal spread must be in [0, 1], got {self.spread}")
        if any(h < 0 for _, h in self.heads):
            raise ValueError(f"retrieval signal heads must be (layer, head >= 0) pairs, got {self.heads}")

    def reserved(self, top_k: int) -> int:
        """Newest chunks always kept in a working cache of top_k chunks: the reserve's share, at least one."""
        return max(1, round(self.reserve * top_k))

    def pairs(self, num_layers: int, num_heads: int) -> tuple[tuple[int, int], ...]:
        """The (layer, head) pairs that score, layer by layer, heads ascending (the order a QueryWindow keeps)."""
        return tuple((layer, h) for layer, hs in self.head_sets(num_layers, num_heads).items() for h in hs)

    def head_sets(self, num_layers: int, num_heads: int) -> dict[int, tuple[int, ...]]:
        """{layer: query heads that score} for a target of `num_layers` x `num_heads`, layers counted from 0."""
        def index(layer: int) -> int:
            if not -num_layers <= layer < num_layers:
                raise ValueError(f"retrieval signal {self.name!r} names layer {layer}; the target has {num_layers}")
            return layer % num_layers

        if self.heads:
            out: dict[int, list[int]] = {}
            for layer, head in self.heads:
                if head >= num_heads:
                    raise ValueError(f"retrieval signal {self.name!r} names head {head}; the target has {num_heads}")
                out.setdefault(index(layer), []).append(head)
            return {layer: tuple(sorted(set(h))) for layer, h in sorted(out.items())}
        layers = {index(layer) for layer in self.layers} if self.layers else set(range(num_layers))
        return {layer: tuple(range(num_heads)) for layer in sorted(layers)}


@dataclass(frozen=True)
class RetrievalConfig:
    """Cross-model Retrieval and the draft's other cache budgets (paper defaults: 32, 32, every 4, window 512)."""

    chunk_size: int = 32
    top_k: int = 32  # chunks in the working cache, the sink chunk and the newest chunk included
    retrieve_every: int = 4  # verification steps between retrievals
    prefill_window: int = 512  # the draft's sliding attention window during prefill
    sink_tokens: int = 4  # streaming: attention-sink tokens kept at the start
    trigger: Literal["fixed", "adaptive"] = "fixed"  # adaptive: retrieve early when acceptance drops
    min_acceptance: float = 0.5  # adaptive: retrieve when the recent acceptance rate falls below this
    acceptance_window: int = 2  # adaptive: steps the recent acceptance rate is averaged over
    signal: str | RetrievalSignal = "default"  # a name ("paper", "default": the pair's calibrated signal) or a signal

    def __post_init__(self) -> None:
        if self.trigger not in ("fixed", "adaptive"):
            raise ValueError(f"retrieval trigger must be 'fixed' or 'adaptive', got {self.trigger!r}")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"min_acceptance must be in [0, 1], got {self.min_acceptance}")
        if self.acceptance_window < 1:
            raise ValueError(f"acceptance_window must be at least 1 step, got {self.acceptance_window}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be at least 1 token, got {self.chunk_size}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be at least 1 chunk, got {self.top_k}")
        if self.chunk_size > MAX_CHUNK or self.top_k > MAX_CHUNK:
            raise ValueError(f"chunk_size and top_k must be at most {MAX_CHUNK:,}, got {self.chunk_size} and {self.top_k}")
        if self.top_k < 2:
            raise ValueError(
                f"top_k={self.top_k} leaves no room: the working cache always holds the sink chunk and the newest chunk, "
                "so top_k must be at least 2"
            )
        if self.retrieve_every < 1:
            raise ValueError(f"retrieve_every must be at least 1 step, got {self.retrieve_every}")
        if self.prefill_window < 1:
            raise ValueError(f"prefill_window must be at least 1 token, got {self.prefill_window}")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must not be negative, got {self.sink_tokens}")
        if isinstance(self.signal, str) and self.signal not in SIGNAL_NAMES:
            raise ValueError(f"retrieval signal must be one of {', '.join(SIGNAL_NAMES)} or a RetrievalSignal, "
                             f"got {self.signal!r}")
        if self.sink_tokens >= self.working_cache:
            raise ValueError(
                f"sink_tokens={self.sink_tokens} must be smaller than the working cache ({self.working_cache} tokens)"
            )

    @property
    def working_cache(self) -> int:
        """Working-cache budget in tokens (top_k chunks of chunk_size)."""
        return self.chunk_size * self.top_k

    @classmethod
    def with_working_cache(cls, working_cache: int, chunk_size: int = 32, **kwargs) -> RetrievalConfig:
        """Size the working cache in tokens instead of chunks."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be at least 1 token, got {chunk_size}")
        if working_cache < chunk_size:
            raise ValueError(f"a working cache of {working_cache} tokens is smaller than one chunk ({chunk_size})")
        return cls(chunk_size=chunk_size, top_k=working_cache // chunk_size, **kwargs)


@dataclass(frozen=True)
class LookupConfig:
    """Lookup drafting: propose what followed the latest occurrences of the newest n-gram (prompt + output).

    The longest suffix of max_ngram..min_ngram tokens that occurred before is matched; each match proposes the
    up to `max_tokens` tokens that followed it; `branches` matches with distinct first tokens become branches,
    ranked by `rank`: `recent` (latest occurrence first), `frequent` (the commonest next token first, ties to the
    latest) or `first` (earliest occurrence first, as transformers' prompt lookup). `with_draft`: under a
    draft-model method, `always` merges the model's draft into the same tree; `on_miss` drafts with the model
    only in steps where lookup found nothing. `adaptive`: a branch is at most 2a + 2 tokens long, a being how
    many tokens of the last proposal were committed. `draft_gate`: the draft model is asked only while its proposals
    got at least this many tokens accepted per use, on average over its last uses; while below, it sits out
    and is tried again now and then (0: always asked).
    """

    enabled: bool | None = None  # None: on exactly for method lookup; True adds lookup to a draft-model method
    max_ngram: int = 4
    min_ngram: int = 2
    max_tokens: int = 16
    branches: int = 1
    rank: Literal["recent", "frequent", "first"] = "recent"
    with_draft: Literal["always", "on_miss"] = "on_miss"
    adaptive: bool = True
    draft_gate: float = 1.0

    def __post_init__(self) -> None:
        if self.min_ngram < 1 or self.max_ngram < self.min_ngram:
            raise ValueError(f"lookup n-grams need 1 <= min_ngram <= max_ngram, got {self.min_ngram}..{self.max_ngram}")
        if not 1 <= self.max_tokens <= MAX_DRAFT:
            raise ValueError(f"lookup max_tokens must be from 1 to {MAX_DRAFT}, got {self.max_tokens}")
        if not 1 <= self.branches <= MAX_DRAFT:
            raise ValueError(f"lookup branches must be from 1 to {MAX_DRAFT}, got {self.branches}")
        if self.rank not in ("recent", "frequent", "first"):
            raise ValueError(f"lookup rank must be 'recent', 'frequent' or 'first', got {self.rank!r}")
        if self.with_draft not in ("always", "on_miss"):
            raise ValueError(f"lookup with_draft must be 'always' or 'on_miss', got {self.with_draft!r}")
        if not self.draft_gate >= 0.0:  # also rejects NaN
            raise ValueError(f"lookup draft_gate must be >= 0 accepted tokens per use, got {self.draft_gate}")

    @property
    def budget(self) -> int:
        """Most lookup nodes one step can propose."""
        return self.max_tokens * self.branches


@dataclass(frozen=True)
class AttentionConfig:
    """Which kernel each phase uses, and how decode-time forwards run. SpecExtend's defaults: fused prefill, the
    fastest tree kernel for the device and length (Hybrid Tree Attention or one fused call), captured steps on CUDA."""

    prefill: PrefillKernel = "fused"  # fused: SDPA / flash-attn causal kernel; eager: matmul + softmax
    # hybrid: HTA (fused prefix + LSE merge); onecall: one fused call, folded heads, tree mask; masked: SDPA with a
    # full mask and repeated KV heads (transformers' way); auto: the fastest of the three, timed on first use
    verify: VerifyKernel = "hybrid"
    # decode-time forwards (steps.py): eager; static (fixed shapes, run eagerly); captured (fixed shapes replayed
    # as CUDA graphs); auto: captured on CUDA, eager elsewhere
    steps: StepMode = "eager"
    # the target reads the prompt in bfloat16 when its dtype is float32: on; off; auto: where that measured faster on
    # this machine (models.prefill_dtype). Decoding keeps the model's dtype; the KV cache is handed over in it
    bf16_prefill: Bf16Prefill = "auto"
    # the target's numerics on the CPU (numerics.py): fp32; bf16 (packed bf16 weights, fp32 between products);
    # bf16-kv (and the KV cache in bf16). In bf16 settings the prompt is read in them too (bf16_prefill does not apply)
    numerics: Numerics = "fp32"

    def __post_init__(self) -> None:
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}; got {self.numerics!r}")
        if self.bf16_prefill not in ("auto", "on", "off"):
            raise ValueError(f"bf16 prefill must be 'auto', 'on' or 'off', got {self.bf16_prefill!r}")
        if self.prefill not in ("fused", "eager"):
            raise ValueError(f"prefill kernel must be 'fused' or 'eager', got {self.prefill!r}")
        if self.verify not in ("hybrid", "onecall", "masked", "auto"):
            raise ValueError(f"verify kernel must be 'hybrid', 'onecall', 'masked' or 'auto', got {self.verify!r}")
        if self.steps not in ("auto", "eager", "static", "captured"):
            raise ValueError(f"steps must be 'auto', 'eager', 'static' or 'captured', got {self.steps!r}")


def exact_trees(attention: AttentionConfig, device_type: str = "cpu") -> bool:
    """Whether a tree's nodes get the bits their tokens will get once committed: in fp32 (its rounding has not moved
    a greedy token in any race measured), and in bf16-kv where the CPU's bf16 cache attention runs (eager steps on
    the CPU: it attends each node over its ancestors as if they were committed). Not in bf16, whose fp32 cache goes
    through the tree kernels, where a node's sums depend on its slot and bf16 products round the difference into
    other tokens (measured on the bundled target), nor through static or captured steps' split attention."""
    if attention.numerics == "fp32":
        return True
    return attention.numerics == "bf16-kv" and attention.steps in ("auto", "eager") and device_type == "cpu"


MAX_TEMPERATURE = 10.0  # beyond this, sampling is close to uniform: a slip, not a setting
MAX_SEED = 2**63 - 1  # what torch's generator takes


@dataclass(frozen=True)
class GenerationConfig:
    """One request: the method, its knobs, and when to stop."""

    method: Method = "specextend"
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int = 0
    eos_token_ids: tuple[int, ...] = ()
    draft: DraftConfig = field(default_factory=DraftConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    lookup: LookupConfig = field(default_factory=LookupConfig)
    cmr: bool | None = None  # None: on exactly for method specextend; an explicit value ablates it

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:  # also rejects NaN
            raise ValueError(f"temperature must be between 0 (greedy) and {MAX_TEMPERATURE:g}, got {self.temperature}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be a whole number from 0 to {MAX_SEED}, got {self.seed}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        info = METHOD_INFO[self.method]
        if self.cmr and info.cache in (None, DraftCache.STREAMING):
            raise ValueError(f"cmr cannot be switched on for method {self.method!r}")
        if self.lookup.enabled and self.method == "autoregressive":
            raise ValueError("lookup drafting cannot be switched on for the target alone (use method 'lookup')")
        if self.lookup.enabled is False and self.method == "lookup":
            raise ValueError("method 'lookup' is lookup drafting: it cannot be switched off")
        if self.branching and not exact_trees(self.attention):  # measured: greedy output left the target's
            raise ValueError(f"a draft tree cannot be verified exactly in {self.attention.numerics} numerics with "
                             f"{self.attention.steps} steps: its nodes sit in other cache slots than the tokens it "
                             "commits, attention's sums there depend on the slot, and bf16 rounding turns that into "
                             "other tokens; draft a chain (one lookup branch, lookup only on a draft miss), or use "
                             "numerics fp32, or bf16-kv with eager steps")
        if self.branching and self.tree_budget > MAX_DRAFT:  # a chain is one proposer's: within MAX_DRAFT by its own checks
            drafted = self.draft.budget if self.uses_draft else 0
            raise ValueError(f"one step can send the target at most {MAX_DRAFT} draft tokens; these proposals side by side "
                             f"can send {self.tree_budget} (the draft's {drafted} and {self.lookup.branches} lookup "
                             f"branches of {self.lookup.max_tokens})")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_draft(self) -> bool:
        """Whether the draft model proposes (every method but the target alone and lookup alone)."""
        return METHOD_INFO[self.method].draft_model

    @property
    def uses_lookup(self) -> bool:
        return self.method == "lookup" or bool(self.lookup.enabled)

    @property
    def branching(self) -> bool:
        """Whether a step's proposals can branch (siblings in the verified tree): a draft tree, more than one lookup
        branch, or lookup's branch beside the draft's (`with_draft="always"`)."""
        lookup = self.uses_lookup and (self.lookup.branches > 1 or (self.uses_draft and self.lookup.with_draft == "always"))
        return (self.uses_draft and self.draft.shape == "tree") or lookup

    @property
    def tree_budget(self) -> int:
        """Most draft nodes one step can send to the target."""
        return (self.draft.budget if self.uses_draft else 0) + (self.lookup.budget if self.uses_lookup else 0)

    @property
    def draft_cache(self) -> DraftCache:
        """Which draft-cache policy the method resolves to (`cmr` ablates CMR on or off)."""
        default = METHOD_INFO[self.method].cache
        if default is DraftCache.STREAMING:
            return default
        cmr = self.cmr if self.cmr is not None else default is DraftCache.CMR
        return DraftCache.CMR if cmr else DraftCache.FULL

    def replace(self, **changes) -> GenerationConfig:
        return replace(self, **changes)


def preset(method: str, **changes) -> GenerationConfig:
    """The config a method gets by default.

    Standard speculative decoding and streaming use the kernels and the eager forwards transformers gives a user by
    default (SDPA causal prefill, SDPA with a full boolean mask for verification): the honest baselines.
    SpecExtend uses fused prefill, the measured-fastest tree kernel, captured steps where the device allows, and
    CMR; the target alone and lookup drafting (no draft model) use the same kernels and steps as SpecExtend.
    Any field can be overridden.
    """
    attention = AttentionConfig(prefill="fused", verify="masked")
    if method in METHOD_INFO and METHOD_INFO[method].fast:
        attention = AttentionConfig(prefill="fused", verify="auto", steps="auto")
    changes.setdefault("attention", attention)
    return GenerationConfig(method=method, **changes)
