"""Time the app's default race as a newcomer meets it: the first sample, the default task and knobs, the main
method then the race, through the app's own Job on the bundled pair. Runs it with the target's prefill read
by every method and with it shared (alternating), and prints each run's wall time and the time to the first
token a user sees (the main run's first token).

    python -m scripts.race_time --repeats 1
"""

from __future__ import annotations

import argparse
import json
import time

from app import documents
from app.backend import real_factory
from app.runner import Job, Knobs, build_config
from app.settings import BUNDLED_PAIR
from app.ui import DEFAULT_TASK
from specextend.events import Prefilled

METHODS = ("specextend", "speculative", "autoregressive")  # the page's default method and race


def race(loaded, prompt, shared: bool) -> dict:
    generate = loaded.for_click() if shared else loaded.generate
    configs = lambda m, codec: build_config(m, Knobs(), codec.eos_ids, lookup=m == METHODS[0])  # noqa: E731
    began = time.perf_counter()
    job = Job(METHODS, configs, lambda say: (loaded.codec, prompt, loaded.max_positions, generate)).start()
    first = None
    while not job.done.wait(0.05):
        if first is None and any(isinstance(e, Prefilled) for e in job.runs.get(METHODS[0], [])):
            first = time.perf_counter() - began
    if job.error:
        raise SystemExit(job.error)
    return {"shared": shared, "wall_s": round(time.perf_counter() - began, 1), "first_token_s": round(first or 0.0, 1),
            "prefill_s": {m: round(next(e.target_s for e in job.runs[m] if isinstance(e, Prefilled)), 1) for m in METHODS}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    loaded = real_factory(BUNDLED_PAIR, lambda message: None)
    name = documents.samples()[0][1]
    prompt = loaded.codec.prompt(documents.sample_text(name), DEFAULT_TASK)
    print(f"{name}: {len(prompt.ids):,} prompt tokens", flush=True)
    race(loaded, prompt, True)  # warm-up (kernel choices, first allocations)
    for _ in range(args.repeats):
        for shared in (False, True):
            print(json.dumps(race(loaded, prompt, shared)), flush=True)


if __name__ == "__main__":
    main()
