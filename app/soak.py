"""Soak: `python -m app.soak [--runs 30] [--switches 2] [--shrink] [--out DIR]`, the real engine run after run through
the app's own run handler (`Studio.run`), on random-init pairs in preset shapes built as app/preset_check.py builds
them, with the pair switched `--switches` times (A -> B -> A by default: each switch frees the last pair first).

Every run is the same click (a race of SpecExtend and speculative decoding, both with lookup, and the target alone,
greedy, on one document), so after a warm-up nothing a run keeps should grow. After each run, once its thread has
returned, it reads host resident memory and CUDA memory allocated and reserved as the run left them; then the tensors that only
reference cycles held (a server frees those at the cyclic collector's next full pass, maybe many requests later: a KV
cache in a cycle holds its memory meanwhile), freeing them; then counts what is alive: models, tokenizers, and step
runners (`specextend.steps.StepRunner`: on CUDA, those kept between requests and any a run failed to hand back; none
on the CPU, where steps run eagerly) with the steps they hold and the captures they have made.

Checks: every race's greedy outputs agree; after warm-up no run leaves tensors to the cyclic collector (to 0.1 MiB;
a visit's first run may, building its pair); within each visit, every reading after the warm-up stays within TOLERANCE
of the reading that ended the warm-up; a pair visited again settles where it did the first time (its least
readings after warm-up: the pair before it was freed, its tokenizer too). Writes soak.json and soak.md under --out
after every run (a run cut short keeps its readings), prints a summary, and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import threading
import time
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specextend.steps import StepRunner

from .preset_check import SHAPES, agree, device_dtype, document_for, race, studio_for

MEASURES = ("rss_mib", "cuda_allocated_mib", "cuda_reserved_mib", "models", "tokenizers", "runners", "steps", "captures")
# how far a reading after warm-up may rise above its visit's base: (a fraction of the base, and at least this much)
TOLERANCE = {
    # glibc's arenas and Python's heap keep some freed blocks, so host memory moves with nothing kept (building a
    # shrunk pair's 152K-word tokenizer again moved it by up to ~70 MiB on the CPU): the counts below say what is kept
    "rss_mib": (0.10, 96),
    # identical runs allocate identically: 64 MiB is a fraction of any KV cache a run fills (hundreds of MiB at 4K
    # tokens on a 7B shape), and one step's fp32 logits (~20 MiB at 150K rows) leaked per run passes it in four
    "cuda_allocated_mib": (0.0, 64),
    # the caching allocator may split a segment a new way and reserve one more, without holding more tensors
    "cuda_reserved_mib": (0.05, 256),
    # counts: one pair (and its tokenizer) at a time, and the same click meets the same step shapes every time, so after
    # warm-up not one more model, tokenizer, runner, step or capture; a pair visited again holds what it held before
    "models": (0.0, 0), "tokenizers": (0.0, 0), "runners": (0.0, 0), "steps": (0.0, 0), "captures": (0.0, 0),
}
COLUMNS = (*MEASURES, "cyclic_mib")  # a reading: the measures, and the MiB of tensors only reference cycles held
PAIRS = ("qwen2.5-7b", "llama-3.1-8b-eagle3")  # a draft model, then an EAGLE-3 head


def rss_mb() -> float:
    """This process's resident memory, from /proc."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def settled(timeout: float = 60) -> None:
    """Wait for the last job's thread to return (it hands the run's memory back after its result is out)."""
    deadline = time.monotonic() + timeout
    while any(t.name == "specextend-job" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)


def alive() -> dict[str, int]:
    """What this process holds, counted over its Python objects once the garbage is collected: models (each
    `PreTrainedModel`: a causal LM and its base model count two), tokenizers, and step runners with the steps they hold
    and the forwards they have captured."""
    gc.collect()
    models = tokenizers = 0
    runners = []
    for o in gc.get_objects():
        kind = type(o)  # not isinstance: some objects' __class__ warns when read
        if issubclass(kind, StepRunner):
            runners.append(o)
        elif issubclass(kind, PreTrainedModel):
            models += 1
        elif issubclass(kind, PreTrainedTokenizerBase):
            tokenizers += 1
    return {"models": models, "tokenizers": tokenizers, "runners": len(runners),
            "steps": sum(len(r.steps) for r in runners), "captures": sum(r.captures for r in runners)}


