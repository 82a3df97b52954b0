"""Does the draft read the needle? The Studio's needle click (CMR under the calibrated and the paper's signal,
StreamingLLM) on each bundled pair, through `Studio.needle` as the page runs it (its defaults unless told), then the
control the tab leaves out: the same prompt and knobs with the draft reading the whole document (standard
speculative decoding's full draft cache). Per run: how much of the needle the first working cache held, tokens per
step, the draft's accepted tokens, the steps where its proposals differed from the first run's, and how many of the
needle's value tokens the draft proposed.
Then what the page says of it, and whether the layer x head picture was drawn again for the second pair.

    .venv/bin/python -m scripts.needle_guesses                      # both bundled pairs, the tab's defaults
    .venv/bin/python -m scripts.needle_guesses --pairs bundled --depth 10
"""

from __future__ import annotations

import argparse
import html
import json
import re
import time

from app import Settings, documents
from app.backend import real_factory
from app.runner import Job, build_config
from app.settings import BUNDLED, BUNDLED_DRAFT_MODEL
from app.studio import SessionState, Studio, needle_knobs
from specextend.events import Retrieved
from specextend.tools import needle
from visualizers import held_share
from visualizers.needle import guesses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", default=f"{BUNDLED},{BUNDLED_DRAFT_MODEL}")
    p.add_argument("--haystack", default=documents.samples()[0][1])
    p.add_argument("--length", type=int, default=16000, help="haystack characters (the tab's default)")
    p.add_argument("--depth", type=float, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=24)
    args = p.parse_args()
    studio = Studio(real_factory, Settings())
    planted = needle.generate(documents.sample_text(args.haystack)[: args.length], args.depth / 100, seed=args.seed)
    for pair in (k.strip() for k in args.pairs.split(",")):
        state, said = SessionState(), []
        began = time.perf_counter()
        for message in studio.needle(state, args.haystack, args.length, args.depth, args.seed, args.top_k,
                                     args.max_new_tokens, pair):
            said.append(text_of(message[0]))
        job = state.job
        if job is None or job.error:
            raise SystemExit(said[-1])
        span = job.prompt.marks["needle"]
        events = {**job.runs, "speculative": full_cache(studio, pair, job, args)}
        seen = {m: guesses(m, ev, job.codec.text, planted.answer) for m, ev in events.items()}
        first = next(iter(seen.values())).proposals
        held = {m: [held_share(e, span) for e in ev if isinstance(e, Retrieved)][:1] or [1.0]  # a full cache holds all
                for m, ev in events.items()}
        runs = [{"run": g.name, "needle_held_first": round(held[m][0], 2), "tokens_per_step": round(g.per_step, 3),
                 "draft_accepted": g.drafted,
                 "steps": len(g.proposals), "steps_proposing_otherwise": sum(a != b for a, b in zip(g.proposals, first)),
                 "value_tokens": g.value, "value_tokens_drafted": g.in_value} for m, g in seen.items()]
        print(json.dumps({"pair": pair, "prompt_tokens": len(job.prompt.ids), "value": planted.answer,
                          "seconds": round(time.perf_counter() - began, 1),
                          "drew_heads_picture": any("Reading where each" in s for s in said), "runs": runs}), flush=True)
        panel = next(v for v in message if isinstance(v, str) and "Expected answer" in v)
        report = re.search(r"<p><b>Did the draft's cache.*?</p>(<p class='se-muted'>.*?</p>)?", panel, re.S)
        print(text_of(report.group(0)) if report else "(no report)", flush=True)


def full_cache(studio: Studio, pair: str, needle_job: Job, args) -> list:
    """The needle click's prompt and knobs again, the draft attending over the whole document: its events."""
    loaded = studio.pairs.get(studio.settings.pair(pair), lambda _: None)
    knobs = needle_knobs(args.max_new_tokens, args.top_k)
    job = Job(["speculative"], lambda m, codec: build_config(m, knobs, codec.eos_ids, studio.settings.max_new_tokens),
              lambda say: (needle_job.codec, needle_job.prompt, loaded.max_positions, loaded.click())).start()
    job.done.wait()
    if job.error:
        raise SystemExit(job.error)
    return job.runs["speculative"]


def text_of(markup: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", " ", str(markup))).strip()


if __name__ == "__main__":
    main()
