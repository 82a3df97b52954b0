"""The app in a real browser: Debian chromium driven by Playwright. Loads the page, picks a sample
document, runs a short race (SpecExtend, then standard speculative decoding), waits for every panel to
draw (checked in the DOM), checks the panels against the run's exported trace (the chunks CMR reached
back for are drawn and listed), and saves screenshots under test-output/. The needle tab runs CMR under
the pair's default and the paper's retrieval signal beside StreamingLLM; with the bundled pair, the
default signal's first working cache holds the needle and the layer x head picture is drawn. Then lookup
drafting alone on a task that makes the target copy: the copied stretches are marked in the output and the
retrieval panel shows where they came from. Uses the bundled pair when the engine and the bundled draft are
present, else the fake engine (tests/fixtures/fake_engine.py); the test id says which.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
OUT = Path(__file__).parent.parent / "test-output"
PLOTS = ("retrieval-plot", "acceptance-plot", "throughput-plot")
DOCUMENT_CHARS = 5000  # about 1,300 tokens: a short prefill on a CPU-only CI machine
MAX_CHARS = 50_000  # the test server's cap on a document: a longer one is refused at once

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="Debian chromium is not installed at /usr/bin/chromium (apt-get install -y chromium)"
)


def bundled_pair_missing() -> str:
    """Why the bundled pair cannot run here ('' when it can)."""
    try:
        import specextend.engine  # noqa: F401
        from specextend.tools.bundled import draft_dir
    except ImportError as exc:
        return f"engine not importable ({exc})"
    try:
        draft_dir()
    except FileNotFoundError as exc:
        return str(exc)
    return ""


ENGINE = "fake" if bundled_pair_missing() else "bundled"


# open unless a test closes it: a closed gate holds every click's generation before its first step (after the
# prefill's progress is shown), so a test can act while a run is surely going, however fast the run would end
GATE = threading.Event()
GATE.set()
GATE_WAIT_S = 600.0  # a test that fails with the gate closed must not hold the server's runs forever


def gated(generate):
    """`generate` whose requests wait at the gate before the engine (and its clock) starts."""

    def waiting(*args, **kwargs):
        GATE.wait(GATE_WAIT_S)
        yield from generate(*args, **kwargs)

    return waiting


def gated_factory(factory):
    """`factory`'s pairs, their generation held by the gate (the plain and the race's one-prefill generate alike)."""

    def load(choice, progress):
        loaded = factory(choice, progress)
        race = loaded.race
        return dataclasses.replace(loaded, generate=gated(loaded.generate),
                                   race=None if race is None else lambda: gated(race()))

    return load


@pytest.fixture(scope="module")
def studio_url():
    from app import Settings, build_app, launch, real_factory

    if ENGINE == "bundled":
        factory, max_new = real_factory, 16
    else:
        from fixtures.fake_engine import fake_factory

        factory, max_new = fake_factory(step_s=0.03), 48
    factory = gated_factory(factory)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = Settings(port=port, max_document_chars=MAX_CHARS)
    demo = build_app(factory, settings)
    launch(demo, settings, prevent_thread_lock=True, quiet=True)
    yield f"http://127.0.0.1:{port}/", max_new
    demo.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield b
        b.close()


def plot_data(page, elem_id: str) -> list[dict]:
    """The traces Plotly drew in a panel, read from its graph div."""
    return page.evaluate(
        "id => (document.querySelector(`#${id} .js-plotly-plot`)?.data || [])"
        ".map(t => ({type: t.type, name: t.name, x: t.x, y: t.y}))", elem_id)


def far_back(retrieved: dict) -> bool:
    """Whether a recorded retrieval kept a chunk that a recency window of the same size would not hold."""
    kept, n = retrieved["selected"], len(retrieved["chunk_spans"])
    return any(0 < i < n - (len(kept) - 1) for i in kept)


def pick_sample(page, chars: int) -> None:
    """Pick the first sample document, then keep its first `chars` characters (a short prefill for CI)."""
    page.get_by_role("combobox", name="Sample document").click()
    page.get_by_role("option").first.click()
    page.wait_for_function("document.querySelector('#document textarea').value.length > 1000")
    text = page.input_value("#document textarea")
    page.fill("#document textarea", text[:chars])


def status_shows(page, condition: str, timeout_s: float) -> None:
    """Wait until the main tab's status text `s` meets `condition` (JavaScript); the failure says what it showed."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(f"(s => {condition})(document.querySelector('#status').innerText)",
                               timeout=timeout_s * 1000)
    except PlaywrightTimeout:
        pytest.fail(f"the status never met {condition} in {timeout_s:.0f} s; it shows: {page.inner_text('#status')!r}")


