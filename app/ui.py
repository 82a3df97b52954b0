"""The Gradio app: layout and wiring. Built from an injected engine factory, so importing it loads no
model; each browser tab gets its own session state; generation runs in a background thread per click
and the panels are redrawn from snapshots, throttled so drawing costs generation at most a few percent.
"""

from __future__ import annotations

import html
import itertools
import logging
import threading
import tempfile
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import gradio as gr
import orjson
from gradio.components.plot import PlotData

from specextend.config import GenerationConfig, preset
from specextend.methods import METHOD_TABLE
from specextend.tools.prompting import LONG_OUTPUT_INSTRUCTION, LONG_OUTPUT_TOKENS, Prompt
from visualizers import heads_spec, needle_spec, retrieval_spec, signal_html
from visualizers.acceptance import forget_texts
from visualizers.common import ending, label
from visualizers.steps import last_step, step_html

from . import documents, zerogpu
from .backend import EngineFactory, Loaded, PairCache, real_factory
from .documents import DocumentError
from .panels import machine_load, main_view, needle_view, status_html, step_view
from .runner import Job, Knobs, Recent, RedrawMeter, build_config, replay, whole
from .settings import Settings
from .trace import TraceError, dumps, loads

log = logging.getLogger(__name__)

CSS = """
.se-output { white-space: pre-wrap; line-height: 1.55; font-size: 15px; padding: 10px 12px; border: 1px solid #e4e7eb;
  border-radius: 8px; background: #fff; max-height: 320px; overflow-y: auto; }
.se-draft { border-bottom: 2px solid #2a9d8f; }
.se-copy { border-bottom: 2px solid #7b61ff; }
.se-target { border-bottom: 2px solid #c9d1d9; }
.se-legend { font-size: 13px; color: #52606d; margin-bottom: 6px; }
.se-legend span { margin-right: 14px; padding: 1px 4px; }
.se-note { color: #7b8794; }
.se-table { border-collapse: collapse; font-size: 13px; width: 100%; }
.se-table th, .se-table td { border-bottom: 1px solid #e4e7eb; padding: 4px 8px; text-align: left; }
.se-ok { color: #1b7a5a; font-weight: 600; }
.se-bad { color: #c0392b; font-weight: 600; }
.se-muted { color: #52606d; font-size: 13px; }
.se-status { font-size: 13px; color: #323f4b; min-height: 1.4em; }
.se-help { font-size: 13px; color: #52606d; margin: -4px 0 4px 0; }
.se-focus { outline: 2px solid #e9c46a; border-radius: 3px; background: #fff8e1; }
.se-guess { color: #e76f51; margin-left: 2px; }
.se-step { font-size: 14px; padding: 6px 10px; background: #f7f9fb; border-left: 4px solid #e9c46a; border-radius: 4px; }
.se-hidden { display: none !important; }
.se-needle { font-size: 14px; padding: 8px 12px; background: #fff8e1; border-left: 4px solid #e9c46a; border-radius: 4px; }
"""

INTRO = """
# SpecExtend Studio
**Speculative decoding on long inputs and long outputs, drawn live.** A small *draft* model guesses the next few tokens; the
larger *target* model checks all the guesses in one pass, keeps the ones it agrees with and adds one token of its
own (the *bonus* token). The output is exactly what the target alone would write, only faster. On a long document
the draft gets slow and guesses worse; **SpecExtend** lets it read only the *chunks* of the document that the
target is paying attention to right now (Cross-model Retrieval, CMR), and uses faster attention kernels.

Pick a sample document (or paste or upload one), press **Run**, and watch: **①** the text as it is written,
**②** which chunks the draft reads, **③** which of its guesses the target keeps, **④** the speed against
standard speculative decoding and the target alone. Or choose **long output**: a short prompt and thousands of new
tokens, where the sequence grows by generation and CMR reads back what the model wrote itself.
"""

METHOD_CHOICES = [(m.choice, m.name) for m in reversed(METHOD_TABLE)]  # SpecExtend first, the target alone last
SIGNAL_CHOICES = [("the pair's default (calibrated heads, recent rows, recency reserve)", "default"),
                  ("the paper's (final layer, last token, heads averaged)", "paper")]
NEEDLE_RUNS = ("specextend", "specextend_paper", "streaming")  # the needle tab's runs: CMR under two signals, StreamingLLM
RACE_CHOICES = [("standard speculative decoding", "speculative"), ("lookup drafting alone", "lookup"),
                ("the target alone (also checks exactness)", "autoregressive")]
DEFAULT_TASK = "Summarize the document in a few sentences."
WORKLOADS = [("long input: read a document, write a short answer", "document"),
             ("long output: write at length from a short prompt", "long_output")]
RUN_IS_GOING = "A run is going in this tab: Run starts nothing until it ends. Press Stop to end it sooner."
STOPPING = "Stopping: the run ends after the current step (or prefill block)."
STOP_WAIT_S = 5.0  # Stop waits this long for the run to end, so that its answer cannot land after the run's last word
NOTHING_RAN = "<div class='se-muted'>Nothing was generated: the status above says why.</div>"
KEEP_TRACES = 64  # exported trace files kept on disk (gradio's cache of them is swept hourly)
Draw = Callable[[Job, dict, Callable, bool], list]  # (job, runs so far, decode, charts due) -> each panel's value

