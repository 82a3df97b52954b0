"""Runs behind one click: load the pair, tokenize, then run each method in turn on the same prompt, in a
background thread, collecting events. The UI thread only reads snapshots, so drawing never blocks
generation. Also builds a GenerationConfig from the UI's knobs, and replays a recorded trace.
Knows the engine's contract and events; knows nothing of gradio or figures.
"""

from __future__ import annotations

import contextvars
import ctypes
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Iterable, Iterator, Sequence

from specextend.config import DraftConfig, GenerationConfig, LookupConfig, RetrievalConfig, default_chain, preset
from specextend.events import Event, Finished, Prefilled, Prefilling, Started, Verified
from specextend.tools.prompting import Prompt
from visualizers.common import label

from .backend import Click, Codec

log = logging.getLogger(__name__)


def serving_chain() -> int:
    """The chain length k a run gets unless the user sets one (the page's knob, the API's default, the needle tab's):
    config.default_chain for the device the app's models load on (load_pair's "auto": CUDA where there is one). Asked
    when a Knobs is made, not on import, so it sees the device as load_pair then does (on a ZeroGPU Space, once
    `zerogpu.adapt` has loaded `spaces`)."""
    from specextend.models import choose_device  # transformers too: imported when first asked, as real_factory does

    return default_chain(choose_device().type)


@dataclass(frozen=True)
class Knobs:
    """The method's settings as the UI collects them."""

    max_new_tokens: int = 96
    chunk_size: int = 32
    top_k: int = 16
    retrieve_every: int = 4
    shape: str = "chain"
    k: int = field(default_factory=serving_chain)  # the device's: 2 on CPU, 4 on CUDA
    max_depth: int = 5
    node_budget: int = 12
    temperature: float = 0.0
    seed: int = 0
    lookup: bool = True  # add lookup branches to every drafting method's tree in a click (lookup alone has them)
    signal: str = "default"  # CMR's retrieval signal by name (config.SIGNAL_NAMES)


def whole(name: str, value: float | int | None) -> int:
    """A setting that must be a whole number, as an int; a ValueError that names it otherwise."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or int(value) != value:
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return int(value)


# the engine's field names, as the knobs are labelled on the page (the engine's refusals name its fields)
USER_WORDS = (("tree max_depth", "tree depth"), ("tree node_budget", "tree node budget"),
              ("max_new_tokens", "max new tokens"), ("chunk_size", "chunk size"),
              ("top_k=", "top-k chunks kept = "), ("top_k", "top-k chunks kept"),
              ("retrieve_every", "retrieve every (steps)"), ("sink_tokens=", "attention-sink tokens = "),
              ("sink_tokens", "attention-sink tokens"), (" or a RetrievalSignal", ""))


def in_user_words(message: str) -> str:
    """An engine refusal with its field names replaced by the knobs' labels."""
    for name, words in USER_WORDS:
        message = message.replace(name, words)
    return message


def build_config(method: str, knobs: Knobs, eos_ids: Sequence[int] = (), max_new_tokens_cap: int = 1024,
                 lookup: bool = False) -> GenerationConfig:
    """The method's preset with the user's knobs; every nonsense setting is a ValueError with a readable message
    in the page's words. `lookup` adds lookup branches to a draft-model method when the knobs ask for them."""
    try:
        return _config(method, knobs, eos_ids, max_new_tokens_cap, lookup)
    except ValueError as exc:
        raise ValueError(in_user_words(str(exc))) from exc


def _config(method: str, knobs: Knobs, eos_ids: Sequence[int], max_new_tokens_cap: int, lookup: bool
            ) -> GenerationConfig:
    new = whole("max new tokens", knobs.max_new_tokens)
    if new > max_new_tokens_cap:
        raise ValueError(f"max new tokens is capped at {max_new_tokens_cap} on this server, got {new}")
    if knobs.temperature is None or knobs.temperature != knobs.temperature:
        raise ValueError("temperature must be a number (0 is greedy)")
    draft = DraftConfig(shape=knobs.shape, k=whole("chain length k", knobs.k),
                        max_depth=whole("tree depth", knobs.max_depth),
                        node_budget=whole("tree node budget", knobs.node_budget))
    retrieval = RetrievalConfig(chunk_size=whole("chunk size", knobs.chunk_size), top_k=whole("top-k chunks", knobs.top_k),
                                retrieve_every=whole("retrieve every", knobs.retrieve_every), signal=knobs.signal)
    merged = lookup and bool(knobs.lookup) and method not in ("autoregressive", "lookup")
    return preset(method, max_new_tokens=new, temperature=float(knobs.temperature), seed=whole("seed", knobs.seed),
                  eos_token_ids=tuple(eos_ids), draft=draft, retrieval=retrieval,
                  lookup=LookupConfig(enabled=True if merged else None))