def wait_status(page, words: str, timeout_s: float = 60) -> None:
    """Wait until the main tab's status says `words`."""
    status_shows(page, f"s.includes({json.dumps(words)})", timeout_s)


def set_number(page, selector: str, value: int) -> None:
    page.fill(selector, str(value))
    page.press(selector, "Tab")


@pytest.mark.parametrize("engine", [ENGINE])
def test_a_race_draws_every_panel(studio_url, browser, engine):
    url, max_new = studio_url
    page = browser.new_page(viewport={"width": 1500, "height": 1100})
    page.goto(url)
    page.wait_for_selector("#run")
    pick_sample(page, DOCUMENT_CHARS)
    page.get_by_role("checkbox", name="the target alone (also checks exactness)").uncheck()
    page.get_by_text("Knobs").click()
    set_number(page, "#max-new input[type=number]", 4 * max_new)
    # the run is held at the gate until the second click has been answered: a run that ended first (the target's
    # answer can end early, a busy machine can answer the click late) would make that click start a new run instead
    GATE.clear()
    try:
        page.click("#run")
        page.wait_for_function("document.querySelector('#stepper') === null || "
                               "!document.querySelector('#stepper').checkVisibility()")
        # the run has begun (its own progress replaced the click's "Starting"): on a busy machine the queue can take
        # a while
        status_shows(page, "s.length > 0 && !s.startsWith('Ready') && !s.startsWith('Starting')", 120)
        page.click("#run")  # again, while the run goes: the page says so, and the run goes on
        wait_status(page, "A run is going", 120)
    finally:
        GATE.set()
    wait_status(page, "Done.", 900)
    assert "se-bad" not in page.inner_html("#status"), page.inner_text("#status")
    assert "A run is going" not in page.inner_text("#status")
    # every panel drew: plotly graph divs with traces, and the output text
    page.wait_for_function(
        f"{list(PLOTS)}.every(id => (document.querySelector(`#${{id}} .js-plotly-plot`)?._fullData || []).length > 0)"
        " && document.querySelector('#output .se-output')?.innerText.length > 0",
        timeout=60_000,
    )
    with page.expect_download() as download:
        page.click("#download")
    trace = json.loads(Path(download.value.path()).read_text())
    events = trace["runs"]["specextend"]
    retrieved = [e["step"] for e in events if e["type"] == "Retrieved"]
    verified = [e["step"] for e in events if e["type"] == "Verified"]

    retrieval = plot_data(page, "retrieval-plot")
    assert retrieval[1]["type"] == "heatmap" and retrieval[1]["y"] == retrieved  # a row per retrieval that ran
    reached = [e for e in events if e["type"] == "Retrieved" and far_back(e)]
    assert reached, "no retrieval reached back past the recent window"
    assert "Reaching back" in page.inner_text("#far-chunks")
    assert any(2 in (row or []) for row in page.evaluate(  # green cells: chunks a recency window would not hold
        "document.querySelector('#retrieval-plot .js-plotly-plot').data[1].z"))
    acceptance = plot_data(page, "acceptance-plot")
    assert acceptance[0]["type"] == "heatmap" and acceptance[0]["x"] == verified  # a column per step
    curves = [t["name"] for t in plot_data(page, "throughput-plot") if t["type"] == "scatter"]
    # a fair race: lookup is added to every drafting run, and the headline is the paper's comparison on those sources
    assert curves == ["SpecExtend + lookup", "speculative (full draft cache) + lookup"]
    readout = page.inner_text("#readout")
    assert "SpecExtend over standard speculative decoding, both with lookup" in readout and "not comparable" not in readout
    assert "the same draft and the same sources" in page.inner_text("#race")
    # the live run, once finished, can be stepped through like a replayed one: the control offers both runs
    page.wait_for_selector("#stepper", state="visible", timeout=30_000)
    assert f"Step {verified[-1]} of {verified[-1]}" in page.inner_text("#step-info")
    assert page.locator("#step-run input[type=radio]").count() == 2

    OUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUT / f"studio-{engine}.png"), full_page=True)
    page.close()


