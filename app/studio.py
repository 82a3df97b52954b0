"""The Studio's handlers: what each click on the page does, answered in `app.updates`' plain values (never gradio's).
Run (a method and its race on a document or a short prompt) and its check at the click, replay a trace, Stop, the
needle race, the queue's word before a click's turn, the sample, prompt, upload and workload pickers, the document
readout, and the trace export;
stepping through a finished run is `app.stepping`'s. Generation runs in a background thread per click (`Job`) and
the panels are redrawn from snapshots, throttled so drawing costs generation at most a few percent.
Knows the settings, the pair cache, sessions, the panels and the trace format; knows nothing of gradio or of the
page's layout (`app/ui.py` lays it out, wires each event to a handler here and translates the answers).
"""

from __future__ import annotations

import html
import itertools
import logging
import tempfile
import threading
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import orjson

from specextend.config import GenerationConfig, preset
from specextend.events import Started
from specextend.tools.prompting import LONG_OUTPUT_INSTRUCTION, LONG_OUTPUT_TOKENS, Prompt
from visualizers import heads_spec, needle_spec, retrieval_spec, signal_html
from visualizers.acceptance import forget_texts
from visualizers.common import ending, label

from . import documents
from .backend import EngineFactory, HeadPictures, Loaded, PairCache
from .documents import DocumentError
from .panels import (View, about_html, machine_load, main_view, needle_nothing_ran, needle_view, nothing_ran,
                     recorded_settings, status_html, status_text)
from .runner import Job, Knobs, Recent, RedrawMeter, build_config, replay, serving_chain, whole
from .settings import Settings
from .stepping import Stepping
from .trace import TraceError, dumps, loads
from .updates import KEEP, Figure, Halt, Update, figure

log = logging.getLogger(__name__)

NEEDLE_RUNS = ("specextend", "specextend_paper", "streaming")  # the needle tab's runs: CMR under two signals, StreamingLLM
DEFAULT_TASK = "Summarize the document in a few sentences."
WORKLOADS = [("long input: read a document, write a short answer", "document"),
             ("long output: write at length from a short prompt", "long_output")]
RUN_IS_GOING = "A run is going in this tab: Run starts nothing until it ends. Press Stop to end it sooner."
STOPPING = "Stopping: the run ends after the current step (or prefill block)."
STOP_WAIT_S = 5.0  # Stop waits this long for the run to end, so that its answer cannot land after the run's last word
READY = "Ready: a sample document is loaded. Press Run, or pick, paste or upload another."
KEEP_TRACES = 64  # exported trace files kept on disk (gradio's cache of them is swept hourly)
KNOB_NAMES = tuple(f.name for f in fields(Knobs))  # the knob widgets' values reach `run` in this order
Draw = Callable[[Job, dict, Callable, bool], list]  # (job, runs so far, decode, charts due) -> each panel's value


def said(lines: list[str], error: str = "", details: str = "") -> tuple[str, str]:
    """The status twice: as the page shows it (HTML, `details` folded away) and as API callers read it (plain text)."""
    return status_html(lines, error, details), status_text(lines, error)


def needle_knobs(max_new_tokens: Any, top_k: Any) -> Knobs:
    """The needle tab's knobs: its new tokens and chunks kept, retrieving after every step, the device's chain."""
    return Knobs(max_new_tokens=max_new_tokens, top_k=top_k, retrieve_every=1)


def panels(view: View) -> tuple:
    """The main tab's panels as a handler answers them, in the order the page lists them (output to speed table)."""
    return (view.output, view.exactness, figure(view.retrieval), view.far, figure(view.acceptance),
            figure(view.throughput), view.readout)


