"""Command line: `.venv/bin/python -m specextend generate --input FILE --method METHOD [knobs]`.

A thin shell around the engine: it owns tokenization (the engine sees token ids only), prints the
generated text and, as its last line, one JSON object with the run's figures. What the run is doing
(the prompt's reading, the decoding) goes to stderr as the engine's events arrive, unless --quiet.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from functools import partial
from pathlib import Path
from typing import TextIO

from . import prompting
from ..config import (METHODS, NUMERICS_CHOICES, SIGNAL_NAMES, AttentionConfig, DraftConfig, LookupConfig, RetrievalConfig,
                     RetrievalSignal, draft_defaults, preset)
from ..events import Event, Finished, Prefilled, Prefilling, Started, Verified


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=".venv/bin/python -m specextend", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate from a document with one method",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("--input", required=True, help="UTF-8 text file: the document (with --long-output: the short prompt)")
    g.add_argument("--method", choices=METHODS, default="specextend", help="decoding method")
    g.add_argument("--long-output", action="store_true",
                   help="the long-output workload: a short prompt and a long generation (a template with a thinking "
                        f"mode thinks; the instruction defaults to {prompting.LONG_OUTPUT_INSTRUCTION!r} and "
                        f"--max-new-tokens to {prompting.LONG_OUTPUT_TOKENS})")
    g.add_argument("--instruction", help="the task, appended after the document (default: "
                                         f"{prompting.DEFAULT_INSTRUCTION!r})")
    g.add_argument("--raw", action="store_true", help="feed the document as is: no chat template, no instruction")
    g.add_argument("--truncate", action="store_true",
                   help="if the prompt plus max-new-tokens exceeds the target's limit, drop the document's middle "
                        "(keeping its start, its end and the instruction) instead of failing")
    g.add_argument("--target", help="target model: local dir, dir with one .gguf, or hub id (default: bundled)")
    g.add_argument("--draft", help="draft model (default: bundled)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    add_numerics_argument(g)
    g.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)")
    g.add_argument("--max-new-tokens", type=int, help=f"default: 128 ({prompting.LONG_OUTPUT_TOKENS} with --long-output)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    # draft settings default to the device's (config.draft_defaults): a chain of 2 on CPU, a 15-node tree on CUDA
    g.add_argument("--draft-shape", choices=("chain", "tree"))
    g.add_argument("--k", type=int, help="chain: draft tokens per step (default: 2 on CPU, 4 on CUDA)")
    g.add_argument("--max-depth", type=int, help="tree: deepest level")
    g.add_argument("--node-budget", type=int, help="tree: most nodes verified per step")
    g.add_argument("--branch", type=int, help="tree: frontier nodes expanded per level")
    g.add_argument("--children", type=int, help="tree: children per expanded node")
    g.add_argument("--stop-threshold", type=float, help="tree: stop growing below this cumulative draft probability")
    g.add_argument("--confidence-floor", type=float,
                   help="chain: end the chain before a token that would take its draft probability below this")
    r = RetrievalConfig()
    g.add_argument("--chunk-size", type=int, default=r.chunk_size, help="CMR chunk size in tokens")
    g.add_argument("--top-k", type=int, default=r.top_k, help="CMR chunks in the working cache (sink and newest included)")
    g.add_argument("--working-cache", type=int, help="working cache in tokens (sets --top-k = this // chunk size)")
    g.add_argument("--retrieve-every", type=int, default=r.retrieve_every, help="CMR: steps between retrievals")
    g.add_argument("--prefill-window", type=int, default=r.prefill_window, help="draft's sliding prefill window")
    g.add_argument("--sink-tokens", type=int, default=r.sink_tokens, help="streaming: attention-sink tokens")
    g.add_argument("--prefill", choices=("fused", "eager"), help="prefill kernel (default: the method's)")
    g.add_argument("--verify", choices=("hybrid", "onecall", "masked", "auto"),
                   help="verification kernel (default: the method's)")
    g.add_argument("--steps", choices=("auto", "eager", "static", "captured"),
                   help="decode-time forwards: captured CUDA graphs, static shapes, or eager (default: the method's)")
    g.add_argument("--cmr", action=argparse.BooleanOptionalAction, default=None,
                   help="Cross-model Retrieval on/off (default: on for specextend only)")
    g.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=None,
                   help="lookup drafting: add copied continuations to the draft's tree (default: on for method lookup only)")
    add_lookup_arguments(g)
    add_signal_arguments(g)
    g.add_argument("--trace", help="save the run's events as a JSON trace here")
    g.add_argument("--quiet", action="store_true",
                   help="print nothing on stderr but errors (no progress, no word on the bundled target's preparation)")
    return p


def add_numerics_argument(parser: argparse.ArgumentParser) -> None:
    """The target's numerics setting (shared by the CLI, the benchmark and scripts/race_time.py)."""
    parser.add_argument("--numerics", choices=NUMERICS_CHOICES, default="auto",
                        help="the target's products and KV cache (specextend/numerics.py): auto is bf16-kv for an fp32 "
                             "target on a CPU with native bf16 products, else fp32; every method runs in it")


