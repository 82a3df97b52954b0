"""The prepared GPU proof's CPU run: `bash scripts/gpu_proof.sh --quick` runs every part in tiny shapes and leaves a
summary and an archive holding what each part wrote, so the script cannot rot before a GPU runs it; a part that the
deadline leaves no time for is skipped and fails the run (after the preflight, nothing else runs). Its soak part is
the suite's run of `python -m app.soak --shrink` (the real engine through the app, A -> B -> A): its report is checked
here, not run a second time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from app.preset_check import SHAPES
from app.soak import PAIRS as PAIRS_VISITED

pytestmark = pytest.mark.soak  # about a minute and a half on a quiet 2-core CPU

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("preflight", "gpu_check", "presets", "long", "soak")


def proof(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    # the script's own limits catch a hang in a part (900 s each with --quick); this one a hang of the script itself
    return subprocess.run(["bash", "scripts/gpu_proof.sh", *args], cwd=ROOT, capture_output=True, text=True, timeout=4000,
                          env={**os.environ, "OUT": str(out), "PYTHON": sys.executable, **env})


def statuses(summary: str) -> dict[str, str]:
    """Each part's row of the summary: name -> status, seconds and limit in words."""
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in summary.splitlines() if line.startswith("| ")]
    return {name: f"{status} after {seconds} s (limit {limit} s)" for name, status, seconds, limit in rows[1:]}


def what_went_wrong(done: subprocess.CompletedProcess, summary_path: Path) -> str:
    """The parts that did not end ok (or never ran), each with its status and last lines, for a failure message."""
    if not summary_path.exists():
        return f"no summary written (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
    summary = summary_path.read_text()
    found = statuses(summary)
    bad = [f"{part}: {found.get(part, 'did not run')}" for part in PARTS if not found.get(part, "").startswith("ok ")]
    sections = [s for s in summary.split("\n## ")[1:] if s.split(" ", 1)[0] in {b.split(":")[0] for b in bad}]
    return "parts not ok: " + "; ".join(bad) + "".join(f"\n\n## {s}" for s in sections) + f"\n{done.stderr[-2000:]}"


def test_the_quick_proof_runs_every_part_and_keeps_what_each_wrote(tmp_path):
    done = proof(tmp_path, "--quick")
    assert done.returncode == 0, what_went_wrong(done, tmp_path / "summary.md")
    summary = (tmp_path / "summary.md").read_text()
    assert all(f"| {part} | ok |" in summary for part in PARTS), what_went_wrong(done, tmp_path / "summary.md")
    with tarfile.open(tmp_path / "gpu_proof.tar.gz") as archive:
        archive.extractall(tmp_path / "parts", filter="data")
    parts = tmp_path / "parts"
    assert {p.name for p in parts.glob("*.log")} == {f"{part}.log" for part in PARTS}
    check = json.loads((parts / "gpu_check" / "gpu_check.json").read_text())
    assert check["errors"] == {} and check["kernels"] and check["quick"]
    presets = json.loads((parts / "presets" / "preset_check.json").read_text())
    assert [r["preset"] for r in presets] == list(SHAPES) and all(r["outputs_agree"] for r in presets)
    (long,) = json.loads((parts / "long" / "preset_check.json").read_text())
    assert long["workload"] == "long_output" and set(long["new_tokens"].values()) == {32}
    # the shrunk soak: the real engine through the app's run handler, pair A -> B -> A, every check passing
    soak = json.loads((parts / "soak" / "soak.json").read_text())
    assert soak["runs_done"] == 12 and soak["device"] == "cpu" and all(c["ok"] for c in soak["checks"]), soak["checks"]
    assert [r["pair"] for r in soak["readings"]] == [PAIRS_VISITED[0]] * 4 + [PAIRS_VISITED[1]] * 4 + [PAIRS_VISITED[0]] * 4
    assert all(r["rss_mib"] > 0 and r["models"] > 0 and r["cuda_allocated_mib"] is None for r in soak["readings"])
    assert soak["checks"][-1]["check"] == f"visit 3 ({PAIRS_VISITED[0]}): settles where its first visit did"
    table = (parts / "soak" / "soak.md").read_text()
    assert "| run | visit | pair |" in table and "| cyclic_mib |" in table


def test_a_part_the_deadline_leaves_no_time_for_is_skipped_and_fails_the_run(tmp_path):
    done = proof(tmp_path, "--quick", DEADLINE="5")
    assert done.returncode == 1
    summary = (tmp_path / "summary.md").read_text()
    assert "| preflight | SKIPPED: the deadline is near |" in summary and "| soak |" not in summary, summary
    told = what_went_wrong(done, tmp_path / "summary.md")  # what the first test's failure would say
    assert told.startswith("parts not ok: preflight: SKIPPED: the deadline is near after ") and "soak: did not run" in told
    assert tarfile.is_tarfile(tmp_path / "gpu_proof.tar.gz")