NEEDLE_INTRO = """
### Needle in a haystack: can the draft still see the fact?
A one-sentence fact (the *needle*) is planted in a long document and the model is asked about it. The target reads
the whole document, so its answer is the same in every run. But the draft only sees its small working cache: to
guess the answer's tokens, the needle must be in it. **CMR** fills that cache with the chunks the target's attention
scores highest; *which* attention is the retrieval signal. Three runs, same prompt, a retrieval after every step,
and the same working-cache budget (the chunks you set × 32 tokens). StreamingLLM fills it to the token; CMR keeps
whole chunks, and the newest of them is still being written, so it holds up to one chunk fewer:

- **CMR, the pair's chosen signal**: the heads and query rows calibrated for this target on the bundled documents
  (needles planted at several depths; the rows are the last tokens the target has read, at first the question), with
  part of the cache kept for the newest text and the rest spent only on older chunks (its settings are listed below);
- **CMR, the paper's signal**: the final layer, the last token's attention row, all heads averaged, with only the
  newest chunk reserved;
- **StreamingLLM**: the first tokens and the most recent ones, whatever the question is.

The picture of layers and heads shows why the paper's choice fails on this small model: the heads that find the
needle sit in the middle layers and read it from the question's tokens; averaged over the final layer's heads for a
single token, that signal is too weak, and recency wins the working cache. On larger targets, the final layer often
does find it; the calibration is what tells.
"""


class SessionState:
    """One tab's runs in one browser tab: its current job (so Stop and a new Run can reach it). The main tab (long
    input or long output) and the needle tab each hold their own, so one's run never shows in, or stops, the other's."""

    def __init__(self) -> None:
        self.job: Job | None = None

    def stop(self) -> None:
        if self.job is not None:
            self.job.stop()

    @staticmethod
    def close(state: SessionState) -> None:
        if state is not None:
            state.stop()


KNOB_NAMES = tuple(f.name for f in fields(Knobs))  # the knob widgets' values reach `run` in this order
STEP_PANELS = 7  # what moving the step control redraws: output, exactness, retrieval, far, acceptance, speed, step
PACES = [("half a second a step", "0.5"), ("a second a step", "1"), ("two seconds a step", "2")]
# a click on a step of the acceptance panel, or on a retrieval's row, moves the step control there (through the
# hidden #step-jump box); plots are redrawn as new elements, so new ones are hooked as they appear
CLICK_TO_STEP = """
() => {
  const send = (step) => {
    const box = document.querySelector("#step-jump textarea, #step-jump input");
    if (!box || !Number.isFinite(step)) return;
    box.value = `${Math.max(0, Math.round(step))}:${Date.now()}`;
    box.dispatchEvent(new Event("input", {bubbles: true}));
  };
  const hook = () => {
    for (const [id, pick] of [
      ["acceptance-plot", (p) => (!p.data.xaxis || p.data.xaxis === "x" || p.data.xaxis === "x3") ? p.x : NaN],
      // a row of the heatmap names its step in its trace's meta: the step after a retrieval, or a copying step
      ["retrieval-plot", (p) => p.data.yaxis === "y2" && p.data.meta ? p.y + p.data.meta.stepOffset : NaN],
    ]) {
      const plot = document.querySelector(`#${id} .js-plotly-plot`);
      if (plot && plot.on && !plot.__stepHooked) {
        plot.__stepHooked = true;
        plot.on("plotly_click", (event) => event.points && event.points.length && send(Number(pick(event.points[0]))));
      }
    }
  };
  setInterval(hook, 500);
}
"""


def _payload(figure: bytes) -> PlotData:
    """A figure serialised once with orjson, as a ready Plot payload."""
    return PlotData(type="plotly", plot=figure.decode())


def _plot(spec: dict[str, Any] | None) -> Any:
    """A figure dict as a ready Plot payload, or left as it is."""
    return gr.skip() if spec is None else _payload(orjson.dumps(spec))


