"""The Studio on a ZeroGPU Space, with a stand-in for the `spaces` package: a click's engine work goes through the GPU
decorator in one grant sized by its request, and crosses a process boundary as it would there (everything pickled);
its results are those of the undecorated path; Stop, refusals and the visitor's request behave as they do off
ZeroGPU; and nothing is decorated where `spaces` is absent or the Space is not a ZeroGPU one."""

from __future__ import annotations

import html
import inspect
import pickle
import sys
import threading
import time
import types
from dataclasses import asdict
from functools import partial

import pytest

from app import zerogpu
from app.backend import Codec, Loaded
from app.settings import BUNDLED, BUNDLED_PAIRS, PRESETS, Settings
from app.studio import SessionState, Studio
from app.ui import build_app
from app.zerogpu import GpuCost, StopFlag, estimate_seconds

from fixtures.fake_engine import WordTokenizer, fake_factory

DOC = " ".join(f"word{i % 300}" for i in range(1500))
SMALL_DOC = " ".join(f"w{i % 40}" for i in range(240))  # few distinct words: ids within the tiny models' vocabulary


def fake_spaces(zero_gpu: bool = True) -> types.ModuleType:
    """A stand-in for `spaces` as a ZeroGPU Space has it. `GPU` records each function it decorates; each call records
    the seconds asked for (its `duration` callable called with the call's own arguments) and the gradio request the
    call sees, then runs the function as a forked worker would: its arguments and every result pickled across."""
    from gradio.context import LocalContext

    spaces = types.ModuleType("spaces")
    spaces.config = types.ModuleType("spaces.config")
    spaces.config.Config = types.SimpleNamespace(zero_gpu=zero_gpu)
    spaces.decorated, spaces.asked, spaces.requests = [], [], []
    crossed = lambda value: pickle.loads(pickle.dumps(value))  # noqa: E731

    def GPU(task=None, *, duration=None, size=None):
        if task is None:
            return lambda fn: GPU(fn, duration=duration, size=size)
        spaces.decorated.append(task)

        def ask(args, kwargs):
            spaces.asked.append(duration(*args, **kwargs) if callable(duration) else duration)
            spaces.requests.append(LocalContext.request.get(None))
            return crossed((args, kwargs))

        if inspect.isgeneratorfunction(task):
            def granted(*args, **kwargs):
                args, kwargs = ask(args, kwargs)
                for item in task(*args, **kwargs):
                    yield crossed(item)
        else:
            def granted(*args, **kwargs):
                args, kwargs = ask(args, kwargs)
                return crossed(task(*args, **kwargs))
        return granted

    spaces.GPU = GPU
    return spaces


@pytest.fixture
def spaces(monkeypatch):
    """A ZeroGPU Space: SPACES_ZERO_GPU set and the stand-in importable."""
    fake = fake_spaces()
    monkeypatch.setitem(sys.modules, "spaces", fake)
    monkeypatch.setitem(sys.modules, "spaces.config", fake.config)
    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    return fake


def studio_for(factory, settings: Settings | None = None) -> Studio:
    """A Studio as build_app makes it (on a ZeroGPU Space where the environment says so), without the page."""
    return Studio(*zerogpu.adapt(factory, settings or Settings()))


def click(studio: Studio, document: str = DOC, race=("speculative", "autoregressive"), **knobs) -> tuple[list, SessionState]:
    """Every message of one Run, to its end, and the session that ran it."""
    state = SessionState()
    args = dict(pair=BUNDLED, method="specextend", race=list(race), chart_every="0", max_new_tokens=48, top_k=6,
                retrieve_every=3)
    return list(studio.run(state, document, "Summarize.", **{**args, **knobs})), state


def essence(event) -> tuple:
    """An event without its timings (every field ending in _s) and without the config a run reports."""
    return type(event).__name__, {k: v for k, v in asdict(event).items() if not k.endswith("_s") and k != "config"}


