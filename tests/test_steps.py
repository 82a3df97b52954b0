"""Static steps and the GPU check on CPU.

The padded sizes, key splits and preallocated capacities a runner uses; captured runners handed from one
request to the next (the pool is exercised on CPU by calling runners captured, without running a graph);
and `gpu_check --quick`, the prepared GPU run in tiny shapes, end to end: every section runs, greedy output
is lossless under static steps, and the report carries what the GPU run is judged by.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import tiny
from specextend import steps
from specextend.tools import gpu_check
from specextend.models import prepare
from specextend.steps import BUCKET, capacity_for, make_runner, release, resolve_mode, sizes_up_to, splits_for


@given(st.integers(1, 300))
def test_sizes_cover_every_forward_with_powers_of_two(n):
    sizes = sizes_up_to(n)
    assert sizes[0] == 1 and sizes[-1] >= n and (len(sizes) == 1 or sizes[-2] < n)
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))


@given(st.integers(1, 200), st.integers(1, 512))
def test_splits_divide_every_bucket_into_aligned_blocks(m, rows):
    bucket = m * BUCKET
    splits = splits_for(bucket, rows)
    assert splits in (1, 2, 4, 8, 16, 32) and bucket % splits == 0 and (bucket // splits) % 16 == 0
    assert (bucket // splits >= 256 and splits * rows <= 2048) or splits == 1
    assert splits_for(bucket, max(1, rows // 2)) >= splits  # fewer rows, at least as many splits


@given(room=st.integers(1, 40_000), largest=st.integers(1, 128))
def test_capacity_leaves_room_for_padding_in_whole_buckets(room, largest):
    sizes = sizes_up_to(largest)
    cap = capacity_for(room, sizes)
    assert cap % BUCKET == 0 and cap >= room + sizes[-1]


def test_step_modes_resolve_per_device():
    assert resolve_mode("auto", torch.device("cpu")) == "eager"
    assert resolve_mode("static", torch.device("cpu")) == "static"
    with pytest.raises(ValueError, match="CUDA"):
        resolve_mode("captured", torch.device("cpu"))
    with pytest.raises(ValueError, match="steps must be"):
        resolve_mode("fast", torch.device("cpu"))


def test_captured_runners_pass_from_request_to_request(monkeypatch):
    """A released captured runner serves the next request that fits its cache (emptied), one request at a time;
    a larger request gets a new one, and the larger of two is the one kept."""
    monkeypatch.setattr(steps, "resolve_mode", lambda mode, device: "captured")
    monkeypatch.setattr(steps, "_FREE", {})
    model = prepare(tiny("llama", layers=1, seed=21))
    first = make_runner(model, 600, "auto", 8)
    first.cache.layers[0].length = 17
    release(first)
    again = make_runner(model, 300, "auto", 8)
    assert again is first and again.cache.length == 0
    other = make_runner(model, 300, "auto", 8)  # the first is taken: a second request gets its own
    assert other is not first
    bigger = make_runner(model, 5000, "auto", 8)
    assert bigger is not first and bigger.slots >= 5000
    release(first)
    release(bigger)
    release(other)
    assert make_runner(model, 100, "auto", 8) is bigger
    assert make_runner(model, 100, "auto", 4) is not bigger  # other padded sizes: other captured shapes


def test_eager_and_static_runners_are_never_kept(monkeypatch):
    monkeypatch.setattr(steps, "_FREE", {})
    model = prepare(tiny("llama", layers=1, seed=22))
    for mode in ("eager", "static"):
        runner = make_runner(model, 100, mode, 8)
        release(runner)
        assert make_runner(model, 100, mode, 8) is not runner
    assert steps._FREE == {}


def test_gpu_check_quick_runs_every_section(tmp_path):
    assert gpu_check.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["errors"] == {}
    assert report["lossless"] and all(report["lossless"].values())
    assert any(name.endswith("/static") for name in report["lossless"])
    assert max(report["kernels"].values()) < 1e-4  # fp32 on CPU
    rows = report["steps"]["rows"]
    assert [r["tokens"] for r in rows] == report["lengths"]
    assert all(r["floor_ms"] > 0 and r["ar_static_ms"] > 0 and r["verify_masked_ms"] > 0 for r in rows)
    assert set(report["steps"]["curve"]) == {str(n) for n in gpu_check.CURVE}
    assert set(report["engine"]) >= {"autoregressive", "speculative", "specextend", "specextend (EAGLE head)"}
    assert all(e["steps"] > 0 for e in report["engine"].values())
    assert all(p["kernels"] > 0 for p in report["profile"].values())
    assert set(report["projection"]) == {"draft 68M", "draft 1B"}
    assert f"{report['lengths'][-1]} tokens ran" in report["criteria"]
    text = (tmp_path / "gpu_check.md").read_text()
    assert "PROJECTION (not measured)" in text and "| tokens |" in text


def test_a_dropped_models_runners_are_not_kept_even_when_a_late_run_hands_one_back():
    """Changing pairs forgets the old models' kept runners; a run still going on the old pair hands its runner back
    later, and that one must not be kept either (it would hold the old weights for the life of the process)."""
    import weakref
    from types import SimpleNamespace

    model = torch.nn.Linear(2, 2)
    runner = SimpleNamespace(mode="captured", model=model, sizes=(1, 2), slots=64, cache=SimpleNamespace(dtype=None))
    key = (id(model), runner.sizes, None)  # kept by model, sizes and the dtype its cache keeps
    steps.release(runner)
    assert steps._FREE.get(key) is runner
    steps.forget((weakref.ref(model),))
    assert key not in steps._FREE
    steps.release(runner)  # the late run ends
    assert key not in steps._FREE
