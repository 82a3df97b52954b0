"""Visualizers: pure functions from a trace (a list of engine events, plus a token decoder) to a Plotly
figure dict or an HTML string. Import no gradio and load no models; the same call redraws a live run
or a replayed trace.
"""

from .acceptance import acceptance_spec
from .common import Decode, segments, to_figure
from .needle import answer_html, guesses_html, heads_spec, held_share, needle_spec, signal_html
from .retrieval import far_chunks, far_html, kept_chunks, output_chunks, retrieval_spec
from .text import exactness_html, first_divergence, output_html
from .throughput import phase_breakdown, throughput_html, throughput_spec

__all__ = [
    "Decode", "acceptance_spec", "answer_html", "exactness_html", "first_divergence", "guesses_html", "heads_spec",
    "held_share", "far_chunks", "far_html", "kept_chunks", "needle_spec", "output_chunks", "output_html",
    "phase_breakdown", "retrieval_spec", "segments", "signal_html", "throughput_html", "throughput_spec", "to_figure",
]
