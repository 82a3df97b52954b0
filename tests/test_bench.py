"""The benchmark end to end in --quick mode (tiny random-init models, the bundled pair's tokenizer): it writes
its table, JSON, CSV and figures, covers every method with the required fields, and stops on a greedy mismatch."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os

import pytest

from specextend import numerics
from specextend.tools import bench, bundled
from specextend.engine import generate
from specextend.events import Finished

CELL_FIELDS = ("length", "method", "prompt_tokens", "new_tokens", "decode_tokens_per_s", "e2e_tokens_per_s",
               "decode_speedup_vs_autoregressive", "decode_speedup_vs_speculative", "decode_speedup_vs_hf_assisted",
               "e2e_speedup_vs_autoregressive", "mean_accepted", "acceptance_by_position", "phase_seconds",
               "cmr_overhead_share", "decode_speedup_vs_hf_prompt_lookup", "tokens_per_step_by_source")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = bench.main(["--quick", "--out", str(out)])
    return rc, stdout.getvalue().splitlines(), out


def test_quick_run_writes_table_json_csv_and_figures(quick):
    rc, lines, out = quick
    assert rc == 0
    assert lines[0].split()[:3] == ["tokens", "method", "decode"]
    summary = json.loads(lines[-1])  # the last line is one JSON object
    report = json.loads((out / "bench.json").read_text())
    assert summary["cells"] == report["cells"]
    for name in ("bench.csv", "sweep.csv", "throughput.html", "speedup.html", "acceptance.html", "phases.html",
                 "needle.html", "sweep.html"):
        assert (out / name).stat().st_size > 0, name
        assert name in report["files"]
    if os.path.exists("/usr/bin/chromium"):  # tests/run.sh installs it and kaleido (requirements-dev.txt)
        assert report["png"] == "written", report["png"]
        for name in ("throughput.png", "speedup.png", "needle.png", "sweep.png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
            assert name in report["files"]
    else:
        assert report["png"].startswith("skipped")
    header = (out / "bench.csv").read_text().splitlines()[0].split(",")
    assert {"method", "decode_tokens_per_s_median", "decode_tokens_per_s_min", "decode_tokens_per_s_max",
            "decode_speedup_vs_speculative_median", "phase_seconds_verification"} <= set(header)


def test_quick_run_covers_every_method_with_the_required_fields(quick):
    _, _, out = quick
    report = json.loads((out / "bench.json").read_text())
    # --numerics auto: the engine's methods in the CPU default where this CPU packs (checked against each other), the
    # transformers peers in fp32 (against each other)
    assert report["numerics"] == (numerics.CPU_DEFAULT if numerics.packs_here() else "fp32")
    assert report["args"]["numerics"] == "auto"
    lengths = {c["length"] for c in report["cells"]}
    assert len(lengths) == 2
    for length in lengths:
        assert {c["method"] for c in report["cells"] if c["length"] == length} == set(bench.METHODS)
    for cell in report["cells"]:
        assert set(CELL_FIELDS) <= set(cell), cell["method"]
        assert cell["decode_tokens_per_s"]["median"] > 0
        assert cell["decode_tokens_per_s"]["min"] <= cell["decode_tokens_per_s"]["median"] <= cell["decode_tokens_per_s"]["max"]
        if cell["method"] not in bench.PEERS:
            assert set(cell["phase_seconds"]) == {"target_prefill", "draft_prefill", "drafting", "verification", "retrieval"}
            assert set(cell["tokens_per_step_by_source"]) == {"draft", "lookup", "both", "target"}
            assert cell["tokens_per_step_by_source"]["target"] >= 1.0  # every step ends with the target's bonus token
        else:
            assert cell["tokens_per_step_by_source"] is None
    by = {(c["length"], c["method"]): c for c in report["cells"]}
    for length in lengths:
        assert by[(length, "speculative")]["decode_speedup_vs_speculative"]["median"] == pytest.approx(1.0)
        assert by[(length, "fused_prefill_only")]["same_as"] == "speculative"  # --prefill fused: same config
        assert by[(length, "specextend")]["cmr_overhead_share"]["median"] > 0
        lookup = by[(length, "lookup")]["tokens_per_step_by_source"]
        assert lookup["draft"] == lookup["both"] == 0  # lookup alone: no draft model
        assert by[(length, "specextend_lookup")]["decode_speedup_vs_hf_prompt_lookup"]["median"] > 0
    assert report["needle"]["summary"]["needles"] == 2
    summary = report["needle"]["summary"]
    assert set(summary["accuracy"]) == {"target", "full", "streaming", "paper", "default"}
    assert set(summary["hold_rate"]) == {"paper", "default", "streaming"}
    assert summary["signals"] == {"paper": "paper", "default": "uncalibrated"}  # the quick pair has no calibration
    assert all(0.0 <= v <= 1.0 for v in summary["hold_rate"].values())
    assert report["sweep"][0]["setting"].startswith("default") and len(report["sweep"]) > 4
    assert {s["trigger"] for s in report["sweep"]} == {"fixed", "adaptive"}
    assert any(g["goal"].startswith("specextend_lookup decode speedup over hf_prompt_lookup") for g in report["goals"])


def test_planted_greedy_mismatch_stops_the_run(tmp_path, monkeypatch, capsys):
    def corrupted(pair, prompt, config, **kw):
        for event in generate(pair, prompt, config, **kw):
            if isinstance(event, Finished) and config.method == "streaming":
                event = dataclasses.replace(event, token_ids=event.token_ids[:2] + (event.token_ids[2] + 1,))
            yield event

    monkeypatch.setattr(bench.runs, "generate", corrupted)  # where the benchmark looks it up
    rc = bench.main(["--quick", "--out", str(tmp_path), "--methods", "autoregressive,streaming", "--skip", "sweep,needle"])
    err = capsys.readouterr().err
    assert rc == 3
    assert "'streaming'" in err and "'autoregressive'" in err and "at new token 2" in err
    assert not (tmp_path / "bench.json").exists()


def test_needle_only_run_writes_only_the_needle_figure(tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(f"Sentence number {i} says little of note." for i in range(120)))
    rc = bench.main(["--quick", "--out", str(tmp_path), "--skip", "grid,sweep", "--needle-docs",
                     str(doc), "--signal-layers", "all", "--signal-rows", "8", "--signal-combine", "max"])
    assert rc == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(last["needle"]["hold_rate"]) == {"paper", "default", "chosen", "streaming"}  # --signal-* made a third
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["cells"] == [] and report["needle"]["summary"]["needles"] == 2  # --quick: 2 needles
    assert report["needle"]["documents"] == ["doc.txt"] and {c["document"] for c in report["needle"]["cases"]} == {"doc.txt"}
    for case in report["needle"]["cases"]:  # the needle's token span really is the planted fact
        assert 0 < case["needle_span"][0] < case["needle_span"][1] < case["prompt_tokens"]
    assert "needle.html" in report["files"] and not (tmp_path / "throughput.html").exists()
    md = (tmp_path / "bench.md").read_text()
    assert "**Needle retrieval**" in md and "| goal |" not in md


SMALL = ["--quick", "--methods", "autoregressive,speculative", "--skip", "sweep,needle"]


def test_png_writer_without_a_browser_loses_nothing(tmp_path, monkeypatch, capsys):
    """kaleido installed and no Chrome: plotly raises RuntimeError from write_images. The run's JSON, tables and HTML
    figures are written all the same, and the skipped PNGs are reported."""
    pytest.importorskip("kaleido")
    import plotly.io as pio

    def no_browser(*args, **kwargs):
        raise RuntimeError("Kaleido requires Google Chrome to be installed.")

    monkeypatch.setattr(pio, "write_images", no_browser)
    rc = bench.main([*SMALL, "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["png"].startswith("skipped") and "Kaleido requires Google Chrome" in report["png"]
    assert {"bench.csv", "bench.md", "throughput.html"} <= set(report["files"])
    assert not any(name.endswith(".png") for name in report["files"])
    assert "Kaleido requires Google Chrome" in capsys.readouterr().err
    assert report["args"]["k"] is None and report["draft"]["k"] == 2  # no --k: the CPU's chain (config.default_chain)


def test_a_figure_that_cannot_be_drawn_is_reported_and_the_numbers_are_kept(tmp_path, monkeypatch, capsys):
    def broken(report):
        assert (tmp_path / "bench.json").exists() and (tmp_path / "bench.md").exists()  # the numbers come first
        raise ValueError("a figure went wrong")

    monkeypatch.setattr(bench.report, "figures", broken)
    rc = bench.main([*SMALL, "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["figure_errors"] == ["the figures could not be drawn: ValueError: a figure went wrong"]
    assert {c["method"] for c in report["cells"]} == {"autoregressive", "speculative"}
    assert "method" in (tmp_path / "bench.csv").read_text().splitlines()[0].split(",")
    assert "| autoregressive |" in (tmp_path / "bench.md").read_text()
    assert not list(tmp_path.glob("*.html"))
    err = capsys.readouterr().err
    assert "a figure went wrong" in err and "bench.json" in err


def test_the_engines_methods_may_read_the_prompt_in_bf16(tmp_path, capsys):
    """--bf16-prefill on (in fp32 numerics, where it stands): the engine's methods read the prompt in bf16 and are
    checked against each other, the transformers peer (fp32) against itself; the report says what the prompt was read
    in."""
    rc = bench.main(["--quick", "--out", str(tmp_path), "--methods", "autoregressive,speculative,hf_assisted",
                     "--skip", "sweep,needle", "--bf16-prefill", "on", "--numerics", "fp32"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["prefill_dtype"] == "bfloat16" and report["args"]["bf16_prefill"] == "on"
    assert report["numerics"] == "fp32"
    assert {c["method"] for c in report["cells"]} == {"autoregressive", "speculative", "hf_assisted"}


LONG = ["--quick", "--skip", "grid,sweep,needle", "--long-output"]


def test_a_long_output_run_tables_tokens_per_step_by_window_for_every_long_output_method(tmp_path, capsys):
    rc = bench.main([*LONG, "--out", str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    methods = ["autoregressive", "speculative", "streaming", "specextend", "specextend_lookup"]
    start = out.index(next(line for line in out if line.startswith("long output:")))
    assert out[start + 1].split() == ["method", "0-16", "16-32", "32-48", "new", "tokens", "decode", "tok/s", "x", "AR",
                                      "(decode)"]  # --quick: 48 new tokens in windows of 16
    assert [line.split()[0] for line in out[start + 2:start + 7]] == methods
    report = json.loads((tmp_path / "bench.json").read_text())
    section = report["long_output"]
    assert section["max_new_tokens"] == 48 and section["window"] == 16
    assert section["prompts"] == [p.name for p in bundled.short_prompts()]
    assert [r["method"] for r in section["rows"]] == methods
    for row in section["rows"]:
        assert list(row["windows"]) == ["0-16", "16-32", "32-48"] and row["new_tokens"]["median"] == 48
        assert all(w["median"] >= 1.0 for w in row["windows"].values())  # every step commits its bonus token
    alone = next(r for r in section["rows"] if r["method"] == "autoregressive")
    assert alone["decode_speedup_vs_autoregressive"]["median"] == pytest.approx(1.0)
    assert all(w["median"] == 1.0 for w in alone["windows"].values())
    assert len(section["runs"]) == len(methods) * len(section["prompts"])
    for prompt in section["prompts"]:  # the greedy check: every method wrote the same tokens on a prompt
        outputs = {r["method"]: r["token_ids"] for r in section["runs"] if r["prompt"] == prompt}
        assert set(outputs) == set(methods) and len({tuple(ids) for ids in outputs.values()}) == 1
        assert sum(w["tokens"] for w in next(r for r in section["runs"] if r["prompt"] == prompt)["windows"]) == 47
    assert {"long_output.csv", "long_output.html"} <= set(report["files"]) and report["cells"] == []
    assert "windows_16-32_median" in (tmp_path / "long_output.csv").read_text().splitlines()[0].split(",")
    assert "**Long outputs**" in (tmp_path / "bench.md").read_text()
    assert json.loads(out[-1])["long_output"] == section["rows"]


def test_a_greedy_mismatch_in_a_long_output_stops_the_run(tmp_path, monkeypatch, capsys):
    def corrupted(pair, prompt, config, **kw):
        for event in generate(pair, prompt, config, **kw):
            if isinstance(event, Finished) and config.method == "specextend" and len(event.token_ids) > 8:
                event = dataclasses.replace(event, token_ids=event.token_ids[:30] + (event.token_ids[30] + 1,))
            yield event

    monkeypatch.setattr(bench.runs, "generate", corrupted)
    prompt = tmp_path / "unseen.txt"
    prompt.write_text("A clock tower in a small town stopped one night at a quarter past three.", encoding="utf-8")
    rc = bench.main([*LONG, "--out", str(tmp_path), "--methods", "autoregressive,specextend",
                     "--long-output-prompts", str(prompt)])
    err = capsys.readouterr().err
    assert rc == 3
    assert "unseen.txt" in err and "'specextend'" in err and "'autoregressive'" in err and "at new token 30" in err
    assert not (tmp_path / "bench.json").exists()
