"""Soak tests: the app under repetition and under concurrent sessions, in one server process (the fake
engine, so they fit CI's time budget). Fifty short runs leave resident memory within 10% of where it stood
after warm-up and the thread count steady; four sessions at once with different inputs and settings each get the
output their own run gets alone."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from app import Settings, build_app, launch
from app.runner import Knobs
from app.settings import BUNDLED
from app.soak import rss_mb
from fixtures.fake_engine import fake_factory

pytestmark = pytest.mark.soak


@pytest.fixture(scope="module")
def server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = Settings(port=port, max_new_tokens=64, concurrency=2)
    demo = build_app(fake_factory(step_s=0.002, max_positions=4096), settings)
    launch(demo, settings, prevent_thread_lock=True, quiet=True)
    yield f"http://127.0.0.1:{port}/"
    demo.close()


def run_args(document: str, method: str = "specextend", race=("autoregressive",), **knobs) -> tuple:
    k = {**Knobs(max_new_tokens=12).__dict__, **knobs}
    return (document, "Summarize.", BUNDLED, method, list(race), "0", *k.values())


def test_fifty_runs_hold_memory_and_threads(server):
    """After a warm-up, fifty more runs: resident memory stays within 10%, and the thread count after the second
    twenty-five is at most two above the count after the first (a leak would grow by one with every run, 25 here);
    no job thread outlives its run."""
    from gradio_client import Client

    client = Client(server, verbose=False)
    documents = [f"Document {i}: " + "the quick brown fox jumps over the lazy dog. " * (20 + i) for i in range(5)]
    for i in range(10):  # warm-up: caches, first allocations, gradio's worker threads
        assert "Done." in client.predict(*run_args(documents[i % 5]), api_name="/run")[0]
    memory = rss_mb()
    counts = []
    for half in range(2):
        for i in range(25):
            assert "Done." in client.predict(*run_args(documents[i % 5], seed=25 * half + i), api_name="/run")[0]
        counts.append(settled_threads(counts[-1] if counts else 0))
    assert rss_mb() < 1.10 * memory, (memory, rss_mb())
    # a leak adds a thread per run (25 between the counts); pools may still add a worker or two late (a submit
    # that found every worker busy starts one, up to the pool's size), and a progress bar's monitor comes and goes
    assert counts[1] <= counts[0] + 2, "; ".join(sorted(t.name for t in threading.enumerate()))
    assert not any(t.name == "specextend-job" for t in threading.enumerate())


def settled_threads(at_most: int = 0, wait_s: float = 5.0) -> int:
    """The thread count once the last runs' threads have returned (a job's thread ends just after its result is
    sent): at most `at_most` as soon as it gets there, else whatever it is after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while threading.active_count() > at_most and time.monotonic() < deadline:
        time.sleep(0.05)
    return threading.active_count()


def test_four_sessions_at_once_each_get_their_own_output(server):
    from gradio_client import Client

    cases = [run_args("Alpha beta gamma. " * 40, "specextend", seed=1),
             run_args("One two three four. " * 60, "speculative", race=(), shape="tree", seed=2),
             run_args("Red green blue. " * 30, "lookup", race=("autoregressive",), seed=3),
             run_args("North south east west. " * 50, "autoregressive", race=(), temperature=0.7, seed=4)]
    solo = [Client(server, verbose=False).predict(*case, api_name="/run")[1] for case in cases]
    clients = [Client(server, verbose=False) for _ in cases]
    jobs = [c.submit(*case, api_name="/run") for c, case in zip(clients, cases)]
    together = [job.result()[1] for job in jobs]
    assert together == solo
    assert len(set(solo)) == 4
