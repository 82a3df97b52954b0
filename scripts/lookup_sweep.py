"""Choose lookup drafting's defaults offline: replay lookup on the target's own greedy outputs.

Run from the repository root: `python -m scripts.lookup_sweep [--lengths 1024,7168] [--out results/lookup]`.

1. The target's greedy output (the `autoregressive` method of the engine) on every bundled document, cut to
   each length with the benchmark's summarization prompt, is computed once and cached as JSON (--cache).
2. `specextend.lookup.replay` runs lookup drafting on each output for a grid of settings (longest and
   shortest n-gram, tokens per branch, branches, rank, adaptive length) with no model: it gives the tokens each step would
   commit and the nodes it would send to the target, exactly as the engine's `lookup` method would.
3. The target's verification cost by node count is measured at each length (one forward over the root and
   n chain nodes, timed against n = 0, which is an autoregressive step; medians of alternating repeats),
   so each setting's speed can be estimated: tokens committed / sum over steps of cost(nodes that step),
   in autoregressive steps. Lookup itself costs no forward; the estimate leaves out its bookkeeping.
4. Prints a Markdown table per length (pooled over documents: tokens per step, nodes per step, estimated
   speedup over the target alone; per document: tokens per step), ranked by the estimate, and writes it
   with the raw figures as JSON. The estimate picks candidates; the benchmark measures them.

Only the bundled documents are used: defaults are chosen here and checked on other text elsewhere.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import torch

from specextend.tools import bundled
from specextend.tools.bench import make_prompt
from specextend.tools.prompting import DEFAULT_INSTRUCTION, stop_ids
from specextend.config import LookupConfig, preset
from specextend.engine import generate
from specextend.lookup import replay
from specextend.models import load_pair, read_tokenizer

NODES = (0, 1, 2, 4, 8, 12, 16, 24, 32, 48)  # node counts whose verification cost is measured
GRID = dict(max_ngram=(2, 3, 4, 6), min_ngram=(1, 2, 3), max_tokens=(4, 8, 12, 16), branches=(1, 2, 3),
            rank=("recent", "frequent", "first"), adaptive=(False, True))


def outputs(lengths: list[int], max_new_tokens: int, cache: Path, threads: int) -> list[dict]:
    """The target's greedy outputs on every bundled document at every length (cached)."""
    key = f"{','.join(map(str, lengths))}/{max_new_tokens}/{DEFAULT_INSTRUCTION}"
    if cache.exists():
        stored = json.loads(cache.read_text())
        if stored["key"] == key:
            return stored["cases"]
    if threads:
        torch.set_num_threads(threads)
    target_dir, _ = bundled.default_pair()
    tokenizer = read_tokenizer(target_dir)
    pair = load_pair(target_dir, None, "cpu", "float32", tokenizer)
    config = preset("autoregressive", max_new_tokens=max_new_tokens, eos_token_ids=stop_ids(tokenizer, pair.target))
    cases = []
    for doc in bundled.documents():
        for length in lengths:
            prompt = make_prompt(tokenizer, doc.text(), length, DEFAULT_INSTRUCTION)
            out = list(list(generate(pair, prompt, config))[-1].token_ids)
            cases.append({"document": doc.name, "length": length, "prompt": prompt, "output": out})
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": key, "cases": cases}))
    return cases