@pytest.mark.parametrize("engine", [ENGINE])
def test_needle_teaching_tab_compares_two_signals_and_streaming(studio_url, browser, engine):
    url, _ = studio_url
    page = browser.new_page(viewport={"width": 1500, "height": 1100})
    page.goto(url)
    page.get_by_role("tab", name="Needle in a haystack (teaching)").click()
    set_number(page, "#needle-length input[type=number]", DOCUMENT_CHARS)
    set_number(page, "#needle-max-new input", 12)
    page.click("#needle-run")
    page.wait_for_function("document.querySelector('#needle-status').innerText.includes('Done.')", timeout=900_000)
    assert "se-bad" not in page.inner_html("#needle-status"), page.inner_text("#needle-status")
    page.wait_for_function(
        "['needle-plot', 'needle-cmr', 'needle-paper', 'needle-streaming'].every(id => "
        "(document.querySelector(`#${id} .js-plotly-plot`)?._fullData || []).length > 0)", timeout=60_000)
    grid = plot_data(page, "needle-plot")[0]
    default = "CMR, calibrated signal" if engine == "bundled" else "CMR, default signal"
    assert grid["y"] == [default, "CMR, paper signal", "StreamingLLM draft cache"] and len(grid["x"]) > 0
    assert page.inner_text("#needle-answers").count("\n") >= 3
    # the tab says, from these runs, whether the draft's guesses changed between its caches; its pair is its own
    assert "Did the draft's cache change its guesses?" in page.inner_text("#needle-answers")
    assert page.locator("#needle-pair").is_visible() and "this tab's own" in page.inner_text("#needle-pair")
    if engine == "bundled":  # the calibrated signal's first working cache holds the whole needle
        held = page.evaluate("document.querySelector('#needle-plot .js-plotly-plot').data[0].z")
        assert held[0][0] == 1.0, held
        page.wait_for_function("(document.querySelector('#needle-heads .js-plotly-plot')?._fullData || []).length > 0")
        heads = plot_data(page, "needle-heads")[0]
        assert heads["type"] == "heatmap" and len(heads["y"]) == 30  # the target's 30 layers
    OUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUT / f"needle-{engine}.png"), full_page=True)
    # the Long-document tab owns its runs: a refused run there brings back no step control over the needle runs
    page.get_by_role("tab", name="Long input or long output").click()
    page.fill("#document textarea", "word " * (MAX_CHARS // 4))
    page.click("#run")
    wait_status(page, "up to 50,000 characters", 30)
    page.wait_for_timeout(1500)  # the step control's update comes after the run's answer
    assert not page.locator("#stepper").is_visible()
    assert "waiting for the run" not in page.inner_text("#output")
    page.close()


COPY_TASK = "Copy the first two sentences of the document exactly, word for word."


@pytest.mark.parametrize("engine", [ENGINE])
def test_lookup_copies_show_in_the_output_and_the_retrieval_panel(studio_url, browser, engine):
    if engine == "fake":
        pytest.skip("the fake engine drafts no lookup copies: this check needs the bundled pair")
    url, _ = studio_url
    page = browser.new_page(viewport={"width": 1500, "height": 1100})
    page.goto(url)
    page.wait_for_selector("#run")
    pick_sample(page, DOCUMENT_CHARS)
    page.fill("#task textarea, #task input", COPY_TASK)
    page.get_by_label("lookup drafting alone (copies, no draft model)").check()
    for name in ("standard speculative decoding", "the target alone (also checks exactness)"):
        page.get_by_role("checkbox", name=name).uncheck()
    page.get_by_text("Knobs").click()
    set_number(page, "#max-new input[type=number]", 24)
    page.click("#run")
    wait_status(page, "Done.", 900)
    assert "se-bad" not in page.inner_html("#status"), page.inner_text("#status")
    page.wait_for_function("(document.querySelector('#retrieval-plot .js-plotly-plot')?._fullData || []).length > 0",
                           timeout=60_000)
    with page.expect_download() as download:
        page.click("#download")
    events = json.loads(Path(download.value.path()).read_text())["runs"]["lookup"]
    drafted = {e["step"]: e for e in events if e["type"] == "Drafted"}
    copied = [e["step"] for e in events if e["type"] == "Verified"
              and any(drafted[e["step"]]["sources"][n] != "draft" for n in e["accepted_nodes"][: len(e["committed"])])]
    assert copied, "the target copied nothing from the document: no lookup tokens were accepted"
    assert page.locator("#output .se-copy").count() >= 1  # copied stretches are marked in the text
    strip, rows = plot_data(page, "retrieval-plot")
    assert strip["y"] == [1] and rows["y"] == copied  # the copy strip, and a row per step that copied
    assert "Lookup:" in page.inner_text("#retrieval-plot")
    OUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUT / f"lookup-{engine}.png"), full_page=True)
    page.close()


