"""Stepping through a run: the state at step s is a fold of the trace's events up to s. At the last step it is the
whole trace (today's end-of-run panels); at any step it matches the events up to that step, on the recorded trace
and on synthetic ones."""

from __future__ import annotations

import html
import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from app.panels import main_view, step_view
from specextend.config import DraftConfig, RetrievalConfig
from specextend.events import Drafted, Finished, Prefilled, Retrieved, Verified
from test_visualizers import decode, recorded_traces, trace
from visualizers import acceptance_spec, output_html, retrieval_spec
from visualizers.common import guessed_nodes
from visualizers.retrieval import changed, kept_chunks
from visualizers.steps import as_of, last_step, moment, step_html


def cases() -> list[tuple[str, dict, object]]:
    out = [(m, {m: trace(m)}, decode) for m in ("specextend", "streaming", "speculative", "autoregressive")]
    out.append(("tree", {"specextend": trace(draft=DraftConfig(shape="tree", max_depth=4, node_budget=8),
                                             retrieval=RetrievalConfig(chunk_size=32, top_k=6, retrieve_every=1))}, decode))
    for runs, codec, _ in recorded_traces():
        out += [(f"recorded {m}", {m: runs[m], **runs}, codec.decode) for m in runs]
    return out


CASES = cases()


@pytest.mark.parametrize("name,runs,dec", CASES, ids=[c[0] for c in CASES])
def test_the_last_step_is_the_whole_run_and_draws_todays_end_of_run_panels(name, runs, dec):
    method = next(iter(runs))
    events = runs[method]
    last = last_step(events)
    assert as_of(events, last) == list(events) and as_of(events, last + 5) == list(events)
    end, at_last = main_view(runs, method, dec), step_view(runs, method, last, dec)
    for panel in ("retrieval", "far", "acceptance", "exactness", "readout"):
        assert getattr(at_last, panel) == getattr(end, panel), panel
    # the output too, once the marks of the step being looked at (its outline, the draft's rejected guess) are off
    unmarked = re.sub(r"<s class='se-guess'[^>]*>.*?</s>", "", at_last.output)
    unmarked = re.sub(r"<span class='se-focus' title='step \d+'>(.*?)</span>(</span>)", r"\1\2", unmarked)
    assert unmarked == end.output and ("se-focus" in at_last.output) == (last > 0 or "Prefilled" in repr(events))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(CASES), where=st.floats(0, 1))
def test_the_state_at_a_step_matches_the_events_up_to_it(case, where):
    _, runs, dec = case
    method = next(iter(runs))
    events = runs[method]
    last = last_step(events)
    s = round(where * last)
    shown = as_of(events, s)
    assert shown == list(events)[: len(shown)]  # a prefix: nothing invented, nothing reordered
    verified = [v for v in shown if isinstance(v, Verified)]
    assert [v.step for v in verified] == [v.step for v in events if isinstance(v, Verified) and v.step <= s]
    if s < last:
        assert not any(isinstance(e, Finished) for e in shown)
        # the working cache as the draft of step s read it: retrievals after earlier steps only
        assert [r.step for r in shown if isinstance(r, Retrieved)] == [
            r.step for r in events if isinstance(r, Retrieved) and r.step < s]
    # the panels drawn from it: the acceptance columns are the steps up to s, the heatmap rows the retrievals so far
    columns = acceptance_spec(shown, dec)["data"]
    if method != "autoregressive" and verified:
        assert columns[0]["x"] == [v.step for v in verified]
    retrievals = [r for r in shown if isinstance(r, Retrieved)]
    if retrievals:
        spec = retrieval_spec(shown, dec)
        assert spec["data"][1]["y"] == [r.step for r in retrievals][-len(spec["data"][1]["y"]):]
        added, dropped = changed(retrievals[-1], retrievals[-2] if len(retrievals) > 1 else None)
        signs = [a["text"] for a in spec["layout"]["annotations"] if a["text"] in ("+", "−")]
        assert ("+" in signs) == bool(added) and ("−" in signs) == bool(dropped)
    # the output holds the tokens committed by then, that step's outlined, then the draft's rejected guess
    text = html.unescape(re.sub(r"<[^>]+>", "", output_html(shown, dec, at_step=s)))
    committed = [p.first_token for p in shown if isinstance(p, Prefilled)] + [t for v in verified for t in v.committed]
    guess = ()
    if s > 0 and verified and verified[-1].step == s:
        drafts = [d for d in shown if isinstance(d, Drafted) and d.step == s]
        drafted = drafts[0] if drafts else None
        guess = tuple(drafted.tokens[n] for n in guessed_nodes(drafted, verified[-1]))
    assert dec(committed) + dec(list(guess)) in text
    seconds, tokens = moment(events, s)
    assert tokens == (verified[-1].total_new if verified else 1)
    assert f"Step {s} of {last}" in step_html(events, s, dec)


