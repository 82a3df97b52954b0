"""Needle in a haystack: plant one fact in a long document and ask about it.

Pure text functions. A needle is a one-sentence fact ("The secret passphrase of Captain Blue is
amber-falcon-42."), inserted at a sentence boundary near a chosen depth (0.0 = start, 1.0 = end) of a
document, with a question whose answer is the fact's value. Knows nothing of tokenizers or models.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

__all__ = [
    "TEMPLATES",
    "NeedleTemplate",
    "Needle",
    "sentence_boundaries",
    "plant",
    "make_needle",
    "generate",
]


@dataclass(frozen=True)
class NeedleTemplate:
    """A fact pattern with slots {subject} and {value}, and its question about {subject}."""

    name: str
    fact: str
    question: str


TEMPLATES: tuple[NeedleTemplate, ...] = (
    NeedleTemplate("passphrase", "The secret passphrase of {subject} is {value}.",
                   "What is the secret passphrase of {subject}?"),
    NeedleTemplate("number", "The magic number of {subject} is {value}.",
                   "What is the magic number of {subject}?"),
    NeedleTemplate("city", "{subject} keeps the hidden key in the city of {value}.",
                   "In which city does {subject} keep the hidden key?"),
    NeedleTemplate("colour", "The favourite colour of {subject} is {value}.",
                   "What is the favourite colour of {subject}?"),
)

SUBJECTS = ("Captain Blue", "the old ferryman", "Lady Marlowe", "the clockmaker of Ghent", "Doctor Pym",
            "the lighthouse keeper", "Master Thornbury", "the gardener Anselm")
WORDS = ("amber", "falcon", "cobalt", "willow", "ember", "harbor", "quartz", "meadow", "lantern", "orchid",
         "granite", "saffron", "thistle", "comet", "juniper", "marble")
CITIES = ("Lisbon", "Tallinn", "Valparaiso", "Kyoto", "Marrakesh", "Reykjavik", "Cartagena", "Odessa")
COLOURS = ("turquoise", "vermilion", "ochre", "lavender", "teal", "crimson", "indigo", "chartreuse")


@dataclass(frozen=True)
class Needle:
    """A document with one planted fact, the question about it, and where the fact sits."""

    document: str
    question: str
    answer: str
    fact: str
    span: tuple[int, int]  # [start, end) character offsets of the fact sentence in `document`
    depth: float  # the depth asked for, in [0, 1]
    template: str

    @property
    def actual_depth(self) -> float:
        """Where the fact really starts, as a fraction of the document's length."""
        return self.span[0] / max(1, len(self.document))


_BOUNDARY = re.compile(r"(?<=[.!?;:])[\"')\]]*(?=\s)|\n\s*\n")


def sentence_boundaries(text: str) -> list[int]:
    """Character offsets where a new sentence may start: 0, after sentence-ending punctuation
    (with any closing quotes or brackets) followed by whitespace, at blank lines, and len(text)."""
    points = {0, len(text)}
    for m in _BOUNDARY.finditer(text):
        end = m.end()
        while end < len(text) and text[end] in " \t":
            end += 1
        points.add(end)
    return sorted(points)


def plant(text: str, fact: str, depth: float) -> tuple[str, tuple[int, int]]:
    """Insert `fact` at the sentence boundary nearest to `depth` (a fraction of len(text)).

    Returns the new text and the [start, end) span of the fact in it. The original text is kept
    whole: at most one space is added on each side of the fact, only where the neighbouring
    character is not already whitespace, so removing the fact and those spaces gives it back.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    fact = fact.strip()
    if not fact:
        raise ValueError("the fact must not be empty")
    target = depth * len(text)
    at = min(sentence_boundaries(text), key=lambda p: (abs(p - target), p))
    before, after = text[:at], text[at:]
    sep_before = "" if not before or before[-1].isspace() else " "
    sep_after = "" if not after or after[0].isspace() else " "
    start = len(before) + len(sep_before)
    new = before + sep_before + fact + sep_after + after
    return new, (start, start + len(fact))


def make_needle(template: NeedleTemplate, rng: random.Random) -> tuple[str, str, str]:
    """(fact, question, answer) for one template with random subject and value."""
    subject = rng.choice(SUBJECTS)
    if template.name == "passphrase":
        value = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-{rng.randint(10, 99)}"
    elif template.name == "number":
        value = str(rng.randint(1000, 99999))
    elif template.name == "city":
        value = rng.choice(CITIES)
    elif template.name == "colour":
        value = rng.choice(COLOURS)
    else:
        value = f"{rng.choice(WORDS)}-{rng.randint(10, 99)}"
    fact = template.fact.format(subject=subject, value=value)
    fact = fact[0].upper() + fact[1:]
    question = template.question.format(subject=subject)
    return fact, question, value


def generate(text: str, depth: float, seed: int = 0, template: str | None = None) -> Needle:
    """Plant one random fact (seeded) in `text` near `depth`; `template` picks one by name."""
    rng = random.Random(seed)
    if template is None:
        chosen = rng.choice(TEMPLATES)
    else:
        matches = [t for t in TEMPLATES if t.name == template]
        if not matches:
            raise ValueError(f"unknown needle template {template!r}; known: {[t.name for t in TEMPLATES]}")
        chosen = matches[0]
    fact, question, answer = make_needle(chosen, rng)
    document, span = plant(text, fact, depth)
    return Needle(document=document, question=question, answer=answer, fact=fact, span=span,
                  depth=depth, template=chosen.name)