FIXTURE_TRACE = Path(__file__).parent / "fixtures" / "smollm2_hamlet.trace.json"


def stepped(page) -> dict:
    """What the step control changes: the step in words, the output, the working cache outlined on the strip, the
    acceptance panel's columns and its draft tree's title."""
    return page.evaluate("""() => {
        const plot = id => document.querySelector(`#${id} .js-plotly-plot`);
        const outline = (plot('retrieval-plot').layout.shapes || []).filter(s => s.type === 'rect' && s.yref === 'y')
            .map(s => [s.x0, s.x1]);
        const titles = (plot('acceptance-plot').layout.annotations || []).map(a => a.text);
        return {info: document.querySelector('#step-info').innerText, output: document.querySelector('#output').innerHTML,
                outline: JSON.stringify(outline), columns: plot('acceptance-plot').data[0].x.length,
                tree: titles.find(t => t.includes('draft tree')) || ''};
    }""")


# element ids seen twice; Plotly's own marker definitions (id "symbol", one per chart) are not the page's
DUPLICATE_IDS = """() => { const seen = {};
    for (const e of document.querySelectorAll('[id]')) if (e.id) seen[e.id] = (seen[e.id] || 0) + 1;
    return Object.entries(seen).filter(([id, n]) => n > 1 && !['symbol'].includes(id)); }"""


def click(page, elem_id: str, trace: int, x: float, y: float) -> None:
    """A click on a point of a panel, as Plotly reports it, once the page has hooked the panel's graph."""
    page.wait_for_function(f"document.querySelector('#{elem_id} .js-plotly-plot')?.__stepHooked === true",
                           timeout=10_000)
    page.evaluate(f"""() => {{ const p = document.querySelector('#{elem_id} .js-plotly-plot');
                               p.emit('plotly_click', {{points: [{{x: {x}, y: {y}, data: p.data[{trace}]}}]}}); }}""")


def wait_for_step(page, step: int) -> None:
    """Until the step is told in words and the acceptance panel has that many columns (the panels are redrawn)."""
    page.wait_for_function(
        f"document.querySelector('#step-info')?.innerText.includes('Step {step} of') && "
        f"document.querySelector('#retrieval-plot .js-plotly-plot')?.layout && "
        f"(document.querySelector('#acceptance-plot .js-plotly-plot')?.data?.[0]?.x || []).length === {step}",
        timeout=30_000)


