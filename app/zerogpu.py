"""The Studio on a ZeroGPU Space, where CUDA exists only inside calls to functions marked with the `spaces` package's
GPU decorator: each call is a grant of a GPU for a number of seconds asked for before it starts.

What it knows of ZeroGPU (the `spaces` package's source and the ZeroGPU documentation):
- A ZeroGPU Space sets SPACES_ZERO_GPU, and `spaces.config.Config.zero_gpu` says so once `spaces` is imported. Where
  that variable is not set this module imports nothing and decorates nothing.
- A decorated call runs in a worker process forked from the app: its arguments and whatever it yields or returns
  are pickled across. A worker is kept for a later call only while it is alive and the scheduler hands the same GPU
  back idle; otherwise the next call forks a fresh one. The app process never runs CUDA: models are moved to "cuda" at
  start-up on the main thread, where `spaces` records them (its emulation is entered on the importing thread only),
  and each worker copies them to its GPU before the call runs.
- `duration` may be a callable of the decorated function's own arguments. The seconds asked for are checked against
  the visitor's remaining daily quota before the call runs, and a shorter grant is scheduled sooner. A generator may
  be decorated: what it yields streams back as it comes.

What follows from that here:
- One grant per click: the whole plan (the main run and the runs racing it) in one call, asking for the seconds
  `estimate_seconds` gives for the prompt's length, the new tokens and the number of runs, capped.
- Decode-time steps run "static" (the captured steps' fixed shapes, run eagerly), not captured as CUDA graphs:
  captured runners are kept between requests in the process that captured them (`specextend.steps`), which here is a
  worker that may not live to the next click, and every fresh worker would capture its shapes again inside the
  visitor's grant. Hugging Face's ZeroGPU guidance says the same of torch.compile's just-in-time work.
- Stop crosses the process boundary as a file's existence (`StopFlag`), so a stopped run ends the way the engine ends
  it (a Finished event, "stopped"), as it does off ZeroGPU.
- A ZeroGPU Space serves its default pair only, loaded before serving (`serving`).
- Not avoided, and not yet measured on a real Space: the engine's compiled kernels (`attention.compiled_on_cuda`: the
  split merge, FusedRMSNorm; fused layers) compile in each fresh worker, inside its grant; and whether `prepare`, run
  in the app process under `spaces`' emulation, sees the models as CUDA ones (and so fuses them) is unverified.

Knows nothing of gradio's layout, figures, tokenization or the engine's internals: it runs a served pair's
`for_click` generate and head picture inside grants, and changes only the step mode of the configs it is given.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import tempfile
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Iterator, Mapping

from specextend.config import GenerationConfig
from specextend.events import Event

from .backend import Click, EngineFactory, Loaded, Plan
from .settings import Settings

log = logging.getLogger(__name__)

ON = ("1", "t", "true")  # the values of SPACES_ZERO_GPU that `spaces` reads as a ZeroGPU Space


def detect(env: Mapping[str, str] = os.environ) -> ModuleType | None:
    """The `spaces` package where this is a ZeroGPU Space (SPACES_ZERO_GPU set, `spaces` importable and agreeing);
    None anywhere else, without importing it."""
    if env.get("SPACES_ZERO_GPU", "").strip().lower() not in ON:
        return None
    try:
        spaces = importlib.import_module("spaces")
        config = importlib.import_module("spaces.config")
    except ImportError:
        log.warning("SPACES_ZERO_GPU is set but the spaces package cannot be imported: the runs take no GPU grant")
        return None
    return spaces if config.Config.zero_gpu else None


@dataclass(frozen=True)
class GpuCost:
    """What a click's grant is sized by, in seconds: upper estimates for a 7-8B bf16 target with a 0.5-1B draft on
    ZeroGPU's default size (half an H200) with static steps. The measurements are this project's own, on one full H200
    with a 7B-shaped target (docs/RESULTS.md, "GPU path", run 4)."""

    # a grant's start: a fresh worker's CUDA start, the pair's weights copied to its GPU (about 16 GB for a 7-8B pair),
    # the engine's compiled kernels loaded. An allowance, not measured on ZeroGPU
    start_s: float = 20.0
    # a prompt token read: 32K tokens were prefilled in 2.3 s (0.07 ms a token); half the GPU's compute doubles that,
    # and the draft reads the prompt too. Runs racing on one prompt share the target's prefill; each is still counted
    prefill_s: float = 0.0002
    # a new token, at one token a step (every guess rejected, the worst case): an eager SpecExtend step at 16K took
    # 68.5 ms (verification 48.3, drafting 16.7, retrieval 3.5), the target alone 23-45 ms. Eager steps are bound by
    # kernel launches on the host, which half a GPU does not slow down
    decode_s: float = 0.08
    # the longest grant a click asks for (SPECEXTEND_ZEROGPU_MAX_S). ZeroGPU grants 60 s unless asked; the seconds asked
    # for must fit the visitor's daily quota (2 minutes without an account at the time of writing)
    max_s: int = 120


def estimate_seconds(prompt_tokens: int, new_tokens: int, runs: int, cost: GpuCost = GpuCost()) -> int:
    """Whole seconds of GPU to ask for: a grant's start, then `runs` runs that each read `prompt_tokens` and write up
    to `new_tokens`, at `cost`'s upper estimates; at most `cost.max_s`."""
    need = cost.start_s + runs * (prompt_tokens * cost.prefill_s + new_tokens * cost.decode_s)
    return min(cost.max_s, math.ceil(need))