def test_a_step_in_words_names_the_cache_its_draft_read_and_what_changed():
    events = trace(retrieval=RetrievalConfig(chunk_size=32, top_k=6, retrieve_every=1))
    retrievals = [r for r in events if isinstance(r, Retrieved)]
    moved = next(i for i in range(1, len(retrievals)) if changed(retrievals[i], retrievals[i - 1]) != ((), ()))
    read, before = retrievals[moved], retrievals[moved - 1]
    added, dropped = changed(read, before)
    assert set(added) == set(kept_chunks(read)) - set(kept_chunks(before))
    words = html.unescape(step_html(events, read.step + 1, decode))
    assert f"chosen after step {read.step} (+{len(added)} / −{len(dropped)} chunks since the retrieval after step " \
           f"{before.step})" in words
    verified = next(v for v in events if isinstance(v, Verified) and v.step == read.step + 1)
    verdict = f"the target accepted {verified.num_accepted}," if verified.num_accepted else "the target kept none"
    assert verdict in re.sub(r"<[^>]+>", "", words)
    assert "the target read the prompt (1,200 tokens)" in step_html(events, 0, decode)


def test_the_step_handlers_stay_within_the_run_and_play_stops_at_its_end():
    from pathlib import Path

    from app.settings import Settings
    from app.stepping import STEP_PANELS
    from app.studio import SessionState, Studio
    from fixtures.fake_engine import fake_factory

    fixture = Path(__file__).parent / "fixtures" / "smollm2_hamlet.trace.json"
    studio, state = Studio(fake_factory(), Settings()), SessionState()
    assert studio.stepper(state)[0].visible is False  # nothing has run
    list(studio.replay(state, str(fixture), "instant"))
    runs = state.job.snapshot()
    last = last_step(runs["specextend"])
    shown, run, slider, words, download = studio.stepper(state)
    assert shown.visible and run.value == "specextend" and slider.value == last and f"Step {last} of {last}" in words
    assert download.visible  # the trace's download shows with the step control, and hides with it
    assert studio.hide_stepper()[-1].visible is False
    back = studio.step_by(-1)(state, "specextend", 5)
    assert back[0] == 4 and len(back) == STEP_PANELS + 1 and "Step 4 of" in back[-1]
    assert studio.step_by(1)(state, "specextend", last)[0] == last and studio.step_by(-1)(state, "specextend", 0)[0] == 0
    assert studio.jump(state, "specextend", "12:1764000000")[0] == 12
    assert studio.jump(state, "specextend", "not a step")[0].__class__.__name__ != "int"  # ignored, not a crash
    timer, button, playing, start = studio.play(state, "specextend", last, "0.5", False)  # at the end: from the start
    assert timer.active and timer.value == 0.5 and playing and start == 0 and "pause" in button
    *moved, timer, button, playing = studio.tick(state, "specextend", last - 1)
    assert moved[0] == last and timer.active is False and playing is False and "play" in button
    assert studio.play(state, "specextend", 3, "1", True)[2] is False  # pause
    slider, *_ = studio.pick_run(state, "autoregressive")
    assert slider.value == last_step(runs["autoregressive"]) == slider.maximum


