"""Put the Studio on a Hugging Face Space: the files a Space runs, in one commit, with the Space's README written as
space/header.yml's front matter followed by README.md.

    python scripts/space_upload.py USER/SPACE --dry-run   # the files and their total size; nothing is sent
    python scripts/space_upload.py USER/SPACE             # create the Space where it is missing, then upload
    python scripts/space_upload.py USER/SPACE --prune     # also delete the Space's files that this upload lacks

The token is HF_TOKEN's, or a saved login's (`hf auth login`). The files are those git holds or would add (tracked,
and untracked ones .gitignore leaves in) less IGNORE: tests, docs/results, caches, environments, the GPU carry.
huggingface_hub stores the weights and the other large or binary files with LFS/Xet by itself, so no git LFS setup
is needed (a git push to a Space is refused for binaries over 10 MiB outside LFS, and this history holds some).
Knows files, git and huggingface_hub; imports nothing of the project.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADER = Path("space") / "header.yml"
README = "README.md"
# what a Space does not run: patterns as huggingface_hub applies them (fnmatch on the path; a trailing / is a folder)
IGNORE = [
    "tests/", "docs/results/", "results/", "test-output/", "cache/",  # tests, measurements, local outputs
    ".venv/", ".whl/", ".gl/", ".ci/", "space/",  # environments, the GPU carry, CI, the header (it is in README.md)
    ".git/", ".pytest_cache/", ".hypothesis/", ".ruff_cache/", "__pycache__/", "*/__pycache__/*", "*.pyc",
]
MIB = 2**20


def candidates(root: Path) -> list[str]:
    """The files git holds or would add under `root` (relative, sorted); every file where `root` is no git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                             capture_output=True, check=True).stdout.decode()
        paths = out.split("\0")
    except (OSError, subprocess.CalledProcessError):
        paths = [p.relative_to(root).as_posix() for p in root.rglob("*")]
    return sorted({p for p in paths if p and (root / p).is_file()})  # a file deleted but not yet committed goes not


def file_set(root: Path = ROOT) -> list[str]:
    """The Space's files: the candidates less IGNORE (and huggingface_hub's own defaults), README.md included."""
    from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

    return list(filter_repo_objects(candidates(root), ignore_patterns=IGNORE + DEFAULT_IGNORE_PATTERNS))


def space_readme(root: Path = ROOT) -> str:
    """The Space's README.md: the header's YAML (its comment lines left out) as front matter, then README.md."""
    header = [line for line in (root / HEADER).read_text().splitlines() if not line.startswith("#")]
    readme = (root / README).read_text()
    if readme.startswith("---\n"):
        raise ValueError(f"{README} has front matter of its own; the Space's lives in {HEADER}")
    return "---\n" + "\n".join(header).strip() + "\n---\n\n" + readme


def sizes(root: Path, files: list[str]) -> dict[str, int]:
    """Each file's size in bytes as uploaded (README.md: the Space's version)."""
    return {f: len(space_readme(root).encode()) if f == README else (root / f).stat().st_size for f in files}


def stage(root: Path, files: list[str], into: Path) -> None:
    """Copy `files` into `into`, README.md as the Space's."""
    for name in files:
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if name == README:
            target.write_text(space_readme(root))
        else:
            shutil.copy2(root / name, target)


def dry_run(root: Path = ROOT) -> str:
    """What an upload would send: each file, largest first, and the total."""
    by_size = sorted(sizes(root, file_set(root)).items(), key=lambda item: (-item[1], item[0]))
    total = sum(size for _, size in by_size)
    lines = [f"{size / MIB:9.2f} MiB  {name}" for name, size in by_size]
    return "\n".join(lines + [f"{len(by_size)} files, {total / MIB:.2f} MiB in all"])


def upload(repo_id: str, root: Path = ROOT, private: bool = False, prune: bool = False,
           message: str = "Upload SpecExtend Studio") -> str:
    """Create the Space where it is missing (Gradio SDK) and upload the file set in one commit; the commit's URL."""
    from huggingface_hub import HfApi, get_token

    if get_token() is None:
        raise SystemExit("No Hugging Face token: set HF_TOKEN, or log in with `hf auth login`, then run this again.")
    files = file_set(root)
    api = HfApi()
    api.create_repo(repo_id, repo_type="space", space_sdk="gradio", private=private, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        stage(root, files, Path(folder))
        commit = api.upload_folder(repo_id=repo_id, repo_type="space", folder_path=folder, ignore_patterns=IGNORE,
                                   delete_patterns=["*"] if prune else None, commit_message=message)
    return str(getattr(commit, "commit_url", commit))


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("repo_id", help="the Space, as user/name or org/name")
    p.add_argument("--dry-run", action="store_true", help="print the files and their total size; send nothing")
    p.add_argument("--private", action="store_true", help="create the Space private (an existing one keeps its own)")
    p.add_argument("--prune", action="store_true", help="delete the Space's files that this upload does not hold")
    p.add_argument("--message", default="Upload SpecExtend Studio", help="the commit message")
    args = p.parse_args(argv)
    if args.dry_run:
        print(dry_run(root))
        return 0
    print(upload(args.repo_id, root, args.private, args.prune, args.message))
    return 0


if __name__ == "__main__":
    sys.exit(main())