class Studio:
    """The app's handlers, closed over the settings, the pair cache and a folder for exported traces."""

    def __init__(self, factory: EngineFactory, settings: Settings) -> None:
        self.settings = settings
        self.pairs = PairCache(factory, on_drop=forget_texts)
        self.trace_dir = Path(tempfile.mkdtemp(prefix="specextend-traces-"))
        self._exports, self._exported = threading.Lock(), itertools.count(1)
        self.generations = Recent(64)  # recent generation jobs' clocks, for the waiting user's estimate

    # --- the queue -------------------------------------------------------------------------------
    def queued(self, state: SessionState | None = None) -> str:
        """The status a click shows at once, before its turn: that this tab's run is still going (the click starts
        nothing: the page ignores Run until the run ends), else whether a slot is free, and if not, how many runs
        hold the slots and when, by how long recent runs took, one should free up."""
        job = state.job if state is not None else None
        if job is not None and not job.done.is_set():
            job.notice = RUN_IS_GOING  # kept in the status until the run ends: progress lines must not hide it
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
        return documents.sample_text(name) if name else gr.skip()

    def pick_prompt(self, name: str | None) -> tuple:
        """A bundled long-output prompt: its text and its instruction."""
        return documents.sample_prompt(name) if name else (gr.skip(), gr.skip())

    def choose_workload(self, workload: str) -> tuple:
        """The controls of a workload: which samples are offered, what the text box holds, the task, and how many new
        tokens (a long output asks for thousands, where the server allows them). The text typed so far stays."""
        long = workload == "long_output"
        tokens = min(LONG_OUTPUT_TOKENS if long else Knobs.max_new_tokens, self.settings.max_new_tokens)
        return (gr.Dropdown(visible=not long), gr.Dropdown(visible=long),
                gr.Textbox(label="Prompt" if long else "Document",
                           placeholder="…or write a short prompt: a story opening, a question, a problem" if long
                           else "…or paste a long document here"),
                LONG_OUTPUT_INSTRUCTION if long else DEFAULT_TASK, tokens)

    def upload(self, path: str | None):
        if not path:
            return gr.skip(), gr.skip()
        try:
            text = documents.read_upload(path, self.settings.max_upload_bytes, self.settings.max_document_chars)
        except DocumentError as exc:
            return gr.skip(), f"<div class='se-bad'>{html.escape(str(exc))}</div>"
        return text, gr.skip()

    def document_info(self, text: str, pair_key: str) -> str:
        if not text or not text.strip():
            return "<div class='se-muted'>No document yet: pick a sample, paste text, or upload a .txt/.md file.</div>"
        try:
            documents.check_text(text, self.settings.max_document_chars)  # before counting: oversized text costs nothing
            loaded = self.pairs.peek(self.settings.pair(pair_key))
        except ValueError as exc:
            return f"<div class='se-bad'>{html.escape(str(exc))}</div>"
        if loaded is None:
            return (f"<div class='se-muted'>{len(text):,} characters, about {len(text) // 4:,} tokens (estimated; the "
                    "exact count and the model's limit show once the model is loaded).</div>")
        # one tokenization: what a run checks is the whole prompt (the template and a task around the document), here
        # with the default task; the document's own tokens are its span in it
        prompt = loaded.codec.prompt(text, DEFAULT_TASK)
        n = prompt.document_span[1] - prompt.document_span[0]
        limit, what = self.input_limit(loaded)
        over = len(prompt.ids) > limit
        style = "se-bad" if over else "se-muted"
        note = " — too long; shorten it." if over else ""
        shorter = loaded.draft_positions
        draft = (f" The draft was trained on {shorter:,} positions: SpecExtend and StreamingLLM keep its working "
                 "positions within them; plain speculative decoding runs it past them, as the paper's baseline does."
                 if shorter is not None and n > shorter and not over else "")
        return f"<div class='{style}'>{len(text):,} characters, {n:,} tokens · {what}{note}{draft}</div>"

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
            k: float = Knobs.k, max_depth: float = Knobs.max_depth, node_budget: float = Knobs.node_budget,
            temperature: float = Knobs.temperature, seed: float = Knobs.seed, lookup: bool = Knobs.lookup,
            signal: str = Knobs.signal, workload: str = "document") -> Iterator[tuple]:
        """The API's `/run`: its parameters are named as the page's controls are (the knobs in KNOB_NAMES' order,
        then the workload: "document", a long input, or "long_output", a short prompt written on at length)."""
        state.stop()
        try:
            text = documents.check_text(document, self.settings.max_document_chars)
            if not task or not task.strip():
                raise ValueError("The task is empty: say what to do with the document (for example, summarize it).")
            if workload not in {value for _, value in WORKLOADS}:
                raise ValueError(f"the workload is 'document' (a long input) or 'long_output', got {workload!r}")
            choice = self.settings.pair(pair) if pair else self.settings.default
            knobs = Knobs(max_new_tokens, chunk_size, top_k, retrieve_every, shape, k, max_depth, node_budget,
                          temperature, seed, lookup, signal)
            build_config(method, knobs, (), self.settings.max_new_tokens, lookup=True)  # refuse nonsense before loading
        except ValueError as exc:
            yield self._idle(str(exc))
            return
        methods = [method] + [m for m in race or [] if m != method]

        def prepare(say):
            loaded = self.pairs.get(choice, say)
            say(f"Tokenizing the {'prompt' if workload == 'long_output' else 'document'} with the target's chat "
                f"template ({loaded.device}, {loaded.dtype})")
            prompt = loaded.codec.prompt(text, task, thinking=workload == "long_output")
            self.check_input(loaded, prompt)
            return loaded.codec, prompt, loaded.max_positions, loaded.click()

        def configs(m: str, codec) -> GenerationConfig:  # the race runs the plain methods it names
            return build_config(m, knobs, codec.eos_ids, self.settings.max_new_tokens, lookup=m == method)

        state.job = Job(methods, configs, prepare).start()
        self.generations.append(state.job)
        yield from self._stream(state.job, self._main_draw(method), {"pair": choice.label, "task": task, "primary": method,
                                                                     "workload": workload}, chart_every)

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
            runs, codec, meta = loads(Path(trace).read_text(encoding="utf-8"))
        except (TraceError, OSError, UnicodeDecodeError) as exc:
            yield self._idle(f"Cannot replay this file: {exc}")
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

        state.job = Job(list(runs), lambda m, c: preset(m), prepare).start()
        yield from self._stream(state.job, self._main_draw(primary, lambda: recorded), {**meta, "replayed": True},
                                chart_every)

    def stop(self, state: SessionState) -> Any:
        """Stop this tab's run. The run's own stream says when it has ended; this answers "Stopping" only while
        it has not (waiting a little first), so the answer never lands after that last word and stays."""
        job = state.job
        if job is None or job.done.is_set():
            return status_html(["Nothing is running."])
        state.stop()
        return gr.skip() if job.done.wait(STOP_WAIT_S) else status_html([STOPPING])

    def _idle(self, error: str, outputs: int = 8) -> tuple:
        return (status_html([], error), *[gr.skip()] * outputs)

    def _main_draw(self, primary: str, load: Callable[[], float | None] = machine_load) -> Draw:
        """`load`: the load per core of the machine the runs ran on, read when they end (a replay's: its trace's)."""
        def draw(job: Job, runs, decode, charts: bool) -> list:
            view = main_view(runs, primary, decode, charts, text=job.codec.text if job.codec else None,
                             load=load() if job.done.is_set() else None)
            if job.done.is_set() and not runs:  # refused or stopped before any run began: nothing is coming
                view = replace(view, output=NOTHING_RAN)
            return [view.output, view.exactness, view.retrieval, view.far, view.acceptance, view.throughput, view.readout]

        return draw

    def _stream(self, job: Job, draw: Draw, export: dict[str, Any] | None = None,
                chart_every: str | float | None = None) -> Iterator[tuple]:
        """Redraw the panels from the job's snapshots until it is done; unchanged panels are not resent.

        `draw` gives each panel's value (HTML, a figure dict that is serialised here once with orjson
        and handed to gradio as a ready Plot payload, or None to leave it; never gr.skip(), which is a dict
        and would be sent as a figure). Charts are drawn at most
        every `chart_every` seconds (0: on the first redraw and at the end only): in the browser they
        cost far more than text. With `export`, the last message also carries the trace download.
        """
        meter = RedrawMeter(self.settings.redraw_s, self.settings.redraw_share)
        chart_every = self.settings.redraw_s if chart_every is None else float(chart_every)
        sent: list[Any] = []
        charted = -1e9
        while True:
            finished = job.done.wait(meter.wait())
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
                    values.append(gr.skip())
                else:
                    sent[i] = value
                    values.append(_payload(value) if isinstance(value, bytes) else value)
            meter.drew()
            if export is not None:
                download = gr.skip()
                if finished and runs:  # after the run: not counted as drawing cost
                    download = gr.DownloadButton(value=self._export(runs, decode, export), visible=True)
                values.append(download)
            yield (status_html(self._status(job, runs, finished), job.error, meter.line()), *values)
            meter.resumed()
            if finished:
                return

    @staticmethod
    def _status(job: Job, runs: dict, finished: bool) -> list[str]:
        """The status lines: what the run is doing (or that it is stopping, once asked: progress must not hide
        that) and any notice; at the end, how it ended and how each run ended."""
        stopped = job.stop_event.is_set()
        if not finished:
            return [STOPPING if stopped else job.status, job.notice]
        head = "" if job.error else "Stopped, as asked: the panels show the runs as far as they got." if stopped else "Done."
        return [head, *(f"{label(m)}: {ending(ev)}" for m, ev in runs.items())]

    def _export(self, runs, decode, meta: dict[str, Any]) -> str:
        """Write the trace for download under a name no other export takes; only the most recent KEEP_TRACES files
        are kept. Runs finishing at once export one at a time (one sweeping while another writes lost a file). A live
        run's trace records this machine's load (a replay keeps its trace's), so its replay says whether it was busy."""
        text = dumps(runs, decode, meta if meta.get("replayed") else {**meta, "machine_load": machine_load()})
        with self._exports:
            number = next(self._exported)
            path = self.trace_dir / f"specextend-trace-{time.strftime('%Y%m%d-%H%M%S')}-{number}.json"
            path.write_text(text, encoding="utf-8")
            written = lambda f: int(f.stem.rsplit("-", 1)[1])  # noqa: E731  (the export's number)
            for old in sorted(self.trace_dir.glob("specextend-trace-*.json"), key=written)[:-KEEP_TRACES]:
                old.unlink(missing_ok=True)
        return str(path)

    # --- stepping through a finished run ----------------------------------------------------------
    @staticmethod
    def _finished(state: SessionState | None) -> Job | None:
        """The session's last job, if it finished with runs to step through (they no longer change: no snapshot)."""
        job = state.job if state is not None else None
        return job if job is not None and job.done.is_set() and job.runs and job.codec is not None else None

    def stepper(self, state: SessionState) -> tuple:
        """After a run or a replay: the step control over its runs, on the main run at its last step."""
        job = self._finished(state)
        if job is None:
            return gr.Column(visible=False), gr.skip(), gr.skip(), ""
        runs = job.runs
        primary = job.methods[0] if job.methods and job.methods[0] in runs else next(iter(runs))
        last = last_step(runs[primary])
        return (gr.Column(visible=True), gr.Radio(choices=[(label(m), m) for m in runs], value=primary),
                gr.Slider(minimum=0, maximum=max(last, 1), value=last), step_html(runs[primary], last, job.codec.text))

    def at_step(self, state: SessionState, method: str, step: float) -> tuple:
        """Every panel as of `step` of the run `method`, and that step in words (STEP_PANELS' order)."""
        job = self._finished(state)
        runs = job.runs if job is not None else {}
        if method not in runs:
            return tuple(gr.skip() for _ in range(STEP_PANELS))
        step = max(0, min(int(step or 0), last_step(runs[method])))
        view = step_view(runs, method, step, job.codec.decode, job.codec.text)
        return (view.output, view.exactness, _plot(view.retrieval), view.far, _plot(view.acceptance),
                _plot(view.throughput), step_html(runs[method], step, job.codec.text))

    def _last(self, state: SessionState, method: str) -> int:
        job = self._finished(state)
        runs = job.runs if job is not None else {}
        return last_step(runs[method]) if method in runs else 0

    def step_by(self, delta: int) -> Callable[..., tuple]:
        """A handler that moves the control `delta` steps (within the run) and redraws."""
        def move(state: SessionState, method: str, step: float) -> tuple:
            target = max(0, min(int(step or 0) + delta, self._last(state, method)))
            return (target, *self.at_step(state, method, target))

        return move

    def pick_run(self, state: SessionState, method: str) -> tuple:
        """The control follows the run picked: its steps, at its last one."""
        last = self._last(state, method)
        return (gr.Slider(maximum=max(last, 1), value=last), *self.at_step(state, method, last))

    def jump(self, state: SessionState, method: str, value: str) -> tuple:
        """A click on a panel asked for a step (`step:nonce`, so the same step twice is two changes)."""
        try:
            step = int(str(value).split(":")[0])
        except ValueError:
            return tuple(gr.skip() for _ in range(STEP_PANELS + 1))
        return self.step_by(0)(state, method, step)

    def play(self, state: SessionState, method: str, step: float, pace: str, playing: bool) -> tuple:
        """Play (from the start when at the end) or pause: the timer, the button's label, whether playing, the step."""
        if playing:
            return gr.Timer(active=False), "▶ play", False, gr.skip()
        start = 0 if int(step or 0) >= self._last(state, method) else int(step or 0)
        return gr.Timer(value=float(pace), active=True), "⏸ pause", True, start

    def tick(self, state: SessionState, method: str, step: float) -> tuple:
        """One step on while playing; at the last step the timer stops."""
        moved = self.step_by(1)(state, method, step)
        done = moved[0] >= self._last(state, method)
        stop = (gr.Timer(active=False), "▶ play", False) if done else (gr.skip(), gr.skip(), True)
        return (*moved, *stop)

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
            knobs = Knobs(max_new_tokens=max_new_tokens, top_k=top_k, retrieve_every=1, k=4)
            build_config("specextend", knobs, (), self.settings.max_new_tokens)
        except ValueError as exc:
            yield self._idle(str(exc), 7)
            return
        except KeyError as exc:  # a haystack that is not a bundled sample
            yield self._idle(f"{exc.args[0]}: pick a haystack from the list", 7)
            return
        task = f"{planted.question} Answer with the answer only."
        picture: dict[str, Any] = {}

        def prepare(say):
            loaded = self.pairs.get(choice, say)
            say("Tokenizing the haystack and the question")
            prompt = loaded.codec.prompt(planted.document, task, marks={"needle": planted.fact})
            self.check_input(loaded, prompt)
            if loaded.heads is not None and "needle" in prompt.marks and len(prompt.ids) < loaded.max_positions:
                say("Reading where each of the target's heads looks (one prefill that keeps every head's queries)")
                picture["map"] = loaded.heads(prompt.ids, prompt.marks["needle"])
            return loaded.codec, prompt, loaded.max_positions, loaded.click()

        def configs(m: str, codec) -> GenerationConfig:  # both CMR runs are SpecExtend; they differ in the signal
            signal = "paper" if m == "specextend_paper" else "default"
            return build_config("streaming" if m == "streaming" else "specextend", replace(knobs, signal=signal),
                                codec.eos_ids, self.settings.max_new_tokens)

        info = (f"<div class='se-needle'><b>Needle</b> (planted {planted.actual_depth:.0%} into the document): "
                f"“{html.escape(planted.fact)}”<br><b>Question</b>: {html.escape(planted.question)}</div>")

        def draw(job: Job, runs, decode, charts: bool) -> list:
            prompt = job.prompt
            if prompt is None or "needle" not in prompt.marks:
                return [info, needle_spec({}, (0, 0), 0), "", None, None, None, None]  # None: left as it is
            span = prompt.marks["needle"]
            grid, answers = needle_view(runs, span, len(prompt.ids), planted.answer, job.codec.text)
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


