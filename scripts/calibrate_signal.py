"""Calibrate CMR's retrieval signal for the bundled pair, on the bundled documents only, with planted needles.

Run from the repository root: `python -m scripts.calibrate_signal [--lengths 2048,4096,7168] [--depths ...]`.

For every needle prompt (each bundled document cut to each length, a needle at each depth) the target prefills
once, keeping the queries of every head for the last 64 prompt rows (the question and the chat template). From
those it measures, per head and per query window W, the share of attention on the needle, and per candidate signal
whether CMR's first working cache would hold the whole needle. Candidates: the paper's recipe; every head with
max or mean; the final layer over W rows; and the top-n heads by needle share (ranked without the document they
are scored on: leave-one-document-out), for n, W and the recency reserve R on a grid. The best calibrated signal
(hold rate, then fewer heads and rows) is written beside the bundled draft (`retrieval_signal.json`), with the
numbers behind it; `--report` keeps every figure as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from specextend import bundled, signal
from specextend.bench import cut_text
from specextend.config import RetrievalConfig, RetrievalSignal
from specextend.models import load_pair
from specextend.probe import ALL_HEADS, needle_prompt, read
from specextend.retrieval import StreamingPolicy, chunk_scores, select_chunks

ROWS = (1, 8, 16, 32, 64)
TOP_N = (1, 2, 4, 8, 16, 32)
RESERVES = (0.0, 0.125, 0.25, 0.5)  # share of the working cache kept for the newest chunks (0: the newest one)


def needle_chunks(span: tuple[int, int], chunk_size: int) -> set[int]:
    return set(range(span[0] // chunk_size, (span[1] - 1) // chunk_size + 1))


def measure(pair, tokenizer, texts: dict[str, str], lengths: list[int], depths: list[float], seeds: int,
            retrieval: RetrievalConfig, log) -> list[dict]:
    """Per needle prompt: per-head needle share and per-head chunk scores for every W, and the every-head max."""
    cases = []
    layers, heads = pair.target.config.num_hidden_layers, pair.target.config.num_attention_heads
    for (name, text), length, depth, seed in itertools.product(texts.items(), lengths, depths, range(seeds)):
        start = time.perf_counter()
        cut = cut_text(tokenizer, text, length - 48)  # room for the chat template and the question
        prompt = needle_prompt(tokenizer, cut, depth, seed)
        target = read(pair, prompt.ids, ALL_HEADS)
        seq_len = len(prompt.ids) - 1  # the draft's store at the first retrieval
        case = {"document": name, "length": length, "depth": depth, "seed": seed, "tokens": len(prompt.ids),
                "span": prompt.span, "needle": needle_chunks(prompt.span, retrieval.chunk_size), "n_chunks":
                -(-seq_len // retrieval.chunk_size), "share": {}, "chunks": {}, "max_chunks": {}}
        for rows in ROWS:
            scores = target.head_scores(rows)[:, :seq_len]  # (L*H, T)
            case["share"][rows] = signal.span_mass(scores, prompt.span)  # (L*H,)
            case["chunks"][rows] = torch.stack([chunk_scores(s, retrieval.chunk_size) for s in scores])  # (L*H, C)
            case["max_chunks"][rows] = chunk_scores(signal.combine(scores, "max"), retrieval.chunk_size)
        window = StreamingPolicy(retrieval).select(seq_len, None)
        case["streaming"] = any(a <= prompt.span[0] and prompt.span[1] <= b for a, b in window.kept_spans)
        cases.append(case)
        log(f"{name} {len(prompt.ids)} tok depth {depth:.1f}: best head share "
            f"{float(case['share'][32].max()):.3f} ({time.perf_counter() - start:.1f} s)")
    assert all(c["share"][1].shape[0] == layers * heads for c in cases)
    return cases


def held(case: dict, chunk_scores_: torch.Tensor, top_k: int, reserve: float) -> bool:
    return case["needle"] <= set(select_chunks(chunk_scores_, top_k, RetrievalSignal(reserve=reserve).reserved(top_k)))


def rank_heads(cases: list[dict], rows: int) -> list[int]:
    """Head indices (layer * heads + head) by mean needle share over `cases`, best first."""
    return torch.stack([c["share"][rows] for c in cases]).mean(dim=0).argsort(descending=True).tolist()


def calibrated_rate(cases: list[dict], ranking: list[int], n: int, rows: int, top_k: int, reserve: float) -> float:
    chosen = ranking[:n]
    return statistics.fmean(held(c, c["chunks"][rows][chosen].mean(dim=0), top_k, reserve) for c in cases)


def best_setting(cases: list[dict], top_k: int) -> tuple[float, int, int, float]:
    """(hold rate, n heads, rows, reserve) of the best calibrated signal on `cases` (ties: fewer heads, fewer rows,
    then the larger reserve, which keeps more of the recent text the draft continues from)."""
    rankings = {rows: rank_heads(cases, rows) for rows in ROWS}
    options = [(calibrated_rate(cases, rankings[rows], n, rows, top_k, r), -n, -rows, r)
               for n, rows, r in itertools.product(TOP_N, ROWS, RESERVES)]
    rate, n, rows, reserve = max(options)
    return rate, -n, -rows, reserve


def evaluate(cases: list[dict], top_k: int, final: int, heads: int) -> dict:
    """Hold rates of the calibration-free candidates, and of the calibrated one, leave-one-document-out."""
    out = {"streaming": statistics.fmean(c["streaming"] for c in cases)}
    last = list(range(final * heads, (final + 1) * heads))
    out["paper"] = statistics.fmean(held(c, c["chunks"][1][last].mean(dim=0), top_k, 0.0) for c in cases)
    for rows, r in itertools.product(ROWS, RESERVES):
        out[f"final layer, mean, W={rows}, R={r}"] = statistics.fmean(
            held(c, c["chunks"][rows][last].mean(dim=0), top_k, r) for c in cases)
        out[f"every head, mean, W={rows}, R={r}"] = statistics.fmean(
            held(c, c["chunks"][rows].mean(dim=0), top_k, r) for c in cases)
        out[f"every head, max, W={rows}, R={r}"] = statistics.fmean(held(c, c["max_chunks"][rows], top_k, r) for c in cases)
    docs = sorted({c["document"] for c in cases})
    folds = {}
    for doc in docs:  # leave one document out: rank and choose on the others, score on it
        train = [c for c in cases if c["document"] != doc]
        test = [c for c in cases if c["document"] == doc]
        rate, n, rows, reserve = best_setting(train, top_k)
        folds[doc] = {"train_rate": rate, "n": n, "rows": rows, "reserve": reserve,
                      "test_rate": calibrated_rate(test, rank_heads(train, rows), n, rows, top_k, reserve),
                      "cases": len(test)}
    out["calibrated (leave one document out)"] = (sum(f["test_rate"] * f["cases"] for f in folds.values())
                                                  / sum(f["cases"] for f in folds.values()))
    return {"rates": out, "folds": folds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="2048,4096,7168")
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--seeds", type=int, default=1, help="needles per document, length and depth")
    p.add_argument("--out", default=None, help="folder for retrieval_signal.json (default: the bundled draft's)")
    p.add_argument("--report", default=None, help="write every figure here as JSON")
    p.add_argument("--cases", default=None, help="keep the measured needles here (torch.save) and reuse them when the "
                   "file exists: the choice can be re-run without a prefill")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    target_dir, draft_dir = bundled.default_pair()
    pair = load_pair(target_dir, draft_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    retrieval = RetrievalConfig()
    texts = {d.name: d.text() for d in bundled.documents()}
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if args.cases and Path(args.cases).is_file():
        cases = torch.load(args.cases, weights_only=False)
    else:
        cases = measure(pair, tokenizer, texts, lengths, depths, args.seeds, retrieval, log)
        if args.cases:
            torch.save(cases, args.cases)
    c = pair.target.config
    result = evaluate(cases, retrieval.top_k, c.num_hidden_layers - 1, c.num_attention_heads)
    rate, n, rows, reserve = best_setting(cases, retrieval.top_k)
    ranking = rank_heads(cases, rows)[:n]
    heads = tuple(divmod(i, c.num_attention_heads) for i in sorted(ranking))
    chosen = RetrievalSignal("calibrated", layers=(), heads=heads, rows=rows, combine="mean", reserve=reserve)
    shares = torch.stack([x["share"][rows] for x in cases]).mean(dim=0)
    calibration = {
        "documents": sorted(texts), "lengths": lengths, "depths": depths, "needles": len(cases),
        "working_cache": {"chunk_size": retrieval.chunk_size, "top_k": retrieval.top_k},
        "hold_rate": {"chosen, on the calibration needles": rate, **result["rates"]},
        "folds": result["folds"],
        "head_share": {f"{i // c.num_attention_heads}.{i % c.num_attention_heads}": round(float(shares[i]), 4)
                       for i in ranking},
        "command": "python -m scripts.calibrate_signal " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    out = Path(args.out) if args.out else Path(draft_dir)
    signal.save(out / signal.SIGNAL_FILE, chosen, signal.target_shape(pair.target), calibration)
    if args.report:
        layers_share = {str(rows): torch.stack([x["share"][rows] for x in cases]).mean(dim=0)
                        .view(c.num_hidden_layers, c.num_attention_heads).tolist() for rows in ROWS}
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps({**calibration, "signal": chosen.__dict__, "layer_head_share":
                                                 layers_share, "per_case": [
            {k: v for k, v in x.items() if k in ("document", "length", "depth", "seed", "tokens", "span", "streaming")}
            for x in cases]}, indent=1, default=list))
    rates = sorted(result["rates"].items(), key=lambda kv: -kv[1])
    print(f"chosen: {n} heads {heads}, W={rows}, R={reserve}: hold {rate:.3f} on the calibration needles")
    for name, value in rates[:12] + [(k, v) for k, v in rates[12:] if k in ("paper", "streaming")]:
        print(f"{value:6.3f}  {name}")
    for doc, fold in result["folds"].items():
        print(f"held out {doc}: {fold}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
