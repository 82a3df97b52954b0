"""Operator settings, read once from the environment: where to listen, which model pairs are allowed,
and the limits that keep a shared app serving. Knows nothing of gradio or models.

| variable | default | meaning |
|---|---|---|
| GRADIO_SERVER_NAME | 127.0.0.1 | address to bind (Spaces sets 0.0.0.0) |
| GRADIO_SERVER_PORT | 7860 | port |
| SPECEXTEND_PAIRS | (none) | extra pairs, comma-separated: a preset's name (PRESETS) or `target+draft` (hub ids, folders) |
| SPECEXTEND_DEFAULT_PAIR | the first | the pair shown first: `bundled`, `bundled-draft-model`, a preset, `target+draft` |
| SPECEXTEND_HIDE_BUNDLED | 0 | 1 leaves the bundled CPU pairs off the list |
| SPECEXTEND_PRELOAD | 0 | 1 downloads and loads the default pair before serving (progress in the log; a failure stops start-up) |
| SPECEXTEND_DTYPE | auto | the models' dtype: auto (bf16 or fp16 on a GPU, fp32 on CPU), bfloat16, float16, float32 |
| SPECEXTEND_NUMERICS | auto | the target's numerics (specextend/numerics.py), one per loaded pair: auto, fp32, bf16, bf16-kv |
| SPECEXTEND_MAX_INPUT_TOKENS | 0 | longest prompt in tokens a run may read (0: the target's context is the only limit) |
| SPECEXTEND_HUB | 0 | 1 lets the app download from the Hugging Face hub (else HF_HUB_OFFLINE=1); gated models need HF_TOKEN |
| SPECEXTEND_MAX_UPLOAD_KB | 1024 | largest document upload accepted |
| SPECEXTEND_MAX_DOCUMENT_CHARS | 400000 | longest document text however it arrives, checked before tokenizing |
| SPECEXTEND_MAX_TRACE_KB | 16384 | largest trace file accepted for replay |
| SPECEXTEND_MAX_NEW_TOKENS | 2048 | largest max_new_tokens a user may ask for (a long output writes up to this) |
| SPECEXTEND_CONCURRENCY | 1 | generations running at once; others wait in the queue |
| SPECEXTEND_QUEUE | 16 | requests that may wait in the queue |
| SPECEXTEND_REDRAW_S | 0.3 | shortest time between redraws of the live panels (and the charts' default) |
| SPECEXTEND_ZEROGPU_MAX_S | 120 | on a ZeroGPU Space, the longest GPU grant one click asks for, in seconds (app/zerogpu.py) |

SPECEXTEND_NUMERICS's "auto" is bf16-kv for an fp32 target on a CPU with native bf16 products (packed bf16 weights and
a bf16 KV cache, every method of a race in it, checked against the target alone in it), else fp32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from specextend.config import NUMERICS_CHOICES

BUNDLED = "bundled"  # the target with its EAGLE-3 head
BUNDLED_DRAFT_MODEL = "bundled-draft-model"  # the target with its distilled draft model


@dataclass(frozen=True)
class PairChoice:
    """One selectable model pair: the bundled default, or an allow-listed target + draft."""

    key: str  # what the UI sends back
    label: str  # what the UI shows
    target: str = ""
    draft: str = ""

    @property
    def bundled(self) -> bool:
        return self.key in (BUNDLED, BUNDLED_DRAFT_MODEL)


BUNDLED_PAIR = PairChoice(BUNDLED, "Bundled: SmolLM2-135M-Instruct target + its EAGLE-3 head (runs on CPU)")
BUNDLED_PAIRS = (BUNDLED_PAIR, PairChoice(BUNDLED_DRAFT_MODEL, "Bundled: SmolLM2-135M-Instruct target + its small "
                                          "distilled draft model (runs on CPU)"))

# GPU pairs an operator enables by name. Each shares one tokenizer (Qwen2.5's embeddings differ only in padding);
# the Llama pair is gated on the hub (HF_TOKEN of an account with access). Vicuna 7B 16K with a 68M draft is the
# paper's kind of pair: a draft trained on 2K positions serving 16K-token inputs.
PRESETS = {p.key: p for p in (
    PairChoice("qwen2.5-7b", "Qwen2.5-7B-Instruct target + Qwen2.5-0.5B-Instruct draft (GPU)",
               "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
    PairChoice("llama-3.1-8b", "Llama-3.1-8B-Instruct target + Llama-3.2-1B-Instruct draft (GPU, gated)",
               "meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"),
    PairChoice("qwen3-8b", "Qwen3-8B target + Qwen3-0.6B draft (GPU; thinks on a long output)", "Qwen/Qwen3-8B",
               "Qwen/Qwen3-0.6B"),
    PairChoice("vicuna-7b-16k", "Vicuna-7B-v1.5-16K target + Vicuna-68M draft (GPU, the paper's kind of pair)",
               "lmsys/vicuna-7b-v1.5-16k", "double7/vicuna-68m"),
    # the paper's EAGLE pairs (its authors' heads) and a published Qwen3-8B EAGLE-3 head
    PairChoice("llama-3.1-8b-eagle3", "Llama-3.1-8B-Instruct target + its EAGLE-3 head (GPU, gated)",
               "meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"),
    PairChoice("vicuna-7b-eagle", "Vicuna-7B-v1.3 target + its EAGLE head (GPU)", "lmsys/vicuna-7b-v1.3",
               "yuhuili/EAGLE-Vicuna-7B-v1.3"),
    PairChoice("deepseek-r1-llama-8b-eagle3",
               "DeepSeek-R1-Distill-Llama-8B target + its EAGLE-3 head (GPU; thinks: the paper's long-output pair)",
               "deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "yuhuili/EAGLE3-DeepSeek-R1-Distill-LLaMA-8B"),
    PairChoice("qwen3-8b-eagle3", "Qwen3-8B target + an EAGLE-3 head (GPU; thinks on a long output)", "Qwen/Qwen3-8B",
               "Tengyunw/qwen3_8b_eagle3"),
)}


def pair_key(entry: str) -> str:
    """The key a pair is known by: a name as it is, `target + draft` as `target+draft`."""
    target, sep, draft = (part.strip() for part in entry.strip().partition("+"))
    return f"{target}+{draft}" if sep else target


def parse_pairs(text: str) -> tuple[PairChoice, ...]:
    """`name, target+draft, ...` -> pair choices (a name from PRESETS); ValueError on anything else."""
    pairs = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        if entry in PRESETS:
            pairs.append(PRESETS[entry])
            continue
        target, sep, draft = (part.strip() for part in entry.partition("+"))
        if not sep or not target or not draft:
            raise ValueError(f"SPECEXTEND_PAIRS entry {entry!r} is neither a preset ({', '.join(PRESETS)}) nor of the "
                             "form target+draft")
        pairs.append(PairChoice(pair_key(entry), f"{target} target + {draft} draft", target, draft))
    return tuple(dict.fromkeys(pairs))  # each once, in order


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


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "0").strip()
    if raw not in ("0", "1", ""):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    return raw == "1"


DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 7860
    pairs: tuple[PairChoice, ...] = BUNDLED_PAIRS  # offered, in this order
    default_pair: str = ""  # the key selected when the page opens ("": the first offered)
    preload: bool = False  # load the default pair before serving
    dtype: str = "auto"
    numerics: str = "auto"  # the target's numerics setting, resolved per loaded pair (backend.serve)
    max_input_tokens: int = 0  # 0: the target's context is the only limit
    hub: bool = False
    max_upload_bytes: int = 1024 * 1024
    max_trace_bytes: int = 16 * 1024 * 1024
    max_new_tokens: int = 2048
    concurrency: int = 1
    queue_size: int = 16
    redraw_s: float = 0.3  # shortest time between panel redraws while a run streams
    redraw_share: float = 0.05  # most of the wall time panel drawing may take
    max_document_chars: int = 400_000  # ~100K tokens: more than any allowed model reads, cheap to refuse beyond
    zerogpu_max_s: int = 120  # on a ZeroGPU Space: the longest GPU grant a click asks for

    def __post_init__(self) -> None:
        if not self.pairs:
            raise ValueError("no model pair to serve: SPECEXTEND_HIDE_BUNDLED=1 needs a pair in SPECEXTEND_PAIRS")
        if self.default_pair and self.default_pair not in {p.key for p in self.pairs}:
            fix = ("unset SPECEXTEND_HIDE_BUNDLED" if self.default_pair in (BUNDLED, BUNDLED_DRAFT_MODEL)
                   else "add it to SPECEXTEND_PAIRS")
            raise ValueError(f"SPECEXTEND_DEFAULT_PAIR {self.default_pair!r} is not among the offered pairs "
                             f"({', '.join(p.key for p in self.pairs)}); {fix}")
        if self.dtype not in DTYPES:
            raise ValueError(f"SPECEXTEND_DTYPE must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.numerics not in NUMERICS_CHOICES:
            raise ValueError(f"SPECEXTEND_NUMERICS must be one of {', '.join(NUMERICS_CHOICES)}, got {self.numerics!r}")

    @property
    def default(self) -> PairChoice:
        """The pair selected when the page opens (and preloaded)."""
        return self.pair(self.default_pair) if self.default_pair else self.pairs[0]

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Settings:
        hidden = _flag(env, "SPECEXTEND_HIDE_BUNDLED")
        return cls(
            host=env.get("GRADIO_SERVER_NAME", "").strip() or "127.0.0.1",
            port=_number(env, "GRADIO_SERVER_PORT", 7860, 1),
            pairs=(*(() if hidden else BUNDLED_PAIRS), *parse_pairs(env.get("SPECEXTEND_PAIRS", ""))),
            default_pair=pair_key(env.get("SPECEXTEND_DEFAULT_PAIR", "")),
            preload=_flag(env, "SPECEXTEND_PRELOAD"),
            dtype=env.get("SPECEXTEND_DTYPE", "").strip() or "auto",
            numerics=env.get("SPECEXTEND_NUMERICS", "").strip() or "auto",
            max_input_tokens=_number(env, "SPECEXTEND_MAX_INPUT_TOKENS", 0, 0),
            hub=_flag(env, "SPECEXTEND_HUB"),
            max_upload_bytes=_number(env, "SPECEXTEND_MAX_UPLOAD_KB", 1024, 1) * 1024,
            max_trace_bytes=_number(env, "SPECEXTEND_MAX_TRACE_KB", 16384, 1) * 1024,
            max_document_chars=_number(env, "SPECEXTEND_MAX_DOCUMENT_CHARS", 400_000, 1),
            max_new_tokens=_number(env, "SPECEXTEND_MAX_NEW_TOKENS", 2048, 1),
            concurrency=_number(env, "SPECEXTEND_CONCURRENCY", 1, 1),
            queue_size=_number(env, "SPECEXTEND_QUEUE", 16, 1),
            redraw_s=_number(env, "SPECEXTEND_REDRAW_S", 0.3, 0.05, float),
            zerogpu_max_s=_number(env, "SPECEXTEND_ZEROGPU_MAX_S", 120, 1),
        )

    def pair(self, key: str) -> PairChoice:
        """The allow-listed pair with this key; anything else is refused."""
        for choice in self.pairs:
            if choice.key == key:
                return choice
        raise ValueError(f"model pair {key!r} is not on this server's allow-list")