@dataclass
class Job:
    """One click's runs, keyed by method, filled by a background thread.

    `prepare` loads what is needed (reporting through `say`) and returns the codec, the prompt, the
    model's position limit and a `generate` callable (each planned method then runs in turn on it) or a `Click` (the
    whole plan in one call: one GPU grant on a ZeroGPU Space). The thread carries the context of the call that started
    it (gradio's request: a ZeroGPU grant is charged to the visitor who clicked).
    """

    methods: Sequence[str]
    configs: Callable[[str, Codec], GenerationConfig]
    prepare: Callable[[Callable[[str], None]], tuple]
    runs: dict[str, list[Event]] = field(default_factory=dict)
    status: str = "Starting"
    notice: str = ""  # a word for the user that progress lines must not overwrite (Run pressed during the run)
    about: str = ""  # what the click is, said before every status line and over the output (a replay: whose trace)
    error: str = ""
    codec: Codec | None = None
    prompt: Prompt | None = None
    stop_event: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    began: float = 0.0  # perf_counter when it started, and when it ended
    ended: float = 0.0
    wake: threading.Event = field(default_factory=threading.Event)  # set when it ends or a notice is given

    def say(self, message: str) -> None:
        self.status = message

    def notify(self, notice: str) -> None:
        """Give the user a word that progress lines must not overwrite; a redraw waiting in `wait` shows it now."""
        self.notice = notice
        self.wake.set()

    def wait(self, timeout: float) -> bool:
        """Until it ends, a notice is given or `timeout` seconds pass (a redraw's pace); whether it has ended."""
        self.wake.wait(timeout)
        self.wake.clear()
        return self.done.is_set()

    def start(self) -> Job:
        self.began = time.perf_counter()
        context = contextvars.copy_context()
        threading.Thread(target=context.run, args=(self._work,), name="specextend-job", daemon=True).start()
        return self

    def stop(self) -> None:
        self.stop_event.set()

    def _work(self) -> None:
        try:
            self._run()
        except ValueError as exc:  # the engine's and our own refusals carry a message for the user
            self.error = str(exc)
        except Exception as exc:  # a thread boundary: report it in the UI rather than lose it
            log.exception("run failed")
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.ended = time.perf_counter()
            self.done.set()
            self.wake.set()
        release_memory()  # the run's caches and prefill copies went with _run's frame: hand their pages back

    def _run(self) -> None:
        self.codec, self.prompt, limit, generate = self.prepare(self.say)
        plan = [(method, self.configs(method, self.codec)) for method in self.methods]
        for _, config in plan:  # every run is checked before any starts (and before a GPU is asked for)
            if len(self.prompt.ids) + config.max_new_tokens > limit:
                raise ValueError(
                    f"The prompt is {len(self.prompt.ids):,} tokens; with {config.max_new_tokens} new tokens that "
                    f"exceeds the model's limit of {limit:,} positions. Shorten the document or ask for fewer tokens."
                )
        if not plan:
            return
        click = generate if isinstance(generate, Click) else Click.in_turn(generate)
        for method, event in click.run(self.prompt.ids, plan, self.stop_event):
            self.runs.setdefault(method, []).append(event)
            self.status = describe(method, event)

    def not_run(self) -> dict[str, str]:
        """Once the click has ended early (stopped, or failed): its methods that never started, each with why."""
        why = "stopped" if self.stop_event.is_set() else "the click failed" if self.error else ""
        if not why or not self.done.is_set():
            return {}
        return {m: why for m in self.methods if m not in self.runs}

    def snapshot(self) -> dict[str, list[Event]]:
        """A copy of the runs so far, safe to read while the thread appends."""
        return {m: list(ev) for m, ev in list(self.runs.items())}


@lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, where the C library has one."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


def release_memory() -> None:
    """After a run: hand the heap pages it freed back to the system. glibc keeps them otherwise, and the app's resident
    memory grew with every run's peak (docs/APP.md, "Memory"). A run leaves no reference cycles to collect first."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@dataclass(frozen=True)
class Clock:
    """When a finished job began and ended: all the queue's estimate reads of it."""

    began: float
    ended: float
    done: threading.Event


