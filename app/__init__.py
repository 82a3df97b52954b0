"""SpecExtend Studio, the web app: Gradio layout and wiring, tokenization, sessions, uploads and limits.
`build_app(factory, settings)` builds it without loading any model; `launch` serves it. Those two come from
`app.ui` on first use, so importing the package (or its gradio-free modules: `app.studio`, `app.soak`,
`app.preset_check`, ...) imports no gradio.
"""

from typing import Any

from .backend import Codec, EngineFactory, Loaded, real_factory
from .settings import PairChoice, Settings

__all__ = ["Codec", "EngineFactory", "Loaded", "PairChoice", "Settings", "build_app", "launch", "real_factory"]


def __getattr__(name: str) -> Any:
    """`build_app` and `launch`, from the page's module, imported when first asked for."""
    if name in ("build_app", "launch"):
        from . import ui

        return getattr(ui, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
