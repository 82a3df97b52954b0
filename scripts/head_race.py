"""The bundled target's EAGLE-3 head against its draft model, side by side in one process.

Run from the repository root: `python -m scripts.head_race [--head DIR] [--lengths 7168,1024] [--docs 3]`, or with
`--files A.txt B.md` on other documents (the same prompt as the benchmark: the document's start, then the task).

Methods, alternated on every input after a warm-up (greedy, in one numerics setting (`--numerics`, default the CPU
default, numerics.choose), one target shared by both drafts, the target's
prefill read once per input and shared): the target alone; each draft (the distilled draft model, the head, and
any `--other-heads`) under
the full cache (standard speculative decoding), StreamingLLM's and CMR's (SpecExtend); and SpecExtend with lookup
merged, with each draft (the app's default lookup settings); each head's SpecExtend again with the `--chains` and
`--trees` asked. Every run drafts the device's default draft (config.draft_defaults: on the CPU a chain of
CPU_CHAIN) unless its name says another chain or tree. Every output is checked against the target alone's.
Prints one line per run (decode tokens/s, tokens per step, tokens by source) and, per length, each method's tokens
per step and decode speed over the target alone's: the median over documents and each document's ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import replace
from pathlib import Path

import torch

from specextend import numerics
from specextend.config import DraftConfig, LookupConfig, draft_defaults, preset
from specextend.engine import generate
from specextend.heads import load_head
from specextend.metrics import summarize
from specextend.models import load_pair, make_pair, read_tokenizer
from specextend.target import SharedPrefill
from specextend.tools import bundled
from specextend.tools.bench import make_inputs
from specextend.tools.cli import add_numerics_argument
from specextend.tools.prompting import DEFAULT_INSTRUCTION, stop_ids


def tree_shape(text: str) -> DraftConfig:
    """`DEPTH/BUDGET/BRANCH/CHILDREN` -> an EAGLE-2 dynamic tree (greedy: grown past its budget, its most probable
    nodes kept)."""
    depth, budget, branch, children = (int(x) for x in text.split("/"))
    return DraftConfig(shape="tree", max_depth=depth, node_budget=budget, branch=branch, children=children)


def chain_shape(text: str) -> DraftConfig:
    """`K` or `K@FLOOR` -> a chain of K (ended early below the confidence floor FLOOR)."""
    k, _, floor = text.partition("@")
    return DraftConfig(shape="chain", k=int(k), confidence_floor=float(floor or 0))


def methods(base: dict, setting: str, chains: tuple[str, ...] = (), trees: tuple[str, ...] = (),
            heads: tuple[str, ...] = ("head",)) -> dict[str, tuple[str, object]]:
    """name -> (which draft, config), every config in numerics `setting`, for the draft model and each of `heads`;
    `chains`: each head's SpecExtend runs again with each of these chains (`chain_shape`, named "... k=K" or
    "... k=K@FLOOR"), and `trees` with each of these trees (`tree_shape`, named "... tree=D/N/B/C"), beside the
    default's."""
    lookup = LookupConfig(enabled=True)
    out = {"target alone": ("model", preset("autoregressive", **base))}
    shapes = {f"k={c}": chain_shape(c) for c in chains} | {f"tree={t}": tree_shape(t) for t in trees}
    for draft in ("model", *heads):
        out[f"{draft}: speculative (full cache)"] = (draft, preset("speculative", **base))
        out[f"{draft}: streaming"] = (draft, preset("streaming", **base))
        out[f"{draft}: specextend (CMR)"] = (draft, preset("specextend", **base))
        out[f"{draft}: specextend + lookup"] = (draft, preset("specextend", lookup=lookup, **base))
        for label, shape in shapes.items() if draft != "model" else ():
            shaped = base | {"draft": shape}
            out[f"{draft}: specextend (CMR) {label}"] = (draft, preset("specextend", **shaped))
            out[f"{draft}: specextend + lookup {label}"] = (draft, preset("specextend", lookup=lookup, **shaped))
    return {name: (draft, config.replace(attention=replace(config.attention, numerics=setting)))
            for name, (draft, config) in out.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", type=Path, default=None, help="the EAGLE head folder (default: the bundled head)")
    p.add_argument("--other-heads", type=Path, nargs="*", default=(),
                   help="more head folders raced beside it, each named by its folder (\"NAME: specextend (CMR)\")")
    p.add_argument("--lengths", default="7168,1024")
    p.add_argument("--docs", type=int, default=3, help="the benchmark's longest eval documents")
    p.add_argument("--files", nargs="*", default=(), help="UTF-8 text files instead of the bundled documents")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--only", default="", help="comma list of method names to run (default: all)")
    p.add_argument("--out", type=Path, help="write every run's figures here as JSON lines")
    add_numerics_argument(p)
    p.add_argument("--chains", default="",
                   help="comma list of chains the head's SpecExtend also runs with: K, or K@FLOOR (a confidence floor)")
    p.add_argument("--trees", default="", help="comma list of DEPTH/BUDGET/BRANCH/CHILDREN dynamic trees, as --chains")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    target_dir = bundled.target_dir()
    tokenizer = read_tokenizer(target_dir)
    model_pair = load_pair(target_dir, bundled.draft_dir(), "cpu", "float32", tokenizer)
    head = args.head or bundled.draft_dir(bundled.HEAD_NAME)
    heads = {"head": head} | {folder.name: folder for folder in args.other_heads}
    pairs = {"model": model_pair} | {  # each head with the target's calibrated retrieval signal
        name: make_pair(model_pair.target, load_head(folder, model_pair.target, model_pair.device, model_pair.dtype),
                        calibrated=model_pair.calibrated) for name, folder in heads.items()}
    base = dict(max_new_tokens=args.max_new_tokens, eos_token_ids=stop_ids(tokenizer, model_pair.target),
                draft=draft_defaults(model_pair.device.type))
    setting = numerics.choose(model_pair.target, args.numerics)
    print(f"numerics: {setting}", flush=True)
    configs = methods(base, setting, tuple(k.strip() for k in args.chains.split(",") if k.strip()),
                      tuple(t.strip() for t in args.trees.split(",") if t.strip()), tuple(heads))
    if args.only:
        configs = {k: v for k, v in configs.items() if k in args.only.split(",") or k == "target alone"}
    lengths = [int(x) for x in args.lengths.split(",")]
    inputs = make_inputs(tokenizer, lengths, args.docs, DEFAULT_INSTRUCTION, args.files)
    for draft, config in configs.values():  # warm-up: kernel choices, first allocations
        list(generate(pairs[draft], inputs[0]["prompt"][:256], config.replace(max_new_tokens=8)))
    log = args.out.open("w") if args.out else None
    table: dict[int, dict[str, dict[str, tuple[float, float]]]] = {}
    for item in inputs:
        shared, reference = SharedPrefill(), None
        for name, (draft, config) in configs.items():
            events = list(generate(pairs[draft], item["prompt"], config, shared=shared))
            s, ids = summarize(events), events[-1].token_ids
            r = {"length": len(item["prompt"]), "document": item["document"], "method": name, "numerics": setting,
                 **s.figures()}
            reference = reference or ids
            if ids != reference:
                raise SystemExit(f"{name} on {item['document']}: greedy output differs from the target alone's")
            table.setdefault(item["length"], {}).setdefault(name, {})[item["document"]] = (s.decode_tokens_per_s,
                                                                                          s.mean_accepted)
            print(f"{len(item['prompt'])} tokens, {item['document']}, {name}: {s.decode_tokens_per_s:.1f} tok/s, "
                  f"{s.mean_accepted:.2f} tokens/step, {s.tokens_by_source}", flush=True)
            if log:
                log.write(json.dumps(r) + "\n")
                log.flush()
    for length, by_method in table.items():
        alone = by_method["target alone"]
        for name, docs in by_method.items():
            ratios = [v[0] / alone[d][0] for d, v in docs.items()]
            per_step = statistics.median(v[1] for v in docs.values())
            print(f"~{length}: {name}: {per_step:.2f} tokens/step, {statistics.median(ratios):.2f}x the target alone "
                  "(median; per document " + ", ".join(f"{d} {x:.2f}" for d, x in zip(docs, ratios)) + ")")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(main())
