"""Calibrate CMR's retrieval signal for the bundled pair, on the bundled documents only, with planted needles.

Run from the repository root: `python -m scripts.calibrate_signal [--lengths 2048,4096,7168] [--depths ...]`.

For every needle prompt (each bundled document cut to each length, a needle at each depth) the target prefills
once, keeping the queries of every head for the last 64 prompt rows (the question and the chat template). From
those it measures, per head and per query window W, the share of attention on the needle, and per candidate signal
whether CMR's first working cache would hold the whole needle (averaged over working caches of 8, 16 and 32
chunks). Candidates: the paper's recipe; every head with max; the final layer over W rows; and the top-n heads
by needle share, for n (at least 4), W and the spread to neighbouring chunks on a grid. The choice: the best hold
rate, then the cheapest to score (heads x rows), then the most decisive (the 10th-percentile margin between the
needle's chunks and the best chunk left out). Leave-one-document-out repeats the choice without each document
and scores it on that document. The chosen signal is written beside the bundled draft (`retrieval_signal.json`)
with the numbers behind it; `--report` keeps every figure as JSON; `--cases` keeps the measured prompts so the
choice can be re-run in seconds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from specextend import signal
from specextend.tools import bundled
from specextend.tools.bench import cut_text
from specextend.config import RetrievalConfig, RetrievalSignal
from specextend.models import load_pair, read_tokenizer
from specextend.tools.probe import ALL_HEADS, holds, needle_prompt, read
from specextend.retrieval import StreamingPolicy, chunk_scores, select_chunks, spread_scores

ROWS = (1, 8, 16, 32, 64)
TOP_N = (4, 8, 16)  # at least 4 heads, so that no single head's quirks decide on text unlike the bundled documents
SPREADS = (0.0, 0.25, 0.5, 1.0)
RESERVE = 0.25  # a quarter of the cache for the newest text: a design choice for the draft's fluency, not calibrated
BUDGETS = (8, 16, 32)  # working caches (chunks) the hold rate is averaged over: the needle tab's, the app's, the paper's


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
        cases.append(case)
        log(f"{name} {len(prompt.ids)} tok depth {depth:.1f}: best head share "
            f"{float(case['share'][32].max()):.3f} ({time.perf_counter() - start:.1f} s)")
    assert all(c["share"][1].shape[0] == layers * heads for c in cases)
    return cases


def held(case: dict, scores: torch.Tensor, top_k: int, reserve: float) -> bool:
    """Whether CMR's first working cache of top_k chunks, selected by these chunk scores, holds the whole needle."""
    return case["needle"] <= set(select_chunks(scores, top_k, RetrievalSignal(reserve=reserve).reserved(top_k)))


def hold_rate(cases: list[dict], scores, reserve: float = RESERVE, budgets=BUDGETS) -> float:
    """Share of needles held, averaged over the working-cache budgets; `scores(case)` gives a case's chunk scores."""
    return statistics.fmean(held(c, scores(c), k, reserve) for c in cases for k in budgets)


def margin(case: dict, scores: torch.Tensor, top_k: int = 16, reserve: float = RESERVE) -> float | None:
    """log(the needle's weakest chunk score / the best score left out): how decisively the needle is chosen."""
    n, reserved = scores.shape[0], RetrievalSignal(reserve=reserve).reserved(top_k)
    need = [i for i in case["needle"] if 0 < i < n - reserved]
    if n <= top_k or not need:
        return None
    older = scores[1 : n - reserved].sort(descending=True).values
    room = top_k - 1 - reserved
    left_out = float(older[room]) if room < older.shape[0] else 0.0
    return math.log(min(float(scores[i]) for i in need) / max(left_out, 1e-30))


def rank_heads(cases: list[dict], rows: int) -> list[int]:
    """Head indices (layer * heads + head) by mean needle share over `cases`, best first."""
    return torch.stack([c["share"][rows] for c in cases]).mean(dim=0).argsort(descending=True).tolist()


def calibrated_scores(heads: list[int], rows: int, spread: float):
    return lambda c: spread_scores(c["chunks"][rows][heads].mean(dim=0), spread)


