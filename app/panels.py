"""From a click's runs to what each panel shows. Pure: runs + decoder in, figure dicts and HTML out.
Knows the visualizers and the metrics; knows nothing of gradio or threads.
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from specextend.events import Event
from specextend.metrics import new_tokens
from visualizers import (
    Decode, acceptance_spec, answer_html, exactness_html, far_html, guesses_html, needle_spec, output_html,
    retrieval_spec, throughput_html, throughput_spec,
)
from visualizers.common import ending, label, message_spec, started, stop_reason
from visualizers.steps import as_of, moment
from visualizers.text import prompt_reading, run_numerics


@dataclass(frozen=True)
class View:
    """Everything the main tab draws for one moment of a click."""

    output: str
    exactness: str
    retrieval: dict[str, Any] | None
    far: str  # the chunks the latest retrieval reached back for, with their text
    acceptance: dict[str, Any] | None
    throughput: dict[str, Any] | None
    readout: str


def _temperature(events: Sequence[Event]) -> float:
    began = started(events)
    return float(began.config.get("temperature", 0.0)) if began else 0.0


def exactness(runs: Mapping[str, Sequence[Event]], primary: str, decode: Decode,
              not_run: Mapping[str, str] | None = None) -> str:
    """The exactness check's line: compare the primary run with the target alone, when both are there and wrote tokens;
    else why not (`not_run`: the click's methods that never started, and why)."""
    ours = runs.get(primary, [])
    if primary == "autoregressive":
        return "<div class='se-muted'>This run is the target alone: it is the reference the others are checked against.</div>"
    if _temperature(ours) > 0:
        return ("<div class='se-muted'>Sampling (temperature &gt; 0): the output follows the target's distribution "
                "exactly, but not token for token; set temperature 0 to check exactness.</div>")
    reference = runs.get("autoregressive")
    if reference is None and "autoregressive" in (not_run or {}):
        return (f"<div class='se-muted'>Exactness: not checked: the target alone did not run "
                f"({html.escape(not_run['autoregressive'])}), so there is no output to compare this one with.</div>")
    if reference is None:
        return ("<div class='se-muted'>Exactness: tick “the target alone” in the race to compare this output with "
                "the target's own greedy output.</div>")
    if stop_reason(ours) == "running" or stop_reason(reference) == "running":
        return "<div class='se-muted'>Exactness: waiting for the target-alone run to finish…</div>"
    silent = [(name, events) for name, events in ((label(primary), ours), ("the target alone", reference))
              if not new_tokens(events)]
    if silent:  # an ended run without a token (stopped in its prefill): nothing to compare
        name, events = silent[0]
        return (f"<div class='se-muted'>Exactness: not checked: {html.escape(name)} wrote no token "
                f"({html.escape(ending(events))}).</div>")
    began = [started(events) for events in (ours, reference)]
    return exactness_html(new_tokens(ours), new_tokens(reference), decode, label(primary), prompt_reading(*began),
                          run_numerics(*began))


def main_view(runs: Mapping[str, Sequence[Event]], primary: str, decode: Decode, charts: bool = True,
              text: Decode | None = None, load: float | None = None, not_run: Mapping[str, str] | None = None) -> View:
    """The main tab's panels; with `charts` False the three figures are left out (None). `not_run`: the click's
    methods that never started (a stopped race's later runs), with why: the exactness line and the speed table say so.

    `decode` shows special tokens (chunk and draft-token hovers); `text`, if given, is used for prose
    (the output and the exactness check) and leaves them out.
    """
    events = runs.get(primary, [])
    text = text or decode
    return View(
        output=output_html(events, text),
        exactness=exactness(runs, primary, text, not_run),
        retrieval=retrieval_spec(events, decode) if charts else None,
        far=far_html(events, text),
        acceptance=acceptance_spec(events, decode) if charts else None,
        throughput=throughput_spec(runs) if charts else None,
        readout=throughput_html(runs, load, not_run),
    )


def step_view(runs: Mapping[str, Sequence[Event]], method: str, step: int, decode: Decode, text: Decode | None = None,
              load: float | None = None, not_run: Mapping[str, str] | None = None) -> View:
    """The main tab's panels for one run as of one step (`visualizers.steps.as_of`): that step's tokens outlined in
    the output with the draft's rejected guess, the working cache its draft read, its draft tree, its moment on the
    speed chart. The other runs of the click stay whole on the speed chart."""
    events = runs.get(method, [])
    shown = as_of(events, step)
    text = text or decode
    return View(
        output=output_html(shown, text, at_step=step),
        exactness=exactness(runs, method, text, not_run),
        retrieval=retrieval_spec(shown, decode),
        far=far_html(shown, text),
        acceptance=acceptance_spec(shown, decode),
        throughput=throughput_spec(runs, (method, *moment(events, step))),
        readout=throughput_html(runs, load, not_run),
    )


NOTHING_RAN = "Nothing was generated: the status above says why."


def nothing_ran() -> View:
    """The main tab's panels after a click that ran nothing (refused): every panel says so, none shows an earlier run."""
    empty = message_spec("nothing ran: the status says why")
    return View(output=f"<div class='se-muted'>{NOTHING_RAN}</div>", exactness="", retrieval=empty, far="",
                acceptance=empty, throughput=empty, readout="")


def needle_nothing_ran(info: str = "") -> list:
    """The needle tab's panels after a click that ran nothing (refused): the planted fact where there was one (`info`),
    then the grid, the answers, the layer x head picture and the three chunk strips, each saying so, none showing an
    earlier click's runs."""
    empty = message_spec("nothing ran: the status says why")
    return [info, empty, f"<div class='se-muted'>{NOTHING_RAN}</div>", empty, empty, empty, empty]


def needle_view(runs: Mapping[str, Sequence[Event]], span: tuple[int, int], prompt_len: int, expected: str,
                text: Decode, done: bool = False, stopped: bool = False) -> tuple[dict[str, Any], str]:
    """The teaching tab: the needle-held grid and each run's answer (`text` decodes it for reading); once the click is
    `done`, whether the draft's guesses changed between its caches (not compared where it was `stopped`)."""
    answers = answer_html(runs, text, expected, span)
    if done:
        answers += guesses_html(runs, text, expected, stopped)
    return needle_spec(runs, span, prompt_len, stopped), answers


def status_html(lines: Sequence[str], error: str = "", details: str = "") -> str:
    """The status line: an error first if any, then the lines; `details` (operator telemetry) folded away."""
    body = "<br>".join(html.escape(x) for x in lines if x)
    if error:
        body = f"<div class='se-bad'>{html.escape(error)}</div>{body}"
    if details:
        body += f"<details class='se-muted'><summary>drawing cost</summary>{html.escape(details)}</details>"
    return f"<div class='se-status'>{body}</div>"


def about_html(about: str) -> str:
    """What a click is (a replay: whose trace it plays), shown over the output ("" for a live run)."""
    return f"<div class='se-about'>{html.escape(about)}</div>" if about else ""


def recorded_settings(config: Mapping[str, Any]) -> str:
    """A recorded run's settings in the page's words, from its Started config (a replay says what the trace ran with,
    since the page's own knobs are not what it ran with)."""
    draft, retrieval = config.get("draft", {}), config.get("retrieval", {})
    shape = (f"a tree of depth {draft.get('max_depth')} and {draft.get('node_budget')} nodes"
             if draft.get("shape") == "tree" else f"a chain of {draft.get('k')}")
    words = [f"{config.get('max_new_tokens')} new tokens", f"the draft proposing {shape}",
             f"chunks of {retrieval.get('chunk_size')}, top-k {retrieval.get('top_k')}, retrieving every "
             f"{retrieval.get('retrieve_every')} steps, the {retrieval.get('signal', 'default')} signal"]
    temperature = config.get("temperature") or 0.0
    words.append(f"sampling at temperature {temperature:g} (seed {config.get('seed')})" if temperature else "greedy")
    lookup = (config.get("lookup") or {}).get("enabled")
    words.append("lookup on" if lookup else "lookup off")
    words.append(f"{config.get('attention', {}).get('numerics', 'fp32')} numerics")
    return ", ".join(words)


def status_text(lines: Sequence[str], error: str = "") -> str:
    """The status as plain text, for API callers: the error first if any, then the lines, one a line."""
    return "\n".join(x for x in (error, *lines) if x)


def machine_load() -> float | None:
    """The machine's one-minute load per core (above 1: work waited for a core), where the system tells it."""
    if not hasattr(os, "getloadavg"):
        return None
    return os.getloadavg()[0] / (os.cpu_count() or 1)
