"""The needle tab says what it shows: its own pair control; its layer x head picture kept by target and input (a switch
to another pair of the same target on the same input draws none); from the runs just made, whether the draft's
guesses changed between its caches, and why not where they did not; "stopped" where a run was stopped, never
"does not contain it". On the fake engine and made-up events (no model)."""

from __future__ import annotations

import html
import threading
from dataclasses import replace

import pytest

from app import Settings
from app.settings import BUNDLED, BUNDLED_DRAFT_MODEL, BUNDLED_PAIRS, PairChoice
from app.studio import SessionState, Studio
from specextend.config import GenerationConfig
from specextend.events import Started
from specextend.tools.probe import HeadMap
from visualizers import answer_html, guesses_html
from visualizers.common import segments
from visualizers.needle import guesses

from fixtures.fake_engine import WordTokenizer, fake_factory, fake_generate

PROMPT = [*range(1, 301)]  # token i reads "w{i}x": no word is part of another
TOKENIZER = WordTokenizer()
for i in PROMPT:
    TOKENIZER._id(f" w{i}x")


def text(ids) -> str:
    return TOKENIZER.decode(ids).strip()


def run(method: str = "specextend", seed: int = 0, draft: str = "draft model", stop: bool = False, **changes) -> list:
    """A made-up run on PROMPT: its events, its Started naming `draft`; `stop`: stopped during its prefill."""
    config = GenerationConfig(method=method, max_new_tokens=24, seed=seed, **changes)
    events = list(fake_generate(PROMPT, config, threading.Event() if not stop else _set()))
    return [replace(e, draft_name=draft) if isinstance(e, Started) else e for e in events]


def _set() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


def positions(events, kind: str) -> list[int]:
    """Output positions whose token came from `kind` ('accepted': the draft's guess, 'bonus': the target's own)."""
    out, at = [], 0
    for k, ids, _ in segments(events):
        out += list(range(at, at + len(ids))) if k == kind else []
        at += len(ids)
    return out


def answers_of(message: tuple) -> str:
    """The answers panel of a needle click's message (the table under its grid)."""
    return next(value for value in message if isinstance(value, str) and "Expected answer" in value)


def word_at(events, position: int) -> str:
    return text([[e for e in events if type(e).__name__ == "Finished"][-1].token_ids[position]])


@pytest.mark.parametrize("draft,why", [("draft model", "does not read the needle back out of its cache"),
                                       ("EAGLE-3 head", "drafts from the target's own hidden states")])
def test_runs_whose_guesses_did_not_change_say_so_and_why(draft, why):
    same = run(draft=draft)
    runs = {"specextend": same, "specextend_paper": same, "streaming": run("streaming", draft=draft)}
    value = word_at(same, positions(same, "bonus")[0])  # a value the target wrote itself
    said = html.unescape(guesses_html(runs, text, value))
    assert "Not in these runs" in said and f"The {draft} proposed the very same tokens at every one of" in said
    assert "no token of the needle's value was the draft's guess under any cache" in said
    assert why in said and "GPU presets" in said  # why, and where the paper's effect is expected


def test_guesses_that_changed_where_the_target_kept_none_of_them_are_told_apart():
    """Proposals that differ only in guesses the target rejected: what the target kept did not change."""
    cmr = run()
    step = next(v.step for v in cmr if type(v).__name__ == "Verified" and v.num_accepted < 4)
    other = [replace(e, tokens=tuple(t + 1000 if i >= 3 else t for i, t in enumerate(e.tokens)))
             if type(e).__name__ == "Drafted" and e.step == step else e for e in cmr]
    said = html.unescape(guesses_html({"specextend": cmr, "streaming": other}, text, "w999x"))
    assert "Not in what the target kept." in said and "at 1 of" in said, said
    assert "no run's answer contains the needle's value" in said


def test_runs_whose_guesses_changed_say_which_and_count_the_drafts_tokens_in_the_value():
    cmr, streaming = run(seed=1), run("streaming", seed=7)
    hit = positions(cmr, "accepted")[0]
    value = word_at(cmr, hit)  # a token of the value was CMR's draft's accepted guess
    assert guesses("specextend", cmr, text, value).in_value == 1
    assert guesses("specextend", cmr, text, value).value == 1
    said = html.unescape(guesses_html({"specextend": cmr, "streaming": streaming}, text, value))
    assert "Yes." in said and "Tokens per step:" in said
    assert "inside the needle's value the target kept the draft's own guesses under" in said
    assert "Not in" not in said