def tiny_factory(pair):
    """The real engine on a tiny pair, served with a whitespace tokenizer (ids within its vocabulary)."""
    from specextend.engine import generate
    from specextend.target import SharedPrefill

    tokenizer = WordTokenizer()

    def factory(choice, progress):
        return Loaded(choice, Codec(tokenizer, (0,)), partial(generate, pair), 4096, "cpu", "float32",
                      race=lambda: partial(generate, pair, shared=SharedPrefill()))

    return factory


def test_the_estimate_grows_with_the_prompt_the_tokens_and_the_runs_and_is_capped():
    base = estimate_seconds(4000, 96, 1)
    assert estimate_seconds(16000, 96, 1) > base and estimate_seconds(4000, 400, 1) > base
    assert estimate_seconds(4000, 96, 3) > base
    # the page's default click (a 4K-token document, 96 new tokens, a race of three): 20 + 3 x (0.8 + 7.68) s
    assert estimate_seconds(4000, 96, 3) == 46
    assert estimate_seconds(0, 0, 1) == GpuCost().start_s  # a grant's start is always asked for
    assert estimate_seconds(32000, 2048, 3) == 120  # a long output's race: capped at the default grant
    assert estimate_seconds(16384, 256, 3) < 120  # the README's settings for a ZeroGPU Space fit the default grant
    assert estimate_seconds(32000, 2048, 3, GpuCost(max_s=300)) == 300
    assert isinstance(estimate_seconds(1234, 5, 2), int)


def test_zerogpu_is_detected_only_where_the_space_says_so_and_spaces_agrees(monkeypatch):
    fake = fake_spaces()
    monkeypatch.setitem(sys.modules, "spaces", fake)
    monkeypatch.setitem(sys.modules, "spaces.config", fake.config)
    assert zerogpu.detect({}) is None  # not a ZeroGPU Space: `spaces` is not even asked
    assert zerogpu.detect({"SPACES_ZERO_GPU": "false"}) is None
    assert zerogpu.detect({"SPACES_ZERO_GPU": "true"}) is fake and zerogpu.detect({"SPACES_ZERO_GPU": "1"}) is fake
    fake.config.Config.zero_gpu = False
    assert zerogpu.detect({"SPACES_ZERO_GPU": "true"}) is None
    monkeypatch.setitem(sys.modules, "spaces", None)  # not installed: importing it fails
    assert zerogpu.detect({"SPACES_ZERO_GPU": "true"}) is None


def spaces_default(prompt: int) -> int:
    """The grant of the test's default click: 48 new tokens, a race of three."""
    return estimate_seconds(prompt, 48, 3)


def test_a_click_takes_one_grant_sized_by_its_request(spaces):
    studio = studio_for(fake_factory(step_s=0.01))
    messages, state = click(studio)
    assert "Done." in messages[-1][0] and len(messages) >= 2  # the panels stream as off ZeroGPU
    assert list(state.job.runs) == ["specextend", "speculative", "autoregressive"]
    assert len(spaces.asked) == 1  # the main run and its race in one grant
    prompt = len(state.job.prompt.ids)
    assert spaces.asked[0] == spaces_default(prompt)

    asked = {}
    instant = studio_for(fake_factory(step_s=0.0))  # the grant is sized before a run starts, not by how long it takes
    for name, request in (("longer document", dict(document=DOC + " " + DOC)), ("more tokens", dict(max_new_tokens=240)),
                          ("fewer methods", dict(race=())), ("long output", dict(max_new_tokens=2048))):
        spaces.asked.clear()
        click(instant, **request)
        asked[name] = spaces.asked[0]
    assert asked["longer document"] > spaces_default(prompt) and asked["more tokens"] > spaces_default(prompt)
    assert asked["fewer methods"] < spaces_default(prompt)
    assert asked["long output"] == 120  # capped at the default grant


