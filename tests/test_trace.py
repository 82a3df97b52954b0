"""Traces as untrusted input, and replay as a bounded job.

Fuzzed with hypothesis over the trace schema: a file is either refused with a TraceError (one message that
says where the problem is) or loads into runs every panel can draw. Wrong types, unknown kinds, runs as
the wrong container, non-numeric token keys and deep nesting are refused, and so are times no recorded run has
(beyond a day, going back, a phase longer than the run). A replay at recorded pace plays each event when it came in
the recorded run, however long that was, and Stop ends it at once; the busy-machine note of a replay is the recorded
machine's.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import get_args, get_origin, get_type_hints

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.panels import main_view
from app.runner import replay
from app.trace import FORMAT, TraceError, loads
from specextend import events as ev
from specextend.config import METHODS, preset

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                    max_leaves=8)


def values(hint, low: int = -1) -> st.SearchStrategy:
    """Values of a field's type, small enough to collide: indices in and out of range, and (from `low`) negatives."""
    if hint is float:
        return st.floats(float(low), 50.0)
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.integers(low, 12)
    if hint is str:
        return st.sampled_from(["cmr", "streaming", "full", "target", "draft", "lookup", "both", "", "x"])
    if get_origin(hint) is tuple:
        args = get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(values(args[0], low), max_size=5)
        return st.tuples(*(values(a, low) for a in args)).map(list)
    return st.just({})


@st.composite
def event_dict(draw, kind: type, method: str, clean: bool) -> dict:
    """An event of `kind` in JSON form. Clean: every field of its type, no negative count (parents and origins may
    be -1); otherwise any field may be negative, and one may be any JSON at all."""
    hints = get_type_hints(kind)
    data = {"type": kind.__name__}
    for name, hint in hints.items():
        data[name] = draw(values(hint, -1 if not clean or name in ("parents", "origins") else 0))
    if kind is ev.Started:
        data["method"], data["prompt_ids"] = method, draw(st.lists(st.integers(0, 12), min_size=1, max_size=5))
    if not clean and draw(st.booleans()):
        data[draw(st.sampled_from(sorted(data)))] = draw(JSON)
    return data


@st.composite
def traces(draw) -> str:
    """A studio trace: clean in shape about half the time (known methods, each run opened by its Started event,
    token ids as keys), its fields' values free to disagree with each other; otherwise anything goes."""
    clean = draw(st.booleans())
    runs = {}
    names = METHODS if clean else [*METHODS, "beam"]
    for method in draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True)):
        kinds = draw(st.lists(st.sampled_from(list(ev.EVENT_TYPES.values())), max_size=8))
        opened = clean or draw(st.booleans())
        runs[method] = [draw(event_dict(ev.Started, method, True))] * opened + [
            draw(event_dict(k, method, clean)) for k in kinds if not (clean and k is ev.Started)]
    keys = st.sampled_from(["1", "2", "3", "4", "5"] if clean else ["1", "2", "x", "-3"])
    tokens = draw(st.dictionaries(keys, st.text(max_size=3), max_size=3))
    return json.dumps({"format": FORMAT, "runs": runs, "tokens": tokens, "meta": {}})


@given(traces())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_trace_is_refused_with_a_message_or_draws(text):
    try:
        runs, codec, _ = loads(text)
    except TraceError as exc:
        assert str(exc) and "Traceback" not in str(exc)
        return
    for primary in runs:
        view = main_view(runs, primary, codec.decode, charts=True)
        assert view.output and view.readout is not None


@pytest.mark.parametrize("text,message", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("not json", "not a JSON file"),
    (json.dumps({"format": FORMAT, "runs": [1, 2]}), "'runs' should map each method's name to a list of events"),
    (json.dumps({"format": FORMAT, "runs": {"specextend": {"0": {}}}}), "'runs' should map"),
    (json.dumps({"format": FORMAT, "runs": {}, "tokens": {"seven": "x"}}), "not a token id"),
    (json.dumps([{"type": "Exploded"}]), "event 0: 'Exploded' is not a kind of event"),
    (json.dumps([{"type": "Prefilling", "t_s": "soon", "elapsed_s": 0, "model": "target", "done": 1, "total": 2}]),
     "event 0: Prefilling.t_s should be a number, got str"),
    (json.dumps({"format": FORMAT, "runs": {"beam": [ev.to_dict(ev.Finished(0.0, 0.0, (), "eos", 0, 3))]}}),
     "'beam' is not a method this app runs"),
    (json.dumps([ev.to_dict(ev.Started(0.0, 0.0, "specextend", (-5,), {}, 2, 1, "cpu", "float32"))]),
     "token ids must lie in"),
    (json.dumps([ev.to_dict(ev.Started(0.0, 0.0, "specextend", (5,), {"attention": {"numerics": "<b>int3</b>"}}, 2, 1,
                                       "cpu", "float32"))]), "attention.numerics should be one of fp32, bf16, bf16-kv"),
    (json.dumps([ev.to_dict(ev.Started(0.0, 0.0, "specextend", (5,), {"attention": 5}, 2, 1, "cpu", "float32"))]),
     "attention.numerics should be one of"),
])
def test_each_kind_of_problem_gets_its_message(text, message):
    with pytest.raises(TraceError, match=message):
        loads(text)


