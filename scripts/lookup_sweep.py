"""Choose lookup drafting's defaults offline: replay lookup on the target's own greedy outputs.

Run from the repository root: `python -m scripts.lookup_sweep [--lengths 1024,7168] [--out results/lookup]`.

1. The target's greedy output (the `autoregressive` method of the engine) on every bundled document, cut to
   each length with the benchmark's summarization prompt, is computed once and cached as JSON (--cache).
2. `specextend.lookup.replay` runs lookup drafting on each output for a grid of settings (longest and
   shortest n-gram, tokens per branch, branches, rank) with no model: it gives the tokens each step would
   commit and the nodes it would send to the target, exactly as the engine's `lookup` method would.
3. Prints a Markdown table per length (pooled over documents: tokens per step, nodes per step; per
   document: tokens per step) and writes it with the raw figures as JSON.

Only the bundled documents are used: defaults are chosen here and checked on other text elsewhere.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from pathlib import Path

import torch

from specextend import bundled
from specextend.bench import make_prompt
from specextend.cli import DEFAULT_INSTRUCTION, eos_ids
from specextend.config import LookupConfig, preset
from specextend.engine import generate
from specextend.lookup import replay
from specextend.models import load_pair

GRID = dict(max_ngram=(2, 3, 4, 6), min_ngram=(1, 2, 3), max_tokens=(4, 8, 12, 16), branches=(1, 2, 3),
            rank=("recent", "frequent", "first"))


def outputs(lengths: list[int], max_new_tokens: int, cache: Path, threads: int) -> list[dict]:
    """The target's greedy outputs on every bundled document at every length (cached)."""
    key = f"{','.join(map(str, lengths))}/{max_new_tokens}/{DEFAULT_INSTRUCTION}"
    if cache.exists():
        stored = json.loads(cache.read_text())
        if stored["key"] == key:
            return stored["cases"]
    from transformers import AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    target_dir, _ = bundled.default_pair()
    pair = load_pair(target_dir, None, "cpu", "float32")
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    config = preset("autoregressive", max_new_tokens=max_new_tokens, eos_token_ids=eos_ids(tokenizer, pair.target))
    cases = []
    for doc in bundled.documents():
        for length in lengths:
            prompt = make_prompt(tokenizer, doc.text(), length, DEFAULT_INSTRUCTION)
            out = list(list(generate(pair, prompt, config))[-1].token_ids)
            cases.append({"document": doc.name, "length": length, "prompt": prompt, "output": out})
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": key, "cases": cases}))
    return cases


def sweep(cases: list[dict], max_new_tokens: int) -> list[dict]:
    rows = []
    names = list(GRID)
    for values in itertools.product(*GRID.values()):
        knobs = dict(zip(names, values))
        if knobs["min_ngram"] > knobs["max_ngram"]:
            continue
        config = LookupConfig(**knobs)
        for length in sorted({c["length"] for c in cases}):
            mine = [c for c in cases if c["length"] == length]
            per_doc, steps = {}, []
            for c in mine:
                s = replay(c["prompt"], c["output"], config, max_new_tokens)
                per_doc[c["document"]] = sum(a + 1 for a, _ in s) / len(s) if s else 0.0
                steps += s
            rows.append({"length": length, **knobs, "tokens_per_step": sum(a + 1 for a, _ in steps) / len(steps),
                         "nodes_per_step": sum(n for _, n in steps) / len(steps),
                         "median_doc_tokens_per_step": statistics.median(per_doc.values()), "per_document": per_doc})
    return rows


def markdown(rows: list[dict], top: int) -> str:
    lines = []
    for length in sorted({r["length"] for r in rows}):
        mine = sorted((r for r in rows if r["length"] == length), key=lambda r: -r["tokens_per_step"])
        docs = list(mine[0]["per_document"])
        lines += [f"**~{length} input tokens**: the {top} best settings by tokens per step (pooled over documents)", "",
                  "| max n | min n | tokens | branches | rank | tokens/step | nodes/step | " + " | ".join(docs) + " |",
                  "|---" * (7 + len(docs)) + "|"]
        for r in mine[:top]:
            lines.append(f"| {r['max_ngram']} | {r['min_ngram']} | {r['max_tokens']} | {r['branches']} | {r['rank']} | "
                         f"{r['tokens_per_step']:.2f} | {r['nodes_per_step']:.1f} | "
                         + " | ".join(f"{r['per_document'][d]:.2f}" for d in docs) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,7168", help="input lengths in target tokens")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--cache", default="cache/lookup_sweep_outputs.json", help="the target's outputs, computed once")
    p.add_argument("--out", default="results/lookup_sweep", help="folder for sweep.json and sweep.md")
    p.add_argument("--top", type=int, default=15, help="rows per length in the table")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cases = outputs([int(x) for x in args.lengths.split(",")], args.max_new_tokens, Path(args.cache), args.threads)
    rows = sweep(cases, args.max_new_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, args.top)
    (out / "sweep.md").write_text(text)
    (out / "sweep.json").write_text(json.dumps({"grid": GRID, "rows": rows,
                                                "cases": [{k: c[k] for k in ("document", "length")} | {
                                                    "prompt_tokens": len(c["prompt"]), "new_tokens": len(c["output"])}
                                                    for c in cases]}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