def build_app(factory: EngineFactory = real_factory, settings: Settings | None = None) -> gr.Blocks:
    """The whole app, wired to `factory`; nothing is loaded until a run asks for it, unless the settings preload the
    default pair (as a ZeroGPU Space always does: `zerogpu.adapt`)."""
    factory, settings = zerogpu.adapt(factory, settings or Settings.from_env())
    studio = Studio(factory, settings)
    if settings.preload:  # before serving: a Space's first visitor should not wait for a download
        log.info("Preloading %s", settings.default.label)
        studio.pairs.get(settings.default, lambda message: log.info("preload: %s", message))
        log.info("Preloaded %s", settings.default.label)
    k = Knobs()
    with gr.Blocks(title="SpecExtend Studio", fill_width=True, delete_cache=(3600, 3600)) as demo:
        state = gr.State(SessionState, delete_callback=SessionState.close)  # the Long-document tab's runs
        n_state = gr.State(SessionState, delete_callback=SessionState.close)  # the needle tab's own
        gr.Markdown(INTRO)
        with gr.Tabs():
            with gr.Tab("Long input or long output", id="main"):
                with gr.Row(equal_height=False):
                    with gr.Column(scale=1, min_width=340):
                        samples = documents.samples()
                        workload = gr.Radio(WORKLOADS, value="document", label="Workload", elem_id="workload",
                                            info="the paper's two: a long document read for a short answer, or a "
                                                 "short prompt written on for thousands of tokens")
                        with gr.Row(equal_height=True):
                            sample = gr.Dropdown(label="Sample document", choices=samples, value=None, scale=3,
                                                 elem_id="sample", info="public-domain texts shipped with the app")
                            prompt_sample = gr.Dropdown(label="Sample prompt", choices=documents.prompts(), value=None,
                                                        scale=3, elem_id="prompt-sample", visible=False,
                                                        info="short prompts shipped with the app")
                            upload = gr.UploadButton("Upload .txt / .md", file_types=[".txt", ".md"], type="filepath",
                                                     scale=1, size="sm", elem_id="upload")
                        document = gr.Textbox(label="Document", lines=6, max_lines=10, elem_id="document",
                                              placeholder="…or paste a long document here")
                        doc_info = gr.HTML(studio.document_info("", settings.default.key), elem_id="doc-info",
                                           label="document readout")
                        task = gr.Textbox(label="Task", value=DEFAULT_TASK, lines=1, elem_id="task")
                        with gr.Row():
                            run_btn = gr.Button("Run", variant="primary", elem_id="run")
                            stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
                        status = gr.HTML(status_html(["Ready: pick a sample document and press Run."]), elem_id="status",
                                         label="status")
                        pair = gr.Dropdown(label="Model pair", choices=[(p.label, p.key) for p in settings.pairs],
                                           value=settings.default.key, elem_id="pair")
                        method = gr.Radio(label="Method", choices=METHOD_CHOICES, value="specextend", elem_id="method")
                        lookup = gr.Checkbox(k.lookup, label="add lookup drafting: copy what followed the newest words "
                                             "where they occurred before", elem_id="lookup",
                                             info="for the draft-model methods: its copies join the draft's guesses "
                                                  "in one tree, checked in the same target pass")
                        race = gr.CheckboxGroup(label="Race on the same input, after the main run", choices=RACE_CHOICES,
                                                value=["speculative", "autoregressive"], elem_id="race")
                        # string values: gradio's API schema describes a Radio's values as strings, so the API
                        # takes them as its schema says
                        chart_choices = [(f"live, every {settings.redraw_s:g} s", f"{settings.redraw_s:g}"),
                                         ("once a second", "1"), ("when the run ends", "0")]
                        charts = gr.Radio(chart_choices, value=f"{settings.redraw_s:g}", label="Redraw the charts",
                                          elem_id="chart-every",
                                          info="charts cost CPU in the browser: with the browser on the same small "
                                               "machine, redraw less often for clean speed numbers")
                        with gr.Accordion("Knobs", open=False):
                            max_new = gr.Slider(1, settings.max_new_tokens, value=min(k.max_new_tokens, settings.max_new_tokens),
                                                step=1, label="max new tokens", elem_id="max-new",
                                                info=f"up to {settings.max_new_tokens:,} on this server")
                            with gr.Row():
                                chunk = gr.Number(k.chunk_size, label="chunk size (tokens)", precision=0)
                                top_k = gr.Number(k.top_k, label="top-k chunks kept", precision=0)
                                every = gr.Number(k.retrieve_every, label="retrieve every (steps)", precision=0)
                            gr.HTML("<div class='se-help'>working cache = chunk size × top-k tokens; it always holds the "
                                    "first chunk (the attention sink) and the newest one.</div>")
                            signal = gr.Radio(SIGNAL_CHOICES, value=k.signal, label="retrieval signal (CMR)",
                                              elem_id="signal")
                            shape = gr.Radio(["chain", "tree"], value=k.shape, label="draft shape")
                            with gr.Row():
                                chain_k = gr.Number(k.k, label="chain length k", precision=0)
                                depth = gr.Number(k.max_depth, label="tree depth", precision=0)
                                budget = gr.Number(k.node_budget, label="tree node budget", precision=0)
                            with gr.Row():
                                temperature = gr.Number(k.temperature, label="temperature (0 = greedy)")
                                seed = gr.Number(k.seed, label="seed", precision=0)
                    with gr.Column(scale=2):
                        # a Column, not a Group: gradio renders a Group's elem_id on two elements
                        with gr.Column(visible=False, elem_id="stepper", variant="panel") as stepper:
                            gr.Markdown("#### Step through the run\nMove the step: every panel below shows the run as "
                                        "of that step. Or click a step in ③, or a retrieval's row in ②.")
                            with gr.Row(equal_height=True):
                                step_run = gr.Radio(label="run", choices=[], elem_id="step-run", scale=2)
                                step = gr.Slider(0, 1, value=0, step=1, label="step", elem_id="step-slider", scale=3)
                            with gr.Row(equal_height=True):
                                prev_btn = gr.Button("◀ previous", size="sm", elem_id="step-prev")
                                next_btn = gr.Button("next ▶", size="sm", elem_id="step-next")
                                play_btn = gr.Button("▶ play", size="sm", elem_id="step-play")
                                step_pace = gr.Dropdown(PACES, value="1", show_label=False, elem_id="step-pace",
                                                   container=False)
                            step_info = gr.HTML(elem_id="step-info")
                            jump = gr.Textbox(elem_id="step-jump", elem_classes="se-hidden", show_label=False,
                                              container=False)
                        playing = gr.State(False)
                        timer = gr.Timer(1.0, active=False)
                        gr.Markdown("### ① Output\nText the run wrote; the highlighted stretches were guessed by the "
                                    "draft and accepted by the target.")
                        output = gr.HTML(elem_id="output", label="output")
                        exact = gr.HTML(elem_id="exactness", label="exactness")
                        gr.Markdown("### ② Retrieval: which chunks the draft reads\nTop strip: the document in chunks, "
                                    "coloured by the target's attention; outlined chunks are in the draft's working "
                                    "cache. Below: the working cache after each retrieval; hover the ▸ marks at the "
                                    "left to read what the output had said by then, and a chunk to read it.")
                        retrieval = gr.Plot(show_label=False, elem_id="retrieval-plot", label="retrieval")
                        far = gr.HTML(elem_id="far-chunks", label="reaching back")
                        gr.Markdown("### ③ Acceptance: which guesses the target keeps")
                        acceptance = gr.Plot(show_label=False, elem_id="acceptance-plot", label="acceptance")
                        gr.Markdown("### ④ Speed\nSame input, same token limit. Tokens/s counts only tokens up to the limit.")
                        throughput = gr.Plot(show_label=False, elem_id="throughput-plot", label="speed")
                        readout = gr.HTML(elem_id="readout", label="speed table")
                        download = gr.DownloadButton("Download this run as a JSON trace", visible=False, size="sm",
                                                     elem_id="download")
                        with gr.Accordion("Replay a trace without loading any model", open=False):
                            with gr.Row():
                                trace_file = gr.File(label="trace to replay (.json)", file_types=[".json"],
                                                     type="filepath", height=90, elem_id="trace-file")
                                pace = gr.Radio(["instant", "recorded pace"], value="instant", label="replay",
                                                info="the second waits as long between events as the original "
                                                     "run did, however long it took (Stop ends it)")
                            replay_btn = gr.Button("Replay", elem_id="replay")

            with gr.Tab("Needle in a haystack (teaching)", id="needle"):
                gr.Markdown(NEEDLE_INTRO)
                with gr.Row():
                    n_hay = gr.Dropdown(label="Haystack", choices=samples, value=samples[0][1] if samples else None,
                                        elem_id="needle-haystack")
                    n_length = gr.Slider(2000, 40000, value=16000, step=1000, elem_id="needle-length",
                                         label="haystack length (characters; about a quarter as many tokens)")
                    n_depth = gr.Slider(0, 100, value=50, step=1, label="needle depth (% into the document)")
                    n_topk = gr.Number(8, label="working cache (chunks of 32 tokens)", precision=0)
                    n_new = gr.Number(24, label="max new tokens", precision=0, elem_id="needle-max-new")
                    n_seed = gr.Number(0, label="seed (which fact)", precision=0)
                with gr.Row():
                    n_run = gr.Button("Run CMR (two signals) and StreamingLLM", variant="primary", elem_id="needle-run")
                    n_stop = gr.Button("Stop", variant="stop", elem_id="needle-stop")
                n_status = gr.HTML(elem_id="needle-status", label="status")
                n_info = gr.HTML(elem_id="needle-info", label="needle")
                n_grid = gr.Plot(show_label=False, elem_id="needle-plot", label="needle held")
                n_answers = gr.HTML(elem_id="needle-answers", label="answers")
                n_heads = gr.Plot(show_label=False, elem_id="needle-heads", label="layers and heads")
                gr.Markdown("Each run's working cache after every retrieval (the needle's chunks marked):")
                with gr.Column():  # one above the other: side by side, their titles were cut off
                    n_cmr = gr.Plot(show_label=False, elem_id="needle-cmr", label="CMR default signal")
                    n_paper = gr.Plot(show_label=False, elem_id="needle-paper", label="CMR paper signal")
                    n_stream = gr.Plot(show_label=False, elem_id="needle-streaming", label="StreamingLLM")

        widgets = {"max_new_tokens": max_new, "chunk_size": chunk, "top_k": top_k, "retrieve_every": every, "shape": shape,
                   "k": chain_k, "max_depth": depth, "node_budget": budget, "temperature": temperature, "seed": seed,
                   "lookup": lookup, "signal": signal}
        knobs = [widgets[name] for name in KNOB_NAMES]  # the order `run` names the values in
        outputs = [status, output, exact, retrieval, far, acceptance, throughput, readout, download]
        # helpers of the page itself (a sample's text, the document readout) are not part of the public API
        sample.change(studio.pick_sample, sample, document, queue=False, api_visibility="private")
        prompt_sample.change(studio.pick_prompt, prompt_sample, [document, task], queue=False, api_visibility="private")
        workload.input(studio.choose_workload, workload, [sample, prompt_sample, document, task, max_new], queue=False,
                       api_visibility="private")
        upload.upload(studio.upload, upload, [document, doc_info], queue=False)
        for source in (document, pair):
            source.change(studio.document_info, [document, pair], doc_info, queue=False, trigger_mode="always_last",
                          show_progress="hidden", api_visibility="private")
        for button, own, said in ((run_btn, state, status), (n_run, n_state, n_status)):
            # at once, outside the queue: that this tab's run still goes, or whether the click waits and how long
            button.click(studio.queued, own, said, queue=False, api_visibility="private", show_progress="hidden")
        stepper_after = dict(fn=studio.stepper, inputs=state, outputs=[stepper, step_run, step, step_info], queue=False,
                             api_visibility="private", show_progress="hidden")
        # the step control: hidden while a run or a replay goes (the first link of its chain, so it cannot land after
        # the control is shown again), shown once it has finished
        hide_stepper = dict(fn=lambda: (gr.Column(visible=False), gr.Timer(active=False), "▶ play", False), inputs=None,
                            outputs=[stepper, timer, play_btn, playing], queue=False, api_visibility="private",
                            show_progress="hidden")
        run_btn.click(**hide_stepper).then(
            studio.run, [state, document, task, pair, method, race, charts, *knobs, workload], outputs, api_name="run",
            concurrency_limit=settings.concurrency, concurrency_id="generate", show_progress="minimal",
        ).then(studio.document_info, [document, pair], doc_info, queue=False, show_progress="hidden",
               api_visibility="private",  # the exact token count, now that the model is loaded
               ).then(**stepper_after)
        stop_btn.click(studio.stop, state, status, api_name="stop", queue=False)
        n_run.click(studio.needle, [n_state, n_hay, n_length, n_depth, n_seed, n_topk, n_new, pair],
                    [n_status, n_info, n_grid, n_answers, n_heads, n_cmr, n_paper, n_stream], api_name="needle",
                    concurrency_limit=settings.concurrency, concurrency_id="generate", show_progress="minimal")
        n_stop.click(studio.stop, n_state, n_status, api_name="needle_stop", queue=False)
        replay_btn.click(**hide_stepper).then(
            studio.replay, [state, trace_file, pace, charts], outputs, api_name="replay", concurrency_limit=4,
            concurrency_id="replay", show_progress="minimal").then(**stepper_after)

        panels = [output, exact, retrieval, far, acceptance, throughput, step_info]  # STEP_PANELS, in at_step's order
        page = dict(api_visibility="private", show_progress="hidden")
        # typed into its box, moved by keys or dragged: the panels follow the last value it took
        step.input(studio.at_step, [state, step_run, step], panels, trigger_mode="always_last", **page)
        prev_btn.click(studio.step_by(-1), [state, step_run, step], [step, *panels], **page)
        next_btn.click(studio.step_by(1), [state, step_run, step], [step, *panels], **page)
        step_run.input(studio.pick_run, [state, step_run], [step, *panels], **page)
        jump.change(studio.jump, [state, step_run, jump], [step, *panels], **page)
        play_btn.click(studio.play, [state, step_run, step, step_pace, playing], [timer, play_btn, playing, step], **page)
        timer.tick(studio.tick, [state, step_run, step], [step, *panels, timer, play_btn, playing], **page)
        demo.load(None, None, None, js=CLICK_TO_STEP)
    demo.queue(default_concurrency_limit=settings.concurrency, max_size=settings.queue_size)
    return demo


def launch(demo: gr.Blocks, settings: Settings, **overrides: Any):
    """Serve the app: the operator's address (127.0.0.1 by default), never a public share link."""
    options = dict(server_name=settings.host, server_port=settings.port, share=False, css=CSS,
                   max_file_size=max(4 * settings.max_upload_bytes, settings.max_trace_bytes), footer_links=["api"],
                   show_error=True)
    options.update(overrides)
    options["share"] = False
    return demo.launch(**options)
