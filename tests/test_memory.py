"""What the app keeps after a run: a finished job hands the memory it freed back to the system, the queue's estimate
keeps when jobs began and ended but not the jobs themselves, and the needle tab's layer x head picture is drawn once
per prompt and span. No model: the real engine's soak is tests/test_soak_real.py."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import weakref

import pytest

from app import Settings
from app.backend import HEAD_PICTURES, HeadPictures
from app.runner import Job, _malloc_trim
from app.soak import rss_mb
from fixtures.fake_engine import fake_factory


def finished(prepare) -> Job:
    """A job with no methods to run, after `prepare`, once its thread has returned."""
    job = Job([], None, prepare).start()
    assert job.done.wait(30)
    deadline = time.monotonic() + 30
    while any(t.name == "specextend-job" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return job


@pytest.mark.skipif(_malloc_trim() is None, reason="the C library has no malloc_trim (not glibc)")
def test_a_finished_job_hands_the_memory_it_freed_back():
    """A run that allocated 400 MB in small blocks and freed them, while a later allocation still sits above them (as
    a run's last allocations outlive it), leaves resident memory near where it began: glibc alone keeps those pages."""
    pinned: list[bytearray] = []
    peak: list[float] = []

    def prepare(say):
        blocks = [bytearray(64 * 1024) for _ in range(6400)]  # under glibc's mmap threshold: heap pages, touched
        pinned.append(bytearray(64 * 1024))  # above them: the heap cannot shrink from its top
        peak.append(rss_mb())
        del blocks
        return None, None, 0, None

    before = rss_mb()
    finished(prepare)
    grown = peak[0] - before
    assert grown > 300, grown
    assert rss_mb() - before < 0.25 * grown, (before, peak[0], rss_mb())


def test_the_queue_estimate_keeps_when_jobs_ran_not_the_jobs():
    """Recent jobs feed the waiting user's estimate with their times alone: once its session lets a finished job go,
    nothing of it (its runs, its prompt) is kept, and the estimate still counts how long it took."""
    from app.studio import Studio

    studio = Studio(fake_factory(), Settings(concurrency=1))
    job = finished(lambda say: (time.sleep(0.05), (None, None, 0, None))[1])
    job.began, job.ended = job.ended - 40.0, job.ended  # it took 40 s
    studio.generations.append(job)
    gone = weakref.ref(job)
    del job
    gc.collect()
    assert gone() is None
    running = Job([], None, None, began=time.perf_counter() - 10)
    studio.generations.append(running)
    status = studio.queued()
    assert "1 run(s) in progress" in status and "about 40 s" in status and "free in about 30 s" in status


def test_the_layer_by_head_picture_is_drawn_once_per_target_prompt_and_span():
    """The needle tab's picture costs a prefill: it is drawn once for a target, prompt and span (a second pair with the
    same target reuses it), and only the last HEAD_PICTURES of them are kept."""
    from types import SimpleNamespace

    drawn = []

    def pair(key: str, target: str):
        heads = lambda ids, span: drawn.append((target, tuple(ids), span)) or len(drawn)  # noqa: E731
        return SimpleNamespace(heads_key=target, choice=SimpleNamespace(key=key), heads=heads)

    pictures, first, second, other = HeadPictures(), pair("a", "t"), pair("b", "t"), pair("c", "u")
    assert pictures.get(first, [1, 2, 3], (0, 2)) == pictures.get(second, [1, 2, 3], (0, 2)) == 1
    assert pictures.get(first, [1, 2, 3], (1, 2)) == 2 and pictures.get(first, [1, 2, 4], (0, 2)) == 3
    assert pictures.get(other, [1, 2, 3], (0, 2)) == 4  # another target: its own picture
    assert drawn == [("t", (1, 2, 3), (0, 2)), ("t", (1, 2, 3), (1, 2)), ("t", (1, 2, 4), (0, 2)), ("u", (1, 2, 3), (0, 2))]
    for n in range(HEAD_PICTURES):
        pictures.get(first, [n], (0, 1))
    pictures.get(first, [1, 2, 3], (0, 2))  # pushed out by the newer ones: drawn again
    assert len(drawn) == 4 + HEAD_PICTURES + 1


def test_a_codec_keeps_a_bounded_number_of_decoded_texts():
    """The panels decode the same chunks at every redraw, so texts are kept, but only the last DECODED of them: a
    server that runs for days does not keep every text it ever showed."""
    from types import SimpleNamespace

    from app.backend import DECODED, Codec

    calls = []
    codec = Codec(SimpleNamespace(decode=lambda ids, skip_special_tokens: calls.append(ids) or str(ids)), eos_ids=(0,))
    for n in range(DECODED + 1):
        assert codec.decode([n, n + 1]) == str([n, n + 1])
    codec.decode([DECODED, DECODED + 1])  # the newest: kept
    assert len(calls) == DECODED + 1
    codec.decode([0, 1])  # the oldest: let go, decoded again
    assert len(calls) == DECODED + 2


SHAPES = """
import ctypes, re, sys
import torch
import specextend.models  # noqa: F401  (what it sets on import is under test)
def rss():
    ctypes.CDLL(None).malloc_trim(0)
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
torch.set_num_threads(1)
layer = torch.nn.Linear(576, 1536).to(torch.bfloat16)
with torch.no_grad():
    layer(torch.randn(5, 576, dtype=torch.bfloat16))
    before = rss()
    for rows in range(1400, 1600):
        layer(torch.randn(rows, 576, dtype=torch.bfloat16))
print(rss() - before)
"""


@pytest.mark.skipif(_malloc_trim() is None, reason="the C library has no malloc_trim (not glibc)")
def test_bf16_prefills_of_new_lengths_keep_a_bounded_number_of_kernels():
    """A bf16 prefill at 200 new prompt lengths: oneDNN keeps a kernel per shape (236 MB more resident on the AMX
    machine by its default), at most 16 once the engine is imported (65-110 MB with 8-64)."""
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    out = subprocess.run([sys.executable, "-c", SHAPES], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.split()[-1]) < 150, out.stdout
