"""The real engine under repetition: the bundled pair (SmolLM2-135M-Instruct and its EAGLE-3 head, on the CPU) through
the Studio's handlers in this process, races and needle runs mixed, each tab its own session. After a warm-up,
resident memory stays within 15% of where it stood. About two minutes on a 2-core CPU, in the default run;
`pytest -s tests/test_soak_real.py` prints the readings (docs/APP.md, "Memory", has the figure it measured)."""

from __future__ import annotations

import os

import pytest
import torch

from app import Settings, documents
from app.settings import BUNDLED
from app.soak import rss_mb, settled

pytestmark = pytest.mark.soak

WARM_UP = 4  # two races and two needle runs: the pair loads, every kernel and cache has met its shapes
RUNS = 24  # then twelve of each, alternating
CHARS = 6000  # about 1,500 prompt tokens
NEW = 12


@pytest.fixture(scope="module")
def studio():
    from app.backend import real_factory
    from app.studio import Studio

    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # as the app runs (conftest pins tests to one thread)
    yield Studio(real_factory, Settings())
    torch.set_num_threads(threads)


def test_races_and_needle_runs_keep_memory_flat(studio):
    from app.studio import SessionState

    main, needle_tab = SessionState(), SessionState()
    text = documents.sample_text("britannica_life")

    def race(i: int) -> str:
        *_, last = studio.run(main, text[300 * i : 300 * i + CHARS], "Summarize the document.", BUNDLED, "specextend",
                              ["speculative", "autoregressive"], "0", max_new_tokens=NEW)
        return last[0]

    def needle(i: int) -> str:  # two inputs, taking turns: each one's layer x head picture is drawn once
        *_, last = studio.needle(needle_tab, "britannica_life", CHARS, (25, 75)[i % 2], i % 2, 8, NEW, BUNDLED)
        return last[0]

    memory = []
    for i in range(WARM_UP + RUNS):
        status = (race if i % 2 == 0 else needle)(i // 2)
        assert "Done." in status and "se-bad" not in status, status
        settled()
        memory.append(round(rss_mb()))
    base = memory[WARM_UP - 1]
    print(f"resident MB after each run (warm-up {WARM_UP}): {memory}")  # docs/APP.md's figure, with -s
    assert max(memory[WARM_UP:]) <= 1.15 * base, memory
