"""The Gradio page: its layout, and its events wired to the Studio's handlers (`app.studio`, `app.stepping`), whose
plain answers (`app.updates`) are turned into gradio's updates here, in one adapter (`wired`). Built from an injected
engine factory, so importing it loads no model; each browser tab gets its own session state per tab of the page.
Knows gradio and the page's widgets; holds no handler logic: what a click does is the Studio's.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable, Iterator

import gradio as gr
from gradio.components.plot import PlotData

from specextend.methods import METHOD_TABLE

from . import documents, zerogpu
from .backend import EngineFactory, real_factory
from .panels import status_html
from .runner import Knobs
from .settings import Settings
from .stepping import PLAY
from .studio import DEFAULT_TASK, KNOB_NAMES, READY, WORKLOADS, SessionState, Studio
from .updates import Figure, Halt, Keep, Update

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
.se-about { font-size: 14px; padding: 6px 10px; margin-bottom: 6px; background: #eef4ff; border-left: 4px solid #2a6fdb;
  border-radius: 4px; }
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
standard speculative decoding and the target alone. The race is fair by construction: every method that drafts uses
the same draft and the same sources (with lookup ticked, all of them copy with lookup too), so SpecExtend over
standard speculative decoding is what CMR and the faster kernels buy, as in the paper. Or choose **long output**: a
short prompt and thousands of new tokens, where the sequence grows by generation and CMR reads back what the model
wrote itself.
"""

METHOD_CHOICES = [(m.choice, m.name) for m in reversed(METHOD_TABLE)]  # SpecExtend first, the target alone last
SIGNAL_CHOICES = [("the pair's default (calibrated heads, recent rows, recency reserve)", "default"),
                  ("the paper's (final layer, last token, heads averaged)", "paper")]
RACE_CHOICES = [("standard speculative decoding", "speculative"), ("lookup drafting alone", "lookup"),
                ("the target alone (also checks exactness)", "autoregressive")]
NEEDLE_INTRO = """
### Needle in a haystack: can the draft still see the fact?
A one-sentence fact (the *needle*) is planted in a long document and the model is asked about it. The target reads
the whole document, so its answer is the same in every run. But a draft model only sees its small working cache: to
guess the answer's tokens from the document, the needle must be in it. **CMR** fills that cache with the chunks the
target's attention scores highest; *which* attention is the retrieval signal. Three runs, same prompt, a retrieval
after every step, and the same working-cache budget (the chunks you set × 32 tokens). StreamingLLM fills it to the
token; CMR keeps whole chunks, and the newest of them is still being written, so it holds up to one chunk fewer:

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

Holding the needle lets a draft guess the answer; it does not make it guess it. Under the answers, the page says from
the runs just made whether the draft's guesses changed between the three caches, and why not where they did not.
With the bundled pairs on this tab's defaults, what the target keeps of them does not change (and neither guesses a
token of the needle's value): the small draft model does not read the fact back out of its cache, and an EAGLE head
drafts from the target's own hidden states, which already carry the whole document. The paper's effect, a full draft
cache that decays as the context grows, is expected with published drafts and heads on long inputs on the GPU
presets. The model pair is this tab's own.
"""
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


def gradio_value(value: Any) -> Any:
    """One widget's part of a handler's answer (`app.updates`' plain values) as gradio takes it."""
    if isinstance(value, Keep):
        return gr.skip()
    if isinstance(value, Figure):  # a ready Plot payload: the figure is not serialised again
        return PlotData(type="plotly", plot=value.json.decode())
    if isinstance(value, Update):
        return gr.update(**value.changes())
    return value


def gradio_answer(answer: Any) -> Any:
    if isinstance(answer, Halt):  # gradio ends a chain of events where one raises; not shown (the page says why)
        raise gr.Error(answer.reason, visible=False, print_exception=False)
    return tuple(map(gradio_value, answer)) if isinstance(answer, tuple) else gradio_value(answer)


def wired(handler: Callable) -> Callable:
    """A Studio handler as gradio calls it: the same signature (gradio names the API's parameters from it), the
    same kind (a generator streams), each answer translated."""
    if inspect.isgeneratorfunction(handler):
        @functools.wraps(handler)
        def stream(*args: Any, **kwargs: Any) -> Iterator[Any]:
            for answer in handler(*args, **kwargs):
                yield gradio_answer(answer)

        return stream

    @functools.wraps(handler)
    def call(*args: Any, **kwargs: Any) -> Any:
        return gradio_answer(handler(*args, **kwargs))

    return call


