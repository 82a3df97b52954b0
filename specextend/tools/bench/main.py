"""The benchmark's run: load the pair, run the grid, the sweep, the needle and the long-output sections, write the
report."""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
import torch
from dataclasses import asdict, replace
from pathlib import Path

from .. import bundled, prompting
from ...config import DraftConfig, RetrievalConfig, default_chain
from ...models import ModelPair, load_pair, make_pair, prefill_dtype, read_tokenizer
from ...numerics import apply, bf16_prefill, choose
from ..cli import add_lookup_arguments, add_numerics_argument, add_signal_arguments, lookup_from, signal_from
from ..kernel_bench import llama
from .inputs import (GreedyMismatch, LONG_OUTPUT_METHODS, METHODS, PEERS, QUICK, QUICK_SHAPE, aliases, cut_text,
                     long_output_inputs, make_inputs, method_configs)
from .report import plain, table, write_outputs
from .runs import cells, check_or_keep, check_same, goals, rotated, run_engine, run_method
from .sections import (NeedleSection, NeedleSummary, long_output_section, needle_case, needle_signals, needle_texts,
                       sweep_configs, sweep_row)


# ---------------------------------------------------------------- the run


def load(args) -> tuple[ModelPair, object, tuple[int, ...]]:
    """(pair, tokenizer, stop ids): tiny random-init models with the bundled pair's tokenizer (--quick: the bundled
    target's, prepared on first use), or real models."""
    if args.quick:  # the draft is a copy of the target, so drafts are accepted and every path runs
        tokenizer = read_tokenizer(bundled.target_dir())
        target = llama(QUICK_SHAPE, len(tokenizer), torch.float32, "cpu", seed=1, max_positions=4096)
        pair = make_pair(target, copy.deepcopy(target))
    else:
        target, draft = bundled.pair_or_default(args.target, args.draft)
        tokenizer = read_tokenizer(target)
        pair = load_pair(target, draft, args.device, args.dtype, tokenizer)
    return pair, tokenizer, prompting.stop_ids(tokenizer, pair.target)


def reader(method: str, prefill: str, numerics: str = "fp32") -> str:
    """Which reading and decoding a method's greedy output is compared within: one for all, unless the engine's methods
    may read the prompt in bf16 (`prefill`, the bf16_prefill asked) or run in a bf16 numerics setting while
    transformers' peers (PEERS) run the target in fp32."""
    return "transformers" if method in PEERS and (prefill != "off" or numerics != "fp32") else "engine"


def machine(pair: ModelPair) -> dict:
    import transformers

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": str(pair.device),
            "gpu": torch.cuda.get_device_name(pair.device) if pair.device.type == "cuda" else None,
            "dtype": str(pair.dtype).replace("torch.", ""), "backend": pair.backend,
            "load_average_start": os.getloadavg() if hasattr(os, "getloadavg") else None}


