"""Documents coming in: uploads checked (type, size, binary, UTF-8, empty) and the bundled samples listed.
Every refusal is a DocumentError whose message is shown to the user as is. Knows nothing of gradio.
"""

from __future__ import annotations

from pathlib import Path

ALLOWED_SUFFIXES = (".txt", ".md")


class DocumentError(ValueError):
    """A document the app will not use, with a message meant for the user."""


def read_upload(path: str | Path, max_bytes: int) -> str:
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
    if b"\x00" in data:
        raise DocumentError(f"“{path.name}” looks like a binary file (it contains NUL bytes), not text.")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DocumentError(
            f"“{path.name}” is not valid UTF-8 (byte {exc.start} cannot be decoded); save it as UTF-8 and upload again."
        ) from None
    return check_text(text)


def check_text(text: str) -> str:
    """The document text if it has something to read, else a DocumentError."""
    if not text or not text.strip():
        raise DocumentError("The document is empty: paste some text, upload a .txt/.md file, or pick a sample.")
    return text


def samples() -> list[tuple[str, str]]:
    """(label, name) of the bundled sample documents; empty if the assets are not there."""
    from specextend.bundled import documents

    try:
        docs = documents()
    except (OSError, ValueError, KeyError):
        return []
    return [(f"{d.title} (~{d.tokens:,} tokens)", d.name) for d in docs]


def sample_text(name: str) -> str:
    from specextend.bundled import document

    return document(name).text()
