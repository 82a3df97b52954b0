"""What a click's answer does to one widget of the page, in plain values: the Studio's handlers answer in these and
`app/ui.py` turns them into gradio's updates in one place. A handler's answer per widget is one of:

- `KEEP`: leave the widget as it is;
- a plain value (str, int, float, bool): set the widget's value;
- `Figure`: a Plotly figure, serialised once, for a plot;
- `Update`: change some of the widget's properties (show or hide it, set a slider's range, relabel a box, start or
  stop a timer), and its value with them where `value` is given.

A handler with no widget to answer may answer `Halt`: the click's chain of events ends there.

Knows nothing of gradio, of what a figure shows, or of the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import orjson


@dataclass(frozen=True)
class Keep:
    """Leave the widget as it is."""


KEEP = Keep()


@dataclass(frozen=True)
class Figure:
    """A plot's figure, its dict serialised once as JSON bytes (compared as bytes, so an unchanged one is not resent)."""

    json: bytes


@dataclass(frozen=True)
class Update:
    """Some of a widget's properties, changed; a field left None stays as it is."""

    value: Any = None
    visible: bool | None = None
    label: str | None = None
    placeholder: str | None = None
    choices: tuple[tuple[str, str], ...] | None = None  # (shown, value) for each choice
    minimum: float | None = None
    maximum: float | None = None
    active: bool | None = None  # a timer ticks

    def changes(self) -> dict[str, Any]:
        """The properties this update sets, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class Halt:
    """End the click's chain of events here, silently: the events chained after this one do not run (the page
    already says why: `reason`)."""

    reason: str


def figure(spec: dict[str, Any] | None) -> Figure | Keep:
    """A figure dict as a plot's new figure (serialised with orjson), or None as the plot left as it is."""
    return KEEP if spec is None else Figure(orjson.dumps(spec))