def add_lookup_arguments(parser: argparse.ArgumentParser) -> None:
    """Lookup drafting's knobs (shared by the CLI and the benchmark); `lookup_from` reads them back."""
    lk = LookupConfig()
    parser.add_argument("--lookup-max-ngram", type=int, default=lk.max_ngram, help="lookup: longest suffix matched")
    parser.add_argument("--lookup-min-ngram", type=int, default=lk.min_ngram, help="lookup: shortest suffix matched")
    parser.add_argument("--lookup-tokens", type=int, default=lk.max_tokens, help="lookup: most tokens a branch copies")
    parser.add_argument("--lookup-branches", type=int, default=lk.branches,
                        help="lookup: most branches (distinct first tokens)")
    parser.add_argument("--lookup-rank", choices=("recent", "frequent", "first"), default=lk.rank,
                        help="lookup: which matches first: latest, commonest next token, or earliest")
    parser.add_argument("--lookup-with-draft", choices=("always", "on_miss"), default=lk.with_draft,
                        help="lookup with a draft model: merge both every step, or ask the draft model only on a miss")
    parser.add_argument("--lookup-adaptive", action=argparse.BooleanOptionalAction, default=lk.adaptive,
                        help="lookup: a branch is at most 2a + 2 tokens, a = tokens of the last proposal committed")
    parser.add_argument("--lookup-draft-gate", type=float, default=lk.draft_gate,
                        help="lookup with a draft model: ask the draft model only while its last proposals averaged at "
                             "least this many accepted tokens (0: always)")


def add_signal_arguments(parser: argparse.ArgumentParser) -> None:
    """The retrieval signal: a name, or a signal of your own from any of the --signal-* knobs."""
    parser.add_argument("--signal", choices=SIGNAL_NAMES, default=RetrievalConfig().signal,
                        help="CMR's retrieval signal: paper (final layer, last token, heads averaged), calibrated (the "
                             "pair's calibrated heads), default (calibrated where the pair has it, else every head's max)")
    parser.add_argument("--signal-layers", help="a signal of your own: 'final', 'all', or comma-separated layer indices "
                                                "(negative from the end)")
    parser.add_argument("--signal-rows", type=int, help="a signal of your own: query rows, the last W tokens read")
    parser.add_argument("--signal-combine", choices=("mean", "max"), help="a signal of your own: how heads combine")
    parser.add_argument("--signal-reserve", type=float,
                        help="a signal of your own: share of the working cache kept for the newest chunks, in [0, 1)")


def signal_from(args: argparse.Namespace) -> str | RetrievalSignal:
    """The --signal name, or (when a --signal-* knob is given) a signal of those knobs on the paper's defaults."""
    knobs = (args.signal_layers, args.signal_rows, args.signal_combine, args.signal_reserve)
    if all(k is None for k in knobs):
        return args.signal
    layers = (args.signal_layers or "final").strip()
    try:
        parsed = (-1,) if layers == "final" else () if layers == "all" else tuple(int(x) for x in layers.split(","))
    except ValueError:
        raise ValueError(f"--signal-layers must be 'final', 'all' or comma-separated integers, got {layers!r}") from None
    paper = RetrievalSignal()
    pick = lambda value, default: default if value is None else value  # noqa: E731
    return RetrievalSignal("custom", layers=parsed, rows=pick(args.signal_rows, paper.rows),
                           combine=pick(args.signal_combine, paper.combine),
                           reserve=pick(args.signal_reserve, paper.reserve))


