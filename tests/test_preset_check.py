"""The preset check on CPU: each GPU preset's pair, random and shrunk to two narrow layers (six under an EAGLE-3 head)
but with its family, rope scaling and embedding rows, runs through the app's own run handler and every method agrees;
EAGLE heads run in their published shapes as the draft."""

from __future__ import annotations

import json

from app.preset_check import SHAPES, main


def test_every_preset_runs_through_the_apps_handler_and_its_methods_agree(tmp_path):
    assert main(["--shrink", "--tokens", "400", "--max-new-tokens", "6", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "preset_check.json").read_text())
    assert [r["preset"] for r in results] == list(SHAPES)
    for r in results:
        assert r["error"] == "" and r["outputs_agree"] and r["prompt_tokens"] > 400, r
        assert set(r["new_tokens"].values()) == {6}, r
    drafts = {r["preset"]: r["draft"] for r in results}
    assert drafts["vicuna-7b-eagle"] == "EAGLE head" and drafts["qwen3-8b-eagle3"] == "EAGLE-3 head"
    assert drafts["qwen2.5-7b"] == "draft model"
    target, draft, _ = SHAPES["qwen2.5-7b"]
    assert target["rows"] > draft["rows"]  # the padded pair really is one


def test_a_thinking_preset_writes_a_long_output_through_the_apps_handler(tmp_path):
    assert main(["--shrink", "--long-output", "--max-new-tokens", "160", "--presets", "qwen3-8b-eagle3",
                 "--out", str(tmp_path)]) == 0
    (result,) = json.loads((tmp_path / "preset_check.json").read_text())
    assert result["workload"] == "long_output" and result["outputs_agree"] and result["error"] == "", result
    assert result["prompt_tokens"] < 150 and set(result["new_tokens"].values()) == {160}


def test_a_document_longer_than_a_targets_context_is_cut_to_fit_it(tmp_path):
    assert main(["--shrink", "--tokens", "3000", "--max-new-tokens", "2", "--presets", "vicuna-7b-eagle",
                 "--out", str(tmp_path)]) == 0
    (result,) = json.loads((tmp_path / "preset_check.json").read_text())
    context = SHAPES["vicuna-7b-eagle"][0]["context"]
    assert context - 16 <= result["prompt_tokens"] <= context - 2 and result["outputs_agree"], result
