"""Every accepted token credited to its source: the draft (a draft model or an EAGLE head), a lookup's copy, or both.

A hand-built SpecExtend + lookup run in which, as in the Studio's default race, lookup's copies carry the run and the
draft's own guesses are rejected: the metrics, the acceptance panel, the retrieval panel's yield, the step sentence
and the speed table must each tell the two apart, and say when and why the draft sat out. Also: texts placed in
HTML attributes (the output's tooltips) survive apostrophes and quotes.
"""

from __future__ import annotations

import html
import re
from dataclasses import asdict, replace
from html.parser import HTMLParser

import pytest

from specextend.config import DraftConfig, LookupConfig, preset
from specextend.events import Drafted, Finished, Prefilled, Retrieved, Started, Verified
from specextend.metrics import (
    Yield, acceptance_by_position, acceptance_by_source, retrieval_yield, sat_out, step_tokens_by_source, summarize,
)
from visualizers import acceptance_spec, answer_html, far_html, output_html, retrieval_spec, throughput_html
from visualizers.steps import step_html

CONFIG = asdict(preset("specextend", lookup=LookupConfig(enabled=True, with_draft="always")))  # draft_gate 1.0
PROMPT = tuple(range(100, 164))  # four chunks of 16
SPANS = ((0, 16), (16, 32), (32, 48), (48, 64))


def decode(ids):
    return "".join(f" w{i}" for i in ids)


def lookup_run() -> list:
    """Six steps: 1 the draft's chain, all rejected; 2 lookup's branch (accepted) beside a draft node; 3 the draft
    gated off and lookup found nothing; 4 the draft gated off, lookup's first copy accepted, its second not; 5 a node
    both proposed, accepted; 6 no room left (no Drafted). The retrieval after prefill reaches back (chunk 1); the one
    after step 2 keeps the sink and the newest chunks only."""
    gate = {"sat_out": "gate", "recent": (0, 0, 0, 0)}
    return [
        Started(0.0, 0.0, "specextend", PROMPT, CONFIG, 3, 1, "cpu", "float32"),
        Prefilled(1.0, 0.9, 64, 0.6, 0.3, 5),
        Retrieved(1.1, 0.1, 0, "cmr", 64, 16, SPANS, (0.4, 0.3, 0.1, 0.2), (0, 1, 3), ((0, 32), (48, 64)), 48),
        Drafted(1.2, 0.1, 1, 64, (7, 8), (-1, 0), (0.5, 0.4), 2),
        Verified(1.3, 0.1, 1, 65, (), (False, False), 0, 9, (9,), 2),
        Drafted(1.4, 0.1, 2, 65, (10, 11, 12), (-1, 0, -1), (1.0, 1.0, 0.3), 1, ("lookup", "lookup", "draft"),
                (20, 21, -1), "", (0,)),
        Verified(1.5, 0.1, 2, 66, (0, 1), (True, True, False), 2, 13, (10, 11, 13), 5),
        Retrieved(1.6, 0.1, 2, "cmr", 67, 16, (*SPANS, (64, 67)), (0.4, 0.1, 0.1, 0.2, 0.2), (0, 3, 4),
                  ((0, 16), (48, 67)), 35),
        Drafted(1.7, 0.0, 3, 68, (), (), (), 0, (), (), **gate),
        Verified(1.8, 0.1, 3, 69, (), (), 0, 14, (14,), 6),
        Drafted(1.9, 0.0, 4, 69, (15, 21), (-1, 0), (1.0, 1.0), 0, ("lookup", "lookup"), (30, 31), **gate),
        Verified(2.0, 0.1, 4, 70, (0,), (True, False), 1, 16, (15, 16), 8),
        Drafted(2.1, 0.1, 5, 71, (17, 18), (-1, 0), (0.8, 0.2), 2, ("both", "draft"), (40, -1), "", (0, 0, 0, 1)),
        Verified(2.2, 0.1, 5, 72, (0,), (True, False), 1, 19, (17, 19), 10),
        Verified(2.3, 0.1, 6, 74, (), (), 0, 20, (20,), 11),
        Finished(2.4, 2.4, (5, 9, 10, 11, 13, 14, 15, 16, 17, 19, 20), "max_new_tokens", 6, 64),
    ]