def open_replay(browser, url: str):
    """A new page with the recorded trace chosen for replay (not yet started)."""
    page = browser.new_page(viewport={"width": 1500, "height": 1100})
    page.goto(url)
    page.wait_for_selector("#run")
    page.get_by_text("Replay a trace without loading any model").click()
    page.set_input_files("#trace-file input[type=file]", str(FIXTURE_TRACE))
    page.wait_for_function("document.querySelector('#trace-file')?.innerText.includes('.json')", timeout=30_000)
    return page


@pytest.mark.parametrize("engine", [ENGINE])
def test_the_step_control_moves_every_panel_through_a_replayed_trace(studio_url, browser, engine):
    """Replay the recorded trace (no model), then step: the output, the working-cache outline and the draft tree
    follow the control, whether moved by its buttons, by the slider's box or by a click on a step in ③."""
    url, _ = studio_url
    events = json.loads(FIXTURE_TRACE.read_text())["runs"]["specextend"]
    last = max(e["step"] for e in events if e["type"] == "Verified")
    page = open_replay(browser, url)
    page.click("#replay")
    wait_status(page, "Done.", 120)
    page.wait_for_selector("#stepper", state="visible", timeout=30_000)
    wait_for_step(page, last)
    end = stepped(page)
    assert end["columns"] == last and "se-focus" not in end["output"]  # the end of the run, as drawn live

    page.click("#step-prev")
    wait_for_step(page, last - 1)
    before = stepped(page)
    assert before["columns"] == last - 1 and before["output"] != end["output"]

    assert not page.evaluate(DUPLICATE_IDS)  # no two elements share an id (a gradio Group repeats its own)
    titles = page.evaluate("() => [...document.querySelectorAll('#output .se-target')].map(e => e.title)")
    assert any(t.endswith(": the target's token") for t in titles), titles[:3]  # an apostrophe ended the attribute
    page.focus("#step-slider input[type=range]")
    page.keyboard.press("ArrowLeft")  # a key moves the slider, and every panel with it
    wait_for_step(page, last - 2)
    page.fill("#step-slider input[type=number]", "6")  # typed into the slider's box: no blur, no release
    wait_for_step(page, 6)
    early = stepped(page)
    assert early["columns"] == 6 and len(early["output"]) < len(before["output"])
    assert early["outline"] != before["outline"]  # the working cache the draft read then, not at the end
    drafted_at_6 = any(e["type"] == "Drafted" and e["step"] == 6 and e["tokens"] for e in events)
    assert ("step 6: draft tree" in early["tree"]) == drafted_at_6 and early["tree"] != end["tree"]

    click(page, "acceptance-plot", 0, x=12, y=1)  # a step of ③
    wait_for_step(page, 12)
    assert stepped(page)["columns"] == 12
    click(page, "retrieval-plot", 1, x=3, y=8)  # a row of ②'s heatmap: the working cache chosen after step 8
    wait_for_step(page, 9)  # the step whose draft read it
    page.click("#step-next")
    wait_for_step(page, 10)
    OUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUT / "stepping.png"), full_page=False)
    page.close()


@pytest.mark.parametrize("engine", [ENGINE])
def test_stop_during_a_replay_is_said_until_the_end_and_the_end_stays(studio_url, browser, engine):
    """A replay at its recorded pace (the fixture's runs took minutes) stopped midway: the status says it is
    stopping, then that it stopped, and that last word stays (Stop's own answer never lands after it)."""
    url, _ = studio_url
    page = open_replay(browser, url)
    page.get_by_label("recorded pace").check()
    page.click("#replay")
    wait_status(page, "step ", 60)
    page.click("#stop")
    wait_status(page, "Stopped, as asked", 30)
    page.wait_for_timeout(3000)
    status = page.inner_text("#status")
    assert "Stopped, as asked" in status and "Stopping" not in status
    page.close()


# --- the page as a new user meets it: its defaults, Stop, a replay, a refusal, a typed step -----------------------

# the words a panel shows while it waits for something; after Stop, nothing is coming
WAITING = "waiting for"

