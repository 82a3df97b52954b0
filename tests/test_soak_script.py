"""The soak script, `python -m app.soak`: its checks flag a reading that grows, a count that moves, a pair that settles
higher on its second visit, a race whose outputs differ and tensors left in reference cycles; its counts see a model
and a step runner come and go, and tensors that only a cycle holds are measured. Its `--shrink` run (the real engine
through the app's run handler on the CPU, A -> B -> A, every check passing) is the GPU proof's soak part, checked in
tests/test_gpu_proof.py rather than run twice."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from app import soak
from conftest import tiny
from specextend.models import prepare
from specextend.steps import make_runner


def readings(visits: list[tuple[str, list[dict]]]) -> list[dict]:
    """Soak readings for `visits`: (pair, one dict of measures per run), unset measures as a flat CPU run has them."""
    out = []
    for visit, (pair, runs) in enumerate(visits, start=1):
        for values in runs:
            out.append({"run": len(out) + 1, "visit": visit, "pair": pair, "s": 1.0, "agree": True, "error": "",
                        **{m: None for m in soak.MEASURES}, "rss_mib": 600, "models": 4, "tokenizers": 1, "runners": 2,
                        "steps": 5, "captures": 5, "cyclic_mib": 0.0,
                        **values})
    return out


def failed(result: list[dict]) -> dict[str, list[str]]:
    return {c["check"]: c["failed"] for c in result if not c["ok"]}


def test_flat_visits_pass_and_what_grows_after_warm_up_fails():
    flat = [{"rss_mib": 600}, {"rss_mib": 640}, {"rss_mib": 660}, {"rss_mib": 620}]  # within 64 MiB of the base, 640
    assert failed(soak.checks(readings([("a", flat)]), warm_up=2)) == {}
    leak = [{"cuda_allocated_mib": 1000 + 40 * i, "cuda_reserved_mib": 2000} for i in range(5)]
    assert failed(soak.checks(readings([("a", leak)]), warm_up=2)) == {
        "visit 1 (a): flat after warm-up": ["run 4: cuda_allocated_mib 1120 > 1104 (base 1040)",
                                            "run 5: cuda_allocated_mib 1160 > 1104 (base 1040)"]}
    recaptured = [{"captures": 5}, {"captures": 6}, {"captures": 6}, {"captures": 7}]  # counts: not one more
    assert failed(soak.checks(readings([("a", recaptured)]), warm_up=2)) == {
        "visit 1 (a): flat after warm-up": ["run 4: captures 7 > 6 (base 6)"]}


def test_a_pair_visited_again_must_settle_where_it_did_and_every_race_must_agree():
    first, other = [{"cuda_allocated_mib": 16000}] * 3, [{"cuda_allocated_mib": 17000}] * 3
    kept = [{"cuda_allocated_mib": 33000, "tokenizers": 2}] * 3  # the first pair's weights and tokenizer still held
    result = soak.checks(readings([("a", first), ("b", other), ("a", kept)]), warm_up=1)
    assert failed(result) == {"visit 3 (a): settles where its first visit did": [
        "cuda_allocated_mib 33000 > 16064 (first visit 16000)", "tokenizers 2 > 1 (first visit 1)"]}
    assert failed(soak.checks(readings([("a", first), ("b", other), ("a", first)]), warm_up=1)) == {}
    differ = readings([("a", [{}, {"agree": False}, {"error": "CUDA out of memory"}])])
    assert failed(soak.checks(differ, warm_up=1)) == {
        "greedy outputs of the race agree, no errors": ["run 2: outputs differ", "run 3: CUDA out of memory"]}


def test_after_warm_up_a_run_may_leave_no_tensors_to_the_cyclic_collector():
    cycles = readings([("a", [{"cyclic_mib": 114.2}, {"cyclic_mib": 0.0}, {"cyclic_mib": 0.7}])])  # the first builds
    assert failed(soak.checks(cycles, warm_up=1)) == {
        "after warm-up, a run leaves no tensors to the cyclic garbage collector": ["run 3: 0.7 MiB held by reference "
                                                                                  "cycles only"]}


def test_tensors_only_a_reference_cycle_holds_are_measured_then_freed():
    gc.disable()  # no collection of the cycle before it is measured
    try:
        soak.cyclic_mib()  # what earlier tests left
        a, b = {"tensor": torch.zeros(3 * 2**20 // 4)}, {}  # 3 MiB of fp32
        a["b"], b["a"] = b, a
        tensor = weakref.ref(a["tensor"])
        del a, b
        held = tensor() is not None  # not inside an assert: pytest would keep the tensor for its message
        measured = soak.cyclic_mib()
        assert held and measured == 3.0
        assert tensor() is None and soak.cyclic_mib() == 0.0
    finally:
        gc.enable()


def test_runs_are_shared_out_over_the_visits_the_pairs_taken_in_turn():
    assert soak.schedule(30, 2, ["a", "b"]) == [("a", 10), ("b", 10), ("a", 10)]
    assert soak.schedule(11, 3, ["a", "b"]) == [("a", 3), ("b", 3), ("a", 3), ("b", 2)]
    with pytest.raises(SystemExit):  # two runs a visit cannot pass a warm-up of two
        soak.main(["--shrink", "--runs", "6", "--out", "unused"])


def test_the_counts_see_a_model_and_its_runner_and_what_it_holds_until_they_are_gone():
    before = soak.alive()
    runner = make_runner(prepare(tiny("llama", layers=1, seed=31)), 100, "static", 8)
    runner.steps["a captured shape"] = None
    runner.captures = 3
    grown = {k: before[k] + n for k, n in {"models": 2, "runners": 1, "steps": 1, "captures": 3}.items()}  # LM, base model
    assert soak.alive() == {**before, **grown}
    del runner
    assert soak.alive() == before