def test_a_stopped_run_says_stopped_in_every_cell():
    stopped = run(stop=True)  # stopped during its prefill: no answer, no step
    runs = {"specextend": run(), "streaming": stopped}
    table = answer_html(runs, text, "w999x", (10, 20))
    row = table.split("<tr>")[-1]
    assert "does not contain it" not in row and row.count(">stopped") == 5, row  # every cell but the run's name
    said = guesses_html(runs, text, "w999x")
    assert "Stopped" in said and "Not in" not in said and "Yes." not in said


def test_a_needle_click_stopped_says_stopped_and_compares_nothing():
    studio = Studio(fake_factory(step_s=0.05), Settings())
    state = SessionState()
    stream = studio.needle(state, "hamlet_opening", 4000, 50, 0, 8, 200, BUNDLED)
    next(stream)
    next(stream)
    studio.stop(state)
    last = list(stream)[-1]
    assert "Stopped, as asked" in html.unescape(last[0])
    answers = answers_of(last)
    assert "does not contain it" not in answers and ">stopped" in answers
    assert "not said" in answers and "Did the draft's cache change" not in answers


def test_a_finished_needle_click_reports_whether_the_guesses_changed():
    studio = Studio(fake_factory(step_s=0.0), Settings())
    *_, last = studio.needle(SessionState(), "hamlet_opening", 4000, 50, 0, 8, 12, BUNDLED)
    assert "Done." in last[0] and "Did the draft's cache change its guesses?" in answers_of(last)


def test_the_layer_x_head_picture_is_kept_by_target_and_input_not_by_pair():
    """Two pairs with one target share the picture on the same input; another input, or another target, draws anew."""
    drawn = []
    factory = fake_factory(step_s=0.0)
    other = PairChoice("other", "another target + draft", "someone/target", "someone/draft")

    def with_heads(choice, progress):
        def heads(ids, span):
            drawn.append((choice.key, len(ids), span))
            return HeadMap(((0.1, 0.9), (0.2, 0.3)), 32, {"default signal": ((1, 1),)})

        return replace(factory(choice, progress), heads=heads, heads_key="the same target" if choice.bundled else "")

    studio = Studio(with_heads, Settings(pairs=(*BUNDLED_PAIRS, other)))
    ask = dict(haystack="hamlet_opening", length=4000, depth=50, seed=0, top_k=8, max_new_tokens=8)
    for pair in (BUNDLED, BUNDLED_DRAFT_MODEL, BUNDLED):
        assert "Done." in list(studio.needle(SessionState(), **ask, pair=pair))[-1][0]
    assert [key for key, _, _ in drawn] == [BUNDLED]  # drawn once for the target, whichever pair asked
    assert "Done." in list(studio.needle(SessionState(), **{**ask, "depth": 20}, pair=BUNDLED_DRAFT_MODEL))[-1][0]
    assert "Done." in list(studio.needle(SessionState(), **ask, pair="other"))[-1][0]
    assert [key for key, _, _ in drawn] == [BUNDLED, BUNDLED_DRAFT_MODEL, "other"]


def test_the_needle_tab_has_its_own_pair_control():
    """The needle click reads the pair from the needle tab's control, not from the other tab's."""
    from app import build_app

    demo = build_app(fake_factory(step_s=0.0), Settings())
    config = demo.config
    ids = {c["id"]: c["props"].get("elem_id") for c in config["components"]}
    needle = next(d for d in config["dependencies"] if d.get("api_name") == "needle")
    inputs = [ids[i] for i in needle["inputs"]]
    assert "needle-pair" in inputs and "pair" not in inputs


@pytest.mark.parametrize("refuse", ["settings", "input"])
def test_a_refused_needle_click_leaves_no_earlier_click_on_the_page(refuse):
    """Nonsense settings (refused before a job) or a haystack longer than the pair allows (refused by the job):
    the status says why, and the grid, the answers, the picture and the strips say nothing ran, not the last click's."""
    studio = Studio(fake_factory(max_positions=600), Settings())
    state = SessionState()
    earlier = list(studio.needle(state, "hamlet_opening", 1500, 50, 0, 8, 24, BUNDLED))[-1]
    assert "Expected answer" in answers_of(earlier)
    depth, chars = (150, 1500) if refuse == "settings" else (50, 20000)
    last = list(studio.needle(state, "hamlet_opening", chars, depth, 0, 8, 24, BUNDLED))[-1]
    status = html.unescape(last[0])
    assert ("needle depth" in status) if refuse == "settings" else ("longer" in status or "token" in status), status
    said = repr(last)
    assert "Expected answer" not in said and said.count("nothing ran: the status says why") == 5, said[:2000]
    assert "Nothing was generated" in said
    assert not any(isinstance(v, dict) for v in last)  # figures go out serialised, as every other answer's