PANEL_TEXTS = """() => {
    const note = id => ((document.querySelector(`#${id} .js-plotly-plot`)?.layout?.annotations) || [])
        .map(a => a.text).join(' | ');
    const text = id => document.querySelector(`#${id}`)?.innerText || '';
    return {status: text('status'), output: text('output'), exactness: text('exactness'), readout: text('readout'),
            step: text('step-info'), retrieval: note('retrieval-plot'), acceptance: note('acceptance-plot'),
            speed: note('throughput-plot'), stepper: !!document.querySelector('#stepper')?.checkVisibility()};
}"""

# Symbols drawn where no installed font has them come out as the font's empty box (the same box as a private-use
# character no font has). Each element's non-ASCII characters (its text, or the characters given for it), drawn on a
# canvas in that element's font, are compared with that box.
MISSING_GLYPHS = """(asked) => {
    const canvas = document.createElement('canvas');
    canvas.width = 40; canvas.height = 40;
    const ctx = canvas.getContext('2d', {willReadFrequently: true});
    const draw = (ch, font) => {
        ctx.clearRect(0, 0, 40, 40); ctx.font = font; ctx.fillStyle = '#000'; ctx.textBaseline = 'top';
        ctx.fillText(ch, 4, 4);
        return Array.from(ctx.getImageData(0, 0, 40, 40).data).join(',');
    };
    const missing = [];
    for (const [id, chars] of Object.entries(asked)) {
        const el = document.querySelector(`#${id}`);
        if (!el) continue;
        const font = getComputedStyle(el).font || '16px sans-serif';
        const box = draw('\\uE000', font);
        for (const ch of new Set(Array.from(chars ?? el.innerText).filter(c => c.codePointAt(0) > 127 && c.trim()))) {
            if (draw(ch, font) === box) missing.push(`${id}: ${ch} U+${ch.codePointAt(0).toString(16)}`);
        }
    }
    return missing;
}"""


def texts(page) -> dict:
    return page.evaluate(PANEL_TEXTS)


def new_page(browser, url: str):
    page = browser.new_page(viewport={"width": 1500, "height": 1100})
    page.goto(url)
    page.wait_for_selector("#run")
    return page


@pytest.mark.parametrize("engine", [ENGINE])
def test_a_refused_click_does_not_wait_behind_another_tabs_run(studio_url, browser, engine):
    """The server runs one generation at a time; while one tab's run holds that slot, another tab's Run on an empty
    document is refused at once: its refusal shows while the first run is still going, not after it."""
    url, _ = studio_url
    running, refused = new_page(browser, url), new_page(browser, url)
    running.click("#run")
    wait_status(running, "SpecExtend", timeout_s=300)  # its first run has begun (the model loaded, if it had to)
    refused.fill("#document textarea", "")
    refused.click("#run")
    wait_status(refused, "The document is empty")
    assert "Done." not in running.inner_text("#status")  # the first run still holds the slot
    running.click("#stop")
    wait_status(running, "Stopped, as asked", timeout_s=120)
    running.close()
    refused.close()


@pytest.mark.parametrize("engine", [ENGINE])
def test_a_fresh_page_runs_on_its_defaults_and_stop_leaves_nothing_stale(studio_url, browser, engine):
    """Opened, the page has a sample chosen and counted; Run on the defaults starts the race (it answered "The
    document is empty"); Stop in its first run leaves every panel saying what happened: nothing waits, the speed table
    gives the time the run took and lists the race's runs that never began, the exactness line does not ask to tick
    the target alone (it is ticked), and the step control does not say "Step 0 of 0"."""
    url, _ = studio_url
    page = new_page(browser, url)
    assert len(page.input_value("#document textarea")) > 1000
    chosen = page.input_value("#sample input")
    assert "tokens)" in chosen, chosen  # the first sample's label, "... (~7,534 tokens)"
    listed = chosen.rsplit("(~", 1)[1].split(" ")[0]
    assert f"{listed} tokens in the document" in page.inner_text("#doc-info")  # the readout counts as the list does
    assert "Ready: a sample document is loaded" in page.inner_text("#status")
    page.click("#run")
    wait_status(page, "SpecExtend", timeout_s=300)  # its first run has begun (the model loaded, if it had to)
    page.click("#stop")
    wait_status(page, "Stopped, as asked", timeout_s=120)
    page.wait_for_selector("#stepper", state="visible", timeout=30_000)
    page.wait_for_function("document.querySelector('#readout').innerText.includes('did not run')", timeout=30_000)
    seen = texts(page)
    assert "The document is empty" not in seen["status"] and "target alone: did not run (stopped)" in seen["status"]
    for panel in ("output", "retrieval", "acceptance", "step", "exactness"):
        assert WAITING not in seen[panel], (panel, seen[panel])
    assert "Step 0 of 0" not in seen["step"] and "tick" not in seen["exactness"], seen
    assert "did not run (stopped)" in seen["readout"] and "0.00 s" not in seen["readout"], seen["readout"]
    OUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUT / f"page-stopped-{engine}.png"), full_page=True)
    assert not page.evaluate(MISSING_GLYPHS, dict.fromkeys(["output", "status", "readout", "step-info", "stepper"]))
    page.close()


