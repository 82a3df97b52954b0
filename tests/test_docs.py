"""The docs hold together: every section of docs/RESULTS.md is in its contents list (by its title and its GitHub
anchor), and every relative link in README.md and docs/*.md names a file that exists. Reads text only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "RESULTS.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text without its fenced code blocks (a `# comment` in a shell block is not a heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped but hyphens, spaces made hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_anchor_is_githubs():
    assert anchor("Compact weights (issue 38, CPU)") == "compact-weights-issue-38-cpu"
    assert anchor("Needle hold rate (50 needles each, depths 0.1-0.9)") == "needle-hold-rate-50-needles-each-depths-01-09"
    assert anchor("Where a captured step's time goes") == "where-a-captured-steps-time-goes"


def test_every_results_section_is_in_the_contents():
    text = prose(RESULTS.read_text())
    head, contents = text.split("\n## Contents\n", 1)
    contents, body = re.split(r"\n(?=## )", contents, maxsplit=1)
    sections = re.findall(r"^## (.+)$", body, flags=re.M)
    assert len(sections) >= 10 and "Compact weights (issue 38, CPU)" in sections
    listed = re.findall(r"^- \[(.+)\]\(#([^)]+)\)$", contents, flags=re.M)
    missing = [s for s in sections if (s, anchor(s)) not in listed]
    assert not missing, f"sections of docs/RESULTS.md missing from its contents (or with another anchor): {missing}"
    assert [s for s, _ in listed] == sections  # in the file's order


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_name_existing_files(doc):
    links = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose(doc.read_text()))
    local = [link for link in links if not re.match(r"[a-z][a-z0-9+.-]*:|#", link)]  # not a URL, not this file
    broken = [link for link in local if not (doc.parent / link.split("#")[0]).exists()]
    assert not broken, f"{doc.relative_to(ROOT)} links to files that do not exist: {broken}"