def verify_costs(cases: list[dict], repeats: int, threads: int) -> dict[int, list[float]]:
    """Per length: the target's verification time for each of NODES chain nodes, over the time for none."""
    from specextend.drafting import DraftTree
    from specextend.target import Target

    if threads:
        torch.set_num_threads(threads)
    pair = load_pair(bundled.default_pair()[0], None, "cpu", "float32")
    config = preset("autoregressive")
    out = {}
    for length in sorted({c["length"] for c in cases}):
        prompt = next(c["prompt"] for c in cases if c["length"] == length)
        target = Target(pair.target, config, len(prompt) + repeats * len(NODES) + max(NODES) + 8)
        for _ in target.prefill(prompt, None):
            pass
        times: dict[int, list[float]] = {n: [] for n in NODES}
        for r in range(repeats + 1):  # the first round warms up
            for n in NODES if r % 2 == 0 else reversed(NODES):  # alternate the order
                tree = DraftTree(tuple(range(100, 100 + n)), tuple(range(-1, n - 1)), tuple(range(1, n + 1)),
                                 (1.0,) * n, None, 0)
                start = time.perf_counter()
                target.verify(prompt[-1], tree)
                elapsed = time.perf_counter() - start
                target.commit([])
                if r:
                    times[n].append(elapsed)
        base = statistics.median(times[0])
        out[length] = [statistics.median(times[n]) / base for n in NODES]
    return out


def cost(costs: list[float], nodes: int) -> float:
    """Verification cost of `nodes` nodes in autoregressive steps, interpolated between measured counts."""
    for (n0, c0), (n1, c1) in zip(zip(NODES, costs), zip(NODES[1:], costs[1:])):
        if nodes <= n1:
            return c0 + (c1 - c0) * (nodes - n0) / (n1 - n0)
    return costs[-1] * nodes / NODES[-1]


def sweep(cases: list[dict], max_new_tokens: int, costs: dict[int, list[float]]) -> list[dict]:
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
            tokens = sum(a + 1 for a, _ in steps)
            rows.append({"length": length, **knobs, "tokens_per_step": tokens / len(steps),
                         "nodes_per_step": sum(n for _, n in steps) / len(steps),
                         "estimated_speedup": tokens / sum(cost(costs[length], n) for _, n in steps),
                         "median_doc_tokens_per_step": statistics.median(per_doc.values()), "per_document": per_doc})
    return rows


def markdown(rows: list[dict], top: int) -> str:
    lines = []
    for length in sorted({r["length"] for r in rows}):
        mine = sorted((r for r in rows if r["length"] == length), key=lambda r: -r["estimated_speedup"])
        docs = list(mine[0]["per_document"])
        lines += [f"**~{length} input tokens**: the {top} best settings by estimated speedup (pooled over documents; "
                  "the last columns are tokens per step per document)", "",
                  "| max n | min n | tokens | branches | rank | adaptive | tokens/step | nodes/step | est. x AR | "
                  + " | ".join(docs) + " |", "|---" * (9 + len(docs)) + "|"]
        for r in mine[:top]:
            lines.append(f"| {r['max_ngram']} | {r['min_ngram']} | {r['max_tokens']} | {r['branches']} | {r['rank']} | "
                         f"{'yes' if r['adaptive'] else 'no'} | "
                         f"{r['tokens_per_step']:.2f} | {r['nodes_per_step']:.1f} | {r['estimated_speedup']:.2f} | "
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
    p.add_argument("--repeats", type=int, default=5, help="rounds of the verification-cost measurement")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cases = outputs([int(x) for x in args.lengths.split(",")], args.max_new_tokens, Path(args.cache), args.threads)
    costs = verify_costs(cases, args.repeats, args.threads)
    rows = sweep(cases, args.max_new_tokens, costs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"grid": GRID, "nodes": NODES, "verify_cost": costs, "rows": rows,
                                                "cases": [{k: c[k] for k in ("document", "length")} | {
                                                    "prompt_tokens": len(c["prompt"]), "new_tokens": len(c["output"])}
                                                    for c in cases]}, indent=1))  # the numbers first, then the table
    text = "Verification cost in autoregressive steps, by chain nodes " + ", ".join(map(str, NODES)) + ":\n\n" + "".join(
        f"- ~{length} tokens: " + ", ".join(f"{c:.2f}" for c in row) + "\n" for length, row in costs.items()) + "\n"
    text += markdown(rows, args.top)
    (out / "sweep.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
