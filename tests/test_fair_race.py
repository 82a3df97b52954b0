"""A fair race by construction: every drafting method of one click drafts from the same sources (the pair's draft, and
lookup in all of them or in none), what each run's Started event records; the speed table then states the paper's
comparison (SpecExtend over standard speculative decoding, the same draft and sources) and names what each ratio
compares, and the page's words about the race say so. Runs on the fake engine (no model)."""

from __future__ import annotations

import html

import pytest

from app import Settings
from app.settings import BUNDLED
from app.studio import SessionState, Studio
from specextend.events import Started

from fixtures.fake_engine import fake_factory

DOC = " ".join(f"word{i}" for i in range(1200))
RACE = ["speculative", "lookup", "autoregressive"]


@pytest.fixture(scope="module")
def studio():
    return Studio(fake_factory(step_s=0.0), Settings())


def race(studio, lookup: bool) -> tuple[dict, str]:
    """One click's race on the defaults but `lookup`: the runs' Started configs by method, and the speed table."""
    state = SessionState()
    *_, last = studio.run(state, DOC, "Summarize.", BUNDLED, "specextend", RACE, "0", max_new_tokens=24, top_k=6,
                          lookup=lookup)
    assert "Done." in last[0], last[0]
    began = {m: next(e for e in events if isinstance(e, Started)) for m, events in state.job.runs.items()}
    readout = next(v for v in last if isinstance(v, str) and "tokens/s (incl. prefill)" in v)  # the speed table
    return began, html.unescape(readout)


@pytest.mark.parametrize("lookup", [True, False])
def test_every_drafting_method_drafts_from_the_same_sources(studio, lookup):
    began, readout = race(studio, lookup)
    assert list(began) == ["specextend", *RACE]
    drafting = {m: bool(b.config["lookup"]["enabled"]) for m, b in began.items() if b.draft_layers > 0}
    assert drafting == {"specextend": lookup, "speculative": lookup}  # the same sources in both
    assert {b.draft_name for m, b in began.items() if m in drafting} == {"draft model"}  # the same draft
    assert not began["autoregressive"].config["lookup"]["enabled"]
    both = "both with lookup" if lookup else "both without lookup"
    # the headline: the paper's comparison with a ratio, named for what it compares; beside it, over the target alone
    assert f"SpecExtend over standard speculative decoding, {both}, the same draft model: " in readout, readout
    headline, table = readout.split("<table", 1)
    assert "over the target alone:" in headline and "not comparable" not in headline
    assert "speedup over standard speculative decoding, same draft and sources" in table
    row = next(r for r in table.split("<tr>") if "SpecExtend" in r)
    assert row.count("×") == 2 and "not comparable" not in row  # over the target alone, and over speculative


def test_the_page_says_what_the_race_compares():
    """The race control and the lookup control say that the race drafts from the same sources."""
    from app import build_app

    demo = build_app(fake_factory(step_s=0.0), Settings())
    props = {c["props"].get("elem_id"): c["props"] for c in demo.config["components"]}
    assert "the same draft and the same sources" in props["race"]["label"]
    assert "in the main run and in the race alike" in props["lookup"]["info"]
    intro = " ".join(c["props"].get("value") or "" for c in demo.config["components"] if c["type"] == "markdown")
    assert "every method that drafts uses the same draft and the same sources" in " ".join(intro.split())
