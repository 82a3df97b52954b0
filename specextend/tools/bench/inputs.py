"""The benchmark's methods and inputs: each method's config (the engine's methods, SpecExtend's ablations, and
transformers' own peers), prompts cut from the bundled eval documents to each input length, and the short prompts of
the long-output section."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from .. import bundled, prompting
from ...config import AttentionConfig, GenerationConfig, LookupConfig, RetrievalConfig, preset


ASSISTED = "hf_assisted"  # transformers' generate(..., assistant_model=draft): the outside reference
PROMPT_LOOKUP = "hf_prompt_lookup"  # transformers' generate(..., prompt_lookup_num_tokens=10): lookup's peer
PEERS = (ASSISTED, PROMPT_LOOKUP)  # run by transformers, not by this engine
HF_LOOKUP_TOKENS = 10  # the prompt_lookup_num_tokens transformers' documentation uses
METHODS = ("autoregressive", "speculative", "streaming", "specextend", "specextend_paper", "cmr_only", "fused_prefill_only",
           "hta_only", "lookup", "specextend_lookup", ASSISTED, PROMPT_LOOKUP)
BASELINES = ("autoregressive", "speculative", ASSISTED, PROMPT_LOOKUP)
LONG_OUTPUT_METHODS = ("autoregressive", "speculative", "streaming", "specextend", "specextend_lookup")
QUICK_SHAPE = (2, 64, 4, 2, 128)  # --quick target: layers, hidden, heads, KV heads, MLP width
QUICK = dict(lengths="160,336", docs=1, repeats=1, max_new_tokens=8, needles=2, needle_tokens=240,
             needle_depths="0.3,0.7", long_output_tokens=48, long_output_window=16,
             retrieval=RetrievalConfig(chunk_size=16, top_k=8, retrieve_every=2, prefill_window=64))


class GreedyMismatch(RuntimeError):
    """Two methods produced different greedy outputs on the same input."""


# ---------------------------------------------------------------- methods and inputs


def method_configs(base: dict, prefill: str, lookup: LookupConfig) -> dict[str, GenerationConfig | None]:
    """name -> engine config (None: a transformers peer). `prefill` is the baselines' prefill kernel: 'fused'
    (SDPA, what transformers does by default) or 'eager' (the paper's baseline). `lookup`: lookup's knobs."""
    speculative = preset("speculative", attention=AttentionConfig(prefill, "masked"), **base)
    return {
        "autoregressive": preset("autoregressive", attention=AttentionConfig(prefill, "auto", "auto"), **base),
        "speculative": speculative,
        "streaming": preset("streaming", attention=AttentionConfig(prefill, "masked"), **base),
        "specextend": preset("specextend", **base),
        "specextend_paper": preset("specextend", **{**base, "retrieval": replace(base["retrieval"], signal="paper")}),
        "cmr_only": speculative.replace(cmr=True),
        "fused_prefill_only": speculative.replace(attention=AttentionConfig("fused", "masked")),
        "hta_only": speculative.replace(attention=AttentionConfig(prefill, "hybrid")),
        "lookup": preset("lookup", lookup=replace(lookup, enabled=None), **base),
        "specextend_lookup": preset("specextend", lookup=replace(lookup, enabled=True), **base),
        ASSISTED: None,
        PROMPT_LOOKUP: None,
    }


def aliases(configs: dict[str, GenerationConfig | None]) -> dict[str, str]:
    """Methods whose config equals an earlier one's (fused_prefill_only is speculative under --prefill fused)."""
    seen: dict[GenerationConfig, str] = {}
    out = {}
    for name, config in configs.items():
        if config is not None and config in seen:
            out[name] = seen[config]
        elif config is not None:
            seen[config] = name
    return out


def cut_text(tokenizer, text: str, tokens: int) -> str:
    """The first `tokens` target tokens of `text`, as text."""
    return tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][: max(tokens, 1)])


def make_prompt(tokenizer, text: str, length: int, instruction: str) -> list[int]:
    """A chat prompt of about `length` tokens: the document's start, then the instruction (at most `length`)."""
    overhead = len(prompting.encode(tokenizer, "", instruction).ids)
    return prompting.encode(tokenizer, cut_text(tokenizer, text, length - overhead), instruction, limit=length).ids


def make_inputs(tokenizer, lengths: list[int], n_docs: int, instruction: str, files: list[str] = ()) -> list[dict]:
    """The `n_docs` longest eval documents, or the UTF-8 text `files` when given (text nobody tuned for), each cut
    to every length (the same documents at every length)."""
    if files:
        texts = [(Path(f).name, Path(f).read_text(encoding="utf-8")) for f in files]
    else:
        texts = [(d.name, d.text()) for d in sorted(bundled.documents("eval"), key=lambda d: -d.tokens)[:n_docs]]
    return [{"length": length, "document": name, "prompt": make_prompt(tokenizer, text, length, instruction)}
            for length in lengths for name, text in texts]


def long_output_inputs(tokenizer, files: list[str] = ()) -> list[dict]:
    """The long-output section's prompts: the bundled short prompts with their own instructions, or the UTF-8 text
    `files` (text nobody tuned for) with prompting.LONG_OUTPUT_INSTRUCTION; a template with a thinking mode thinks."""
    if files:
        texts = [(Path(f).name, Path(f).read_text(encoding="utf-8"), prompting.LONG_OUTPUT_INSTRUCTION) for f in files]
    else:
        texts = [(p.name, p.text(), p.instruction) for p in bundled.short_prompts()]
    return [{"document": name, "prompt": prompting.encode(tokenizer, text, instruction, thinking=True).ids}
            for name, text, instruction in texts]