def run_of(times: list[float]) -> dict:
    started = ev.Started(0.0, 0.0, "autoregressive", (1, 2), {}, 2, 0, "cpu", "float32")
    steps = [ev.Verified(t, 0.0, i + 1, 2 + i, (), (), 0, 5, (5,), i + 1) for i, t in enumerate(times)]
    return {"autoregressive": [started, *steps]}


def test_a_replay_at_recorded_pace_plays_each_event_when_it_came():
    runs = run_of([0.4, 0.8, 1.2])
    began = time.perf_counter()
    came = [(e, time.perf_counter() - began) for e in replay(runs, 1.0)([1, 2], preset("autoregressive"), None)]
    assert [e for e, _ in came] == runs["autoregressive"]
    for e, at in came:  # never early; late only by what a busy machine's thread wake-up may take
        assert e.t_s - 0.02 <= at <= e.t_s + 2.0, f"recorded at {e.t_s} s, played at {at:.2f} s"


def test_a_long_recorded_run_is_not_sped_up_and_stop_ends_its_wait_at_once():
    runs = run_of([130.0, 131.0])  # longer than the two minutes a replay used to be squeezed into
    stop = threading.Event()
    events = replay(runs, 1.0)([1, 2], preset("autoregressive"), stop)
    assert isinstance(next(events), ev.Started)
    came: list = []
    waiting = threading.Thread(target=lambda: came.append(next(events)), daemon=True)
    waiting.start()
    waiting.join(3.0)
    assert not came  # the recorded step came 130 s in: it is not played after a wait of two seconds
    began = time.perf_counter()
    stop.set()
    waiting.join(30.0)
    assert came and isinstance(came[0], ev.Finished) and came[0].stop_reason == "stopped"
    assert time.perf_counter() - began < 30.0, "Stop did not end the wait for the step recorded 130 s in"


def studio_trace(times: list[float], elapsed: float = 0.0, **meta) -> str:
    """A studio trace of one autoregressive run whose steps come at `times`, each phase `elapsed` long."""
    started, *steps = run_of(times)["autoregressive"]
    events = [started, *(replace(v, elapsed_s=elapsed) for v in steps)]
    return json.dumps({"format": FORMAT, "runs": {"autoregressive": [ev.to_dict(e) for e in events]},
                       "tokens": {}, "meta": meta})


@pytest.mark.parametrize("text,message", [
    (studio_trace([1.0, 1e12]), "its time is 1e\\+12 s, but a recorded run's clock reads from 0 to 86,400 s"),
    (studio_trace([-0.5]), "its time is -0.5 s"),
    (studio_trace([2.0, 1.0]), "event 2 \\(Verified\\): its time, 1.000 s, is earlier than the event before it \\(2.000 s\\)"),
    (studio_trace([1.0, 2.0], elapsed=5.0), "elapsed_s is 5 s, but the run had taken 1.000 s by then"),
    (studio_trace([1.0], elapsed=-1.0), "elapsed_s is -1 s"),
    (studio_trace([1.0], machine_load="busy"), "'meta.machine_load' should be the recorded machine's load per core"),
    (studio_trace([1.0], machine_load=-2), "'meta.machine_load'"),
])
def test_times_no_recorded_run_has_are_refused_with_the_reason(text, message):
    with pytest.raises(TraceError, match=message):
        loads(text)


def test_a_recorded_runs_times_load():
    runs, _, meta = loads(studio_trace([0.5, 0.5, 45_000.0], elapsed=0.5, machine_load=1.5))
    assert [e.t_s for e in runs["autoregressive"][1:]] == [0.5, 0.5, 45_000.0] and meta["machine_load"] == 1.5


def last_readout(studio, state, path) -> str:
    *_, last = studio.replay(state, str(path), "instant")
    return last[8]  # status, its plain text, output, exactness, retrieval, far, acceptance, speed chart, speed table


def test_a_replay_says_the_recorded_machine_was_busy_not_the_replaying_one(tmp_path, monkeypatch):
    import app.studio as studio_module
    from app.settings import Settings
    from fixtures.fake_engine import fake_factory

    studio, state = studio_module.Studio(fake_factory(), Settings()), studio_module.SessionState()
    monkeypatch.setattr(studio_module, "machine_load", lambda: 6.0)  # the machine replaying is busy
    quiet, busy, unknown = tmp_path / "quiet.json", tmp_path / "busy.json", tmp_path / "unknown.json"
    quiet.write_text(studio_trace([0.1, 0.2], machine_load=0.2))
    busy.write_text(studio_trace([0.1, 0.2], machine_load=2.5))
    unknown.write_text(studio_trace([0.1, 0.2]))
    assert "tokens/s" in last_readout(studio, state, quiet) and "busy" not in last_readout(studio, state, quiet)
    assert "The machine was busy while this ran (load 2.5 per core)" in last_readout(studio, state, busy)
    assert "busy" not in last_readout(studio, state, unknown)


