"""Two checkouts of the engine side by side: `python scripts/engine_ab.py --trees A B --input FILE [options]`.

Runs the CLI (`python -m specextend generate`) of each checkout on the same input, method by method, the trees
alternating within every round and their order flipped each round, so that a noisy machine weighs on both alike.
Reports per method the median decode tokens per second and milliseconds per step of each tree, the ratio B / A, and
whether every run's greedy output is the same token for token (a change to the loop must not change one). Each CLI
call loads the pair and reads the document itself; only decoding is compared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def run(tree: Path, method: str, args: argparse.Namespace) -> dict:
    """One CLI run in `tree`: its JSON line."""
    command = [sys.executable, "-m", "specextend", "generate", "--input", str(Path(args.input).resolve()),
               "--method", method, "--max-new-tokens", str(args.max_new_tokens), *args.extra.split()]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(tree)}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", nargs=2, required=True, help="two checkouts: A (the baseline), B")
    p.add_argument("--input", required=True, help="the document (or, with --extra=--long-output, the prompt)")
    p.add_argument("--methods", default="autoregressive,specextend")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--extra", default="", help="more CLI options, given with '=': --extra='--long-output --threads 2'")
    args = p.parse_args(argv)
    trees = [Path(t).resolve() for t in args.trees]
    methods = args.methods.split(",")
    got: dict[tuple[int, str], list[dict]] = {}
    for turn in range(args.rounds):
        for method in methods:
            for t in (0, 1) if turn % 2 == 0 else (1, 0):
                got.setdefault((t, method), []).append(run(trees[t], method, args))
    print(f"| method | A tok/s | B tok/s | B / A | A ms/step | B ms/step | same output |\n|{'---|' * 7}")
    same_everywhere = True
    for method in methods:
        a, b = got[(0, method)], got[(1, method)]
        outputs = {tuple(r["token_ids"]) for r in a + b}
        same_everywhere &= len(outputs) == 1
        speed = [statistics.median(r["decode_tokens_per_s"] for r in runs) for runs in (a, b)]
        per_step = [statistics.median(1e3 * sum(r["phase_seconds"][k] for k in ("drafting", "verification", "retrieval"))
                                      / max(r["steps"], 1) for r in runs) for runs in (a, b)]
        print(f"| {method} | {speed[0]:.1f} | {speed[1]:.1f} | {speed[1] / speed[0]:.2f} | {per_step[0]:.1f} | "
              f"{per_step[1]:.1f} | {'yes' if len(outputs) == 1 else 'NO'} |")
    print(f"\nA: {trees[0]}\nB: {trees[1]}\n{args.rounds} rounds, medians; {args.max_new_tokens} new tokens on {args.input}")
    return 0 if same_everywhere else 3


if __name__ == "__main__":
    raise SystemExit(main())
