"""Offline looks at where the target's attention goes, for calibration, the benchmark and the needle tab.

`needle_prompt` builds a needle question over a document and finds the needle's token span; `read` prefills a
target that keeps the queries of the heads a signal names; `head_map` is the share of each head's attention on a
span (the layer x head picture); `holds` says whether a working cache kept a whole span; `first_hold` is whether
a signal's first retrieval (right after prefill) keeps the needle. Everything here runs the target's prefill only.
Knows models through the engine's Target; knows nothing of the UI.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import needle
from .cli import encode_marked, render_request
from .config import GenerationConfig, RetrievalConfig, RetrievalSignal
from .engine import Target
from .models import ModelPair
from .retrieval import StreamingPolicy, make_policy
from .signal import span_mass

NEEDLE_HINT = "Answer with the value only."
ALL_HEADS = RetrievalSignal("every head", layers=(), rows=64)  # what the layer x head picture reads


@dataclass(frozen=True)
class NeedlePrompt:
    """A needle question over a document, tokenized: the ids and the needle's token span in them."""

    ids: list[int]
    span: tuple[int, int]
    planted: needle.Needle


def needle_prompt(tokenizer, text: str, depth: float, seed: int) -> NeedlePrompt:
    """Plant a needle in `text` near `depth` and ask about it; ValueError when the needle cannot be located in tokens."""
    planted = needle.generate(text, depth, seed=seed)
    rendered = render_request(tokenizer, planted.document, f"{planted.question} {NEEDLE_HINT}")
    ids, spans = encode_marked(tokenizer, rendered, {"needle": planted.fact})
    if "needle" not in spans:
        raise ValueError("the planted needle was not found in the tokenized prompt")
    return NeedlePrompt(ids, spans["needle"], planted)


def read(pair: ModelPair, prompt: list[int], signal: RetrievalSignal, extra: int = 2) -> Target:
    """A target that has prefilled `prompt`, keeping the queries `signal` scores with (room for `extra` more tokens)."""
    target = Target(pair.target, GenerationConfig(), len(prompt) + extra, signal)
    for _ in target.prefill(prompt, None):
        pass
    return target


def head_map(target: Target, span: tuple[int, int], rows: int | None = None) -> torch.Tensor:
    """(layers, heads): the share of each head's attention (its last `rows` rows averaged) on `span`, for a target
    read with ALL_HEADS."""
    c = target.model.config
    return span_mass(target.head_scores(rows), span).view(c.num_hidden_layers, c.num_attention_heads)


def holds(kept_spans, span: tuple[int, int]) -> bool:
    """Whether the kept [start, end) spans cover every token of `span`."""
    return any(a <= span[0] and span[1] <= b for a, b in kept_spans)


def first_hold(pair: ModelPair, prompt: NeedlePrompt, retrieval: RetrievalConfig) -> dict[str, bool]:
    """Whether each working cache holds the whole needle after the first retrieval: CMR under the (resolved) signal
    `retrieval.signal`, and StreamingLLM's window."""
    signal = retrieval.signal
    target = read(pair, prompt.ids, signal)
    seq_len = len(prompt.ids) - 1  # what the draft has stored at the first retrieval: all but the last prompt token
    cmr = make_policy("cmr", retrieval).select(seq_len, target.token_scores())
    window = StreamingPolicy(retrieval).select(seq_len, None)
    return {signal.name: holds(cmr.kept_spans, prompt.span), "streaming": holds(window.kept_spans, prompt.span)}


def with_signal(retrieval: RetrievalConfig, signal: RetrievalSignal) -> RetrievalConfig:
    return replace(retrieval, signal=signal)