@pytest.mark.parametrize("engine", [ENGINE])
def test_a_replay_says_so_and_stopped_in_its_prefill_leaves_nothing_stale(studio_url, browser, engine):
    """The recorded trace at its recorded pace (its prefill took 16 s) stopped after a second: the status and the
    page say it is a replay of a trace and whose; then every panel says the run was stopped before its first token,
    retrieval and step; the speed table gives the time the replay had reached and lists the two runs that never began;
    the exactness line says the target alone did not run; the stop mark is a glyph the fonts have."""
    url, _ = studio_url
    pair = json.loads(FIXTURE_TRACE.read_text())["meta"]["pair"]
    page = open_replay(browser, url)
    page.get_by_label("recorded pace").check()
    page.click("#replay")
    wait_status(page, "Replay of a trace recorded on a date the file does not say, " + pair)
    page.wait_for_function("document.querySelector('#output .se-about')?.innerText.includes('Replay of a trace')",
                           timeout=30_000)
    page.wait_for_timeout(1000)
    page.click("#stop")
    wait_status(page, "Stopped, as asked", timeout_s=30)
    page.wait_for_selector("#stepper", state="visible", timeout=30_000)
    page.wait_for_function("document.querySelector('#step-info').innerText.length > 0", timeout=30_000)
    seen = texts(page)
    assert "Replay of a trace" in seen["status"] and "Replay of a trace" in seen["output"]
    assert "stopped before the first token, during the prefill" in seen["output"]
    assert "stopped before the first retrieval" in seen["retrieval"]
    assert "stopped before the first step" in seen["acceptance"]
    assert "stopped before the first token" in seen["speed"]  # not empty axes
    assert seen["step"].startswith("Stopped before the first step"), seen["step"]
    assert "target alone did not run (stopped)" in seen["exactness"] and "tick" not in seen["exactness"]
    assert seen["readout"].count("did not run (stopped)") == 2 and "0.00 s" not in seen["readout"], seen["readout"]
    for panel in ("output", "retrieval", "acceptance", "step", "exactness"):
        assert WAITING not in seen[panel], (panel, seen[panel])
    OUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUT / "page-replay-stopped.png"), full_page=True)
    assert not page.evaluate(MISSING_GLYPHS, dict.fromkeys(["output", "status", "readout", "step-info", "step-play"]))
    page.close()


