"""Measure what drawing the live panels costs generation.

Runs the same request alternately with no one watching and with the panels drawn at the app's pace
(figures built and serialised exactly as the app does, on the app's redraw schedule), and prints the
decode tokens/s of both, the redraw rate and the share of wall time the drawing took. Gradio's own
transport and the browser's rendering are not included; `--browser` adds them by driving the real app
in Debian's chromium and reading the run's exported trace.

    python -m app.overhead --document britannica_plays --max-new-tokens 64 --repeats 3 [--browser]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from dataclasses import replace

import orjson

from specextend.metrics import summarize

from . import documents
from .backend import PairCache, real_factory
from .panels import main_view
from .runner import Job, Knobs, RedrawMeter, build_config
from .settings import BUNDLED_PAIR, Settings
from .trace import loads

TASK = "Summarize the document in a few sentences."


def run_once(loaded, prompt, config, settings: Settings, draw: bool) -> tuple[float, RedrawMeter]:
    """Decode tokens/s of one run, drawing the panels at the app's pace when `draw`."""
    job = Job([config.method], lambda m, c: config, lambda say: (loaded.codec, prompt, loaded.max_positions, loaded.generate))
    job.start()
    meter = RedrawMeter(settings.redraw_s, settings.redraw_share)
    while draw:
        finished = job.done.wait(meter.wait())
        meter.start()
        view = main_view(job.snapshot(), config.method, loaded.codec.decode)
        for spec in (view.retrieval, view.acceptance, view.throughput):
            orjson.dumps(spec)
        meter.drew()
        meter.resumed()
        if finished:
            break
    job.done.wait()
    if job.error:
        raise RuntimeError(job.error)
    return summarize(job.runs[config.method]).decode_tokens_per_s, meter


def run_in_browser(text: str, max_new: int, settings: Settings) -> float:
    """Decode tokens/s of one run started from the app in headless chromium, panels drawn live."""
    from playwright.sync_api import sync_playwright

    from .ui import build_app, launch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        settings = replace(settings, host="127.0.0.1", port=s.getsockname()[1])
    demo = build_app(real_factory, settings)
    launch(demo, settings, prevent_thread_lock=True, quiet=True)
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=args)
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.goto(f"http://127.0.0.1:{settings.port}/")
            page.fill("#document textarea", text)
            for box in page.get_by_role("checkbox").all():
                box.uncheck()
            page.get_by_text("Knobs").click()
            page.fill("#max-new input[type=number]", str(max_new))
            page.press("#max-new input[type=number]", "Tab")
            page.click("#run")
            page.wait_for_function("document.querySelector('#status').innerText.includes('Done.')", timeout=3_600_000)
            with page.expect_download() as download:
                page.click("#download")
            with open(download.value.path(), encoding="utf-8") as f:
                runs, _, _ = loads(f.read())
            browser.close()
    finally:
        demo.close()
    return summarize(runs["specextend"]).decode_tokens_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--document", default="britannica_plays")
    parser.add_argument("--chars", type=int, default=0, help="use only the first N characters (0: all)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--browser", action="store_true", help="also run through the app in headless chromium")
    args = parser.parse_args()

    settings = Settings.from_env()
    text = documents.sample_text(args.document)
    text = text[: args.chars] if args.chars else text
    loaded = PairCache(real_factory).get(BUNDLED_PAIR, lambda message: print(message, flush=True))
    prompt = loaded.codec.prompt(text, TASK)
    config = build_config("specextend", Knobs(max_new_tokens=args.max_new_tokens), loaded.codec.eos_ids)
    print(f"{len(prompt.ids)} prompt tokens, {args.max_new_tokens} new tokens, {loaded.device} {loaded.dtype}")
    run_once(loaded, prompt, config, settings, draw=False)  # warm-up
    alone, drawn, rates, shares, costs = [], [], [], [], []
    for i in range(args.repeats):
        a, _ = run_once(loaded, prompt, config, settings, draw=False)
        b, meter = run_once(loaded, prompt, config, settings, draw=True)
        wall = time.perf_counter() - meter.began
        alone.append(a)
        drawn.append(b)
        rates.append(meter.draws / wall)
        shares.append(meter.draw_s / wall)
        costs.append(meter.draw_s / max(meter.draws, 1))
        print(f"repeat {i + 1}: alone {a:.2f} tok/s, with panels {b:.2f} tok/s, {rates[-1]:.1f} redraws/s, "
              f"{costs[-1] * 1000:.1f} ms each, {shares[-1]:.1%} of wall time", flush=True)
    mean_a, mean_b = statistics.mean(alone), statistics.mean(drawn)
    print(f"decode tokens/s: alone {mean_a:.2f}, with panels drawn {mean_b:.2f} "
          f"({(mean_a - mean_b) / mean_a:+.1%} cost); {statistics.mean(rates):.1f} redraws/s, "
          f"{statistics.mean(costs) * 1000:.1f} ms each, {statistics.mean(shares):.1%} of wall time")
    if args.browser:
        del loaded  # the app loads its own pair
        c = run_in_browser(text, args.max_new_tokens, settings)
        print(f"through the app in chromium: {c:.2f} decode tok/s ({(mean_a - c) / mean_a:+.1%} vs alone)")


if __name__ == "__main__":
    main()