@dataclass(frozen=True)
class StopFlag:
    """Stop, across the process boundary: set once its file exists. The engine only asks `is_set()`, between steps
    and prefill blocks, as it asks a threading.Event."""

    path: str

    def is_set(self) -> bool:
        return os.path.exists(self.path)

    def set(self) -> None:
        Path(self.path).touch()


def static_steps(config: GenerationConfig) -> GenerationConfig:
    """`config` with its decode-time forwards run static where it would capture them (module docstring: why)."""
    if config.attention.steps not in ("auto", "captured"):
        return config
    return config.replace(attention=replace(config.attention, steps="static"))


def grant(loaded: Loaded, spaces: ModuleType, cost: GpuCost) -> Loaded:
    """`loaded` with its GPU work inside grants: a click's whole plan in one decorated generator, and the needle tab's
    head picture (one prefill) in a decorated function; each asks for the seconds `estimate_seconds` gives. The
    decorated functions close over the pair (a forked worker has it); only their arguments cross: ids, configs and a
    StopFlag in, events and a picture out."""

    def runs(prompt_ids: list[int], plan: Plan, stop: StopFlag) -> Iterator[tuple[str, Event]]:
        yield from Click.in_turn(loaded.for_click()).run(prompt_ids, plan, stop)

    def runs_s(prompt_ids: list[int], plan: Plan, stop: StopFlag) -> int:
        return estimate_seconds(len(prompt_ids), max(config.max_new_tokens for _, config in plan), len(plan), cost)

    on_gpu = spaces.GPU(duration=runs_s)(runs)

    def run(prompt_ids: list[int], plan: Plan, stop: threading.Event) -> Iterator[tuple[str, Event]]:
        if stop.is_set() or not plan:  # nothing to run: no grant asked for
            return
        plan = tuple((method, static_steps(config)) for method, config in plan)
        with tempfile.TemporaryDirectory(prefix="specextend-stop-") as folder:
            flag = StopFlag(os.path.join(folder, "stop"))
            events = on_gpu(list(prompt_ids), plan, flag)
            try:
                for item in events:
                    if stop.is_set():
                        flag.set()
                    yield item
            finally:
                events.close()

    heads = None
    if loaded.heads is not None:
        # the Studio keeps the pictures drawn (backend.HeadPictures): a grant is asked for only to draw a new one
        heads = spaces.GPU(duration=lambda ids, span: estimate_seconds(len(ids), 0, 1, cost))(loaded.heads)
    return replace(loaded, granted=Click(run), heads=heads)


def granting(factory: EngineFactory, spaces: ModuleType, cost: GpuCost) -> EngineFactory:
    """A factory whose pairs do their GPU work inside grants (`grant`)."""

    def load(choice, progress) -> Loaded:
        return grant(factory(choice, progress), spaces, cost)

    return load


def serving(settings: Settings) -> Settings:
    """What a ZeroGPU Space serves: its default pair only, loaded before serving, on the main thread where `spaces`
    records the models' move to the GPU (a pair loaded later, on a request's thread, would not be recorded; and every
    recorded model is copied to the GPU at every fresh worker's start, so one pair is what a grant should carry)."""
    return replace(settings, pairs=(settings.default,), default_pair=settings.default.key, preload=True)


def adapt(factory: EngineFactory, settings: Settings, env: Mapping[str, str] = os.environ) -> tuple[EngineFactory, Settings]:
    """The factory and settings the app is built from: on a ZeroGPU Space, pairs whose GPU work runs in grants and the
    default pair served alone, loaded before serving; anywhere else, `factory` and `settings` as they are."""
    spaces = detect(env)
    if spaces is None:
        return factory, settings
    settings = serving(settings)
    log.info("ZeroGPU Space: serving %s; a click's GPU grant is at most %d s", settings.default.label,
             settings.zerogpu_max_s)
    return granting(factory, spaces, GpuCost(max_s=settings.zerogpu_max_s)), settings
