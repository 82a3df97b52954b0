"""Measure what the live panels cost generation. Two measurements:

`ab`: the same request on a model pair, alternately with no one watching and with the panels drawn at
the app's pace (built and serialised exactly as the app does); prints decode tokens/s of both and the
drawing's CPU time. On a busy machine the tokens/s of repeated runs scatter more than the effect.

`ui`: replays a recorded trace at its recorded pace through the real app in headless Debian chromium
and counts the CPU time the UI takes while it streams: this process (drawing, gradio, the replay) and
the browser's processes. With the engine running, that CPU is what the panels take from it.

    python -m app.overhead ab --document britannica_plays --chars 4000 --max-new-tokens 32 --repeats 3
    python -m app.overhead ui path/to/run.trace.json
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from dataclasses import replace
from pathlib import Path

import orjson

from specextend.metrics import summarize

from . import documents
from .backend import PairCache, real_factory
from .panels import main_view
from .runner import Job, Knobs, RedrawMeter, build_config
from .settings import BUNDLED_PAIR, Settings
from .trace import loads

TASK = "Summarize the document in a few sentences."
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def run_once(loaded, prompt, config, settings: Settings, draw: bool) -> tuple[float, RedrawMeter]:
    """Decode tokens/s of one run, drawing the panels at the app's pace when `draw`."""
    job = Job([config.method], lambda m, c: config, lambda say: (loaded.codec, prompt, loaded.max_positions, loaded.generate))
    job.start()
    meter = RedrawMeter(settings.redraw_s, settings.redraw_share)
    while draw:
        finished = job.wait(meter.wait())
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


def ab(args: argparse.Namespace) -> None:
    settings = Settings.from_env()
    text = documents.sample_text(args.document)
    text = text[: args.chars] if args.chars else text
    loaded = PairCache(real_factory).get(BUNDLED_PAIR, lambda message: print(message, flush=True))
    prompt = loaded.codec.prompt(text, TASK)
    config = build_config("specextend", Knobs(max_new_tokens=args.max_new_tokens), loaded.codec.eos_ids)
    print(f"{len(prompt.ids)} prompt tokens, {args.max_new_tokens} new tokens, {loaded.device} {loaded.dtype}, "
          f"{loaded.numerics} numerics")
    run_once(loaded, prompt, config, settings, draw=False)  # warm-up
    alone, drawn, rates, costs, shares = [], [], [], [], []
    for i in range(args.repeats):
        a, _ = run_once(loaded, prompt, config, settings, draw=False)
        b, meter = run_once(loaded, prompt, config, settings, draw=True)
        wall = time.perf_counter() - meter.began
        alone.append(a)
        drawn.append(b)
        rates.append(meter.draws / wall)
        costs.append(meter.draw_s / max(meter.draws, 1))
        shares.append(meter.draw_s / wall)
        print(f"repeat {i + 1}: alone {a:.2f} tok/s, with panels {b:.2f} tok/s; {rates[-1]:.1f} redraws/s, "
              f"{costs[-1] * 1000:.1f} ms CPU each, {shares[-1]:.2%} of a core", flush=True)
    print(f"decode tokens/s: alone {statistics.mean(alone):.2f}, with panels {statistics.mean(drawn):.2f}; "
          f"{statistics.mean(rates):.1f} redraws/s, {statistics.mean(costs) * 1000:.1f} ms CPU each, "
          f"{statistics.mean(shares):.2%} of a core")


def _descendants(root: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    out, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, parent in parents.items() if parent == pid]
        out += kids
        frontier += kids
    return out


def _cpu_seconds(pids: list[int], name: str) -> float:
    """CPU seconds (user + system) so far of the processes among `pids` whose command name starts with `name`."""
    total = 0
    for pid in pids:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if comm.startswith(name):
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def ui(args: argparse.Namespace) -> None:
    from playwright.sync_api import sync_playwright

    from .ui import build_app, launch

    runs, _, _ = loads(Path(args.trace).read_text(encoding="utf-8"))
    span = max(e.t_s for events in runs.values() for e in events)
    steps = sum(type(e).__name__ == "Verified" for events in runs.values() for e in events)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        settings = replace(Settings.from_env(), host="127.0.0.1", port=s.getsockname()[1])
    demo = build_app(lambda choice, progress: None, settings)
    launch(demo, settings, prevent_thread_lock=True, quiet=True)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.goto(f"http://127.0.0.1:{settings.port}/")
            page.get_by_text("Replay a trace without loading any model").click()
            page.set_input_files("#trace-file input[type=file]", args.trace)
            page.get_by_label("recorded pace").check()
            page.locator("#chart-every label").nth(args.charts).click()
            page.wait_for_timeout(1000)  # let the upload settle before counting
            browser_pids = _descendants(os.getpid())
            cpu0, browser0, wall0 = time.process_time(), _cpu_seconds(browser_pids, "chromium"), time.perf_counter()
            page.click("#replay")
            page.wait_for_function("document.querySelector('#status').innerText.includes('Done.')",
                                   timeout=int(span * 4000) + 120_000)
            wall = time.perf_counter() - wall0
            server = time.process_time() - cpu0
            browser_cpu = _cpu_seconds(_descendants(os.getpid()), "chromium") - browser0
            status = page.inner_text("#status")
            browser.close()
    finally:
        demo.close()
    print(f"replayed {steps} steps over {wall:.1f} s ({steps / wall:.1f} steps/s)")
    print(status.splitlines()[-1])
    print(f"UI CPU while streaming: this process (drawing + gradio) {server / wall:.1%} of a core, "
          f"chromium {browser_cpu / wall:.1%} of a core")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    a = sub.add_parser("ab", help="engine alone vs engine with the panels drawn (server side)")
    a.add_argument("--document", default="britannica_plays")
    a.add_argument("--chars", type=int, default=0, help="use only the first N characters (0: all)")
    a.add_argument("--max-new-tokens", type=int, default=64)
    a.add_argument("--repeats", type=int, default=3)
    u = sub.add_parser("ui", help="CPU the whole UI takes while streaming a replayed trace in chromium")
    u.add_argument("trace")
    u.add_argument("--charts", type=int, default=0, choices=(0, 1, 2),
                   help="which 'Redraw the charts' choice: 0 live, 1 once a second, 2 when the run ends")
    args = parser.parse_args()
    if args.mode == "ab":
        ab(args)
    else:
        ui(args)


if __name__ == "__main__":
    main()