def words(text: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", text.replace("<br>", " ")))


def test_the_metrics_credit_each_accepted_token_to_its_source():
    run = lookup_run()
    # the draft's nodes (its own or shared with a lookup): depth 1 in steps 1, 2, 5, accepted in 5 (both); depth 2 in
    # steps 1 and 5, never accepted. Lookup's: depth 1 in steps 2, 4, 5, all accepted; depth 2 in steps 2 and 4,
    # accepted in 2.
    assert acceptance_by_source(run) == {"draft": (1 / 3, 0.0), "lookup": (1.0, 0.5)}
    assert summarize(run).acceptance_by_source == acceptance_by_source(run)
    assert acceptance_by_position(run) == pytest.approx((3 / 4, 1 / 4))  # the two mixed, as before
    split = step_tokens_by_source(run)
    assert split == pytest.approx({"draft": 0.0, "lookup": 3 / 6, "both": 1 / 6, "target": 1.0})
    assert sum(split.values()) == pytest.approx(summarize(run).mean_accepted)
    # after prefill: the draft drafted in steps 1 and 2 and got none accepted (lookup's two copies do not count);
    # after step 2: it drafted only in step 5 (3 sat out, 4 was lookup's alone, 6 had no room) and got 1 accepted
    assert retrieval_yield(run) == [Yield(0, 0, 2, 2), Yield(2, 1, 1, 4)]
    assert [y.per_step for y in retrieval_yield(run)] == [0.0, 1.0]
    assert sat_out(run) == {"gate": 2, "on_miss": 0}


def test_the_acceptance_panel_splits_rates_and_tokens_by_source_and_says_why_the_draft_sat_out():
    spec = acceptance_spec(lookup_run(), decode)
    bars = {t["name"]: t["y"] for t in spec["data"] if t["type"] == "bar" and t["xaxis"] == "x2"}
    assert bars == {"the draft model": [1 / 3, 0.0], "lookup": [1.0, 0.5]}
    title = words(spec["layout"]["title"]["text"])
    assert "1.67 tokens committed per step: 0.00 the draft model's + 0.50 lookup's + 0.17 proposed by both + 1.00 " \
           "the target's" in title
    assert "The draft model sat out 2 of 6 steps, gated off for not paying" in title
    assert "its last 4 uses got 0, 0, 0, 0 token(s) accepted, 0.00 per use, below the gate of 1" in title


def test_the_reaching_back_yield_counts_only_the_drafts_own_tokens():
    run = lookup_run()
    far = words(far_html(run, decode))
    assert "accepted per step it drafted, after retrievals that reached back: 0.00 (1 retrievals; it drafted in 2 of " \
           "2 steps); after those that did not: 1.00 (1 retrievals; it drafted in 1 of 4 steps)" in far
    assert "Lookup's 3 accepted copies (the draft model did not propose them) are not counted here" in far
    assert "The draft model sat out 2 of 6 steps" in far
    column = next(t for t in retrieval_spec(run, decode)["data"] if t.get("mode") == "text")
    assert column["text"] == ["0.0", "1.0"]
    assert "0.00 of the draft model's own tokens per step it drafted (2 of 2 step(s)" in column["hovertext"][0]


def test_the_draft_drafting_in_no_step_served_is_said_not_averaged_as_zero():
    run = [e for e in lookup_run() if not (isinstance(e, (Drafted, Verified)) and e.step == 5)]
    assert retrieval_yield(run)[1] == Yield(2, 0, 0, 3)
    assert "after those that did not: – (it drafted in none of the 3 step(s) they served)" in words(far_html(run, decode))
    column = next(t for t in retrieval_spec(run, decode)["data"] if t.get("mode") == "text")
    assert column["text"] == ["0.0", "–"] and "drafted in none of the 3 step(s)" in column["hovertext"][1]


@pytest.mark.parametrize("step,said,unsaid", [
    (1, ["the draft model proposed 2 token(s) as a chain; the target kept none",
         "where the draft model had guessed “ w7 w8”"], ["lookup"]),
    (2, ["the draft model and lookup proposed 3 token(s) as a tree", "accepted 2, “ w10 w11” (2 copied by lookup)"],
     ["sat out"]),
    (3, ["nothing was drafted (lookup found no earlier occurrence of the newest tokens, and the draft model sat out, "
         "gated off for not paying: its last 4 uses got 0, 0, 0, 0 token(s) accepted, 0.00 per use, below the gate "
         "of 1), so the target wrote “ w14” itself"], ["no room"]),
    (4, ["lookup proposed 2 token(s)", "(1 copied by lookup)", "where lookup had guessed “ w21”",
         "the draft model sat out, gated off"], ["no room", "the draft model had guessed"]),
    (5, ["the draft model and lookup proposed 2 token(s)", "(1 proposed by both)", "where the draft model had guessed"],
     ["sat out"]),
    (6, ["nothing was drafted (no room was left before the token limit)"], ["sat out"]),
])
def test_a_step_in_words_credits_its_tokens_and_gives_the_real_reason_nothing_was_drafted(step, said, unsaid):
    text = words(step_html(lookup_run(), step, decode))
    for phrase in said:
        assert phrase in text
    for phrase in unsaid:
        assert phrase not in text


@pytest.mark.parametrize("lookup", [True, False])
def test_a_chain_ended_at_its_confidence_floor_is_said_as_the_draft_being_unsure(lookup):
    floored = asdict(preset("specextend", draft=DraftConfig(k=4, confidence_floor=0.15),
                            lookup=LookupConfig(enabled=lookup, with_draft="always")))
    run = [replace(e, config=floored) if isinstance(e, Started) else
           replace(e, sat_out="", recent=()) if isinstance(e, Drafted) and e.step == 3 else e for e in lookup_run()]
    text = words(step_html(run, 3, decode))
    unsure = "the draft model was unsure of the next token (no token reached its confidence floor of 0.15)"
    assert unsure in text and "sat out" not in text
    assert ("lookup found no earlier occurrence" in text) == lookup
    if lookup:  # lookup alone (no draft drafted) with a floor in its config: lookup's miss is the whole reason
        alone = [replace(e, method="lookup", draft_layers=0) if isinstance(e, Started) else e for e in run]
        text = words(step_html(alone, 3, decode))
        assert "lookup found no earlier occurrence" in text and "unsure" not in text


@pytest.mark.parametrize("step,who", [(1, "the draft model"), (4, "lookup")])
def test_the_outputs_struck_guess_names_who_guessed_it(step, who):
    parser = Titles()
    parser.feed(output_html(lookup_run(), decode, at_step=step))
    assert [t for css, t in parser.titles if css == "se-guess"] == [
        f"step {step}: {who} guessed this; the target wrote the last token of the step instead"]


def test_the_speed_tables_split_tokens_per_step_by_source():
    run = lookup_run()
    table = words(throughput_html({"specextend": run}))
    assert "tokens per step, by who proposed them" in table
    assert "1.67draft model 0.00 · lookup 0.50 · both 0.17 · target 1.00" in table
    answers = words(answer_html({"specextend": run}, decode, "w9"))  # the needle tab's table, the same split
    assert "tokens per step, by who proposed them" in answers and "draft model 0.00 · lookup 0.50" in answers


class Titles(HTMLParser):
    """Each element's class and title attribute, as a browser reads them, and the text."""

    def __init__(self) -> None:
        super().__init__()
        self.titles: list[tuple[str, str]] = []
        self.text = ""

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "title" in attrs:
            self.titles.append((attrs.get("class", ""), attrs["title"]))

    def handle_data(self, data):
        self.text += data


def test_output_tooltips_survive_apostrophes_and_quotes():
    name = 'O\'Neil\'s "big" head'  # a draft name with both kinds of quote
    run = [Started(0.0, 0.0, "speculative", (1, 2), {}, 3, 1, "cpu", "float32", name),
           Prefilled(1.0, 0.9, 2, 0.6, 0.3, 5),
           Drafted(1.2, 0.1, 1, 2, (7, 8), (-1, 0), (0.9, 0.2), 2),
           Verified(1.3, 0.1, 1, 3, (0,), (True, False), 1, 6, (7, 6), 3)]
    quoted = lambda ids: "".join(f"it's \"{i}\" " for i in ids)  # noqa: E731
    parser = Titles()
    parser.feed(output_html(run, quoted, at_step=1))
    assert ("se-target", "step 1: the target's token") in parser.titles  # the apostrophe no longer ends the title
    assert parser.titles == [
        ("se-target", "first token, from the prefill"),
        ("se-draft", f"step 1: 1 token(s) the {name} proposed, accepted"),
        ("se-focus", "step 1"),
        ("se-target", "step 1: the target's token"),
        ("se-focus", "step 1"),
        ("se-guess", f"step 1: the {name} guessed this; the target wrote the last token of the step instead"),
    ]
    assert quoted([5, 7, 6, 8]) in parser.text