def run(args, progress) -> dict:
    pair, tokenizer, eos = load(args)
    numerics = choose(pair.target, args.numerics)  # every engine method runs in it; the peers as loaded (fp32)
    retrieval = replace(QUICK["retrieval"] if args.quick else RetrievalConfig(), signal=signal_from(args))
    draft = DraftConfig(shape=args.draft_shape, k=default_chain(pair.device.type) if args.k is None else args.k)
    base = dict(max_new_tokens=args.max_new_tokens, eos_token_ids=eos, draft=draft, retrieval=retrieval)
    configs = {name: config and config.replace(attention=replace(config.attention, bf16_prefill=args.bf16_prefill,
                                                                 numerics=numerics))
               for name, config in method_configs(base, args.prefill, lookup_from(args, None)).items()}
    names = [m for m in METHODS if m in args.methods]
    same_as = {k: v for k, v in aliases(configs).items() if k in names and v in names}
    measured = [m for m in names if m not in same_as]
    limit = pair.max_positions - args.max_new_tokens
    lengths = [min(int(x), limit) for x in args.lengths.split(",")]
    inputs = make_inputs(tokenizer, lengths, args.docs, args.instruction) if "grid" not in args.skip else []
    sweeps = sweep_configs(retrieval) if "sweep" not in args.skip and inputs else {}
    n_needles = args.needles if "needle" not in args.skip else 0
    long_inputs = long_output_inputs(tokenizer, args.long_output_prompts) if args.long_output else []
    long_measured = [m for m in measured if m in LONG_OUTPUT_METHODS] if long_inputs else []
    report = {"machine": machine(pair), "args": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()},
              "methods": names, "retrieval": asdict(retrieval), "draft": asdict(draft), "numerics": numerics,
              "prefill_dtype": str(prefill_dtype(pair.target, bf16_prefill(numerics, args.bf16_prefill))).replace(
                  "torch.", "")}
    bar = progress(total=(len(measured) * (1 + len(inputs) * args.repeats) if inputs else 0) + len(sweeps) * args.repeats
                   + n_needles + len(long_measured) * (1 + len(long_inputs) * args.repeats))

    runs, references = [], {}
    for name in measured if inputs else ():  # warm-up: every method once on a short input
        bar.set_description(f"warm-up {name}")
        first = inputs[0]["prompt"]
        short = first if len(first) <= 256 else first[:128] + first[-128:]  # its start and its end (the instruction)
        run_method(pair, short, name, configs[name] and configs[name].replace(max_new_tokens=8), 8, eos)
        bar.update()
    for item in inputs:
        where = f"{item['document']} at {len(item['prompt'])} tokens"
        for repeat in range(args.repeats):
            for name in rotated(measured, repeat):  # alternate the order of methods between repeats
                bar.set_description(f"{len(item['prompt'])} tok {item['document'][:16]} {name}")
                result = run_method(pair, item["prompt"], name, configs[name], args.max_new_tokens, eos)
                key = (item["document"], item["length"], reader(name, args.bf16_prefill, numerics))
                check_or_keep(references, key, name, result["token_ids"], where)
                runs.append({"method": name, "document": item["document"], "length": item["length"], "repeat": repeat,
                             "prompt_tokens": len(item["prompt"]), **result})
                bar.update()
    report["cells"] = cells(runs, names, same_as)
    report["goals"] = goals(report["cells"])
    report["runs"] = runs

    if sweeps:  # retrieval parameters: SpecExtend on the longest first input (its default row comes from the grid)
        item = max(inputs, key=lambda i: i["length"])
        key = (item["document"], item["length"], "engine")
        report["sweep_input"] = f"{item['document']}, {len(item['prompt'])} tokens"
        default = [r for r in runs if r["method"] == "specextend" and (r["document"], r["length"]) == key[:2]]
        label = f"default (chunk {retrieval.chunk_size}, top-k {retrieval.top_k}, every {retrieval.retrieve_every})"
        sweep = [sweep_row(label, retrieval, default)]
        for setting, config in sweeps.items():
            results = []
            for _ in range(args.repeats):
                bar.set_description(f"sweep {setting[:30]}")
                results.append(run_engine(pair, item["prompt"], configs["specextend"].replace(retrieval=config)))
                check_same(references[key], f"specextend ({setting})", results[-1]["token_ids"], report["sweep_input"])
                bar.update()
            sweep.append(sweep_row(setting, config, results))
        report["sweep"] = [s for s in sweep if s.decode_tokens_per_s]

    if n_needles:  # does each working cache hold a planted needle, and can the draft alone answer from it (in fp32)
        apply(pair.target, "fp32")
        depths = [float(x) for x in args.needle_depths.split(",")]
        texts = needle_texts(args.needle_docs)
        texts = {name: cut_text(tokenizer, text, args.needle_tokens - 48) for name, text in texts.items()}
        signals = needle_signals(pair, retrieval)
        cases = []
        for i in range(n_needles):
            name = list(texts)[(i // len(depths)) % len(texts)]
            bar.set_description(f"needle {i + 1}/{n_needles}")
            cases.append(needle_case(pair, tokenizer, signals, name, texts[name], depths[i % len(depths)], i,
                                     args.needle_answer_tokens))
            bar.update()
        report["needle"] = NeedleSection(args.needle_tokens, args.needle_answer_tokens, list(texts),
                                         NeedleSummary.of(cases, signals), cases)

    if long_measured:  # a short prompt, a long output: tokens per step along the output, speed over the target alone
        report["long_output"] = long_output(pair, tokenizer, long_inputs, long_measured, configs, args, bar)
    bar.close()
    report["machine"]["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    return report


def long_output(pair: ModelPair, tokenizer, inputs: list[dict], measured: list[str], configs: dict, args, bar):
    """The long-output section: a warm-up of every method, then every method on every short prompt and repeat, the
    order rotated each round; greedy outputs checked equal per prompt."""
    configs = {name: configs[name].replace(max_new_tokens=args.long_output_tokens) for name in measured}
    for name in measured:
        bar.set_description(f"warm-up long output {name}")
        run_engine(pair, inputs[0]["prompt"], configs[name].replace(max_new_tokens=8))
        bar.update()
    runs, references = [], {}
    for turn, (item, repeat) in enumerate((i, r) for i in inputs for r in range(args.repeats)):
        where = f"long output from {item['document']} ({len(item['prompt'])} prompt tokens)"
        for name in rotated(measured, turn):
            bar.set_description(f"long output {item['document'][:16]} {name}")
            result = run_engine(pair, item["prompt"], configs[name], args.long_output_window)
            check_or_keep(references, item["document"], name, result["token_ids"], where)
            runs.append({"method": name, "prompt": item["document"], "repeat": repeat,
                         "prompt_tokens": len(item["prompt"]), **result})
            bar.update()
    outputs = {key: tokenizer.decode(ids, skip_special_tokens=True) for key, (_, ids) in references.items()}
    return long_output_section(runs, measured, args.long_output_tokens, args.long_output_window, outputs)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specextend.tools.bench", description=sys.modules[__package__].__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny random-init models, short inputs, few needles: a check of the whole pipeline in seconds "
                        "(overrides the size arguments below)")
    p.add_argument("--out", default="results", help="results folder")
    p.add_argument("--target", help="target model (default: bundled)")
    p.add_argument("--draft", help="draft model (default: bundled)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    add_numerics_argument(p)
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma list, from: " + ", ".join(METHODS))
    p.add_argument("--lengths", default="1024,2048,4096,7168", help="input lengths in target tokens")
    p.add_argument("--docs", type=int, default=3, help="eval documents per length")
    p.add_argument("--repeats", type=int, default=2, help="runs of every method on every input")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--instruction", default=prompting.DEFAULT_INSTRUCTION)
    p.add_argument("--prefill", choices=("fused", "eager"), default="fused",
                   help="the baselines' prefill kernel: fused (SDPA, transformers' default) or eager (the paper's)")
    p.add_argument("--bf16-prefill", choices=("off", "auto", "on"), default="off",
                   help="the engine's methods read the prompt in bf16 (an fp32 target, --numerics fp32): off keeps "
                        "every method, and transformers' peers, on one fp32 reading, so greedy outputs are compared "
                        "across all of them (with --numerics fp32); auto or on compares the engine's methods with each "
                        "other and the peers with each other, as a bf16 numerics setting does")
    p.add_argument("--draft-shape", choices=("chain", "tree"), default=DraftConfig().shape)
    p.add_argument("--k", type=int, help="chain: draft tokens per step (None: the device's, 2 on CPU and 4 on CUDA)")
    add_lookup_arguments(p)
    add_signal_arguments(p)
    p.add_argument("--needles", type=int, default=50, help="needle questions (depths cycle, documents rotate)")
    p.add_argument("--needle-tokens", type=int, default=4096, help="haystack length in target tokens")
    p.add_argument("--needle-depths", default="0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--needle-answer-tokens", type=int, default=16, help="greedy tokens each reader answers with")
    p.add_argument("--needle-docs", nargs="+", default=None, metavar="FILE",
                   help="UTF-8 text files to plant needles in instead of the bundled documents ('bundled' adds those)")
    p.add_argument("--skip", default="", help="comma list of sections to skip: grid, sweep, needle")
    p.add_argument("--long-output", action="store_true",
                   help="add the long-output section: a short prompt, a long generation, for "
                        + ", ".join(LONG_OUTPUT_METHODS) + " (those in --methods)")
    p.add_argument("--long-output-tokens", type=int, default=prompting.LONG_OUTPUT_TOKENS,
                   help="new tokens per long output (a run may end earlier at an end token)")
    p.add_argument("--long-output-window", type=int, default=256, help="output positions per window of the table")
    p.add_argument("--long-output-prompts", nargs="+", default=None, metavar="FILE",
                   help="UTF-8 text files, each a short prompt, with the instruction "
                        f"{prompting.LONG_OUTPUT_INSTRUCTION!r} (default: the bundled short prompts)")
    return p


def parse(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            if key != "retrieval":
                setattr(args, key, value)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    args.skip = set(filter(None, args.skip.split(",")))
    if args.repeats < 1 or args.docs < 1 or args.needles < 0:
        raise ValueError("--repeats and --docs must be at least 1, --needles at least 0")
    if args.long_output_tokens < 1 or args.long_output_window < 1:
        raise ValueError("--long-output-tokens and --long-output-window must be at least 1")
    if args.long_output_prompts and not args.long_output:
        raise ValueError("--long-output-prompts names the long-output section's prompts: add --long-output")
    return args


def main(argv=None) -> int:
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # transformers' generation-flag warnings would bury the table
    try:
        args = parse(argv)
        if args.threads:
            torch.set_num_threads(args.threads)
        start = time.perf_counter()
        report = run(args, lambda total: tqdm(total=total, file=sys.stderr, dynamic_ncols=True))
        report["wall_s"] = time.perf_counter() - start
        errors = write_outputs(report, Path(args.out))
    except GreedyMismatch as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        hf_logging.set_verbosity(verbosity)
    for error in errors + ([] if report["png"] == "written" else [f"PNG figures {report['png']}"]):
        print(f"warning: {error} (the numbers are saved: {Path(args.out) / 'bench.json'})", file=sys.stderr)
    print(table(report))
    print(json.dumps(plain({k: v for k, v in report.items() if k not in ("runs", "needle", "long_output")}
                           | {"needle": report.get("needle") and report["needle"].summary,
                              "long_output": report.get("long_output") and report["long_output"].rows,
                              "out": str(args.out)})))
    return 0

