"""The bundled target for a GPU call that trains the head: its GGUF file (98.4 MB, 93.8 MiB) is larger than a call may
carry (64 MiB with the tree), so it travels in parts over consecutive calls to one warm machine (each call within the
machine's idle window of the last), is joined there and checked against its pinned sha256; the training script reads
the GGUF file itself (`--target FILE.gguf`: dequantized on load, as the bundled target is prepared).

  python -m scripts.head_gpu split              # here: cache/gpu-target/part-N of bundled.target_gguf's file
  python -m scripts.head_gpu join DIR FILE      # there: DIR's parts joined into FILE, its sha256 checked

Knows files and parts; the pinned file, its download and its hash are specextend.tools.bundled's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specextend.tools.bundled import GGUF_SHA256, file_sha256, target_gguf

PARTS = Path("cache/gpu-target")
MIB = 1 << 20
PART_MIB = 22  # a part beside a tree of up to ~40 MiB stays under a call's 64 MiB
FIRST_MIB = 6  # the part that travels with the wheels and the corpus's ids


def split(folder: Path = PARTS) -> list[Path]:
    """The bundled target's GGUF file (`bundled.target_gguf`: kept in cache/, checked) in parts: FIRST_MIB, then
    PART_MIB each."""
    gguf = target_gguf(Path("cache"))
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    with gguf.open("rb") as src:
        size = FIRST_MIB
        while chunk := src.read(size * MIB):
            parts.append(folder / f"part-{len(parts)}")
            parts[-1].write_bytes(chunk)
            size = PART_MIB
    return parts


def join(folder: Path, out: Path) -> Path:
    """`folder`'s parts, in order, as one file, checked against the pinned sha256."""
    parts = sorted(folder.glob("part-*"), key=lambda p: int(p.name.split("-")[1]))
    with out.open("wb") as f:
        for part in parts:
            f.write(part.read_bytes())
    if file_sha256(out) != GGUF_SHA256:
        raise SystemExit(f"{out} (from {len(parts)} parts) does not have the pinned sha256 {GGUF_SHA256}: a part is "
                         "missing or damaged")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("split", "join"))
    p.add_argument("paths", nargs="*", type=Path)
    args = p.parse_args(argv)
    if args.what == "join":
        print(join(*args.paths))
        return
    for part in split():
        print(f"{part}: {part.stat().st_size / MIB:.1f} MiB")


if __name__ == "__main__":
    main()
