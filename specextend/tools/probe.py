"""Offline looks at where the target's attention goes, for calibration, the benchmark and the needle tab.

`needle_prompt` builds a needle question over a document and finds the needle's token span; `read` prefills a
target that keeps the queries of the heads a signal names, `read_signals` one for several signals at once;
`head_map` is the share of each head's attention on a span (the layer x head picture), `map_heads` that picture
with the heads each signal scores with; `holds` says whether a working cache kept a whole span. Everything here
runs the target's prefill only.
Knows models through the target module; knows nothing of the UI.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import needle, prompting
from ..config import GenerationConfig, RetrievalSignal
from ..target import Target
from ..models import ModelPair
from ..signal import combine, span_mass

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
    prompt = prompting.encode(tokenizer, planted.document, f"{planted.question} {NEEDLE_HINT}", {"needle": planted.fact})
    if "needle" not in prompt.marks:
        raise ValueError("the planted needle was not found in the tokenized prompt")
    return NeedlePrompt(prompt.ids, prompt.marks["needle"], planted)


def read(pair: ModelPair, prompt: list[int], signal: RetrievalSignal, extra: int = 2) -> Target:
    """A target that has prefilled `prompt`, keeping the queries `signal` scores with (room for `extra` more tokens)."""
    target = Target(pair.target, GenerationConfig(), len(prompt) + extra, signal)
    for _ in target.prefill(prompt, None):
        pass
    return target


def read_signals(pair: ModelPair, prompt: list[int], signals: dict[str, RetrievalSignal], extra: int = 2
                 ) -> tuple[Target, dict[str, torch.Tensor]]:
    """One prefill for several signals: a target that keeps the union of their heads and rows, and each signal's
    token scores (T,) as target.Target would give them after that prefill."""
    c = pair.target.config
    pairs = {name: sig.pairs(c.num_hidden_layers, c.num_attention_heads) for name, sig in signals.items()}
    union = sorted({p for heads in pairs.values() for p in heads})
    target = read(pair, prompt, RetrievalSignal("union", heads=tuple(union), rows=max(s.rows for s in signals.values())),
                  extra)
    index = {p: i for i, p in enumerate(union)}  # the window keeps heads layer by layer, ascending
    by_rows = {rows: target.head_scores(rows) for rows in {s.rows for s in signals.values()}}  # (H_union, T)
    scores = {}
    for name, sig in signals.items():
        rows = [index[p] for p in pairs[name]]
        scores[name] = combine(by_rows[sig.rows][rows], sig.combine).cpu()
    return target, scores


def head_map(target: Target, span: tuple[int, int], rows: int | None = None) -> torch.Tensor:
    """(layers, heads): the share of each head's attention (its last `rows` rows averaged) on `span`, for a target
    read with ALL_HEADS."""
    c = target.model.config
    return span_mass(target.head_scores(rows), span).view(c.num_hidden_layers, c.num_attention_heads)


@dataclass(frozen=True)
class HeadMap:
    """Where each of the target's heads looks: the share of its attention (its last `rows` query rows averaged) on a
    span, per (layer, head); and which heads each named signal scores with."""

    share: tuple[tuple[float, ...], ...]  # (layers, heads)
    rows: int
    signals: dict[str, tuple[tuple[int, int], ...]]  # signal name -> its (layer, head) pairs


def map_heads(pair: ModelPair, prompt: list[int], span: tuple[int, int], signals: dict[str, RetrievalSignal]) -> HeadMap:
    """One prefill with every head's queries kept: the layer x head picture for `span`, read with the rows of the
    first signal given, and the heads of each signal."""
    c = pair.target.config
    rows = next(iter(signals.values())).rows if signals else ALL_HEADS.rows
    share = head_map(read(pair, prompt, replace(ALL_HEADS, rows=rows)), span)
    heads = {name: sig.pairs(c.num_hidden_layers, c.num_attention_heads) for name, sig in signals.items()}
    return HeadMap(tuple(tuple(row) for row in share.tolist()), rows, heads)


def holds(kept_spans, span: tuple[int, int]) -> bool:
    """Whether the kept [start, end) spans cover every token of `span`."""
    return any(a <= span[0] and span[1] <= b for a, b in kept_spans)
