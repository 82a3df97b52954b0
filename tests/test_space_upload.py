"""The Space upload (scripts/space_upload.py): the file set a Space gets and its size, the Space's README written with
its front matter first, the upload's calls against a stand-in for huggingface_hub's HfApi, and the .gitattributes
that marks every binary file for those who push with git. No network."""

from __future__ import annotations

import subprocess
from pathlib import Path

import huggingface_hub
import pytest
import yaml

from scripts import space_upload

ROOT = Path(__file__).resolve().parents[1]


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def tree(tmp_path):
    """A small checkout: what a Space runs, what it does not, a file .gitignore leaves out and one nobody added."""
    files = {
        "app.py": "print('app')\n", "requirements.txt": "gradio==6.31.0\n", "README.md": "# Studio\n\nText.\n",
        "space/header.yml": "# a comment\ntitle: Studio\nsdk: gradio\nsdk_version: 6.31.0\napp_file: app.py\n",
        ".gitignore": "/.venv/\n/results/\n", ".gitattributes": "*.safetensors filter=lfs\n",
        "app/__init__.py": "", "app/__pycache__/x.cpython-311.pyc": "b", "specextend/engine.py": "x = 1\n",
        "assets/models/m/model.safetensors": "w" * 5000, "docs/APP.md": "app\n", "docs/results/run/bench.json": "{}",
        "tests/test_app.py": "def test(): pass\n", "scripts/gpu_proof.sh": "true\n", ".ci/run": "true\n",
        ".venv/lib/site.py": "", "results/gpu_proof/summary.md": "", ".whl/plotly-7.1.0-py3-none-any.whl": "z",
        "test-output/x.log": "", "cache/specextend/t": "", ".hypothesis/db": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-f", *[n for n in files if not n.startswith((".venv/", "results/"))])  # the rest: ignored
    (tmp_path / "app" / "new.py").write_text("y = 2\n")  # untracked, not ignored: git would add it
    return tmp_path


SPACE_FILES = [".gitattributes", ".gitignore", "README.md", "app.py", "app/__init__.py", "app/new.py",
               "assets/models/m/model.safetensors", "docs/APP.md", "requirements.txt", "scripts/gpu_proof.sh",
               "specextend/engine.py"]


def test_the_file_set_is_what_a_space_runs(tree):
    assert space_upload.file_set(tree) == SPACE_FILES


def test_this_trees_file_set_has_the_app_and_its_models_and_no_tests_or_results():
    files = space_upload.file_set(ROOT)
    for needed in ("app.py", "requirements.txt", "README.md", ".gitattributes", "app/__init__.py", "specextend/engine.py",
                   "visualizers/common.py"):
        assert needed in files
    assert any(f.startswith("assets/models/smollm2-135m-eagle3/") for f in files)
    assert any(f.startswith("assets/documents/") for f in files)
    left_out = ("tests/", "docs/results/", "results/", ".venv/", ".whl/", ".git/", "space/", "test-output/", "cache/")
    assert not [f for f in files if f.startswith(left_out) or "__pycache__" in f or f.endswith(".pyc")]
    assert set(files) <= set(git(ROOT, "ls-files", "--cached", "--others", "--exclude-standard").split("\n"))


def test_the_dry_run_lists_each_file_largest_first_with_the_total(tree, capsys):
    assert space_upload.main(["someone/studio", "--dry-run"], root=tree) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("MiB  assets/models/m/model.safetensors")
    assert sorted(line.split("MiB  ")[1] for line in lines[:-1]) == SPACE_FILES
    total = sum((tree / f).stat().st_size for f in SPACE_FILES if f != "README.md")
    total += len(space_upload.space_readme(tree).encode())
    assert lines[-1] == f"{len(SPACE_FILES)} files, {total / 2**20:.2f} MiB in all"


def test_the_spaces_readme_is_the_front_matter_then_the_readme(tree):
    text = space_upload.space_readme(tree)
    assert text == "---\ntitle: Studio\nsdk: gradio\nsdk_version: 6.31.0\napp_file: app.py\n---\n\n# Studio\n\nText.\n"
    (tree / "README.md").write_text("---\ntitle: x\n---\n# Studio\n")
    with pytest.raises(ValueError, match="front matter of its own"):
        space_upload.space_readme(tree)


def test_this_repositorys_space_config_runs_the_app_on_the_pinned_gradio():
    text = space_upload.space_readme(ROOT)
    _, front, rest = text.split("---\n", 2)
    config = yaml.safe_load(front)
    pins = dict(line.split("==") for line in (ROOT / "requirements.txt").read_text().splitlines() if "==" in line)
    assert config["sdk"] == "gradio" and config["app_file"] == "app.py" and (ROOT / config["app_file"]).is_file()
    assert str(config["sdk_version"]) == pins["gradio"]
    assert config["python_version"] == "3.11"
    assert "Qwen/Qwen2.5-7B-Instruct" in config["preload_from_hub"]
    assert rest == "\n" + (ROOT / "README.md").read_text()
    assert not (ROOT / "README.md").read_text().startswith("---")  # the page a person reads starts with its title


class StandInApi:
    """Records the calls the upload makes, and what the folder it uploads holds at that moment."""

    calls: list = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def upload_folder(self, **kwargs):
        folder = Path(kwargs["folder_path"])
        held = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        self.calls.append(("upload_folder", kwargs, held, (folder / "README.md").read_text()))
        return type("CommitInfo", (), {"commit_url": "https://huggingface.co/spaces/someone/studio/commit/abc"})()


@pytest.fixture
def hub(monkeypatch):
    StandInApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", StandInApi)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_stand_in")
    return StandInApi.calls


