"""When should the draft model draft beside lookup? Side by side in one process, on the benchmark's inputs.

Run from the repository root: `python -m scripts.lookup_with_draft [--lengths 7168,1024] [--docs 3]`, or with
`--files A.txt B.md` on other documents (the same prompt: the document's start, then the instruction).

Methods, alternated on every input (greedy, fp32, the bundled pair, the benchmark's summarization prompt):
the target alone, lookup alone, SpecExtend, and SpecExtend with lookup in three ways: the defaults (the
draft model on a lookup miss, gated by what it pays), on a miss without the gate, and every step without
the gate. With `--settings`: lookup's defaults against the fixed setting chosen before the adaptive
length. Every output is checked against the target alone's. Prints one line per run (decode tokens/s,
tokens per step, tokens by source) and, per length, each method's decode speed over the target alone's:
the median over documents and each document's ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import replace

import torch

from specextend.tools import bundled
from specextend.tools.bench import make_inputs, run_engine
from specextend.tools.prompting import DEFAULT_INSTRUCTION, stop_ids
from specextend.config import DraftConfig, LookupConfig, default_chain, preset
from specextend.models import load_pair, read_tokenizer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="7168,1024")
    p.add_argument("--docs", type=int, default=3, help="the benchmark's longest eval documents")
    p.add_argument("--files", nargs="*", default=(), help="UTF-8 text files to use instead of the bundled documents "
                   "(to check on text nobody tuned for)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--k", type=int, default=default_chain("cpu"),
                   help="the draft model's chain length (default: the CPU's, config.default_chain; the figures in "
                        "docs/RESULTS.md taken before the CPU default was a chain of 2 drafted chains of 4: --k 4)")
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=LookupConfig().adaptive,
                   help="lookup's adaptive branch length in every lookup method")
    p.add_argument("--settings", action="store_true",
                   help="instead: lookup's default setting against the fixed one the sweep chose without the adaptive "
                        "length (n 4..3, 16 tokens), alone and merged with SpecExtend")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft = bundled.target_dir(), bundled.draft_dir()  # the distilled draft model
    tokenizer = read_tokenizer(target)
    pair = load_pair(target, draft, "cpu", "float32", tokenizer)
    base = dict(max_new_tokens=args.max_new_tokens, eos_token_ids=stop_ids(tokenizer, pair.target),
                draft=DraftConfig(k=args.k))
    lk = LookupConfig(adaptive=args.adaptive)
    fixed = LookupConfig(min_ngram=3, adaptive=False)
    configs = {
        "target alone": preset("autoregressive", **base),
        "lookup alone (defaults)": preset("lookup", **base),
        "lookup alone, n 4..3, fixed 16": preset("lookup", lookup=fixed, **base),
        "specextend + lookup (defaults)": preset("specextend", lookup=LookupConfig(enabled=True), **base),
        "specextend + lookup, n 4..3, fixed 16": preset("specextend", lookup=replace(fixed, enabled=True), **base),
    } if args.settings else {
        "target alone": preset("autoregressive", **base),
        "lookup alone": preset("lookup", lookup=lk, **base),
        "specextend": preset("specextend", **base),
        "specextend + lookup (defaults: on a miss, gated)": preset("specextend", lookup=replace(lk, enabled=True), **base),
        "specextend + lookup, on a miss, no gate": preset("specextend", lookup=replace(lk, enabled=True, draft_gate=0.0),
                                                          **base),
        "specextend + lookup, every step, no gate": preset(
            "specextend", lookup=replace(lk, enabled=True, with_draft="always", draft_gate=0.0), **base),
    }
    lengths = [int(x) for x in args.lengths.split(",")]
    inputs = make_inputs(tokenizer, lengths, args.docs, DEFAULT_INSTRUCTION, args.files)
    for config in configs.values():  # warm-up
        run_engine(pair, inputs[0]["prompt"][:256], config.replace(max_new_tokens=8))
    speed: dict[int, dict[str, dict[str, float]]] = {}
    for item in inputs:
        reference = None
        for name, config in configs.items():
            r = run_engine(pair, item["prompt"], config)
            reference = reference or r["token_ids"]
            if r["token_ids"] != reference:
                raise SystemExit(f"{name} on {item['document']}: greedy output differs from the target alone's")
            speed.setdefault(item["length"], {}).setdefault(name, {})[item["document"]] = r["decode_tokens_per_s"]
            print(f"{len(item['prompt'])} tokens, {item['document']}, {name}: {r['decode_tokens_per_s']:.1f} tok/s, "
                  f"{r['mean_accepted']:.2f} tokens/step, {r['tokens_by_source']}", flush=True)
    for length, by_method in speed.items():
        alone = by_method["target alone"]
        for name, docs in by_method.items():
            ratios = [v / alone[d] for d, v in docs.items()]
            print(f"~{length}: {name}: {statistics.median(ratios):.2f}x the target alone (median; per document "
                  + ", ".join(f"{d} {x:.2f}" for d, x in zip(docs, ratios)) + ")")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