def test_results_are_those_of_the_undecorated_path(spaces, monkeypatch):
    """The fake engine's runs, event for event (timings aside), with and without the grant; only the step mode a run
    reports differs: static on ZeroGPU where SpecExtend's preset would capture steps."""
    factory = fake_factory(step_s=0.0)
    _, granted = click(studio_for(factory))
    monkeypatch.delenv("SPACES_ZERO_GPU")
    _, plain = click(studio_for(factory))
    assert len(spaces.asked) == 1 and list(granted.job.runs) == list(plain.job.runs)
    for method, events in plain.job.runs.items():
        assert [essence(e) for e in granted.job.runs[method]] == [essence(e) for e in events]
    steps = lambda state, m: state.job.runs[m][0].config["attention"]["steps"]  # noqa: E731
    assert steps(granted, "specextend") == "static" and steps(plain, "specextend") == "auto"
    assert steps(granted, "speculative") == steps(plain, "speculative") == "eager"  # the baseline is left as it is


def test_the_real_engine_on_tiny_models_writes_the_same_tokens_through_the_grant(spaces, monkeypatch, llama_pair):
    """Real events cross the boundary (pickled), static steps included, and every run writes the tokens it writes off
    ZeroGPU (greedy: the target's own output)."""
    factory = tiny_factory(llama_pair)
    _, granted = click(studio_for(factory), SMALL_DOC, max_new_tokens=24, top_k=4)
    monkeypatch.delenv("SPACES_ZERO_GPU")
    _, plain = click(studio_for(factory), SMALL_DOC, max_new_tokens=24, top_k=4)
    assert not granted.job.error and not plain.job.error and len(spaces.asked) == 1
    kinds = {type(e).__name__ for events in granted.job.runs.values() for e in events}
    assert {"Started", "Prefilled", "Drafted", "Verified", "Retrieved", "Finished"} <= kinds
    for method, events in plain.job.runs.items():
        mine = granted.job.runs[method][-1]
        assert mine.token_ids == events[-1].token_ids and len(mine.token_ids) == 24, method
        assert mine.stop_reason == events[-1].stop_reason == "max_new_tokens"


def test_stop_crosses_the_boundary_and_ends_the_run_as_the_engine_ends_it(spaces):
    studio = studio_for(fake_factory(step_s=0.02))
    state = SessionState()
    stream = studio.run(state, DOC, "Summarize.", BUNDLED, "specextend", ["autoregressive"], "0", 240)
    next(stream)
    while not state.job.runs.get("specextend"):
        time.sleep(0.01)
    studio.stop(state)
    last = list(stream)[-1]
    assert "Stopped, as asked" in html.unescape(last[0])
    ended = state.job.runs["specextend"][-1]
    assert type(ended).__name__ == "Finished" and ended.stop_reason == "stopped" and len(ended.token_ids) < 240
    assert list(state.job.runs) == ["specextend"]  # the race's next run never started


def test_a_stop_flag_is_a_file_that_pickles(tmp_path):
    flag = pickle.loads(pickle.dumps(StopFlag(str(tmp_path / "stop"))))
    assert not flag.is_set()
    StopFlag(str(tmp_path / "stop")).set()
    assert flag.is_set()


def test_the_grant_is_asked_for_with_the_visitors_request(spaces):
    """The run's thread carries the click's context, so `spaces` sees the visitor's request (their quota, their
    priority), not none."""
    from gradio.context import LocalContext

    visitor = object()
    token = LocalContext.request.set(visitor)
    try:
        click(studio_for(fake_factory(step_s=0.0)), race=())
    finally:
        LocalContext.request.reset(token)
    assert spaces.requests == [visitor]