def choose(cases: list[dict]) -> dict:
    """The calibrated signal's settings on `cases`: the best hold rate; among those the cheapest to score (heads x
    rows: retrieval must stay within 2% of decode time), then the largest 10th-percentile margin."""
    best = None
    for rows in ROWS[1:]:
        ranking = rank_heads(cases, rows)
        for n, spread in itertools.product(TOP_N, SPREADS):
            scores = calibrated_scores(ranking[:n], rows, spread)
            margins = sorted(m for m in (margin(c, scores(c)) for c in cases) if m is not None)
            key = (round(hold_rate(cases, scores), 9), -n * rows, margins[len(margins) // 10] if margins else 0.0)
            if best is None or key > best["key"]:
                best = {"key": key, "rows": rows, "n": n, "spread": spread, "heads": ranking[:n]}
    return best


def evaluate(cases: list[dict], final: int, heads: int) -> dict:
    """Hold rates (averaged over the budgets) of the calibration-free candidates and of the calibrated one,
    leave-one-document-out."""
    last = list(range(final * heads, (final + 1) * heads))
    window = lambda c, k: StreamingPolicy(RetrievalConfig(top_k=k)).select(c["tokens"] - 1, None).kept_spans  # noqa: E731
    out = {"streaming": statistics.fmean(holds(window(c, k), c["span"]) for c in cases for k in BUDGETS),
           "paper": hold_rate(cases, lambda c: c["chunks"][1][last].mean(dim=0), reserve=0.0)}
    for rows, spread in itertools.product(ROWS, SPREADS):
        out[f"final layer, mean, W={rows}, spread {spread}"] = hold_rate(cases, calibrated_scores(last, rows, spread))
        out[f"every head, max, W={rows}, spread {spread}"] = hold_rate(
            cases, lambda c: spread_scores(c["max_chunks"][rows], spread))
    folds = {}
    for doc in sorted({c["document"] for c in cases}):  # leave one document out: choose on the others, score on it
        train = [c for c in cases if c["document"] != doc]
        test = [c for c in cases if c["document"] == doc]
        pick = choose(train)
        folds[doc] = {"rows": pick["rows"], "n": pick["n"], "spread": pick["spread"], "train_rate": pick["key"][0],
                      "test_rate": hold_rate(test, calibrated_scores(pick["heads"], pick["rows"], pick["spread"])),
                      "cases": len(test)}
    out["calibrated (leave one document out)"] = statistics.fmean(f["test_rate"] for f in folds.values())
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
    target_dir, draft_dir = bundled.default_pair()
    tokenizer = read_tokenizer(target_dir)
    pair = load_pair(target_dir, draft_dir, tokenizer=tokenizer)
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
    result = evaluate(cases, c.num_hidden_layers - 1, c.num_attention_heads)
    pick = choose(cases)
    rows, n, ranking = pick["rows"], pick["n"], pick["heads"]
    heads = tuple(divmod(i, c.num_attention_heads) for i in sorted(ranking))
    chosen = RetrievalSignal("calibrated", layers=(), heads=heads, rows=rows, combine="mean", reserve=RESERVE,
                             spread=pick["spread"])
    rate = pick["key"][0]
    shares = torch.stack([x["share"][rows] for x in cases]).mean(dim=0)
    calibration = {
        "documents": sorted(texts), "lengths": lengths, "depths": depths, "needles": len(cases),
        "chunk_size": retrieval.chunk_size, "budgets": list(BUDGETS),
        "hold_rate": {"chosen, on the calibration needles": rate, **result["rates"]},
        "margin_p10": pick["key"][2],
        "folds": result["folds"],
        "head_share": {f"{i // c.num_attention_heads}.{i % c.num_attention_heads}": round(float(shares[i]), 4)
                       for i in ranking},
        "command": "python -m scripts.calibrate_signal " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    # the signal is the target's: each bundled draft folder carries a copy, read when the pair loads
    for out in [Path(args.out)] if args.out else [bundled.draft_dir(), bundled.draft_dir(bundled.HEAD_NAME)]:
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
    print(f"chosen: {n} heads {heads}, W={rows}, spread {pick['spread']}, reserve {RESERVE}: hold {rate:.3f} on the "
          f"calibration needles (budgets {BUDGETS}), 10th-percentile margin {pick['key'][2]:.2f}")
    for name, value in rates[:12] + [(k, v) for k, v in rates[12:] if k in ("paper", "streaming")]:
        print(f"{value:6.3f}  {name}")
    for doc, fold in result["folds"].items():
        print(f"held out {doc}: {fold}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
