"""Store model folders compactly: their weights as 8-bit blocks in one GGUF file, their tokenizer as their target's.

For each folder: `model.safetensors` becomes `model.gguf` (specextend.compact: matrices as Q8_0, dequantized on load;
norms, biases and a head's d2t/t2d maps exact) and the safetensors file is removed (`--keep` keeps it; a folder with
both loads the safetensors). With `--share-tokenizer`, a draft folder whose tokenizer maps the same strings to the same
ids as the bundled target's drops its tokenizer files and records that digest in its config (`shared_tokenizer`):
the pair then reads the target's tokenizer for it (specextend.models.read_pair). The training scripts write their
folders with the same functions.

  python -m scripts.compact_weights assets/models/smollm2-135m-draft assets/models/smollm2-135m-eagle3 --share-tokenizer
"""

from __future__ import annotations

import argparse
import json
from functools import lru_cache
from pathlib import Path

import torch

from specextend import compact
from specextend.models import SHARED_TOKENIZER
from specextend.tools import bundled
from specextend.vocab import tokenizer_digest

ORDINARY = "model.safetensors"  # the weights file a compact one replaces
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model")


def write_weights(state: dict[str, torch.Tensor], folder: Path) -> Path:
    """`state` as `folder`'s compact weights; an ordinary weights file there is removed (the loader would prefer it)."""
    path = compact.write(state, folder / compact.COMPACT_FILE)
    (folder / ORDINARY).unlink(missing_ok=True)
    return path


def compact_folder(folder: Path, keep: bool = False) -> Path:
    """Rewrite `folder`'s model.safetensors as its compact file (removed unless `keep`)."""
    from safetensors.torch import load_file

    state = load_file(str(folder / ORDINARY))
    return compact.write(state, folder / compact.COMPACT_FILE) if keep else write_weights(state, folder)


@lru_cache(maxsize=4)
def target_digest(target: Path) -> str:
    """The digest of the tokenizer in folder `target` (vocab.tokenizer_digest)."""
    from transformers import AutoTokenizer

    return tokenizer_digest(AutoTokenizer.from_pretrained(str(target)))


def share_tokenizer(folder: Path, target: Path) -> bool:
    """Drop `folder`'s tokenizer files and record the target's tokenizer digest in its config, when its tokenizer has
    the target's ids (False, and nothing changed, when it has none or another)."""
    if not (folder / "tokenizer.json").is_file():
        return False
    digest = target_digest(target)
    if target_digest(folder) != digest:
        return False
    config = json.loads((folder / "config.json").read_text())
    config[SHARED_TOKENIZER] = digest
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        (folder / name).unlink(missing_ok=True)
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folders", nargs="+", type=Path, help="model folders holding model.safetensors")
    p.add_argument("--keep", action="store_true", help="keep model.safetensors beside the compact file")
    p.add_argument("--share-tokenizer", action="store_true",
                   help="drop a draft's tokenizer where it is the bundled target's (prepares the target if needed)")
    args = p.parse_args(argv)
    for folder in args.folders:
        before = (folder / ORDINARY).stat().st_size
        path = compact_folder(folder, args.keep)
        line = f"{folder}: {ORDINARY} {before / 1e6:.1f} MB -> {path.name} {path.stat().st_size / 1e6:.1f} MB"
        if args.share_tokenizer and share_tokenizer(folder, bundled.target_dir()):
            line += "; tokenizer: the target's"
        print(line)


if __name__ == "__main__":
    main()