def lookup_from(args: argparse.Namespace, enabled: bool | None) -> LookupConfig:
    return LookupConfig(enabled=enabled, max_ngram=args.lookup_max_ngram, min_ngram=args.lookup_min_ngram,
                        max_tokens=args.lookup_tokens, branches=args.lookup_branches, rank=args.lookup_rank,
                        with_draft=args.lookup_with_draft, adaptive=args.lookup_adaptive,
                        draft_gate=args.lookup_draft_gate)


def workload(args: argparse.Namespace) -> tuple[str, int]:
    """The instruction and max new tokens: as given, else the workload's (a long input's, or --long-output's)."""
    instruction, tokens = ((prompting.LONG_OUTPUT_INSTRUCTION, prompting.LONG_OUTPUT_TOKENS) if args.long_output
                           else (prompting.DEFAULT_INSTRUCTION, 128))
    given = lambda value, default: default if value is None else value  # noqa: E731
    return given(args.instruction, instruction), given(args.max_new_tokens, tokens)


def config_from(args: argparse.Namespace, eos: tuple[int, ...], device_type: str = "cpu", numerics: str = "fp32"):
    """A GenerationConfig from parsed arguments (draft settings not given: the device's defaults) in the numerics
    setting `numerics` (--numerics resolved for the loaded target: `numerics.choose`); every nonsense value raises
    ValueError here."""
    if args.working_cache is not None:
        retrieval = RetrievalConfig.with_working_cache(
            args.working_cache, args.chunk_size, retrieve_every=args.retrieve_every,
            prefill_window=args.prefill_window, sink_tokens=args.sink_tokens, signal=signal_from(args))
    else:
        retrieval = RetrievalConfig(args.chunk_size, args.top_k, args.retrieve_every, args.prefill_window, args.sink_tokens,
                                    signal=signal_from(args))
    d = draft_defaults(device_type)
    given = lambda value, default: default if value is None else value  # noqa: E731
    draft = DraftConfig(given(args.draft_shape, d.shape), given(args.k, d.k), given(args.max_depth, d.max_depth),
                        given(args.node_budget, d.node_budget), given(args.branch, d.branch),
                        given(args.children, d.children), given(args.stop_threshold, d.stop_threshold),
                        given(args.confidence_floor, d.confidence_floor))
    lookup = lookup_from(args, args.lookup)
    base = preset(args.method).attention
    attention = AttentionConfig(prefill=args.prefill or base.prefill, verify=args.verify or base.verify,
                                steps=args.steps or base.steps, numerics=numerics)
    return preset(args.method, max_new_tokens=workload(args)[1], temperature=args.temperature, top_p=args.top_p,
                  seed=args.seed, eos_token_ids=eos, draft=draft, retrieval=retrieval, attention=attention, cmr=args.cmr,
                  lookup=lookup)


def prompt_from(args: argparse.Namespace, tokenizer, text: str, room: int) -> list[int]:
    """The prompt ids the arguments ask for (`room`: the positions the prompt may take, used with --truncate)."""
    request = prompting.raw(tokenizer, text) if args.raw else prompting.encode(tokenizer, text, workload(args)[0],
                                                                               thinking=args.long_output)
    return (prompting.truncate(request, room) if args.truncate else request).ids