class SessionState:
    """One tab's runs in one browser tab: its current job (so Stop and a new Run can reach it). The main tab (long
    input or long output) and the needle tab each hold their own, so one's run never shows in, or stops, the other's."""

    def __init__(self) -> None:
        self.job: Job | None = None
        self.refusal = ""  # why this tab's last click was refused before any job began ("" when it was not)

    def stop(self) -> None:
        if self.job is not None:
            self.job.stop()

    def refused(self) -> bool:
        """Whether this tab's last click was refused (its status says why and nothing ran): before its job began, or
        by its job before any run started (a prompt over the model's limit)."""
        job = self.job
        return bool(self.refusal) or (job is not None and job.done.is_set() and bool(job.error) and not job.runs)

    @staticmethod
    def close(state: SessionState) -> None:
        if state is not None:
            state.stop()


class Studio(Stepping):
    """The app's handlers, closed over the settings, the pair cache and a folder for exported traces."""

    def __init__(self, factory: EngineFactory, settings: Settings) -> None:
        self.settings = settings
        self.pairs = PairCache(factory, on_drop=forget_texts)
        self.trace_dir = Path(tempfile.mkdtemp(prefix="specextend-traces-"))
        self._exports, self._exported = threading.Lock(), itertools.count(1)
        self.generations = Recent(64)  # recent generation jobs' clocks, for the waiting user's estimate
        self.pictures = HeadPictures()  # the needle tab's layer x head pictures, by target and input (not by pair)

    def preload(self) -> None:
        """Load the default pair now (before serving: a Space's first visitor should not wait for a download)."""
        log.info("Preloading %s", self.settings.default.label)
        self.pairs.get(self.settings.default, lambda message: log.info("preload: %s", message))
        log.info("Preloaded %s", self.settings.default.label)

    # --- the queue -------------------------------------------------------------------------------
    def queued(self, state: SessionState | None = None) -> str:
        """The status a click shows at once, before its turn: that this tab's run is still going (the click starts
        nothing: the page ignores Run until the run ends), else whether a slot is free, and if not, how many runs
        hold the slots and when, by how long recent runs took, one should free up."""
        job = state.job if state is not None else None
        if job is not None and not job.done.is_set():
            job.notify(RUN_IS_GOING)  # kept in the status until the run ends: progress lines must not hide it, and
            # the run's next redraw comes at once (one computed before this word could land after it)
            return status_html([job.status, job.notice])
        now = time.perf_counter()
        active = [j for j in self.generations if not j.done.is_set()]
        if len(active) < self.settings.concurrency:
            return status_html(["Starting: a slot is free."])
        took = sorted(j.ended - j.began for j in self.generations if j.done.is_set())
        line = (f"Waiting for a free slot: {len(active)} run(s) in progress (this server runs "
                f"{self.settings.concurrency} at a time); runs queued before yours start first.")
        if took:
            typical = took[len(took) // 2]
            soonest = max(0.0, min(typical - (now - j.began) for j in active))
            line += f" Recent runs took about {typical:.0f} s, so a slot should free in about {soonest:.0f} s."
        return status_html([line])

    # --- documents -------------------------------------------------------------------------------
    def pick_sample(self, name: str | None):
        return documents.sample_text(name) if name else KEEP

    def pick_prompt(self, name: str | None) -> tuple:
        """A bundled long-output prompt: its text and its instruction."""
        return documents.sample_prompt(name) if name else (KEEP, KEEP)

    def choose_workload(self, workload: str) -> tuple:
        """The controls of a workload: which samples are offered, what the text box holds, the task, and how many new
        tokens (a long output asks for thousands, where the server allows them). The text typed so far stays."""
        long = workload == "long_output"
        tokens = min(LONG_OUTPUT_TOKENS if long else Knobs.max_new_tokens, self.settings.max_new_tokens)
        return (Update(visible=not long), Update(visible=long),
                Update(label="Prompt" if long else "Document",
                       placeholder="…or write a short prompt: a story opening, a question, a problem" if long
                       else "…or paste a long document here"),
                LONG_OUTPUT_INSTRUCTION if long else DEFAULT_TASK, tokens)

    def upload(self, path: str | None):
        if not path:
            return KEEP, KEEP
        try:
            text = documents.read_upload(path, self.settings.max_upload_bytes, self.settings.max_document_chars)
        except DocumentError as exc:
            return KEEP, f"<div class='se-bad'>{html.escape(str(exc))}</div>"
        return text, KEEP

    def document_info(self, text: str, pair_key: str) -> str:
        if not text or not text.strip():
            return "<div class='se-muted'>No document yet: pick a sample, paste text, or upload a .txt/.md file.</div>"
        try:
            documents.check_text(text, self.settings.max_document_chars)  # before counting: oversized text costs nothing
            choice = self.settings.pair(pair_key)
            loaded = self.pairs.peek(choice)
        except ValueError as exc:
            return f"<div class='se-bad'>{html.escape(str(exc))}</div>"
        # the tokens of the document alone, as the sample list counts them (the prompt adds the template and the task)
        if loaded is None:
            known = documents.sample_tokens(text)
            if known is not None:
                whose = "" if choice.bundled else "; this pair's own count shows once it is loaded"
                return (f"<div class='se-muted'>{len(text):,} characters, {known:,} tokens in the document (the bundled "
                        f"target's tokenizer{whose}); the model's limit shows once it is loaded.</div>")
            return (f"<div class='se-muted'>{len(text):,} characters, about {len(text) // 4:,} tokens in the document "
                    "(estimated at four characters a token; the exact count and the model's limit show once the model "
                    "is loaded).</div>")
        # what a run checks is the whole prompt (the template and a task around the document), here with the default task
        prompt = loaded.codec.prompt(text, DEFAULT_TASK)
        n = loaded.codec.count(text)
        limit, what = self.input_limit(loaded)
        over = len(prompt.ids) > limit
        style = "se-bad" if over else "se-muted"
        note = " — too long; shorten it." if over else ""
        shorter = loaded.draft_positions
        draft = (f" The draft was trained on {shorter:,} positions: SpecExtend and StreamingLLM keep its working "
                 "positions within them; plain speculative decoding runs it past them, as the paper's baseline does."
                 if shorter is not None and n > shorter and not over else "")
        return (f"<div class='{style}'>{len(text):,} characters, {n:,} tokens in the document ({len(prompt.ids):,} in the "
                f"prompt, with the chat template and the task) · {what}{note}{draft}</div>")

    def input_limit(self, loaded: Loaded) -> tuple[int, str]:
        """The most prompt tokens a run may read, and how to say it: the server's cap (`check_input` refuses a
        longer prompt), else the target's context less the one position a new token needs (the job's check)."""
        cap = self.settings.max_input_tokens
        if cap and cap < loaded.max_positions:
            return cap, f"this server reads prompts (the document, the template and the task) of up to {cap:,} tokens"
        return loaded.max_positions - 1, f"the model's limit is {loaded.max_positions:,} positions (prompt + new tokens)"

    def check_input(self, loaded: Loaded, prompt: Prompt) -> None:
        """Refuse a prompt longer than the server's cap (the model's own limit is the job's to check)."""
        cap = self.settings.max_input_tokens
        if cap and len(prompt.ids) > cap:
            raise ValueError(f"The prompt is {len(prompt.ids):,} tokens; this server reads inputs of up to {cap:,} "
                             "tokens. Shorten the document.")

    # --- runs ------------------------------------------------------------------------------------
    def run(self, state: SessionState, document: str, task: str = DEFAULT_TASK, pair: str | None = None,
            method: str = "specextend", race: list[str] | None = None, chart_every: str | float = "0",
            max_new_tokens: float = Knobs.max_new_tokens, chunk_size: float = Knobs.chunk_size,
            top_k: float = Knobs.top_k, retrieve_every: float = Knobs.retrieve_every, shape: str = Knobs.shape,
            k: float | None = None, max_depth: float = Knobs.max_depth, node_budget: float = Knobs.node_budget,
            temperature: float = Knobs.temperature, seed: float = Knobs.seed, lookup: bool = Knobs.lookup,
            signal: str = Knobs.signal, workload: str = "document") -> Iterator[tuple]:
        """The API's `/run`: its parameters are named as the page's controls are (the knobs in KNOB_NAMES' order,
        then the workload: "document", a long input, or "long_output", a short prompt written on at length). A chain
        length k of None is the serving device's (runner.serving_chain), as the page's knob starts."""
        state.stop()
        try:
            text, choice, knobs = self._request(document, task, pair, method, (
                max_new_tokens, chunk_size, top_k, retrieve_every, shape, k, max_depth, node_budget, temperature, seed,
                lookup, signal), workload)
        except ValueError as exc:
            yield self._refused(state, str(exc))
            return
        methods = [method] + [m for m in race or [] if m != method]

        def prepare(say):
            loaded = self.pairs.get(choice, say)
            say(f"Tokenizing the {'prompt' if workload == 'long_output' else 'document'} with the target's chat "
                f"template ({loaded.device}, {loaded.dtype}, {loaded.numerics} numerics)")
            prompt = loaded.codec.prompt(text, task, thinking=workload == "long_output")
            self.check_input(loaded, prompt)
            return loaded.codec, prompt, loaded.max_positions, loaded.click()

        def configs(m: str, codec) -> GenerationConfig:  # a fair race: every drafting method drafts from the same
            # sources (the pair's draft, and lookup in all of them or in none), so a ratio between two of them is what
            # the methods alone make of those sources (the paper's comparison)
            return build_config(m, knobs, codec.eos_ids, self.settings.max_new_tokens, lookup=True)

        state.refusal, state.job = "", Job(methods, configs, prepare).start()
        self.generations.append(state.job)
        yield from self._stream(state.job, self._main_draw(method), {"pair": choice.label, "task": task, "primary": method,
                                                                     "workload": workload}, chart_every)

    def check(self, state: SessionState, document: str, task: str, pair: str | None, method: str, race: Any,
              chart_every: Any, *values: Any) -> tuple:
        """Run's click at once, outside the queue (the inputs as `run` gets them, the knobs' values then the
        workload): a request refused before any model loads is answered now, its status and every panel (so it never
        waits for a turn behind other tabs' runs, and the click goes no further: `state.refusal`); else the queue's
        word (`queued`), the panels kept."""
        job = state.job
        if job is None or job.done.is_set():
            try:
                self._request(document, task, pair, method, values[:len(KNOB_NAMES)], *values[len(KNOB_NAMES):])
            except ValueError as exc:
                return self._refused(state, str(exc))
            state.refusal = ""
        return self.queued(state), *([KEEP] * 9)

    @staticmethod
    def go_on(state: SessionState) -> Halt | None:
        """Between Run's `check` and its queued run: the click goes no further where the check refused it."""
        return Halt(state.refusal) if state is not None and state.refusal else None

    def _request(self, document: str, task: str, pair: str | None, method: str, knob_values: tuple,
                 workload: str = "document") -> tuple[str, Any, Knobs]:
        """A click's request checked before any model loads (ValueError: why it is refused): the document's text,
        the pair chosen and the knobs (`knob_values` in KNOB_NAMES' order; a chain length k of None is the serving
        device's, runner.serving_chain)."""
        text = documents.check_text(document, self.settings.max_document_chars)
        if not task or not task.strip():
            raise ValueError("The task is empty: say what to do with the document (for example, summarize it).")
        if workload not in {value for _, value in WORKLOADS}:
            raise ValueError(f"the workload is 'document' (a long input) or 'long_output', got {workload!r}")
        if workload == "document":
            documents.check_long_input(text)
        choice = self.settings.pair(pair) if pair else self.settings.default
        given = dict(zip(KNOB_NAMES, knob_values))
        knobs = Knobs(**given | {"k": serving_chain() if given["k"] is None else given["k"]})
        build_config(method, knobs, (), self.settings.max_new_tokens, lookup=True)  # refuse nonsense before loading
        return text, choice, knobs

    def replay(self, state: SessionState, trace: str | None, pace: str = "instant",
               chart_every: str | float | None = None) -> Iterator[tuple]:
        state.stop()
        try:
            if not trace:
                raise TraceError("Choose a trace file (.json) to replay.")
            size = Path(trace).stat().st_size
            if size > self.settings.max_trace_bytes:
                raise TraceError(f"it is {size / 1024:,.0f} KB; this server replays traces up to "
                                 f"{self.settings.max_trace_bytes / 1024:,.0f} KB")
            runs, codec, meta = loads(Path(trace).read_text(encoding="utf-8"), self.settings.max_new_tokens)
        except (TraceError, OSError, UnicodeDecodeError) as exc:
            yield self._refused(state, f"Cannot replay this file: {exc}")
            return
        if not codec.table:  # a plain engine trace carries no token text: borrow a loaded tokenizer if any
            loaded = self.pairs.peek(self.settings.default)
            codec = loaded.codec if loaded is not None else codec
        primary = meta.get("primary") if meta.get("primary") in runs else next(iter(runs))
        prompt_ids = next((list(e.prompt_ids) for e in runs[primary] if hasattr(e, "prompt_ids")), [])

        recorded = meta.get("machine_load")  # the recorded machine's load: the busy note is about the recorded run
        took = sum(events[-1].t_s for events in runs.values())

        def prepare(say):
            say("Replaying a recorded trace (no model loaded) " + (
                f"at its recorded pace: its runs took {took:,.1f} s" if pace == "recorded pace" else "instantly"))
            pace_factor = 1.0 if pace == "recorded pace" else 0.0
            return codec, Prompt(prompt_ids, (0, len(prompt_ids))), float("inf"), replay(runs, pace_factor)

        when = f"recorded on {meta['recorded']}" if meta.get("recorded") else "recorded on a date the file does not say"
        started = next((e for e in runs[primary] if isinstance(e, Started)), None)
        about = (f"Replay of a trace {when}" + (f", {meta['pair']}" if meta.get("pair") else "")
                 + ": no model runs; the panels show the recorded runs"
                 + (f", which ran with {recorded_settings(started.config)} (the knobs on the left are this page's, "
                    "not the trace's)." if started is not None else "."))
        state.refusal, state.job = "", Job(list(runs), lambda m, c: preset(m), prepare, about=about).start()
        yield from self._stream(state.job, self._main_draw(primary, lambda: recorded), {**meta, "replayed": True},
                                chart_every)

    def stop(self, state: SessionState) -> Any:
        """Stop this tab's run. The run's own stream says when it has ended; this answers "Stopping" only while
        it has not (waiting a little first), so the answer never lands after that last word and stays."""
        job = state.job
        if job is None or job.done.is_set():
            return said(["Nothing is running."])
        state.stop()
        return (KEEP, KEEP) if job.done.wait(STOP_WAIT_S) else said([STOPPING])

    def input_changed(self, state: SessionState) -> tuple:
        """The document, the sample, the upload or the workload changed: a refusal of the last click no longer
        applies, so the status says the page is ready again (any other status stays: it tells of the runs shown)."""
        if not state.refused():
            return KEEP, KEEP
        state.refusal, state.job = "", None  # the refused click left nothing to keep
        return said([READY])

    @staticmethod
    def _needle_refused(state: SessionState, error: str) -> tuple:
        """A needle click refused before its job began: the status says why and every panel that nothing ran."""
        state.job = None
        return (*said([], error), *(figure(v) if isinstance(v, dict) else v for v in needle_nothing_ran()))

    def _refused(self, state: SessionState, error: str) -> tuple:
        """A main-tab click refused before its job began: the status says why, and every panel that showed an earlier
        run says that nothing ran (no earlier run is left looking like this click's answer); no trace to download."""
        state.stop()
        state.refusal, state.job = error, None
        return (*said([], error), *panels(nothing_ran()), None)

    def _main_draw(self, primary: str, load: Callable[[], float | None] = machine_load) -> Draw:
        """`load`: the load per core of the machine the runs ran on, read when they end (a replay's: its trace's)."""
        def draw(job: Job, runs, decode, charts: bool) -> list:
            done = job.done.is_set()
            view = main_view(runs, primary, decode, charts, text=job.codec.text if job.codec else None,
                             load=load() if done else None, not_run=job.not_run())
            if done and not runs:  # refused or stopped before any run began: nothing is coming
                view = nothing_ran()
            view = replace(view, output=about_html(job.about) + view.output)
            return [view.output, view.exactness, view.retrieval, view.far, view.acceptance, view.throughput, view.readout]

        return draw

    def _stream(self, job: Job, draw: Draw, export: dict[str, Any] | None = None,
                chart_every: str | float | None = None) -> Iterator[tuple]:
        """Redraw the panels from the job's snapshots until it is done; unchanged panels are not resent.

        `draw` gives each panel's value (HTML, a figure dict that is serialised here once with orjson into a
        `Figure`, or None to leave it; never KEEP). Charts are drawn at most
        every `chart_every` seconds (0: on the first redraw and at the end only): in the browser they
        cost far more than text. With `export`, the last message also carries the trace download.
        """
        meter = RedrawMeter(self.settings.redraw_s, self.settings.redraw_share)
        chart_every = self.settings.redraw_s if chart_every is None else float(chart_every)
        sent: list[Any] = []
        charted = -1e9
        while True:
            finished = job.wait(meter.wait())
            meter.start()
            runs = job.snapshot()
            decode = job.codec.decode if job.codec is not None else (lambda ids: "")
            now = time.perf_counter()
            charts = finished or meter.draws == 0 or (0 < chart_every <= now - charted + 0.01)
            charted = now if charts else charted
            fresh = [orjson.dumps(v) if isinstance(v, dict) else v for v in draw(job, runs, decode, charts)]
            sent += [None] * (len(fresh) - len(sent))
            values: list[Any] = []
            for i, value in enumerate(fresh):
                if value is None or (value == sent[i] and not finished):  # the last message carries every panel
                    values.append(KEEP)
                else:
                    sent[i] = value
                    values.append(Figure(value) if isinstance(value, bytes) else value)
            meter.drew()
            if export is not None:
                download = KEEP
                if finished and runs:  # after the run: not counted as drawing cost; the page shows the button then
                    download = self._export(runs, decode, export)
                values.append(download)
            yield (*said(self._status(job, runs, finished), job.error, meter.line()), *values)
            meter.resumed()
            if finished:
                return

    @staticmethod
    def _status(job: Job, runs: dict, finished: bool) -> list[str]:
        """The status lines: what the run is doing (or that it is stopping, once asked: progress must not hide
        that) and any notice; at the end, how it ended and how each run ended."""
        stopped = job.stop_event.is_set()
        if not finished:
            return [job.about, STOPPING if stopped else job.status, job.notice]
        head = "" if job.error else "Stopped, as asked: the panels show the runs as far as they got." if stopped else "Done."
        return [head, job.about, *(f"{label(m)}: {ending(ev)}" for m, ev in runs.items()),
                *(f"{label(m)}: did not run ({why})" for m, why in job.not_run().items())]

    def _export(self, runs, decode, meta: dict[str, Any]) -> str:
        """Write the trace for download under a name no other export takes; only the most recent KEEP_TRACES files
        are kept. Runs finishing at once export one at a time (one sweeping while another writes lost a file). A live
        run's trace records this machine's load (a replay keeps its trace's), so its replay says whether it was busy."""
        recorded = {"machine_load": machine_load(), "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        text = dumps(runs, decode, meta if meta.get("replayed") else {**meta, **recorded})
        with self._exports:
            number = next(self._exported)
            path = self.trace_dir / f"specextend-trace-{time.strftime('%Y%m%d-%H%M%S')}-{number}.json"
            path.write_text(text, encoding="utf-8")
            written = lambda f: int(f.stem.rsplit("-", 1)[1])  # noqa: E731  (the export's number)
            for old in sorted(self.trace_dir.glob("specextend-trace-*.json"), key=written)[:-KEEP_TRACES]:
                old.unlink(missing_ok=True)
        return str(path)

    # --- teaching mode ---------------------------------------------------------------------------
    def needle(self, state: SessionState, haystack: str, length: float, depth: float, seed: float, top_k: float,
               max_new_tokens: float, pair: str | None = None) -> Iterator[tuple]:
        """The API's `/needle`: plant a fact in a sample document and race CMR under two signals and StreamingLLM."""
        state.stop()
        try:
            from specextend.tools import needle

            choice = self.settings.pair(pair) if pair else self.settings.default
            chars = whole("haystack length", length)
            if not isinstance(depth, (int, float)) or not 0 <= depth <= 100:
                raise ValueError(f"needle depth is a share of the document from 0 to 100 (%), got {depth!r}")
            text = documents.check_text(documents.sample_text(haystack)[:chars] if haystack else "",
                                        self.settings.max_document_chars)
            planted = needle.generate(text, float(depth) / 100.0, seed=whole("seed", seed or 0))
            knobs = needle_knobs(max_new_tokens, top_k)
            build_config("specextend", knobs, (), self.settings.max_new_tokens)
        except ValueError as exc:
            yield self._needle_refused(state, str(exc))
            return
        except KeyError as exc:  # a haystack that is not a bundled sample
            yield self._needle_refused(state, f"{exc.args[0]}: pick a haystack from the list")
            return
        task = f"{planted.question} Answer with the answer only."
        picture: dict[str, Any] = {}

        def prepare(say):
            loaded = self.pairs.get(choice, say)
            say("Tokenizing the haystack and the question")
            prompt = loaded.codec.prompt(planted.document, task, marks={"needle": planted.fact})
            self.check_input(loaded, prompt)
            if loaded.heads is not None and "needle" in prompt.marks and len(prompt.ids) < loaded.max_positions:
                picture["map"] = self.pictures.get(loaded, prompt.ids, prompt.marks["needle"], lambda: say(
                    "Reading where each of the target's heads looks (one prefill that keeps every head's queries)"))
            return loaded.codec, prompt, loaded.max_positions, loaded.click()

        def configs(m: str, codec) -> GenerationConfig:  # both CMR runs are SpecExtend; they differ in the signal
            signal = "paper" if m == "specextend_paper" else "default"
            return build_config("streaming" if m == "streaming" else "specextend", replace(knobs, signal=signal),
                                codec.eos_ids, self.settings.max_new_tokens)

        info = (f"<div class='se-needle'><b>Needle</b> (planted {planted.actual_depth:.0%} into the document): "
                f"“{html.escape(planted.fact)}”<br><b>Question</b>: {html.escape(planted.question)}</div>")

        def draw(job: Job, runs, decode, charts: bool) -> list:
            prompt, done = job.prompt, job.done.is_set()
            stopped = done and job.stop_event.is_set()
            if done and not any(runs.values()):  # refused (or stopped) before a run began: no earlier click's panels
                return needle_nothing_ran(info)
            if prompt is None or "needle" not in prompt.marks:
                return [info, needle_spec({}, (0, 0), 0, stopped), "", None, None, None, None]  # None: left as it is
            span = prompt.marks["needle"]
            grid, answers = needle_view(runs, span, len(prompt.ids), planted.answer, job.codec.text, done, stopped)
            answers += signal_html(runs)
            if not charts:
                return [info, None, answers, None, None, None, None]
            found = picture.get("map")
            heads = heads_spec(found.share, found.signals, found.rows) if found else heads_spec((), {}, 0)
            mark = ("needle", span)
            return [info, grid, answers, heads, *(retrieval_spec(runs.get(m, []), decode, mark, height=300)
                                                  for m in NEEDLE_RUNS)]

        state.job = Job(list(NEEDLE_RUNS), configs, prepare).start()
        self.generations.append(state.job)
        yield from self._stream(state.job, draw)