def refuse_quietly(demo: gr.Blocks) -> None:
    """Values a request's inputs cannot be read into (a number over a control's maximum, a choice it does not offer, a
    file input that is not a file) are the caller's mistake, not the app's: gradio still answers with its message, and
    the log gets one line for it instead of a traceback. Only the reading of inputs, before any handler, is covered."""
    read = demo.preprocess_data

    @functools.wraps(read)
    async def checked(block_fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await read(block_fn, *args, **kwargs)
        except Exception as exc:  # whatever gradio raised reading the inputs: the request's error, said in one line
            message = " ".join(str(getattr(exc, "message", exc)).split())
            log.warning("refused a request to %s (%s): %.300s", block_fn.api_name or block_fn.name, type(exc).__name__,
                        message)
            raise gr.Error(message, print_exception=False) from None

    demo.preprocess_data = checked


def build_app(factory: EngineFactory = real_factory, settings: Settings | None = None) -> gr.Blocks:
    """The whole app, wired to `factory`; nothing is loaded until a run asks for it, unless the settings preload the
    default pair (as a ZeroGPU Space always does: `zerogpu.adapt`)."""
    factory, settings = zerogpu.adapt(factory, settings or Settings.from_env())
    studio = Studio(factory, settings)
    if settings.preload:  # before serving: a Space's first visitor should not wait for a download
        studio.preload()
    k = Knobs()
    with gr.Blocks(title="SpecExtend Studio", fill_width=True, delete_cache=(3600, 3600)) as demo:
        # each tab's session state, copied for every browser tab (an instance, not a class: gradio would make a class
        # into a public API endpoint that makes one)
        state = gr.State(SessionState(), delete_callback=SessionState.close)  # the Long-document tab's runs
        n_state = gr.State(SessionState(), delete_callback=SessionState.close)  # the needle tab's own
        gr.Markdown(INTRO)
        with gr.Tabs():
            with gr.Tab("Long input or long output", id="main"):
                with gr.Row(equal_height=False):
                    with gr.Column(scale=1, min_width=340):
                        samples = documents.samples()
                        first = samples[0][1] if samples else None  # selected as the page opens: Run runs at once
                        text = documents.sample_text(first) if first else ""
                        workload = gr.Radio(WORKLOADS, value="document", label="Workload", elem_id="workload",
                                            info="the paper's two: a long document read for a short answer, or a "
                                                 "short prompt written on for thousands of tokens")
                        with gr.Row(equal_height=True):
                            sample = gr.Dropdown(label="Sample document", choices=samples, value=first, scale=3,
                                                 elem_id="sample", info="public-domain texts shipped with the app")
                            prompt_sample = gr.Dropdown(label="Sample prompt", choices=documents.prompts(), value=None,
                                                        scale=3, elem_id="prompt-sample", visible=False,
                                                        info="short prompts shipped with the app")
                            upload = gr.UploadButton("Upload .txt / .md", file_types=[".txt", ".md"], type="filepath",
                                                     scale=1, size="sm", elem_id="upload")
                        document = gr.Textbox(text, label="Document", lines=6, max_lines=10, elem_id="document",
                                              placeholder="…or paste a long document here")
                        doc_info = gr.HTML(studio.document_info(text, settings.default.key), elem_id="doc-info",
                                           label="document readout")
                        task = gr.Textbox(label="Task", value=DEFAULT_TASK, lines=1, elem_id="task")
                        with gr.Row():
                            run_btn = gr.Button("Run", variant="primary", elem_id="run")
                            stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
                        status = gr.HTML(status_html([READY if first else "Ready: paste or upload a document and "
                                                      "press Run."]), elem_id="status", label="status")
                        # the status as plain text, for the API's callers (the page shows the HTML above)
                        status_text = gr.Textbox(visible=False, label="status_text")
                        pair = gr.Dropdown(label="Model pair", choices=[(p.label, p.key) for p in settings.pairs],
                                           value=settings.default.key, elem_id="pair")
                        method = gr.Radio(label="Method", choices=METHOD_CHOICES, value="specextend", elem_id="method")
                        lookup = gr.Checkbox(k.lookup, label="add lookup drafting: copy what followed the newest words "
                                             "where they occurred before", elem_id="lookup",
                                             info="for every method that drafts, in the main run and in the race "
                                                  "alike (a fair race): its copies join the draft's guesses in one "
                                                  "tree, checked in the same target pass. Untick it to compare the "
                                                  "methods on the draft alone")
                        race = gr.CheckboxGroup(label="Race on the same input, after the main run: the same draft "
                                                "and the same sources (lookup as ticked above)", choices=RACE_CHOICES,
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
                                # whole-number knobs take what is typed as it is (precision 0 rounded 1.5 to 2 out of
                                # sight): the Studio refuses a fraction and says so
                                chunk = gr.Number(k.chunk_size, label="chunk size (tokens)", elem_id="chunk-size")
                                top_k = gr.Number(k.top_k, label="top-k chunks kept")
                                every = gr.Number(k.retrieve_every, label="retrieve every (steps)")
                            gr.HTML("<div class='se-help'>working cache = chunk size × top-k tokens; it always holds the "
                                    "first chunk (the attention sink) and the newest one.</div>")
                            signal = gr.Radio(SIGNAL_CHOICES, value=k.signal, label="retrieval signal (CMR)",
                                              elem_id="signal")
                            shape = gr.Radio(["chain", "tree"], value=k.shape, label="draft shape")
                            with gr.Row():
                                chain_k = gr.Number(k.k, label="chain length k")
                                depth = gr.Number(k.max_depth, label="tree depth")
                                budget = gr.Number(k.node_budget, label="tree node budget")
                            with gr.Row():
                                temperature = gr.Number(k.temperature, label="temperature (0 = greedy)")
                                seed = gr.Number(k.seed, label="seed")
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
                                play_btn = gr.Button(PLAY, size="sm", elem_id="step-play")
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
                n_pair = gr.Dropdown(label="Model pair", choices=[(p.label, p.key) for p in settings.pairs],
                                     value=settings.default.key, elem_id="needle-pair",
                                     info="this tab's own (the other tab's choice does not apply here)")
                with gr.Row():
                    n_hay = gr.Dropdown(label="Haystack", choices=samples, value=samples[0][1] if samples else None,
                                        elem_id="needle-haystack")
                    n_length = gr.Slider(2000, 40000, value=16000, step=1000, elem_id="needle-length",
                                         label="haystack length (characters; about a quarter as many tokens)")
                    n_depth = gr.Slider(0, 100, value=50, step=1, label="needle depth (% into the document)")
                    n_topk = gr.Number(8, label="working cache (chunks of 32 tokens)")
                    n_new = gr.Number(24, label="max new tokens", elem_id="needle-max-new")
                    n_seed = gr.Number(0, label="seed (which fact)")
                with gr.Row():
                    n_run = gr.Button("Run CMR (two signals) and StreamingLLM", variant="primary", elem_id="needle-run")
                    n_stop = gr.Button("Stop", variant="stop", elem_id="needle-stop")
                n_status = gr.HTML(elem_id="needle-status", label="status")
                n_status_text = gr.Textbox(visible=False, label="status_text")
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
        outputs = [status, status_text, output, exact, retrieval, far, acceptance, throughput, readout, download]
        # helpers of the page itself (a sample's text, the document readout) are not part of the public API
        sample.change(wired(studio.pick_sample), sample, document, queue=False, api_visibility="private")
        prompt_sample.change(wired(studio.pick_prompt), prompt_sample, [document, task], queue=False,
                             api_visibility="private")
        workload.input(wired(studio.choose_workload), workload, [sample, prompt_sample, document, task, max_new],
                       queue=False, api_visibility="private")
        upload.upload(wired(studio.upload), upload, [document, doc_info], queue=False)
        # a new document (typed, a sample, an upload) or workload: a refusal of the last click no longer applies
        for event in (document.change, workload.input):
            event(wired(studio.input_changed), state, [status, status_text], queue=False, api_visibility="private",
                  show_progress="hidden")
        for source in (document, pair):
            source.change(wired(studio.document_info), [document, pair], doc_info, queue=False, trigger_mode="always_last",
                          show_progress="hidden", api_visibility="private")
        # at once, outside the queue: that this tab's run still goes, or whether the click waits and how long
        n_run.click(wired(studio.queued), n_state, n_status, queue=False, api_visibility="private", show_progress="hidden")
        stepper_after = dict(fn=wired(studio.stepper), inputs=state,
                             outputs=[stepper, step_run, step, step_info, download], queue=False,
                             api_visibility="private", show_progress="hidden")
        # the step control: hidden while a run or a replay goes (the first link of its chain, so it cannot land after
        # the control is shown again), shown once it has finished
        hide_stepper = dict(fn=wired(studio.hide_stepper), inputs=None,
                            outputs=[stepper, timer, play_btn, playing, download], queue=False,
                            api_visibility="private", show_progress="hidden")
        request = [state, document, task, pair, method, race, charts, *knobs, workload]
        # Run's click: checked at once outside the queue (a refusal is answered there and goes no further, never
        # waiting behind other tabs' runs; else the queue's word), then queued
        run_btn.click(**hide_stepper).then(
            wired(studio.check), request, outputs, queue=False, api_visibility="private", show_progress="hidden",
        ).then(wired(studio.go_on), state, None, queue=False, api_visibility="private", show_progress="hidden").success(
            wired(studio.run), request, outputs, api_name="run", concurrency_limit=settings.concurrency,
            concurrency_id="generate", show_progress="minimal",
        ).then(wired(studio.document_info), [document, pair], doc_info, queue=False, show_progress="hidden",
               api_visibility="private",  # the exact token count, now that the model is loaded
               ).then(**stepper_after)
        stop_btn.click(wired(studio.stop), state, [status, status_text], api_name="stop", queue=False)
        n_run.click(wired(studio.needle), [n_state, n_hay, n_length, n_depth, n_seed, n_topk, n_new, n_pair],
                    [n_status, n_status_text, n_info, n_grid, n_answers, n_heads, n_cmr, n_paper, n_stream],
                    api_name="needle",
                    concurrency_limit=settings.concurrency, concurrency_id="generate", show_progress="minimal")
        n_stop.click(wired(studio.stop), n_state, [n_status, n_status_text], api_name="needle_stop", queue=False)
        replay_btn.click(**hide_stepper).then(
            wired(studio.replay), [state, trace_file, pace, charts], outputs, api_name="replay", concurrency_limit=4,
            concurrency_id="replay", show_progress="minimal").then(**stepper_after)

        panels = [output, exact, retrieval, far, acceptance, throughput, step_info]  # STEP_PANELS, in at_step's order
        # the step control's values reach the Studio as the page sent them (not refused against the slider's range
        # first): a step typed out of range or between steps is rounded and kept within the run there
        page = dict(api_visibility="private", show_progress="hidden", preprocess=False)
        # typed into its box, moved by keys or dragged: the panels follow the last value it took, and the control shows
        # the step drawn
        step.input(wired(studio.step_by(0)), [state, step_run, step], [step, *panels], trigger_mode="always_last",
                   **page)
        prev_btn.click(wired(studio.step_by(-1)), [state, step_run, step], [step, *panels], **page)
        next_btn.click(wired(studio.step_by(1)), [state, step_run, step], [step, *panels], **page)
        step_run.input(wired(studio.pick_run), [state, step_run], [step, *panels], **page)
        jump.change(wired(studio.jump), [state, step_run, jump], [step, *panels], **page)
        play_btn.click(wired(studio.play), [state, step_run, step, step_pace, playing], [timer, play_btn, playing, step],
                       **page)
        timer.tick(wired(studio.tick), [state, step_run, step], [step, *panels, timer, play_btn, playing], **page)
        demo.load(None, None, None, js=CLICK_TO_STEP)
    demo.queue(default_concurrency_limit=settings.concurrency, max_size=settings.queue_size)
    refuse_quietly(demo)
    return demo


def launch(demo: gr.Blocks, settings: Settings, **overrides: Any):
    """Serve the app: the operator's address (127.0.0.1 by default), never a public share link."""
    options = dict(server_name=settings.host, server_port=settings.port, share=False, css=CSS,
                   max_file_size=max(4 * settings.max_upload_bytes, settings.max_trace_bytes), footer_links=["api"],
                   show_error=True)
    options.update(overrides)
    options["share"] = False
    return demo.launch(**options)