@pytest.mark.parametrize("engine", [ENGINE])
def test_a_refused_click_clears_the_panels_and_a_new_input_clears_the_refusal(studio_url, browser, engine, tmp_path):
    """After a replay, Run on an empty document is refused: no panel still shows the replayed run, the step control
    and the trace download go; the refusal then gives way to "Ready" when the document is typed, when a sample is
    picked, when a file is uploaded, and when the workload changes."""
    url, _ = studio_url
    upload = tmp_path / "notes.txt"
    upload.write_text("An uploaded document, long enough to be read as one, about the sea and its tides. " * 4)
    page = open_replay(browser, url)
    page.click("#replay")
    wait_status(page, "Done.")
    page.wait_for_selector("#download", state="visible", timeout=30_000)
    for change in ("type", "sample", "upload", "workload"):
        page.fill("#document textarea", "")
        page.click("#run")
        wait_status(page, "The document is empty")
        page.wait_for_timeout(1000)  # the step control's answer comes after the click's
        seen = texts(page)
        assert "Nothing was generated" in seen["output"] and "Replay of a trace" not in seen["output"]
        assert seen["readout"] == "" and seen["exactness"] == "" and "nothing ran" in seen["retrieval"], seen
        assert not seen["stepper"] and not page.locator("#download").is_visible()
        if change == "type":
            page.fill("#document textarea", "A document typed in after the refusal, long enough to be read. " * 3)
        elif change == "sample":  # another sample than the one chosen as the page opened
            page.get_by_role("combobox", name="Sample document").click()
            page.get_by_role("option").nth(1).click()
        elif change == "upload":
            with page.expect_file_chooser() as chooser:
                page.click("#upload")
            chooser.value.set_files(str(upload))
        else:
            page.get_by_label("long output: write at length from a short prompt").check()
        wait_status(page, "Ready", timeout_s=10)
        assert "empty" not in page.inner_text("#status"), change
        if change == "workload":
            page.get_by_label("long input: read a document, write a short answer").check()
    OUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUT / "page-refusal-cleared.png"), full_page=True)
    page.close()


@pytest.mark.parametrize("engine", [ENGINE])
def test_a_step_typed_between_steps_or_out_of_range_is_drawn_where_the_control_shows(studio_url, browser, engine):
    """12.5, 999 and -5 typed into the step box: the panels are drawn at the step it rounds to within the run, and the
    box and the slider are set to that step, so all three agree."""
    url, _ = studio_url
    events = json.loads(FIXTURE_TRACE.read_text())["runs"]["specextend"]
    last = max(e["step"] for e in events if e["type"] == "Verified")
    page = open_replay(browser, url)
    page.click("#replay")
    wait_status(page, "Done.")
    page.wait_for_selector("#stepper", state="visible", timeout=30_000)
    for typed, drawn in (("12.5", 13), ("999", last), ("-5", 0), ("7", 7)):
        page.fill("#step-slider input[type=number]", typed)
        wait_for_step(page, drawn)  # the step in words, and the acceptance panel with a column per step up to it
        page.wait_for_function(
            f"document.querySelector('#step-slider input[type=number]').value === '{drawn}' && "
            f"document.querySelector('#step-slider input[type=range]').value === '{drawn}'", timeout=30_000)
        assert f"Step {drawn} of {last}" in page.inner_text("#step-info"), typed
    page.close()


@pytest.mark.parametrize("engine", [ENGINE])
def test_every_symbol_the_page_writes_has_a_glyph_in_the_machines_fonts(studio_url, browser, engine):
    """Each non-ASCII character in the app's and the visualizers' sources (marks like "■ stopped", "❚❚ pause", ✔, ①),
    drawn in the output panel's font and in a button's, is a glyph, not the empty box of a character no font has
    ("⏹" and "⏸" were: Debian's fonts lack them)."""
    root = Path(__file__).parent.parent
    chars = sorted({c for folder in ("app", "visualizers") for path in (root / folder).glob("*.py")
                    for c in path.read_text(encoding="utf-8") if ord(c) > 127 and c.strip()})
    assert len(chars) > 20  # the marks, arrows, dashes and quotes the page writes
    page = browser.new_page()
    page.goto(studio_url[0])
    page.wait_for_selector("#run")
    page.wait_for_selector("#output")  # the page draws its parts one after another: on a busy machine #run came first
    assert page.locator("#output").count() == page.locator("#run").count() == 1
    assert page.evaluate(MISSING_GLYPHS, {"output": "⏹⏸"}) == ["output: ⏹ U+23f9", "output: ⏸ U+23f8"]  # it finds them
    assert not page.evaluate(MISSING_GLYPHS, {"output": "".join(chars), "run": "".join(chars)})
    page.close()