class Recent:
    """The last `size` jobs, for the queue's estimate: a finished job is kept as its Clock, not with its runs and
    prompt (those stay with the session that shows them, and go with it)."""

    def __init__(self, size: int) -> None:
        self._jobs: deque[Job | Clock] = deque(maxlen=size)
        self._lock = threading.Lock()

    def append(self, job: Job) -> None:
        with self._lock:
            self._jobs.append(job)
            self._sweep()

    def __iter__(self) -> Iterator[Job | Clock]:
        with self._lock:
            self._sweep()
            return iter(list(self._jobs))

    def __len__(self) -> int:
        return len(self._jobs)

    def _sweep(self) -> None:
        for i, job in enumerate(self._jobs):
            if isinstance(job, Job) and job.done.is_set():
                self._jobs[i] = Clock(job.began, job.ended, job.done)


def describe(method: str, event: Event) -> str:
    """One line on what a run is doing, from its latest event."""
    name = label(method)
    if isinstance(event, Started):
        read = f"; the prompt read in {event.prefill_dtype}" if event.prefill_dtype not in ("", event.dtype) else ""
        return (f"{name}: started on {event.device} ({event.dtype}, {event.numerics} numerics{read}), reading "
                f"{len(event.prompt_ids):,} prompt tokens")
    if isinstance(event, Prefilling):
        return f"{name}: prefill of the {event.model}, {event.done:,} of {event.total:,} tokens read"
    if isinstance(event, Prefilled) and event.shared:
        return f"{name}: the target's prefill is shared with the first run ({event.target_s:.2f} s); generating"
    if isinstance(event, Prefilled):
        return f"{name}: prefill done in {event.elapsed_s:.2f} s; generating"
    if isinstance(event, Verified):
        return f"{name}: step {event.step}, {event.total_new} tokens generated"
    if isinstance(event, Finished):
        return f"{name}: finished ({event.stop_reason}) after {event.steps} steps"
    return f"{name}: {type(event).__name__.lower()} at step {getattr(event, 'step', 0)}"


def replay(runs: dict[str, list[Event]], speed: float) -> Callable:
    """A `generate` that plays recorded runs back: at `speed` x their recorded pace (1: each event as long after the
    run's start as it came in the recorded run; 0: all at once). Stop ends a wait at once. The times were checked on
    loading (`trace.check_times`: within a day, never going back), so a wait is as long as the recorded run's."""

    def generate(prompt_ids: list[int], config: GenerationConfig, stop: threading.Event | None) -> Iterable[Event]:
        events = runs[config.method]
        began = time.perf_counter()
        stop = stop or threading.Event()
        played = 0.0  # the recorded run's clock as far as the replay has played it
        for event in events:
            if speed > 0:
                stop.wait(max(0.0, event.t_s / speed - (time.perf_counter() - began)))
            if stop.is_set():  # stopped between two events: its clock stops where the replay had got to
                now = min(event.t_s, (time.perf_counter() - began) * speed) if speed > 0 else played
                yield Finished(max(played, now), 0.0, (), "stopped", 0, len(prompt_ids), "replay stopped")
                return
            played = event.t_s
            yield event

    return generate


@dataclass
class RedrawMeter:
    """Paces redraws: at most every `redraw_s`, and rarer when drawing costs more than `share` of the time.

    The cost counted is the CPU time the drawing thread spends building and serialising the panels
    (measured, so it grows with the document and the run). Gradio's send is timed too, on the wall
    clock, and reported: on a busy machine that time is mostly waiting for a core, not work.
    `python -m app.overhead --browser` measures the whole cost, browser included, against generation.
    """

    redraw_s: float
    share: float
    began: float = field(default_factory=time.perf_counter)
    draws: int = 0
    draw_s: float = 0.0  # CPU seconds building figures and HTML
    send_s: float = 0.0  # wall seconds between our yield and the next resume (gradio sending)
    last_draw: float = 0.0
    yielded_at: float = 0.0
    _cpu: float = 0.0

    def wait(self) -> float:
        return max(self.redraw_s, self.last_draw / self.share)

    def start(self) -> None:
        self._cpu = time.thread_time()

    def drew(self) -> None:
        self.last_draw = time.thread_time() - self._cpu
        self.draws += 1
        self.draw_s += self.last_draw
        self.yielded_at = time.perf_counter()

    def resumed(self) -> None:
        self.send_s += time.perf_counter() - self.yielded_at

    def line(self) -> str:
        wall = max(time.perf_counter() - self.began, 1e-9)
        n = max(self.draws, 1)
        return (f"panels redrawn {self.draws} times ({self.draws / wall:.1f}/s); drawing took {self.draw_s * 1000 / n:.0f} ms "
                f"of CPU each ({self.draw_s / wall:.1%} of the time), gradio's send {self.send_s * 1000 / n:.0f} ms")
