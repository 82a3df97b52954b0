"""A long output in a real browser (Debian chromium driven by Playwright), on the fake engine so that CI stays fast:
the long-output workload picked on the page, a bundled short prompt, 4,500 new tokens with a chain of one, so the
main run takes 2,000+ steps and the target alone 4,500, with the panels redrawn live all along. Checks that the
retrieval strip marks the output's chunks and that CMR kept chunks of the output, that every chart's size stays
bounded however many steps pass, and measures how long the page's main thread was ever blocked while the runs
streamed (written to test-output/long-output-responsiveness.json)."""

from __future__ import annotations

import json
import re
import socket
import statistics
from pathlib import Path

import pytest

from test_browser import ARGS, CHROMIUM, OUT, PLOTS

NEW_TOKENS = 4500
MAX_POINTS = 1_000  # the most points a line or bar trace may carry, whatever the number of steps
MAX_CELLS = 25_000  # the most cells a heatmap may carry
# the longest task the page's main thread may run: one redraw of every panel (three Plotly figures and the output's
# HTML, ~0.1-0.2 s each) measured 1.1-3.4 s with the server, the fake engine and chromium sharing two busy cores (load
# 5-7). Only a guard against a frozen page, generous so that a busier machine cannot miss it; that the redraws stay
# bounded is checked on the figures' sizes below
MAX_STALL_MS = 10_000
# where the run request carries the two knobs this test sets: the run's inputs, read from the page's own config
RUN_INPUTS = """
() => {
  const config = window.gradio_config;
  const run = config.dependencies.find((d) => d.api_name === "run");
  const at = (test) => run.inputs.indexOf(config.components.find((c) => c.props && test(c.props)).id);
  return {fn: run.id, max_new: at((p) => p.elem_id === "max-new"), k: at((p) => p.label === "chain length k")};
}
"""

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="Debian chromium is not installed at /usr/bin/chromium (apt-get install -y chromium)"
)

# every 50 ms, how late the page's timer fired (a blocked main thread fires late), and the longest tasks it ran
WATCH = """
() => {
  window.__stalls = []; window.__long = [];
  let last = performance.now();
  setInterval(() => { const now = performance.now(); window.__stalls.push(now - last - 50); last = now; }, 50);
  new PerformanceObserver((list) => window.__long.push(...list.getEntries().map((e) => e.duration)))
    .observe({type: "longtask", buffered: true});
}
"""


@pytest.fixture(scope="module")
def long_url():
    from app import Settings, build_app, launch
    from fixtures.fake_engine import fake_factory

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = Settings(port=port, max_new_tokens=NEW_TOKENS)
    demo = build_app(fake_factory(step_s=0.001), settings)
    launch(demo, settings, prevent_thread_lock=True, quiet=True)
    yield f"http://127.0.0.1:{port}/"
    demo.close()


def too_big(trace: dict) -> bool:
    """Whether a Plotly trace carries more than its kind may: a heatmap's cells, a line's or bars' points."""
    z = trace.get("z")
    if z:
        return sum(len(row or []) for row in z) > MAX_CELLS
    return len(trace.get("x") or trace.get("y") or []) > MAX_POINTS


