"""SpecExtend Studio, the web app: Gradio layout and wiring, tokenization, sessions, uploads and limits.
`build_app(factory, settings)` builds it without loading any model; `launch` serves it.
"""

from .backend import Codec, EngineFactory, Loaded, real_factory
from .settings import PairChoice, Settings
from .ui import build_app, launch

__all__ = ["Codec", "EngineFactory", "Loaded", "PairChoice", "Settings", "build_app", "launch", "real_factory"]
