"""Stepping through a finished run: the Studio's handlers for the step control (show it after a run, a step's panels,
previous and next, a click on a panel, the run picked, play and pause). Each answers in `app.updates`' plain values.
Knows a session's finished job and the panels as of one step; knows nothing of gradio, of the page's layout, or of
how a run is started.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from visualizers.common import label
from visualizers.steps import last_step, step_html

from .panels import step_view
from .runner import Job
from .updates import KEEP, Update, figure

if TYPE_CHECKING:
    from .studio import SessionState

STEP_PANELS = 7  # what moving the step control redraws: output, exactness, retrieval, far, acceptance, speed, step
PLAY, PAUSE = "▶ play", "⏸ pause"  # the play button's label while paused, and while playing


class Stepping:
    """The step control's handlers (a part of the Studio): they read the session's last job, once it has finished."""

    @staticmethod
    def _finished(state: SessionState | None) -> Job | None:
        """The session's last job, if it finished with runs to step through (they no longer change: no snapshot)."""
        job = state.job if state is not None else None
        return job if job is not None and job.done.is_set() and job.runs and job.codec is not None else None

    @staticmethod
    def hide_stepper() -> tuple:
        """While a run or a replay goes: the step control hidden, its timer stopped, its play button paused."""
        return Update(visible=False), Update(active=False), PLAY, False

    def stepper(self, state: SessionState) -> tuple:
        """After a run or a replay: the step control over its runs, on the main run at its last step."""
        job = self._finished(state)
        if job is None:
            return Update(visible=False), KEEP, KEEP, ""
        runs = job.runs
        primary = job.methods[0] if job.methods and job.methods[0] in runs else next(iter(runs))
        last = last_step(runs[primary])
        return (Update(visible=True), Update(choices=tuple((label(m), m) for m in runs), value=primary),
                Update(minimum=0, maximum=max(last, 1), value=last), step_html(runs[primary], last, job.codec.text))

    def at_step(self, state: SessionState, method: str, step: float) -> tuple:
        """Every panel as of `step` of the run `method`, and that step in words (STEP_PANELS' order)."""
        job = self._finished(state)
        runs = job.runs if job is not None else {}
        if method not in runs:
            return (KEEP,) * STEP_PANELS
        step = max(0, min(int(step or 0), last_step(runs[method])))
        view = step_view(runs, method, step, job.codec.decode, job.codec.text)
        return (view.output, view.exactness, figure(view.retrieval), view.far, figure(view.acceptance),
                figure(view.throughput), step_html(runs[method], step, job.codec.text))

    def _last(self, state: SessionState, method: str) -> int:
        job = self._finished(state)
        runs = job.runs if job is not None else {}
        return last_step(runs[method]) if method in runs else 0

    def step_by(self, delta: int) -> Callable[..., tuple]:
        """A handler that moves the control `delta` steps (within the run) and redraws."""
        def move(state: SessionState, method: str, step: float) -> tuple:
            target = max(0, min(int(step or 0) + delta, self._last(state, method)))
            return (target, *self.at_step(state, method, target))

        return move

    def pick_run(self, state: SessionState, method: str) -> tuple:
        """The control follows the run picked: its steps, at its last one."""
        last = self._last(state, method)
        return (Update(maximum=max(last, 1), value=last), *self.at_step(state, method, last))

    def jump(self, state: SessionState, method: str, value: str) -> tuple:
        """A click on a panel asked for a step (`step:nonce`, so the same step twice is two changes)."""
        try:
            step = int(str(value).split(":")[0])
        except ValueError:
            return (KEEP,) * (STEP_PANELS + 1)
        return self.step_by(0)(state, method, step)

    def play(self, state: SessionState, method: str, step: float, pace: str, playing: bool) -> tuple:
        """Play (from the start when at the end) or pause: the timer, the button's label, whether playing, the step."""
        if playing:
            return Update(active=False), PLAY, False, KEEP
        start = 0 if int(step or 0) >= self._last(state, method) else int(step or 0)
        return Update(value=float(pace), active=True), PAUSE, True, start

    def tick(self, state: SessionState, method: str, step: float) -> tuple:
        """One step on while playing; at the last step the timer stops."""
        moved = self.step_by(1)(state, method, step)
        done = moved[0] >= self._last(state, method)
        stop = (Update(active=False), PLAY, False) if done else (KEEP, KEEP, True)
        return (*moved, *stop)