def test_an_export_records_the_machines_load_and_a_replay_keeps_the_recorded_one(tmp_path, monkeypatch):
    import app.studio as studio_module
    from app.settings import Settings
    from fixtures.fake_engine import fake_factory

    studio = studio_module.Studio(fake_factory(), Settings())
    monkeypatch.setattr(studio_module, "machine_load", lambda: 3.25)
    runs, codec, _ = loads(studio_trace([0.1]))
    live = json.loads(Path(studio._export(runs, codec.decode, {"primary": "autoregressive"})).read_text())
    assert live["meta"]["machine_load"] == 3.25 and loads(json.dumps(live))[2]["machine_load"] == 3.25
    replayed = json.loads(Path(studio._export(runs, codec.decode, {"machine_load": 0.5, "replayed": True})).read_text())
    assert replayed["meta"]["machine_load"] == 0.5


def asking(max_new_tokens, wrote: int = 2) -> str:
    """A studio trace of one autoregressive run whose Started event asked for `max_new_tokens` and that wrote `wrote`."""
    started, *steps = run_of([0.1] * wrote)["autoregressive"]
    config = {**started.config, "max_new_tokens": max_new_tokens}
    return json.dumps({"format": FORMAT, "runs": {"autoregressive": [ev.to_dict(replace(started, config=config)),
                                                                      *(ev.to_dict(e) for e in steps)]}, "tokens": {}})


@pytest.mark.parametrize("text,message", [
    (asking(10**15), "the autoregressive run asked for 1000000000000000 new tokens, but this server runs from 1 to 2,048"),
    (asking(0), "asked for 0 new tokens"),
    (asking(2.5), "asked for 2.5 new tokens"),
    (asking(True), "asked for True new tokens"),
    (asking(2048, wrote=2050), "wrote 2,050 new tokens, but this server runs at most 2,048"),
])
def test_a_trace_beyond_the_servers_limits_is_refused_at_replay(tmp_path, text, message):
    """A run that asked for (or wrote) more new tokens than this server allows is none of its runs: refused with the
    reason and the operator's setting, before anything plays; the same file loads where no limit is given."""
    from app.settings import Settings
    from app.studio import SessionState, Studio
    from fixtures.fake_engine import fake_factory

    with pytest.raises(TraceError, match=message):
        loads(text, 2048)
    path = tmp_path / "big.json"
    path.write_text(text)
    said = list(Studio(fake_factory(), Settings(max_new_tokens=2048)).replay(SessionState(), str(path), "instant"))
    assert len(said) == 1 and "Cannot replay this file" in said[0][1] and "SPECEXTEND_MAX_NEW_TOKENS" in said[0][1]
    assert loads(asking(2048), 2048)[0] and loads(text)[0]  # within the limit, or with none given: it loads


@pytest.mark.parametrize("meta,message", [({"pair": ["a"]}, "'meta.pair' should be text"),
                                          ({"recorded": "x" * 301}, "'meta.recorded' should be text of up to 300")])
def test_the_texts_a_replay_shows_from_meta_are_checked(meta, message):
    with pytest.raises(TraceError, match=message):
        loads(studio_trace([0.1], **meta))


def test_a_replay_says_whose_trace_it_plays_while_it_plays_and_after(tmp_path, monkeypatch):
    """A live run's trace records when it ran; its replay says "Replay of a trace recorded on <date>, <pair>" in the
    status from its first message to its last, and over the output; a trace without a date says so."""
    import html

    import app.studio as studio_module
    from app.settings import Settings
    from fixtures.fake_engine import fake_factory

    studio, state = studio_module.Studio(fake_factory(), Settings()), studio_module.SessionState()
    runs, codec, _ = loads(studio_trace([0.1, 0.2]))
    path = studio._export(runs, codec.decode, {"primary": "autoregressive", "pair": "Bundled: a pair"})
    recorded = json.loads(Path(path).read_text())["meta"]["recorded"]
    assert recorded.endswith(" UTC") and recorded[:2] == "20"
    said = list(studio.replay(state, path, "instant"))
    about = f"Replay of a trace recorded on {recorded}, Bundled: a pair: no model runs"
    assert all(about in html.unescape(m[0]) for m in said) and about in said[-1][1]  # the page's status, the plain one
    assert about in html.unescape(said[-1][2])  # over the output
    undated = tmp_path / "undated.json"
    undated.write_text(studio_trace([0.1]))
    assert "recorded on a date the file does not say" in list(studio.replay(state, str(undated), "instant"))[-1][1]


def test_instant_replay_plays_everything_at_once():
    runs = run_of([5.0, 10.0])
    began = time.perf_counter()
    assert len(list(replay(runs, 0.0)([1, 2], preset("autoregressive"), None))) == 3
    assert time.perf_counter() - began < 5.0, "an instant replay waited for the recorded times (10 s)"
