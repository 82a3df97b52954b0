"""Compatibility: whether a target and a draft can run together, decided from their configs and tokenizers before
any weights load.

A model runs when the attention hook can run it exactly: a supported family (causal attention over RoPE positions
through transformers' attention interface), no sliding window shorter than its context, no logit soft-capping, and
RoPE frequencies that do not change with the length. A pair runs when both tokenizers map the same strings to the
same ids; embedding rows past the tokenizer (padding, as Qwen2.5 7B has and 0.5B lacks) are fine, and the draft
is kept from proposing them (`models.make_pair`).
Knows configs and tokenizers; knows nothing of weights, the engine or any UI.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
# RoPE kinds whose frequencies are fixed: keys cached (and, under CMR, re-rotated) at one position stay right
FIXED_ROPE = ("default", "linear", "llama3", "yarn")
STRETCHED_ROPE = ("linear", "yarn")  # kinds whose config may give the original context and a factor alone


@dataclass(frozen=True)
class PairFacts:
    """What the configs and tokenizers of a pair say, read before its weights load."""

    shared_vocab: int | None  # ids both tokenizers define: [0, shared_vocab); None: no draft
    head: Any = None  # the draft's folder as read when the draft is an EAGLE head (heads.HeadFolder), else None


def rope_of(config) -> dict:
    """The config's RoPE parameters (transformers 5 names them rope_parameters; older configs rope_scaling)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return dict(rope) if isinstance(rope, dict) else {}


def rope_kind(config) -> str:
    rope = rope_of(config)
    return str(rope.get("rope_type", rope.get("type", "default")) or "default")


def context_length(config) -> int:
    """The positions a model reads: its max_position_embeddings, or the length a linear or YaRN scaling stretches
    its original context to when the config gives that (Vicuna 7B 16K: 4,096 positions x 4)."""
    n = int(getattr(config, "max_position_embeddings", 2048))
    if rope_kind(config) in STRETCHED_ROPE:
        rope = rope_of(config)
        original = int(rope.get("original_max_position_embeddings") or n)
        n = max(n, int(original * float(rope.get("factor", 1.0))))
    return n


def check_architecture(config, source: str | Path = "the model") -> None:
    """Refuse, with the reason, a model the engine cannot run exactly: another family, a sliding attention window
    shorter than the model's context (the hook attends over every cached key), logit soft-capping, RoPE frequencies
    that change with the length."""
    kind = getattr(config, "model_type", "")
    if kind not in SUPPORTED:
        raise ValueError(f"{source}: model type {kind!r} is not supported ({', '.join(SUPPORTED)} are: the engine "
                         "needs plain causal attention over RoPE positions)")
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < context_length(config):
        raise ValueError(f"{source}: it attends within a sliding window of {window} tokens, which the engine does not "
                         "implement; use a version of the model without one")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError(f"{source}: its attention soft-caps logits, which the engine does not implement")
    rope = rope_kind(config)
    if rope not in FIXED_ROPE:
        raise ValueError(f"{source}: its RoPE scaling {rope!r} changes the frequencies with the length, so cached keys "
                         f"would not match; the engine runs {', '.join(FIXED_ROPE)}")


def id_table(tokenizer) -> dict[int, str]:
    """{id: token string} over the tokenizer's whole vocabulary, added tokens included."""
    return {int(i): token for token, i in tokenizer.get_vocab().items()}


def check_tokenizers(target_tokenizer, draft_tokenizer) -> int:
    """The number of ids both tokenizers define, when they map the same strings to the same ids; else ValueError
    naming the first id that differs."""
    target, draft = id_table(target_tokenizer), id_table(draft_tokenizer)
    if target != draft:
        differ = sorted(i for i in target.keys() | draft.keys() if target.get(i) != draft.get(i))
        first = differ[0]
        name = lambda table: repr(table[first]) if first in table else "absent"  # noqa: E731
        raise ValueError(f"the target's and the draft's tokenizers differ ({len(differ)} ids): id {first} is "
                         f"{name(target)} in the target's and {name(draft)} in the draft's; speculative decoding "
                         "needs one shared tokenizer")
    return max(target) + 1


def check_embedding(config, vocab: int, source: str | Path) -> None:
    """Refuse a model whose embedding lacks rows for some of the tokenizer's ids."""
    rows = int(getattr(config, "vocab_size", 0) or 0)
    if rows < vocab:
        raise ValueError(f"{source}: its embedding has {rows} rows, fewer than the tokenizer's {vocab} ids")


def check_pair(target: tuple[Any, Any, str | Path], draft: tuple[Any, Any, str | Path] | None) -> PairFacts:
    """Decide a pair from (config, tokenizer, source) of each model; ValueError with the reason when it cannot run."""
    t_config, t_tokenizer, t_source = target
    check_architecture(t_config, t_source)
    if draft is None:  # the target alone: the engine refuses prompt ids past its embedding per request
        return PairFacts(None)
    d_config, d_tokenizer, d_source = draft
    check_architecture(d_config, d_source)
    vocab = check_tokenizers(t_tokenizer, d_tokenizer)
    check_embedding(t_config, vocab, t_source)
    check_embedding(d_config, vocab, d_source)
    return PairFacts(vocab)