def test_a_step_typed_between_steps_or_out_of_range_is_rounded_into_the_run_and_the_control_shows_it():
    """12.5, 999 or -5 typed into the slider's box (the page passes it as typed): the panels are drawn at the step it
    rounds to within the run, and the control is set to that step, so the box, the slider and the panels agree; a
    step it already shows is left alone (a drag is not pulled back). A replay's output says it is one at every step."""
    from pathlib import Path

    from app.settings import Settings
    from app.stepping import STEP_PANELS
    from app.studio import SessionState, Studio
    from app.updates import KEEP
    from fixtures.fake_engine import fake_factory

    fixture = Path(__file__).parent / "fixtures" / "smollm2_hamlet.trace.json"
    studio, state = Studio(fake_factory(), Settings()), SessionState()
    list(studio.replay(state, str(fixture), "instant"))
    last = last_step(state.job.runs["specextend"])
    follow = studio.step_by(0)
    for typed, drawn in ((12.5, 13), (999, last), (-5, 0), (1e300, last), ("7", 7)):
        moved = follow(state, "specextend", typed)
        assert moved[0] == drawn and len(moved) == STEP_PANELS + 1, typed
        assert f"Step {drawn} of {last}" in moved[-1], (typed, moved[-1])
        assert "Replay of a trace" in moved[1]  # the output panel, at any step
    assert follow(state, "specextend", 6)[0] is KEEP and "Step 6 of" in follow(state, "specextend", 6)[-1]
    assert all(a is KEEP for a in follow(state, "specextend", float("nan")))  # no number: nothing moves, no crash
    assert studio.jump(state, "specextend", "12.6:1764000000")[0] == 13


def test_a_run_stopped_before_its_first_step_is_not_offered_to_step_through():
    from pathlib import Path

    from app.settings import Settings
    from app.studio import SessionState, Studio
    from fixtures.fake_engine import fake_factory

    fixture = Path(__file__).parent / "fixtures" / "smollm2_hamlet.trace.json"
    studio, state = Studio(fake_factory(), Settings()), SessionState()
    list(studio.replay(state, str(fixture), "instant"))
    runs = dict(state.job.runs)
    first, *others = runs

    def before_first_step(events):  # stopped after its prefill: no draft, no verification
        return events[:next(i for i, e in enumerate(events) if isinstance(e, (Drafted, Verified)))]

    state.job.runs = {**runs, first: before_first_step(runs[first])}
    shown, run, slider, _, download = studio.stepper(state)
    assert shown.visible and first not in [m for _, m in run.choices] and run.value == others[0]
    assert slider.maximum == last_step(runs[others[0]]) > 0
    assert slider.visible
    state.job.runs = {m: before_first_step(events) for m, events in runs.items()}
    shown, run, slider, words, download = studio.stepper(state)
    assert shown.visible and slider.visible is False and download.visible  # no 0-1 slider; the trace downloads
    assert "the target read the prompt" in words  # what there is: the prefill


def test_a_replay_says_what_its_trace_ran_with_since_the_knobs_on_the_left_are_the_pages():
    from pathlib import Path

    from app.settings import Settings
    from app.studio import SessionState, Studio
    from fixtures.fake_engine import fake_factory
    from specextend.events import Started

    fixture = Path(__file__).parent / "fixtures" / "smollm2_hamlet.trace.json"
    studio, state = Studio(fake_factory(), Settings()), SessionState()
    last = list(studio.replay(state, str(fixture), "instant"))[-1]
    config = next(e for e in state.job.runs["specextend"] if isinstance(e, Started)).config
    about = html.unescape(next(v for v in last if isinstance(v, str) and "se-about" in v))
    assert f"{config['max_new_tokens']} new tokens" in about and f"a chain of {config['draft']['k']}" in about
    assert f"top-k {config['retrieval']['top_k']}" in about and "not the trace's" in about
