"""Stepping through a finished run: the Studio's handlers for the step control (show it after a run, a step's panels,
previous and next, a click on a panel, the run picked, play and pause). Each answers in `app.updates`' plain values.
Knows a session's finished job and the panels as of one step; knows nothing of gradio, of the page's layout, or of
how a run is started.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

from visualizers.common import label
from visualizers.steps import last_step, step_html

from .panels import about_html, step_view
from .runner import Job
from .updates import KEEP, Update, figure

if TYPE_CHECKING:
    from .studio import SessionState

STEP_PANELS = 7  # what moving the step control redraws: output, exactness, retrieval, far, acceptance, speed, step
PLAY, PAUSE = "▶ play", "❚❚ pause"  # the play button's label while paused, and while playing (glyphs DejaVu Sans has)


def whole_step(value: Any) -> int | None:
    """A step as the page sends it (a number typed into the slider's box, or text) rounded to a whole one (half up);
    None when it is no number. Typed values are not checked against the slider's range before they arrive here."""
    if value is None or value == "":
        return 0
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return math.floor(number + 0.5) if math.isfinite(number) else None


class Stepping:
    """The step control's handlers (a part of the Studio): they read the session's last job, once it has finished."""

    @staticmethod
    def _finished(state: SessionState | None) -> Job | None:
        """The session's last job, if it finished with runs to step through (they no longer change: no snapshot)."""
        job = state.job if state is not None else None
        return job if job is not None and job.done.is_set() and job.runs and job.codec is not None else None

    @staticmethod
    def hide_stepper() -> tuple:
        """While a run or a replay goes: the step control hidden, its timer stopped, its play button paused, and the
        trace download hidden (the run's last answer brings its trace)."""
        return Update(visible=False), Update(active=False), PLAY, False, Update(visible=False)

    def stepper(self, state: SessionState) -> tuple:
        """After a run or a replay: the step control over its runs, on the main run at its last step, and the trace
        download shown (both hidden when nothing ran)."""
        job = self._finished(state)
        if job is None:
            return Update(visible=False), KEEP, KEEP, "", Update(visible=False)
        # a run stopped before its first step has nothing to step through; where none has one, the control says so
        stepped = {m: events for m, events in job.runs.items() if last_step(events)}
        runs = stepped or job.runs
        primary = job.methods[0] if job.methods and job.methods[0] in runs else next(iter(runs))
        last = last_step(runs[primary])
        slider = Update(visible=True, minimum=0, maximum=last, value=last) if stepped else Update(visible=False)
        return (Update(visible=True), Update(choices=tuple((label(m), m) for m in runs), value=primary), slider,
                step_html(runs[primary], last, job.codec.text), Update(visible=True))

    def at_step(self, state: SessionState, method: str, step: float) -> tuple:
        """Every panel as of `step` of the run `method` (rounded, and kept within the run), and that step in words
        (STEP_PANELS' order)."""
        job = self._finished(state)
        runs = job.runs if job is not None else {}
        at = whole_step(step)
        if method not in runs or at is None:
            return (KEEP,) * STEP_PANELS
        step = max(0, min(at, last_step(runs[method])))
        view = step_view(runs, method, step, job.codec.decode, job.codec.text, not_run=job.not_run())
        return (about_html(job.about) + view.output, view.exactness, figure(view.retrieval), view.far,
                figure(view.acceptance), figure(view.throughput), step_html(runs[method], step, job.codec.text))

    def _last(self, state: SessionState, method: str) -> int:
        job = self._finished(state)
        runs = job.runs if job is not None else {}
        return last_step(runs[method]) if method in runs else 0

    def step_by(self, delta: int) -> Callable[..., tuple]:
        """A handler that moves the control `delta` steps (within the run) and redraws; with 0, it follows a step typed
        or dragged: rounded and kept within the run, the control is set to the step shown where the two differ (12.5,
        999 or -5 typed), so the box, the slider and the panels agree."""
        def move(state: SessionState, method: str, step: float) -> tuple:
            at = whole_step(step)
            if at is None:  # no number: nothing moves
                return (KEEP,) * (STEP_PANELS + 1)
            return self._go(state, method, at + delta, step if delta == 0 else None)

        return move

    def _go(self, state: SessionState, method: str, at: int, shown: Any = None) -> tuple:
        """The control set to step `at`, kept within the run, and every panel redrawn there; the control is left as
        it is where it already shows that step (`shown`: what it showed), so a drag is not pulled back."""
        target = max(0, min(at, self._last(state, method)))
        return (KEEP if target == shown else target, *self.at_step(state, method, target))

    def pick_run(self, state: SessionState, method: str) -> tuple:
        """The control follows the run picked: its steps, at its last one."""
        last = self._last(state, method)
        return (Update(maximum=max(last, 1), value=last), *self.at_step(state, method, last))

    def jump(self, state: SessionState, method: str, value: str) -> tuple:
        """A click on a panel asked for a step (`step:nonce`, so the same step twice is two changes)."""
        step = whole_step(str(value).split(":")[0])
        if step is None:
            return (KEEP,) * (STEP_PANELS + 1)
        return self._go(state, method, step)

    def play(self, state: SessionState, method: str, step: float, pace: str, playing: bool) -> tuple:
        """Play (from the start when at the end) or pause: the timer, the button's label, whether playing, the step."""
        if playing:
            return Update(active=False), PLAY, False, KEEP
        at = whole_step(step) or 0
        start = 0 if at >= self._last(state, method) else max(0, at)
        return Update(value=float(pace), active=True), PAUSE, True, start

    def tick(self, state: SessionState, method: str, step: float) -> tuple:
        """One step on while playing; at the last step the timer stops."""
        moved = self.step_by(1)(state, method, step)
        done = not isinstance(moved[0], int) or moved[0] >= self._last(state, method)  # no number: nothing to play
        stop = (Update(active=False), PLAY, False) if done else (KEEP, KEEP, True)
        return (*moved, *stop)