def type_knobs(page, tries: int = 5) -> None:
    """Types NEW_TOKENS and a chain length of 1 into their boxes until both hold them; each try waits 10 s."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    held = (f"document.querySelector('#max-new input[type=number]').value === '{NEW_TOKENS}' && "
            "document.querySelector('input[aria-label=\"chain length k\"]').value === '1'")
    for _ in range(tries):
        page.fill("#max-new input[type=number]", str(NEW_TOKENS))
        page.press("#max-new input[type=number]", "Tab")
        page.get_by_label("chain length k").fill("1")
        page.get_by_label("chain length k").press("Tab")
        try:
            page.wait_for_function(held, timeout=10_000)
            return
        except PlaywrightTimeout:
            continue
    raise AssertionError(f"after {tries} tries the knobs hold max new tokens "
                         f"{page.input_value('#max-new input[type=number]')!r} and chain length "
                         f"{page.get_by_label('chain length k').input_value()!r}, not the {NEW_TOKENS} and 1 typed")


def test_a_long_output_marks_the_outputs_chunks_and_keeps_the_page_responsive(long_url):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        page.goto(long_url)
        page.wait_for_selector("#run")
        page.get_by_text("long output: write at length from a short prompt").click()
        page.get_by_role("combobox", name="Sample prompt").click()
        page.get_by_role("option").first.click()
        page.wait_for_function("document.querySelector('#document textarea').value.length > 100")
        assert "at length" in page.input_value("#task textarea")
        page.get_by_text("Knobs").click()
        assert page.input_value("#max-new input[type=number]") == str(min(2048, NEW_TOKENS))  # the workload's default
        # the page sends the knobs with the Run click: type them until both boxes hold what was typed (an answer from
        # the server still on its way, the workload's or the sample's, once put an older value back), then check that
        # the run request carried them (a run once went with the old chain length: 1,076 steps where this test wants
        # 2,000+)
        type_knobs(page)
        inputs = page.evaluate(RUN_INPUTS)
        assert min(inputs.values()) >= 0, inputs
        page.evaluate(WATCH)
        with page.expect_request(lambda r: r.method == "POST" and "queue/join" in r.url
                                 and json.loads(r.post_data or "{}").get("fn_index") == inputs["fn"]) as sent:
            page.click("#run")
        data = json.loads(sent.value.post_data)["data"]
        assert (data[inputs["max_new"]], data[inputs["k"]]) == (NEW_TOKENS, 1), (
            f"the run was sent max new tokens {data[inputs['max_new']]} and chain length {data[inputs['k']]}, "
            f"not the {NEW_TOKENS} and 1 typed into the page")
        page.wait_for_function("document.querySelector('#status').innerText.includes('Done.')", timeout=600_000)
        assert "se-bad" not in page.inner_html("#status"), page.inner_text("#status")
        page.wait_for_function(
            f"{list(PLOTS)}.every(id => (document.querySelector(`#${{id}} .js-plotly-plot`)?._fullData || []).length > 0)",
            timeout=60_000)
        stalls = page.evaluate("window.__stalls")
        long_tasks = page.evaluate("window.__long")
        redraws = re.search(r"panels redrawn (\d+) times", page.inner_text("#status") + page.inner_html("#status"))

        with page.expect_download() as download:
            page.click("#download")
        runs = json.loads(Path(download.value.path()).read_text())["runs"]
        steps = max(e["step"] for e in runs["specextend"] if e["type"] == "Verified")
        assert steps >= 2000 and len(runs["autoregressive"]) > NEW_TOKENS  # 2,000+ steps, and 4,500 for the target alone

        # the retrieval strip covers prompt and output, and marks the output's chunks as the model's own
        figure = page.evaluate("(() => { const p = document.querySelector('#retrieval-plot .js-plotly-plot');"
                               " return {data: p.data.map(t => ({text: t.text, type: t.type})), layout: p.layout}; })()")
        named = [s.get("name") for s in figure["layout"].get("shapes", [])]
        assert "output chunks" in named, named
        strip = figure["data"][0]["text"][0]
        output_kept = [t for t in strip if "output tokens" in t and "in working cache" in t]
        assert output_kept, "CMR kept no chunk of the output"
        assert any("document tokens" in t or "prompt tokens" in t for t in strip)  # the prompt's chunks come first
        assert "from the output" in figure["layout"]["title"]["text"].replace("<br>", " ")  # wherever it wraps

        # bounded: no trace of any chart grows with the steps
        for plot in PLOTS:
            sizes = page.evaluate(f"document.querySelector('#{plot} .js-plotly-plot').data"
                                  ".map(t => ({x: t.x, y: t.y, z: t.z}))")
            assert not any(too_big(t) for t in sizes), plot

        report = {"steps_main_run": steps, "new_tokens": NEW_TOKENS, "runs": list(runs),
                  "panels_redrawn": int(redraws.group(1)) if redraws else None,
                  "timer_lateness_ms": {"median": statistics.median(stalls), "max": max(stalls),
                                        "over_200ms": sum(s > 200 for s in stalls), "samples": len(stalls)},
                  "long_tasks_ms": {"count": len(long_tasks), "max": max(long_tasks, default=0.0),
                                    "total": sum(long_tasks)}}
        OUT.mkdir(exist_ok=True)
        (OUT / "long-output-responsiveness.json").write_text(json.dumps(report, indent=1))
        page.screenshot(path=str(OUT / "long-output.png"), full_page=True)
        browser.close()
    assert max(long_tasks, default=0.0) < MAX_STALL_MS, f"the page's main thread was blocked for over {MAX_STALL_MS} ms: {report}"