@pytest.mark.parametrize("space", ["not a ZeroGPU Space", "spaces says no", "no spaces package"])
def test_nothing_is_decorated_off_zerogpu(spaces, monkeypatch, space):
    if space == "not a ZeroGPU Space":
        monkeypatch.delenv("SPACES_ZERO_GPU")
    elif space == "spaces says no":
        spaces.config.Config.zero_gpu = False
    else:
        monkeypatch.setitem(sys.modules, "spaces", None)
    factory, settings = fake_factory(step_s=0.0), Settings()
    assert zerogpu.adapt(factory, settings) == (factory, settings)
    messages, state = click(Studio(factory, settings))
    assert "Done." in messages[-1][0] and len(state.job.runs) == 3
    assert spaces.decorated == [] and spaces.asked == []


@pytest.mark.parametrize("request_, message", [
    (dict(document="   \n"), "The document is empty"),
    (dict(top_k=1), "top-k chunks kept = 1 leaves no room"),
    (dict(document=" ".join(["long"] * 2100)), "exceeds the model's limit of 2,048 positions"),
])
def test_bad_input_gets_a_message_and_asks_for_no_gpu(spaces, request_, message):
    studio = studio_for(fake_factory(step_s=0.0, max_positions=2048))
    messages, _ = click(studio, **request_)
    assert message in html.unescape(messages[-1][0])
    assert spaces.asked == []  # refused before any grant was asked for
    assert "Done." in click(studio, race=(), max_new_tokens=8)[0][-1][0]  # and the app keeps serving
    assert len(spaces.asked) == 1


def test_the_needle_tabs_head_picture_takes_its_own_grant_once_per_prompt(spaces):
    from dataclasses import replace

    from app import documents
    from specextend.tools.probe import HeadMap

    pictures = []
    factory = fake_factory(step_s=0.0)

    def with_heads(choice, progress):
        def heads(ids, span):
            pictures.append(len(ids))
            return HeadMap(((0.1, 0.9), (0.2, 0.3)), 32, {"default signal": ((1, 1),)})

        return replace(factory(choice, progress), heads=heads)

    studio = studio_for(with_heads)
    ask = dict(haystack=documents.samples()[0][1], length=8000, depth=50, seed=0, top_k=8, max_new_tokens=16,
               pair=BUNDLED)
    for _ in range(2):
        messages = list(studio.needle(SessionState(), **ask))
        assert "Done." in messages[-1][0]
    assert len(pictures) == 1  # drawn once for the same prompt and span, kept in the app's process
    heads_s, runs_s, _ = spaces.asked  # the picture's grant (one prefill), then each click's runs in one grant
    assert heads_s == estimate_seconds(pictures[0], 0, 1) and runs_s == estimate_seconds(pictures[0], 16, 3)


def test_a_zerogpu_space_serves_its_default_pair_loaded_before_serving(spaces):
    """The pair is loaded while the app is built, on the main thread (where `spaces` records the models' move to the
    GPU), its GPU functions are decorated before the app serves, and the page offers that pair alone."""
    loads = []
    factory = fake_factory()

    def recording(choice, progress):
        loads.append((choice.key, threading.current_thread() is threading.main_thread()))
        return factory(choice, progress)

    settings = Settings(pairs=(*BUNDLED_PAIRS, PRESETS["qwen2.5-7b"]), default_pair="qwen2.5-7b")
    demo = build_app(recording, settings)
    assert loads == [("qwen2.5-7b", True)] and len(spaces.decorated) == 1
    props = next(c for c in demo.get_config_file()["components"] if c.get("props", {}).get("elem_id") == "pair")["props"]
    assert [key for _, key in props["choices"]] == ["qwen2.5-7b"] and props["value"] == "qwen2.5-7b"


def test_the_grant_cap_is_an_operator_setting():
    assert Settings.from_env({}).zerogpu_max_s == 120
    assert Settings.from_env({"SPECEXTEND_ZEROGPU_MAX_S": "300"}).zerogpu_max_s == 300
    with pytest.raises(ValueError, match="SPECEXTEND_ZEROGPU_MAX_S must be at least 1"):
        Settings.from_env({"SPECEXTEND_ZEROGPU_MAX_S": "0"})
