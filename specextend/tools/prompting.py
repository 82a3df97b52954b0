"""Prompting: a document and an instruction in, the target's prompt ids out, and the ids a run stops on.

One path for the CLI, the benchmark and the app. The request is the document, a blank line and the instruction,
written by the tokenizer's chat template when it has one (templates with a thinking mode are asked not to think
about a long input, since a summary should start with the summary, and to think for a long output: `thinking`), else
as plain text after the tokenizer's own start token. Text that
spells a special token inside the document stays text. Truncation
drops the document's middle, never the template or the instruction. A run stops on the union of the end ids the
generation config, the model config and the tokenizer name.
Knows tokenizers and configs; knows nothing of weights, the engine or any UI.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable

DEFAULT_INSTRUCTION = "Summarize the document above in a few sentences."
LONG_OUTPUT_INSTRUCTION = "Continue this at length: write at least 2,000 words."
LONG_OUTPUT_TOKENS = 2048  # a long output's new tokens by default (the CLI, the benchmark, the app where its cap allows)
KEEP_HEAD = 256  # tokens of the prompt's start kept (at most half the limit) when the document's middle is dropped


@dataclass(frozen=True)
class Prompt:
    """A tokenized request: the ids, where the document sits in them, and where each marked passage sits."""

    ids: list[int]
    document_span: tuple[int, int]  # [start, end) of the document's tokens
    marks: dict[str, tuple[int, int]] = field(default_factory=dict)


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def control_strings(tokenizer) -> list[str]:
    """The texts the tokenizer reads as its special tokens (the template's turn markers, end of text, ...)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    found = {t.content for t in added.values() if getattr(t, "special", False)}
    found |= set(getattr(tokenizer, "all_special_tokens", ()))
    return sorted((t for t in found if len(t) > 1), key=len, reverse=True)


def defuse(text: str, controls: list[str]) -> str:
    """`text` with every special token's text (`control_strings`) broken by a zero-width space after its first
    character, so that a document quoting "<|im_end|>" stays text and cannot end the user's turn or open another."""
    for token in controls:
        if token in text:
            text = text.replace(token, f"{token[0]}\u200b{token[1:]}")
    return text


def render(tokenizer, document: str, instruction: str, thinking: bool = False) -> str:
    """The request as text: the chat template's rendering, or the plain prompt (document, blank line, instruction).
    The document and the instruction are user text: their special-token strings are defused. `thinking`: a template
    with a thinking mode opens the answer with it (a long output); templates without one ignore it."""
    controls = control_strings(tokenizer)
    return _write(tokenizer, defuse(document, controls), defuse(instruction, controls), thinking)


def _write(tokenizer, document: str, instruction: str, thinking: bool = False) -> str:
    """`render` of a document and an instruction already defused."""
    content = f"{document.strip()}\n\n{instruction.strip()}"
    if has_template(tokenizer):
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=thinking)
    return content + "\n"


def _locate(offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int] | None:
    """The token span [first, last + 1) of the tokens overlapping characters [start, end), or None."""
    inside = [i for i, (a, b) in enumerate(offsets) if a < end and start < b]
    return (inside[0], inside[-1] + 1) if inside else None


def encode(tokenizer, document: str, instruction: str, marks: dict[str, str] | None = None,
           limit: int | None = None, thinking: bool = False) -> Prompt:
    """Tokenize the request; the token spans of the document and of each marked passage's first occurrence in it
    (a passage not found, or dropped by truncation, is left out). With `limit`, a longer prompt loses the middle of
    its document (`truncate`); `thinking` as in `render`."""
    controls = control_strings(tokenizer)
    document, instruction = defuse(document, controls), defuse(instruction, controls)
    text = _write(tokenizer, document, instruction, thinking)
    # a template writes its own special tokens; a plain prompt takes the tokenizer's start token
    enc = tokenizer(text, add_special_tokens=not has_template(tokenizer), return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    body = document.strip()
    # the document where the request's content starts (a system prompt before it may contain the same words)
    at = text.find(f"{body}\n\n{instruction.strip()}") if body else -1
    at = text.rfind(body) if body and at < 0 else at
    span = _locate(offsets, at, at + len(body)) if at >= 0 else None
    spans = {}
    for name, passage in (marks or {}).items():
        passage = defuse(passage, controls)
        found = body.find(passage) if passage else -1
        located = _locate(offsets, at + found, at + found + len(passage)) if found >= 0 and at >= 0 else None
        if located is not None:
            spans[name] = located
    if span is None:  # an empty document: an empty span where the instruction starts
        i = text.find(instruction.strip())
        first = _locate(offsets, i, i + 1) if i >= 0 else None
        span = (first[0], first[0]) if first else (len(ids), len(ids))
    prompt = Prompt(ids, span, spans)
    return prompt if limit is None else truncate(prompt, limit)


def raw(tokenizer, text: str) -> Prompt:
    """The text as is (no template, no instruction), after the tokenizer's start token: all of it is the document."""
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    return Prompt(ids, (0, len(ids)))


def truncate(prompt: Prompt, limit: int, keep_head: int = KEEP_HEAD) -> Prompt:
    """The prompt in at most `limit` tokens: a run of the document's tokens dropped, so that the prompt keeps its
    first `keep_head` tokens (at most half the limit) and as much of its end as fits, and everything around the
    document stays. Raises ValueError when even the request without its document exceeds `limit`."""
    ids, (start, end) = prompt.ids, prompt.document_span
    cut = len(ids) - limit
    if cut <= 0:
        return prompt
    if cut > end - start:
        raise ValueError(f"the request without its document already takes {len(ids) - (end - start)} tokens, "
                         f"more than the {limit} allowed")
    head = min(max(start, min(keep_head, limit // 2)), end - cut)  # the cut lies inside the document
    gone = (head, head + cut)

    def moved(span: tuple[int, int]) -> tuple[int, int] | None:
        a, b = span
        if b <= gone[0]:
            return span
        if a >= gone[1]:
            return a - cut, b - cut
        return None  # the passage lost some of its tokens

    marks = {name: s for name, s in ((n, moved(s)) for n, s in prompt.marks.items()) if s is not None}
    return replace(prompt, ids=ids[:gone[0]] + ids[gone[1]:], document_span=(start, end - cut), marks=marks)


def _ids(value: Any) -> Iterable[int]:
    if value is None:
        return ()
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def stop_ids(tokenizer, *configs: Any) -> tuple[int, ...]:
    """The ids a run stops on: every end id of the given configs (a model's generation config and config, or
    the model itself, whose two configs are read) and the tokenizer's end of text."""
    ids = set(_ids(tokenizer.eos_token_id))
    for source in configs:
        for config in (getattr(source, "generation_config", None), getattr(source, "config", source)):
            ids.update(_ids(getattr(config, "eos_token_id", None)))
    return tuple(sorted(ids))