def duration(seconds: float) -> str:
    """A wait in words: `12 s`, `3.5 min`."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


class Progress:
    """Tells a person what a run is doing, from its events as they arrive: the prompt's reading (blocks read,
    tokens/s, time left) and the decoding (tokens, tokens/s, tokens per step). One line at most every `every_s`
    seconds of the run's clock; the start, the last block of a reading and the end always. On a terminal a phase's
    lines overwrite each other; elsewhere (a log, a pipe) each is a line of its own."""

    def __init__(self, stream: TextIO, every_s: float = 1.0):
        self.stream, self.every_s = stream, every_s
        self.overwrite = stream.isatty()
        self.shown_t = -math.inf  # the run's clock at the last line written
        self.phase = ""  # what the last line was about; a new one starts a new line on a terminal
        self.first_block: dict[str, int] = {}  # model -> tokens its first block read (its block size)
        self.blocks: dict[str, int] = {}  # model -> blocks read so far
        self.max_new = 0
        self.decode_from: Prefilled | None = None

    def __call__(self, event: Event) -> None:
        said = self.line(event)
        if said is None:
            return
        phase, text, always = said
        if not always and phase == self.phase and event.t_s - self.shown_t < self.every_s:
            return
        self.shown_t = event.t_s
        if self.overwrite:
            self.stream.write(("\n" if self.phase and phase != self.phase else "\r") + text + "\033[K")
            if isinstance(event, Finished):
                self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.phase = phase

    def line(self, event: Event) -> tuple[str, str, bool] | None:
        """(phase, text, always shown) for an event worth a line, else None."""
        if isinstance(event, Started):
            self.max_new = event.config.get("max_new_tokens", 0)
            return "start", f"{event.method}: reading {len(event.prompt_ids):,} prompt tokens on {event.device}", True
        if isinstance(event, Prefilling):
            model = event.model
            self.first_block.setdefault(model, event.done)
            self.blocks[model] = self.blocks.get(model, 0) + 1
            total_blocks = math.ceil(event.total / max(self.first_block[model], 1))
            rate = event.done / event.elapsed_s if event.elapsed_s > 0 else 0.0
            left = f", about {duration((event.total - event.done) / rate)} left" if rate and event.done < event.total else ""
            return (model, f"the {model} reads the prompt: block {self.blocks[model]} of {total_blocks} "
                           f"({event.done:,} of {event.total:,} tokens), {rate:,.0f} tokens/s{left}",
                    event.done >= event.total)
        if isinstance(event, Prefilled):
            self.decode_from = event
            return "read", f"the prompt read in {event.elapsed_s:.1f} s; decoding", True
        if isinstance(event, Verified) and self.decode_from is not None:
            seconds = event.t_s - self.decode_from.t_s
            rate = (event.total_new - 1) / seconds if seconds > 0 else 0.0  # the first token is the prefill's
            return ("decode", f"decoding: {event.total_new:,} of at most {self.max_new:,} tokens, {rate:.1f} tokens/s, "
                              f"{(event.total_new - 1) / event.step:.2f} tokens per step", False)
        if isinstance(event, Finished):
            note = f": {event.message}" if event.message else ""
            return ("end", f"finished ({event.stop_reason}{note}): {len(event.token_ids):,} tokens in "
                           f"{duration(event.t_s)}, {event.steps:,} steps", True)
        return None


def generate_command(args: argparse.Namespace) -> int:
    import torch
    from transformers.utils import logging as hf_logging

    from . import bundled
    from ..engine import generate
    from ..events import save_trace
    from ..metrics import summarize
    from ..models import load_pair, read_tokenizer
    from ..numerics import choose

    text = Path(args.input).read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"{args.input} is empty")
    if args.threads:
        torch.set_num_threads(args.threads)
    # the bundled target's first preparation says how far it has got, on stderr (stdout keeps the text and the JSON)
    say = (lambda message: None) if args.quiet else partial(print, file=sys.stderr, flush=True)
    target, draft = bundled.pair_or_default(args.target, args.draft, say)
    tokenizer = read_tokenizer(target)
    bars = hf_logging.is_progress_bar_enabled()
    if args.quiet:  # transformers' own bars too ("Loading weights"), while the pair loads
        hf_logging.disable_progress_bar()
    try:
        pair = load_pair(target, draft if args.method not in ("autoregressive", "lookup") else None, args.device,
                         args.dtype, tokenizer)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    config = config_from(args, prompting.stop_ids(tokenizer, pair.target), pair.device.type,
                         choose(pair.target, args.numerics))
    prompt = prompt_from(args, tokenizer, text, pair.max_positions - config.max_new_tokens)
    progress = (lambda event: None) if args.quiet else Progress(sys.stderr)
    trace = []
    for event in generate(pair, prompt, config):
        trace.append(event)
        progress(event)
    if args.trace:
        save_trace(trace, args.trace)
    finished = trace[-1]
    assert isinstance(finished, Finished)
    summary = summarize(trace)
    out_text = tokenizer.decode(list(finished.token_ids), skip_special_tokens=True)
    print(out_text)
    print(json.dumps({
        "method": config.method, "prompt_tokens": len(prompt), "token_ids": list(finished.token_ids),
        "text": out_text, **summary.figures(),
        "device": str(pair.device), "dtype": str(pair.dtype).replace("torch.", ""), "numerics": config.attention.numerics,
        "backend": pair.backend,
        "config": trace[0].config,  # as the engine ran it: the retrieval signal resolved for the pair
    }))
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        return generate_command(args)
    except (ValueError, FileNotFoundError, UnicodeDecodeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