def cyclic_mib() -> float:
    """MiB of tensors that only reference cycles hold (what waits for the cyclic garbage collector), freed now."""
    gc.set_debug(gc.DEBUG_SAVEALL)  # the collector leaves what it finds in gc.garbage instead of freeing it
    try:
        gc.collect()
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in gc.garbage
                    if issubclass(type(t), torch.Tensor) and t.layout == torch.strided}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    gc.collect()
    return round(sum(storages.values()) / 2**20, 1)


def reading(device: torch.device) -> dict:
    """Memory as the run left it, then what only reference cycles held (freed), then what is alive."""
    cuda = device.type == "cuda"
    memory = {"rss_mib": round(rss_mb()),
              "cuda_allocated_mib": round(torch.cuda.memory_allocated() / 2**20) if cuda else None,
              "cuda_reserved_mib": round(torch.cuda.memory_reserved() / 2**20) if cuda else None}
    return {**memory, "cyclic_mib": cyclic_mib(), **alive()}


def schedule(runs: int, switches: int, pairs: list[str]) -> list[tuple[str, int]]:
    """The visits: (pair, runs) for each, the pairs taken in turn, the runs shared out evenly (the first get any rest)."""
    visits = switches + 1
    return [(pairs[i % len(pairs)], runs // visits + (i < runs % visits)) for i in range(visits)]


def allowed(measure: str, base: float) -> float:
    fraction, least = TOLERANCE[measure]
    return base + max(least, fraction * base)


def checks(readings: list[dict], warm_up: int) -> list[dict]:
    """Each check: its name, whether it passed, and what failed."""
    out = [{"check": "greedy outputs of the race agree, no errors",
            "failed": [f"run {r['run']}: {r['error'] or 'outputs differ'}" for r in readings
                       if r["error"] or not r["agree"]]},
           {"check": "after warm-up, a run leaves no tensors to the cyclic garbage collector", "failed": []}]
    firsts: dict[str, dict] = {}
    for visit in sorted({r["visit"] for r in readings}):
        runs = [r for r in readings if r["visit"] == visit]
        if len(runs) <= warm_up:
            continue
        out[1]["failed"] += [f"run {r['run']}: {r['cyclic_mib']} MiB held by reference cycles only"
                             for r in runs[warm_up:] if r["cyclic_mib"] > 0]
        base, pair = runs[warm_up - 1], runs[0]["pair"]
        measures = [m for m in MEASURES if base[m] is not None]
        out.append({"check": f"visit {visit} ({pair}): flat after warm-up",
                    "failed": [f"run {r['run']}: {m} {r[m]} > {allowed(m, base[m]):.0f} (base {base[m]})"
                               for r in runs[warm_up:] for m in measures if r[m] > allowed(m, base[m])]})
        # where a visit settles: its least reading after warm-up (host memory may dip as the allocator trims)
        level = {m: min(r[m] for r in runs[warm_up:]) for m in measures}
        first = firsts.setdefault(pair, level)
        if first is not level:
            out.append({"check": f"visit {visit} ({pair}): settles where its first visit did",
                        "failed": [f"{m} {level[m]} > {allowed(m, first[m]):.0f} (first visit {first[m]})"
                                   for m in measures if level[m] > allowed(m, first[m])]})
    for c in out:
        c["ok"] = not c["failed"]
    return out


def markdown(report: dict) -> str:
    head = ["run", "visit", "pair", "s", *COLUMNS, "agree"]
    rows = [[str(r[k]) if r[k] is not None else "-" for k in head] for r in report["readings"]]
    lines = [f"# Soak: {report['device']}, {report['dtype']}",
             "",
             f"{report['runs_done']} of {report['runs']} runs ({report['tokens']}-token document, {report['max_new']} new "
             f"tokens, a race of three), visits {report['schedule']}, warm-up {report['warm_up']} per visit. "
             "Tolerance after warm-up: " + "; ".join(f"{m} +max({f:.0%}, {least})" for m, (f, least) in TOLERANCE.items())
             + "; cyclic_mib (tensors only reference cycles held, freed after each reading) 0.",
             "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows),
             "",
             *(f"- {'PASS' if c['ok'] else 'FAIL'}: {c['check']}" + "".join(f"\n  - {f}" for f in c["failed"])
               for c in report["checks"])]
    return "\n".join(lines) + "\n"


def soak(runs: int, switches: int, pairs: list[str], shrink: bool, tokens: int, max_new: int, warm_up: int,
         out: Path) -> dict:
    device, dtype = device_dtype()
    plan = schedule(runs, switches, pairs)
    studio, values = studio_for(shrink, pairs, max_new, {})
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__, "shrink": shrink, "runs": runs,
              "runs_done": 0, "schedule": [f"{p} x{n}" for p, n in plan], "tokens": tokens, "max_new": max_new,
              "warm_up": warm_up, "tolerance": TOLERANCE, "readings": [], "checks": []}
    out.mkdir(parents=True, exist_ok=True)
    for visit, (pair, n) in enumerate(plan, start=1):
        for _ in range(n):
            start = time.perf_counter()
            job, outputs = race(studio, pair, document_for(pair, tokens, max_new), values)
            settled()
            report["readings"].append({"run": len(report["readings"]) + 1, "visit": visit, "pair": pair,
                                       "s": round(time.perf_counter() - start, 2), "agree": agree(outputs),
                                       "error": job.error, **reading(device)})
            report["runs_done"] += 1
            report["checks"] = checks(report["readings"], warm_up)
            (out / "soak.json").write_text(json.dumps(report, indent=1))
            (out / "soak.md").write_text(markdown(report))
    return report


def summary(report: dict) -> str:
    lines = [f"soak: {report['runs_done']} runs on {report['device']} ({report['dtype']}), visits {report['schedule']}"]
    for visit in sorted({r["visit"] for r in report["readings"]}):
        runs = [r for r in report["readings"] if r["visit"] == visit]
        span = {m: (min(r[m] for r in runs), max(r[m] for r in runs)) for m in COLUMNS if runs[0][m] is not None}
        lines.append(f"  visit {visit} ({runs[0]['pair']}): median {statistics.median(r['s'] for r in runs):.2f} s a run; "
                     + ", ".join(f"{m} {lo}-{hi}" for m, (lo, hi) in span.items()))
    lines += [f"  {'PASS' if c['ok'] else 'FAIL'}: {c['check']}" + "".join(f"\n    {f}" for f in c["failed"][:5])
              for c in report["checks"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=30, help="races in all (default 30)")
    p.add_argument("--switches", type=int, default=2, help="changes of pair (default 2: A -> B -> A)")
    p.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated presets taken in turn (default {','.join(PAIRS)})")
    p.add_argument("--shrink", action="store_true", help="two narrow layers per model (CPU, seconds a run)")
    p.add_argument("--tokens", type=int, help="document length in words (default 4000; 300 with --shrink)")
    p.add_argument("--max-new-tokens", type=int, help="default 32 (6 with --shrink)")
    p.add_argument("--warm-up", type=int, default=2, help="runs of each visit before its base reading (default 2: the "
                                                         "first loads the pair and meets every step shape)")
    p.add_argument("--out", type=Path, default=Path("results/soak"))
    args = p.parse_args(argv)
    pairs = [k.strip() for k in args.pairs.split(",")]
    unknown = [k for k in pairs if k not in SHAPES]
    if unknown:
        p.error(f"unknown presets: {', '.join(unknown)}")
    if args.warm_up < 1 or args.switches < 0 or min(n for _, n in schedule(args.runs, args.switches, pairs)) <= args.warm_up:
        p.error("each visit needs more runs than its warm-up, of at least one run")
    report = soak(args.runs, args.switches, pairs, args.shrink, args.tokens or (300 if args.shrink else 4000),
                  args.max_new_tokens or (6 if args.shrink else 32), args.warm_up, args.out)
    print(summary(report))
    return 0 if all(c["ok"] for c in report["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
