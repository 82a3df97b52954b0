"""Operator settings, read once from the environment: where to listen, which model pairs are allowed,
and the limits that keep a shared app serving. Knows nothing of gradio or models.

| variable | default | meaning |
|---|---|---|
| GRADIO_SERVER_NAME | 127.0.0.1 | address to bind (Spaces sets 0.0.0.0) |
| GRADIO_SERVER_PORT | 7860 | port |
| SPECEXTEND_PAIRS | (none) | extra pairs, comma-separated `target+draft` (hub ids or local folders) |
| SPECEXTEND_HUB | 0 | 1 lets the app download from the Hugging Face hub (else HF_HUB_OFFLINE=1) |
| SPECEXTEND_MAX_UPLOAD_KB | 1024 | largest document upload accepted |
| SPECEXTEND_MAX_DOCUMENT_CHARS | 400000 | longest document text however it arrives, checked before tokenizing |
| SPECEXTEND_MAX_TRACE_KB | 16384 | largest trace file accepted for replay |
| SPECEXTEND_MAX_NEW_TOKENS | 1024 | largest max_new_tokens a user may ask for |
| SPECEXTEND_CONCURRENCY | 1 | generations running at once; others wait in the queue |
| SPECEXTEND_QUEUE | 16 | requests that may wait in the queue |
| SPECEXTEND_REDRAW_S | 0.3 | shortest time between redraws of the live panels (and the charts' default) |
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

BUNDLED = "bundled"


@dataclass(frozen=True)
class PairChoice:
    """One selectable model pair: the bundled default, or an allow-listed target + draft."""

    key: str  # what the UI sends back
    label: str  # what the UI shows
    target: str = ""
    draft: str = ""

    @property
    def bundled(self) -> bool:
        return self.key == BUNDLED


BUNDLED_PAIR = PairChoice(BUNDLED, "Bundled: SmolLM2-135M-Instruct target + its small SpecExtend draft (runs on CPU)")


def parse_pairs(text: str) -> tuple[PairChoice, ...]:
    """`target+draft, target+draft` -> pair choices; raises ValueError on an entry without both parts."""
    pairs = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        target, sep, draft = (part.strip() for part in entry.partition("+"))
        if not sep or not target or not draft:
            raise ValueError(f"SPECEXTEND_PAIRS entry {entry!r} is not of the form target+draft")
        pairs.append(PairChoice(f"{target}+{draft}", f"{target} target + {draft} draft", target, draft))
    return tuple(pairs)


def _number(env: Mapping[str, str], name: str, default: int | float, low: int | float, kind: type = int):
    """An operator setting parsed as `kind` (int or float), at least `low`; `default` when unset."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {raw!r}") from None
    if not value >= low:  # also rejects NaN
        raise ValueError(f"{name} must be at least {low}, got {value}")
    return value


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 7860
    pairs: tuple[PairChoice, ...] = (BUNDLED_PAIR,)
    hub: bool = False
    max_upload_bytes: int = 1024 * 1024
    max_trace_bytes: int = 16 * 1024 * 1024
    max_new_tokens: int = 1024
    concurrency: int = 1
    queue_size: int = 16
    redraw_s: float = 0.3  # shortest time between panel redraws while a run streams
    redraw_share: float = 0.05  # most of the wall time panel drawing may take
    max_document_chars: int = 400_000  # ~100K tokens: more than any allowed model reads, cheap to refuse beyond

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Settings:
        return cls(
            host=env.get("GRADIO_SERVER_NAME", "").strip() or "127.0.0.1",
            port=_number(env, "GRADIO_SERVER_PORT", 7860, 1),
            pairs=(BUNDLED_PAIR, *parse_pairs(env.get("SPECEXTEND_PAIRS", ""))),
            hub=env.get("SPECEXTEND_HUB", "0").strip() == "1",
            max_upload_bytes=_number(env, "SPECEXTEND_MAX_UPLOAD_KB", 1024, 1) * 1024,
            max_trace_bytes=_number(env, "SPECEXTEND_MAX_TRACE_KB", 16384, 1) * 1024,
            max_document_chars=_number(env, "SPECEXTEND_MAX_DOCUMENT_CHARS", 400_000, 1),
            max_new_tokens=_number(env, "SPECEXTEND_MAX_NEW_TOKENS", 1024, 1),
            concurrency=_number(env, "SPECEXTEND_CONCURRENCY", 1, 1),
            queue_size=_number(env, "SPECEXTEND_QUEUE", 16, 1),
            redraw_s=_number(env, "SPECEXTEND_REDRAW_S", 0.3, 0.05, float),
        )

    def pair(self, key: str) -> PairChoice:
        """The allow-listed pair with this key; anything else is refused."""
        for choice in self.pairs:
            if choice.key == key:
                return choice
        raise ValueError(f"model pair {key!r} is not on this server's allow-list")
