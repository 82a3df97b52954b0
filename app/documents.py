"""Documents coming in: uploads checked (type, size, binary, UTF-8, empty) and the bundled samples listed.
Every refusal is a DocumentError whose message is shown to the user as is. Knows nothing of gradio.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

ALLOWED_SUFFIXES = (".txt", ".md")


class DocumentError(ValueError):
    """A document the app will not use, with a message meant for the user."""


def read_upload(path: str | Path, max_bytes: int, max_chars: int | None = None) -> str:
    """The text of an uploaded .txt/.md file, or a DocumentError saying what is wrong with it."""
    path = Path(path)
    if path.suffix.lower() not in ALLOWED_SUFFIXES:
        raise DocumentError(f"“{path.name}” is not a .txt or .md file; upload plain text or Markdown.")
    size = path.stat().st_size
    if size > max_bytes:
        raise DocumentError(
            f"“{path.name}” is {size / 1024:,.0f} KB; this server accepts documents up to {max_bytes / 1024:,.0f} KB."
        )
    data = path.read_bytes()
    wide = wide_encoding(data)
    if wide:
        raise DocumentError(f"“{path.name}” is {wide} text; save it as UTF-8 and upload again.")
    if b"\x00" in data:
        raise DocumentError(f"“{path.name}” looks like a binary file (it contains NUL bytes), not text.")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DocumentError(
            f"“{path.name}” is not valid UTF-8 (byte {exc.start} cannot be decoded); save it as UTF-8 and upload again."
        ) from None
    return check_text(text, max_bytes if max_chars is None else max_chars)


BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
        (b"\xfe\xff", "UTF-16"))


def wide_encoding(data: bytes) -> str:
    """"UTF-16" or "UTF-32" when the bytes are text in that encoding (by its byte-order mark, or for mostly-ASCII
    text by the NUL bytes between its characters); "" otherwise."""
    for bom, name in BOMS:
        if data.startswith(bom):
            return name
    head = data[:4096]
    if len(head) >= 8:
        quads = [head[i : i + 4] for i in range(0, len(head) - 3, 4)]
        if sum(q[1:] == b"\x00\x00\x00" or q[:3] == b"\x00\x00\x00" for q in quads) > 0.9 * len(quads):
            return "UTF-32"
        pairs = [head[i : i + 2] for i in range(0, len(head) - 1, 2)]
        if sum(p[1:] == b"\x00" or p[:1] == b"\x00" for p in pairs) > 0.9 * len(pairs):
            return "UTF-16"
    return ""


def check_text(text: str, max_chars: int) -> str:
    """The document text if it has something to read and is not longer than `max_chars`, else a DocumentError.
    Checked before any tokenizing, so an oversized text costs nothing."""
    if not text or not text.strip():
        raise DocumentError("The document is empty: paste some text, upload a .txt/.md file, or pick a sample.")
    if len(text) > max_chars:
        raise DocumentError(f"The document is {len(text):,} characters; this server takes documents up to "
                            f"{max_chars:,} characters. Shorten it or upload a shorter file.")
    return text


MIN_DOCUMENT_WORDS = 20  # the long-input workload reads a document: fewer words than this is not one


def check_long_input(text: str) -> str:
    """The text, if it is long enough to be read as a document (the long-input workload), else a DocumentError."""
    words = len(text.split())
    if words < MIN_DOCUMENT_WORDS:
        raise DocumentError(f"The document is {words} word{'s' * (words != 1)} long: the long-input workload reads a "
                            f"document of at least {MIN_DOCUMENT_WORDS} words and answers about it (pick a sample, paste "
                            "or upload one). For a short prompt written on at length, choose the long-output workload.")
    return text


def samples() -> list[tuple[str, str]]:
    """(label, name) of the bundled sample documents; empty if the assets are not there."""
    from specextend.tools.bundled import documents

    try:
        docs = documents()
    except (OSError, ValueError, KeyError):
        return []
    return [(f"{d.title} (~{d.tokens:,} tokens)", d.name) for d in docs]


def prompts() -> list[tuple[str, str]]:
    """(label, name) of the bundled long-output prompts; empty if the assets are not there."""
    from specextend.tools.bundled import short_prompts

    try:
        found = short_prompts()
    except (OSError, ValueError, KeyError):
        return []
    return [(p.title, p.name) for p in found]


def sample_prompt(name: str) -> tuple[str, str]:
    """A bundled long-output prompt's text and its instruction."""
    from specextend.tools.bundled import short_prompt

    found = short_prompt(name)
    return found.text(), found.instruction


def sample_text(name: str) -> str:
    from specextend.tools.bundled import document

    return document(name).text()


@lru_cache(maxsize=1)
def _sample_tokens() -> dict[str, int]:
    from specextend.tools.bundled import documents

    try:
        return {d.text(): d.tokens for d in documents()}
    except (OSError, ValueError, KeyError):
        return {}


def sample_tokens(text: str) -> int | None:
    """The token count the sample list shows, when `text` is a bundled sample as it is shipped: the document alone,
    counted with the bundled target's tokenizer (assets/documents/manifest.json); None for any other text."""
    return _sample_tokens().get(text)
