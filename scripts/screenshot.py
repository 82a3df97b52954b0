"""README's screenshot (docs/studio.png): the Studio as a newcomer meets it after replaying a recorded run, no model
loaded. The app is served on 127.0.0.1 with its default settings, headless Debian chromium (/usr/bin/chromium, driven by
Playwright) opens it, puts the input the trace was recorded on in the document and task boxes (where its meta names a
bundled sample, e.g. "hamlet_opening[:4000]"), replays the trace through the page (the replay accordion, instant pace)
and, once every panel has drawn, takes the top of the page: the title, the document, Run, and beside them the output
and the retrieval panel. The picture is cut to a palette of --colours colours so that it stays small in the
repository.

    .venv/bin/python -m scripts.screenshot                      # tests/fixtures/smollm2_hamlet.trace.json -> docs/studio.png
    .venv/bin/python -m scripts.screenshot --trace run.trace.json --out /tmp/studio.png --height 1300
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
DRAWN = ("document.querySelector('#status')?.innerText.includes('Done.') && "
         "['retrieval-plot', 'acceptance-plot', 'throughput-plot'].every("
         "id => document.querySelector(`#${id} .js-plotly-plot`)?.data?.length)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recorded_input(trace: Path) -> tuple[str, str, str] | None:
    """(the sample's label in the page's list, its text as the run read it, the task) where the trace's meta names a
    bundled sample ("hamlet_opening" or "hamlet_opening[:4000]"), else None."""
    from app import documents

    meta = json.loads(trace.read_text()).get("meta", {})
    named = re.fullmatch(r"(\w+)(?:\[:(\d+)\])?", str(meta.get("document", "")))
    labels = {key: label for label, key in documents.samples()}
    if not named or named.group(1) not in labels:
        return None
    text = documents.sample_text(named.group(1))
    return labels[named.group(1)], text[: int(named.group(2))] if named.group(2) else text, str(meta.get("task", ""))


def take(url: str, trace: Path, out: Path, width: int, height: int) -> None:
    """Replay `trace` in the page at `url` and save the top `height` pixels of a `width`-pixel-wide window to `out`."""
    from playwright.sync_api import sync_playwright

    given = recorded_input(trace)

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(url)
            page.wait_for_selector("#run")
            if given is not None:
                label, text, task = given
                page.get_by_role("combobox", name="Sample document").click()
                page.get_by_role("option", name=label).click()
                page.wait_for_function("document.querySelector('#document textarea').value.length > 1000")
                page.fill("#document textarea", text)
                page.evaluate("document.querySelector('#document textarea').scrollTop = 0")  # its beginning shows
                if task:
                    page.fill("#task textarea", task)
                page.press("#task textarea", "Tab")
            page.get_by_text("Replay a trace without loading any model").click()
            page.set_input_files("#trace-file input[type=file]", str(trace))
            page.wait_for_function("document.querySelector('#trace-file')?.innerText.includes('.json')", timeout=30_000)
            page.click("#replay")
            page.wait_for_function(DRAWN, timeout=120_000)
            page.wait_for_selector("#stepper", state="visible", timeout=30_000)
            page.evaluate("window.scrollTo(0, 0)")
            page.mouse.move(width - 1, 1)  # no hover label over a panel
            page.wait_for_timeout(1000)  # the last redraw and the scroll settle
            page.screenshot(path=str(out), full_page=False)
        finally:
            browser.close()


def shrink(path: Path, colours: int) -> None:
    """The PNG cut to a palette of `colours` colours, saved optimised."""
    from PIL import Image

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=colours, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    small.save(path, optimize=True)


def main() -> None:
    from app import Settings, build_app, launch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=ROOT / "tests" / "fixtures" / "smollm2_hamlet.trace.json")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "studio.png")
    p.add_argument("--width", type=int, default=1400)
    p.add_argument("--height", type=int, default=1500)
    p.add_argument("--colours", type=int, default=256)
    args = p.parse_args()
    if not CHROMIUM.exists():
        raise SystemExit(f"no chromium at {CHROMIUM} (apt-get install -y chromium)")

    settings = Settings(port=free_port())
    demo = build_app(settings=settings)  # the default pair, never loaded: a replay needs no model
    launch(demo, settings, prevent_thread_lock=True, quiet=True)
    try:
        take(f"http://127.0.0.1:{settings.port}/", args.trace, args.out, args.width, args.height)
    finally:
        demo.close()
    shrink(args.out, args.colours)
    print(f"{args.out}: {args.width}x{args.height}, {args.out.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