@pytest.mark.parametrize("prune", [False, True])
def test_the_upload_creates_the_space_and_sends_the_file_set_in_one_folder(tree, hub, prune, capsys):
    argv = ["someone/studio"] + (["--prune"] if prune else [])
    assert space_upload.main(argv, root=tree) == 0
    assert capsys.readouterr().out.strip() == "https://huggingface.co/spaces/someone/studio/commit/abc"
    (create, upload) = hub
    assert create == ("create_repo", "someone/studio",
                      {"repo_type": "space", "space_sdk": "gradio", "private": False, "exist_ok": True})
    _, kwargs, held, readme = upload
    assert kwargs["repo_id"] == "someone/studio" and kwargs["repo_type"] == "space"
    assert kwargs["ignore_patterns"] == space_upload.IGNORE and kwargs["delete_patterns"] == (["*"] if prune else None)
    assert held == SPACE_FILES and readme == space_upload.space_readme(tree)
    assert not Path(kwargs["folder_path"]).exists()  # the staging folder is gone after the upload


def test_without_a_token_the_upload_says_how_to_get_one_and_sends_nothing(tree, hub, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(SystemExit, match="HF_TOKEN"):
        space_upload.main(["someone/studio"], root=tree)
    assert hub == []


def test_huggingface_hub_here_uploads_a_folder_with_ignore_and_delete_patterns():
    import inspect

    parameters = inspect.signature(huggingface_hub.HfApi.upload_folder).parameters
    assert {"repo_id", "repo_type", "folder_path", "ignore_patterns", "delete_patterns"} <= set(parameters)


def looks_binary(path: Path) -> bool:
    """git's own test: a NUL byte in the first 8,000 bytes."""
    with path.open("rb") as f:
        return b"\0" in f.read(8000)


def test_every_binary_or_large_tracked_file_is_marked_for_lfs_and_source_is_not():
    tracked = [f for f in git(ROOT, "ls-files", "-z").split("\0") if f and (ROOT / f).is_file()]
    binary = [f for f in tracked if looks_binary(ROOT / f) or (ROOT / f).stat().st_size >= 10 * 2**20]
    assert any(f.endswith(".gguf") for f in binary)  # the bundled drafts' compact weights
    marked = git(ROOT, "check-attr", "filter", "--", *tracked).splitlines()
    lfs = {line.split(": filter: ")[0] for line in marked if line.endswith(": filter: lfs")}
    assert set(binary) <= lfs
    assert "assets/models/smollm2-135m-draft/model.gguf" in lfs
    assert not [f for f in lfs if f.endswith((".py", ".md", ".txt", ".sh"))]
