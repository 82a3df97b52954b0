"""One long-output race through the app, as a visitor's click runs it: the app served on 127.0.0.1 with the bundled
pair, `/run` called with the long-output workload (a bundled short prompt, its instruction, 2,048 new tokens), the main
run and the race, the panels drawn live as the page would get them. Writes the exported trace and a summary (each run's
tokens, time, tokens/s, tokens per step, and tokens per step in windows of the output) under --out.

    python -m scripts.long_output_app --prompt lighthouse --max-new-tokens 2048 --out docs/results/long_output/app
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import socket
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


def main() -> None:
    from gradio_client import Client

    from app import Settings, build_app, launch
    from app.trace import loads
    from specextend.metrics import summarize, tokens_per_step_by_window
    from specextend.tools.bundled import short_prompt

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", default="lighthouse", help="a bundled long-output prompt (assets/prompts)")
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--race", default="speculative,autoregressive")
    p.add_argument("--window", type=int, default=256, help="output tokens per window of the tokens-per-step table")
    p.add_argument("--out", default="docs/results/long_output/app")
    args = p.parse_args()

    chosen = short_prompt(args.prompt)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = Settings(port=port, max_new_tokens=max(args.max_new_tokens, Settings().max_new_tokens))
    demo = build_app(settings=settings)
    launch(demo, settings, prevent_thread_lock=True, quiet=True)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        began = time.perf_counter()
        result = client.predict(document=chosen.text(), task=chosen.instruction, max_new_tokens=args.max_new_tokens,
                                race=[m for m in args.race.split(",") if m], workload="long_output", api_name="/run")
        wall = time.perf_counter() - began
    finally:
        demo.close()
    status, download = result[0], result[-1]
    path = download["value"] if isinstance(download, dict) else download
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, out / "race.trace.json")
    runs, _, meta = loads(Path(path).read_text(encoding="utf-8"))
    summary = {"prompt": args.prompt, "max_new_tokens": args.max_new_tokens, "click_wall_s": wall,
               "status": re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", status))).strip(),
               "machine_load": meta.get("machine_load"), "runs": {}}
    for method, events in runs.items():
        s = summarize(events)
        summary["runs"][method] = {
            "new_tokens": s.new_tokens, "steps": s.steps, "total_s": s.total_s, "e2e_tokens_per_s": s.e2e_tokens_per_s,
            "decode_tokens_per_s": s.decode_tokens_per_s, "mean_accepted": s.mean_accepted,
            "windows": [[w.start, w.steps, round(w.per_step, 3)] for w in tokens_per_step_by_window(events, args.window)]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
