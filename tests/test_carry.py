"""The GPU proof's carry (scripts/carry.py): its size arithmetic and plan over a fake wheel folder, the wheels it keeps
and fetches, how it follows the proof's imports, and that its wheel list is exactly what the proof's modules import
and the GPU image lacks. No network: pip is a stand-in here."""

from __future__ import annotations

import importlib.metadata
import subprocess
import zipfile
from pathlib import Path

import pytest

from scripts import carry

ROOT = Path(__file__).resolve().parents[1]
PINNED = carry.pins((ROOT / "requirements.txt").read_text())


def fake_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = (), pad: int = 0) -> Path:
    """A wheel file with a METADATA and `pad` stored bytes (so its size is known within a zip's few headers)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", metadata)
        archive.writestr(f"{name}/pad.bin", b"\0" * pad)
    return path


def test_the_plan_adds_the_tree_and_each_wheel_against_the_bar(tmp_path):
    fake_wheel(tmp_path, "transformers", "5.24.0", pad=13 * carry.MIB)
    fake_wheel(tmp_path, "plotly", "7.1.0", pad=9 * carry.MIB)
    wheels = carry.wheels_in(tmp_path)
    assert [(w.name, w.version) for w in wheels] == [("plotly", "7.1.0"), ("transformers", "5.24.0")]
    sizes = sum(w.size for w in wheels)
    assert 22 * carry.MIB < sizes < 22 * carry.MIB + 4096  # the pads, and a zip's headers

    fits = carry.Carry(36 * carry.MIB, tuple(wheels))
    assert fits.total_mib == pytest.approx(36 + sizes / carry.MIB) and fits.within
    over = carry.Carry(39 * carry.MIB, tuple(wheels))
    assert over.total_mib > carry.BAR_MIB and not over.within

    needs = {"gpu_check": {"transformers": {"specextend.models"}}, "soak": {"plotly": {"visualizers.common"}}}
    text = carry.report(over, (300, 38 * carry.MIB), (2, carry.MIB), ".whl", needs, ["a problem"])
    assert "38.00 MiB" in text and "1.00 MiB" in text  # tracked, untracked
    assert f"{over.total_mib:.2f} MiB  OVER the bar by {over.total_mib - 60:.2f} MiB" in text
    assert "transformers==5.24.0 (.whl/)" in text and carry.WHEELS["plotly"] in text
    assert "gpu_check  transformers" in text and "PROBLEM: a problem" in text
    assert 'carry:   [".whl"]' in text and "command: WHEELS=.whl bash scripts/gpu_proof.sh" in text
    assert "to spare" in carry.report(fits, (300, 36 * carry.MIB), (0, 0), ".whl", needs, [])


def test_the_working_tree_that_travels_is_tracked_and_untracked_files_but_not_ignored_or_deleted_ones(tmp_path):
    git = lambda *args: subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / ".gitignore").write_text("/ignored/\n")
    (tmp_path / "kept.bin").write_bytes(b"x" * 1000)
    (tmp_path / "gone.bin").write_bytes(b"x" * 500)
    git("add", ".gitignore", "kept.bin", "gone.bin")
    (tmp_path / "gone.bin").unlink()
    (tmp_path / "new.txt").write_bytes(b"y" * 300)
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "big.whl").write_bytes(b"z" * 5000)
    gitignore = len("/ignored/\n")
    assert carry.tree_bytes(tmp_path) == (2, 1000 + gitignore, 1, 300)


def test_download_keeps_one_version_of_each_and_fetches_only_the_missing_for_cpython_312(tmp_path, monkeypatch):
    fake_wheel(tmp_path, "transformers", "5.24.0")
    fake_wheel(tmp_path, "plotly", "7.0.0")  # another version: two would stop the offline install
    fake_wheel(tmp_path, "gradio", "6.31.0")  # not in the list
    calls = []
    monkeypatch.setattr(carry.subprocess, "run", lambda cmd, check: calls.append(cmd))
    wanted = {"transformers": "5.24.0", "plotly": "7.1.0", "orjson": "3.13.0"}
    removed = carry.download(wanted, tmp_path)
    assert sorted(p.name for p in removed) == ["gradio-6.31.0-py3-none-any.whl", "plotly-7.0.0-py3-none-any.whl"]
    assert [w.name for w in carry.wheels_in(tmp_path)] == ["transformers"]
    (cmd,) = calls
    assert cmd[1:4] == ["-m", "pip", "download"] and cmd[-2:] == ["plotly==7.1.0", "orjson==3.13.0"]
    for flag in ("--no-deps", "--only-binary=:all:"):
        assert flag in cmd
    for option, value in (("--python-version", "3.12"), ("--implementation", "cp"), ("-d", str(tmp_path))):
        assert cmd[cmd.index(option) + 1] == value
    assert cmd[cmd.index("--platform") + 1].endswith("_x86_64")

    calls.clear()
    fake_wheel(tmp_path, "plotly", "7.1.0")
    fake_wheel(tmp_path, "orjson", "3.13.0")
    assert carry.download(wanted, tmp_path) == [] and calls == []


def test_each_wheel_is_carried_at_its_requirements_pin():
    wanted = carry.specs(PINNED)
    assert set(wanted) == {carry.norm(n) for n in carry.WHEELS}
    for name, version in wanted.items():
        assert f"{name}=={version}" in (ROOT / "requirements.txt").read_text().splitlines()
    with pytest.raises(ValueError, match="not pinned in requirements.txt: left-pad"):
        carry.specs(PINNED, ["plotly", "left-pad"])


def test_the_parts_and_their_modules_come_from_the_proofs_script_and_the_preflight_imports_them_all():
    parts = carry.proof_parts((ROOT / "scripts" / "gpu_proof.sh").read_text())
    assert list(parts) == ["preflight", "gpu_check", "presets", "long", "soak"]
    assert parts["gpu_check"] == ("specextend.tools.gpu_check",)
    assert parts["presets"] == parts["long"] == ("app.preset_check",) and parts["soak"] == ("app.soak",)
    run = {m for name, modules in parts.items() if name != "preflight" for m in modules}
    assert run <= set(parts["preflight"])  # a missing package fails the preflight, in seconds


def test_imports_are_followed_through_the_project_inside_functions_but_not_optional_or_lazy_ones(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import alpha\n\ndef __getattr__(name):\n    import lazy_one\n")
    (pkg / "a.py").write_text(
        "import json\nfrom . import b\nfrom .c import thing\nfrom .sub import d\n\n"
        "def f():\n    import beta.sub as s\n    return s\n\n"
        "try:\n    import optional_x\nexcept (ImportError, OSError):\n    optional_x = None\n"
        "try:\n    import needed_y\nexcept ValueError:\n    pass\n")
    (pkg / "b.py").write_text("from os import path\nfrom delta import thing\n")
    (pkg / "c.py").write_text("thing = 1\n")
    (pkg / "sub").mkdir()
    (pkg / "sub" / "__init__.py").write_text("import epsilon\n")
    (pkg / "sub" / "d.py").write_text("from ..c import thing\nfrom .. import b\nimport zeta\n")
    (pkg / "unreached.py").write_text("import never\n")
    found = carry.outside_imports(["pkg.a"], tmp_path, ["pkg"])
    assert found == {"alpha": {"pkg"}, "beta": {"pkg.a"}, "needed_y": {"pkg.a"}, "delta": {"pkg.b"},
                     "epsilon": {"pkg.sub"}, "zeta": {"pkg.sub.d"}}


def test_what_must_travel_the_image_lacks_or_has_older_than_the_pin():
    pinned = {"transformers": "5.24.0", "safetensors": "0.8.0", "torch": "2.13.0", "plotly": "7.1.0", "tqdm": "4.70.1"}
    assert carry.must_travel("plotly", pinned)  # absent
    assert carry.must_travel("transformers", pinned)  # 5.17 there
    assert not carry.must_travel("safetensors", pinned)  # the same version there
    assert not carry.must_travel("tqdm", pinned)  # there, version not known
    assert not carry.must_travel("torch", pinned)  # the image's own CUDA build runs
    assert not carry.must_travel("huggingface-hub", pinned)  # there, not pinned


def test_a_carried_wheels_requirements_must_be_met_by_the_image_or_the_carry_on_python_312():
    requires = ["narwhals>=1.15.1", "tokenizers<0.24.0,>=0.23.1", "tokenizers>=0.24", "absent-pkg",
                "absent-pkg; extra == 'gui'", "old-only; python_version < '3.10'", "Other_Carried==1"]
    assert carry.unmet(requires, ["other-carried"]) == ["tokenizers>=0.24 (image: 0.23.2)", "absent-pkg (image: absent)"]


def test_problems_name_a_missing_wheel_an_import_the_list_leaves_out_and_a_wheel_nothing_needs(tmp_path):
    fake_wheel(tmp_path, "plotly", "7.1.0", requires=("narwhals>=1.15.1", "kaleido-absent"))
    wanted = {"plotly": "7.1.0", "transformers": "5.24.0"}
    needs = {"soak": {"plotly": {"visualizers.common"}, "gradio": {"app.ui"}}}
    problems = carry.problems_of(carry.wheels_in(tmp_path), wanted, needs)
    assert problems == [
        "the proof imports gradio (from app.ui), which the image lacks and WHEELS does not carry",
        "transformers is carried but nothing the proof runs imports it",
        ".whl/ lacks transformers==5.24.0",
        "plotly needs kaleido-absent (image: absent)",
    ]


def test_the_wheel_list_is_exactly_what_the_proofs_imports_need_from_outside_the_image():
    parts = carry.proof_parts((ROOT / "scripts" / "gpu_proof.sh").read_text())
    needs = carry.needs(parts, PINNED)
    needed = {dist: sorted(importers) for need in needs.values() for dist, importers in need.items()}
    assert set(needed) == {carry.norm(n) for n in carry.WHEELS}, needed
    assert "gradio" not in needed  # the proof drives the Studio without its page


def test_the_images_transformers_is_too_old_for_the_engine_and_the_pinned_one_is_not():
    from specextend.models import check_transformers

    with pytest.raises(RuntimeError, match="too old"):
        check_transformers(carry.IMAGE_VERSIONS["transformers"])
    check_transformers(PINNED["transformers"])


@pytest.mark.parametrize("name", sorted(carry.WHEELS))
def test_each_carried_wheels_own_requirements_are_on_the_image(name):
    """Read from the installed copy of the same version (scripts/carry.py checks the downloaded wheels themselves)."""
    assert importlib.metadata.version(name) == PINNED[name]
    assert carry.unmet(importlib.metadata.requires(name) or [], carry.WHEELS) == []
