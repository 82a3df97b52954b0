"""The decoding methods, in one table: each one's name, how the app and the figures call and colour it, and what it
runs by default (a draft model or not, which draft cache, which kernels). The config, the CLI, the benchmarks, the
visualizers and the app all read it. Knows names and defaults; nothing of models or any UI.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class DraftCache(str, Enum):
    """What the draft attends over: a string enum, so configs and events keep their plain JSON form."""

    FULL = "full"  # the whole committed prefix (standard speculative decoding)
    STREAMING = "streaming"  # attention-sink tokens plus a recent window (StreamingLLM)
    CMR = "cmr"  # the chunks the target's attention picks (Cross-model Retrieval)


@dataclass(frozen=True)
class MethodInfo:
    name: str
    label: str  # panels, tables, legends
    short: str  # bar labels
    choice: str  # the app's list of methods
    colour: str
    cache: DraftCache | None  # its draft cache unless ablated (None: no draft model)
    fast: bool  # fused prefill, the fastest tree kernel and captured steps (SpecExtend's); else transformers' defaults

    @property
    def draft_model(self) -> bool:
        """Whether a draft model proposes: the methods with a draft cache."""
        return self.cache is not None


METHOD_TABLE: tuple[MethodInfo, ...] = (
    MethodInfo("autoregressive", "target alone", "target alone", "the target alone", "#6c757d", None, True),
    MethodInfo("lookup", "lookup drafting alone", "lookup", "lookup drafting alone (copies, no draft model)", "#b5179e",
               None, True),
    MethodInfo("speculative", "speculative (full draft cache)", "speculative", "standard speculative decoding", "#e76f51",
               DraftCache.FULL, False),
    MethodInfo("streaming", "StreamingLLM draft cache", "streaming", "speculative, StreamingLLM draft cache", "#9b5de5",
               DraftCache.STREAMING, False),
    MethodInfo("specextend", "SpecExtend", "SpecExtend", "SpecExtend (CMR + fast attention)", "#2a6fdb",
               DraftCache.CMR, True),
)
METHOD_INFO = {m.name: m for m in METHOD_TABLE}
METHODS: tuple[str, ...] = tuple(METHOD_INFO)
