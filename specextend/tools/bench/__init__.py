"""Benchmark: `python -m specextend.tools.bench [--quick] [--out results/]`.

Measures the engine against its baselines on the bundled pair (or, with --quick, a check of the whole
pipeline in seconds: a tiny random-init target with a copy of itself as the draft, the bundled pair's
tokenizer, short inputs):

- the grid: every method and SpecExtend ablation, plus transformers' own assisted generation on the same
  pair, on bundled eval documents cut to several input lengths with a summarization instruction; a
  warm-up, methods alternated on the same input, repeats, medians with min/max. Greedy outputs are
  compared across methods on every input; a mismatch stops the run (`GreedyMismatch`).
- needle retrieval (the paper's Table 1): needles planted in the bundled documents (or --needle-docs); per
  retrieval signal (the paper's, the default, --signal's) and for StreamingLLM, whether the working cache
  holds the whole needle after the first retrieval (`needle.hold_rate` in the last JSON line), and whether
  the draft alone answers from its full cache, StreamingLLM's window or CMR's cache per signal.
- a sweep of the retrieval parameters (the paper's Table 5): working cache, chunk size, top-k, frequency.
- long outputs (with --long-output; the paper's second workload): the bundled short prompts (or
  --long-output-prompts) with an instruction to write at length, --long-output-tokens new tokens, for the target
  alone, the full draft cache, StreamingLLM, CMR and CMR with lookup: tokens per step in each window of output
  positions (the draft's working cache fills with the output itself), tokens/s and the speedup over the target
  alone on the same prompt; methods alternated, greedy outputs compared as in the grid.

Every engine number comes from the engine's own events (metrics.summarize); assisted generation is timed
by a streamer. Tokenization goes through specextend.tools.prompting, as the CLI's and the app's does. Shows a
progress bar on stderr, prints a table and, as its last line, one JSON object; writes JSON, CSV and Markdown to the
results folder first, then Plotly figures (HTML; PNG when kaleido finds a browser). A figure that cannot be drawn is
reported (on stderr and in the JSON's `figure_errors` and `png`), never fatal. Plotly and tokenizers are imported
only where they are used.

Parts: `inputs` (methods and prompts), `runs` (one run, the greedy check, medians, goals), `sections` (needle
retrieval, the retrieval sweep, long outputs), `report` (files and tables; the figures come from visualizers.bench), `main`
(the run and its command line).
"""

from .inputs import METHODS, PEERS, cut_text, make_inputs, make_prompt
from .main import build_parser, load, main
from .runs import run_engine

__all__ = ["METHODS", "PEERS", "build_parser", "cut_text", "load", "main", "make_inputs", "make_prompt", "run_engine"]
