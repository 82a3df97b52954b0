"""Time the app's default race as a newcomer meets it: the first sample, the default task and knobs, the main
method then the race, through the app's own Job on the bundled pair. Runs it with the target's prefill read
by every method and with it shared, and with each `--bf16-prefill` setting (alternating, after a warm-up of each),
and prints each run's wall time, the time to the first token a user sees (the main run's first token), the dtype
the target read the prompt in and the numerics setting every run decoded in (`--numerics`, the app's
SPECEXTEND_NUMERICS: auto is the CPU default; a bf16 setting reads the prompt in its own products, so --bf16-prefill
stands in fp32 only).

    python -m scripts.race_time --repeats 1
    python -m scripts.race_time --repeats 2 --sharing shared --bf16-prefill off,auto --numerics fp32   # fp32 vs the choice
    python -m scripts.race_time --repeats 2 --sharing shared --numerics bf16-kv
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from app import documents
from app.backend import real_factory
from app.runner import Job, Knobs, build_config
from app.settings import BUNDLED_PAIR
from app.studio import DEFAULT_TASK
from specextend.events import Prefilled, Started
from specextend.tools.cli import add_numerics_argument

METHODS = ("specextend", "speculative", "autoregressive")  # the page's default method and race


def race(loaded, prompt, shared: bool, bf16_prefill: str = "auto") -> dict:
    generate = loaded.for_click() if shared else loaded.generate

    def configs(method, codec):
        config = build_config(method, Knobs(), codec.eos_ids, lookup=True)  # as the page: lookup in every drafting run
        return config.replace(attention=replace(config.attention, bf16_prefill=bf16_prefill))

    began = time.perf_counter()
    job = Job(METHODS, configs, lambda say: (loaded.codec, prompt, loaded.max_positions, generate)).start()
    first = None
    while not job.done.wait(0.05):
        if first is None and any(isinstance(e, Prefilled) for e in job.runs.get(METHODS[0], [])):
            first = time.perf_counter() - began
    if job.error:
        raise SystemExit(job.error)
    main = job.runs[METHODS[0]]
    began_main = next(e for e in main if isinstance(e, Started))
    return {"numerics": began_main.numerics, "bf16_prefill": bf16_prefill, "prefill_dtype": began_main.prefill_dtype,
            "shared": shared, "wall_s": round(time.perf_counter() - began, 1), "first_token_s": round(first or 0.0, 1),
            "prefill_s": {m: round(next(e.target_s for e in job.runs[m] if isinstance(e, Prefilled)), 1) for m in METHODS},
            "same_output": len({job.runs[m][-1].token_ids for m in METHODS}) == 1}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--sharing", choices=("both", "shared", "unshared"), default="both",
                   help="races with the target's prefill shared (as a click runs them), read by every method, or both")
    p.add_argument("--bf16-prefill", default="auto", help="comma list of settings to alternate: auto, on, off")
    add_numerics_argument(p)
    return p.parse_args(argv)


def main() -> None:
    args = parse()
    settings = [s.strip() for s in args.bf16_prefill.split(",") if s.strip()]
    sharing = {"both": (False, True), "shared": (True,), "unshared": (False,)}[args.sharing]
    loaded = real_factory(BUNDLED_PAIR, lambda message: None, numerics=args.numerics)
    name = documents.samples()[0][1]
    prompt = loaded.codec.prompt(documents.sample_text(name), DEFAULT_TASK)
    print(f"{name}: {len(prompt.ids):,} prompt tokens, {loaded.numerics} numerics", flush=True)
    for setting in settings:  # warm-up (kernel choices, first allocations)
        race(loaded, prompt, True, setting)
    for _ in range(args.repeats):
        for shared in sharing:
            for setting in settings:
                print(json.dumps(race(loaded, prompt, shared, setting)), flush=True)


if __name__ == "__main__":
    main()
