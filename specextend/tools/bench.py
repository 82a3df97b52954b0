"""Benchmark: `python -m specextend.tools.bench [--quick] [--out results/]`.

Measures the engine against its baselines on the bundled pair (or, with --quick, a check of the whole
pipeline in seconds: a tiny random-init target with a copy of itself as the draft, the bundled draft's
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

Every engine number comes from the engine's own events (metrics.summarize); assisted generation is timed
by a streamer. Tokenization goes through the CLI's helpers. Shows a progress bar on stderr, prints a table
and, as its last line, one JSON object; writes JSON, CSV and Plotly figures (HTML; PNG when kaleido is
installed) to the results folder. Plotly and tokenizers are imported only where they are used.
"""

from __future__ import annotations

import argparse
import copy
import csv
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from . import bundled, prompting
from .cli import add_lookup_arguments, add_signal_arguments, lookup_from, signal_from
from ..config import AttentionConfig, DraftConfig, GenerationConfig, LookupConfig, RetrievalConfig, preset
from ..drafting import DraftTree, ModelDrafter
from ..engine import Target, generate
from ..events import Finished
from .kernel_bench import llama
from ..methods import DraftCache
from ..metrics import PHASES, summarize
from ..models import ModelPair, load_pair, make_pair
from .probe import holds, needle_prompt, read_signals
from ..retrieval import make_policy
from ..signal import resolve

ASSISTED = "hf_assisted"  # transformers' generate(..., assistant_model=draft): the outside reference
PROMPT_LOOKUP = "hf_prompt_lookup"  # transformers' generate(..., prompt_lookup_num_tokens=10): lookup's peer
PEERS = (ASSISTED, PROMPT_LOOKUP)  # run by transformers, not by this engine
HF_LOOKUP_TOKENS = 10  # the prompt_lookup_num_tokens transformers' documentation uses
METHODS = ("autoregressive", "speculative", "streaming", "specextend", "specextend_paper", "cmr_only", "fused_prefill_only",
           "hta_only", "lookup", "specextend_lookup", ASSISTED, PROMPT_LOOKUP)
BASELINES = ("autoregressive", "speculative", ASSISTED, PROMPT_LOOKUP)
QUICK_SHAPE = (2, 64, 4, 2, 128)  # --quick target: layers, hidden, heads, KV heads, MLP width
QUICK = dict(lengths="160,336", docs=1, repeats=1, max_new_tokens=8, needles=2, needle_tokens=240,
             needle_depths="0.3,0.7", retrieval=RetrievalConfig(chunk_size=16, top_k=8, retrieve_every=2,
                                                                      prefill_window=64))


class GreedyMismatch(RuntimeError):
    """Two methods produced different greedy outputs on the same input."""


# ---------------------------------------------------------------- methods and inputs


def method_configs(base: dict, prefill: str, lookup: LookupConfig) -> dict[str, GenerationConfig | None]:
    """name -> engine config (None: a transformers peer). `prefill` is the baselines' prefill kernel: 'fused'
    (SDPA, what transformers does by default) or 'eager' (the paper's baseline). `lookup`: lookup's knobs."""
    speculative = preset("speculative", attention=AttentionConfig(prefill, "masked"), **base)
    return {
        "autoregressive": preset("autoregressive", attention=AttentionConfig(prefill, "auto", "auto"), **base),
        "speculative": speculative,
        "streaming": preset("streaming", attention=AttentionConfig(prefill, "masked"), **base),
        "specextend": preset("specextend", **base),
        "specextend_paper": preset("specextend", **{**base, "retrieval": replace(base["retrieval"], signal="paper")}),
        "cmr_only": speculative.replace(cmr=True),
        "fused_prefill_only": speculative.replace(attention=AttentionConfig("fused", "masked")),
        "hta_only": speculative.replace(attention=AttentionConfig(prefill, "hybrid")),
        "lookup": preset("lookup", lookup=replace(lookup, enabled=None), **base),
        "specextend_lookup": preset("specextend", lookup=replace(lookup, enabled=True), **base),
        ASSISTED: None,
        PROMPT_LOOKUP: None,
    }


def aliases(configs: dict[str, GenerationConfig | None]) -> dict[str, str]:
    """Methods whose config equals an earlier one's (fused_prefill_only is speculative under --prefill fused)."""
    seen: dict[GenerationConfig, str] = {}
    out = {}
    for name, config in configs.items():
        if config is not None and config in seen:
            out[name] = seen[config]
        elif config is not None:
            seen[config] = name
    return out


def cut_text(tokenizer, text: str, tokens: int) -> str:
    """The first `tokens` target tokens of `text`, as text."""
    return tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][: max(tokens, 1)])


def make_prompt(tokenizer, text: str, length: int, instruction: str) -> list[int]:
    """A chat prompt of about `length` tokens: the document's start, then the instruction (at most `length`)."""
    overhead = len(prompting.encode(tokenizer, "", instruction).ids)
    return prompting.encode(tokenizer, cut_text(tokenizer, text, length - overhead), instruction, limit=length).ids


def make_inputs(tokenizer, lengths: list[int], n_docs: int, instruction: str) -> list[dict]:
    """The `n_docs` longest eval documents, each cut to every length (the same documents at every length)."""
    docs = sorted(bundled.documents("eval"), key=lambda d: -d.tokens)[:n_docs]
    return [{"length": length, "document": d.name, "prompt": make_prompt(tokenizer, d.text(), length, instruction)}
            for length in lengths for d in docs]


# ---------------------------------------------------------------- one run


class _StepClock:
    """A transformers streamer that notes when each batch of tokens arrives (the first is the prompt)."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.marks.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass


def run_peer(pair: ModelPair, prompt: list[int], config: GenerationConfig, name: str) -> dict:
    """A transformers peer, greedy: assisted generation with its default draft settings (restored after each
    call), or prompt lookup decoding with its documented settings."""
    ids = torch.tensor([prompt], device=pair.device)
    clock = _StepClock()
    saved = copy.deepcopy(pair.draft.generation_config)  # its confidence threshold adapts and persists otherwise
    eos = list(config.eos_token_ids) or None
    drafting = {"assistant_model": pair.draft} if name == ASSISTED else {"prompt_lookup_num_tokens": HF_LOOKUP_TOKENS}
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            out = pair.target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=config.max_new_tokens, eos_token_id=eos,
                                       pad_token_id=eos[0] if eos else None, streamer=clock, **drafting)
    finally:
        pair.draft.generation_config = saved
    new = out[0, len(prompt):].tolist()
    steps = clock.marks[1:]  # one batch per verification step
    (first_t, first_n), (last_t, _) = steps[0], steps[-1]
    decode_s = last_t - first_t
    return {"token_ids": new, "decode_tokens_per_s": (len(new) - first_n) / decode_s if decode_s > 0 else 0.0,
            "e2e_tokens_per_s": len(new) / (last_t - start), "mean_accepted": len(new) / len(steps),
            "acceptance_by_position": None, "phase_seconds": None, "cmr_overhead_share": None, "steps": len(steps),
            "retrievals": None, "stop_reason": "eos" if eos and new[-1] in eos else "max_new_tokens",
            "tokens_by_source": None}


def run_engine(pair: ModelPair, prompt: list[int], config: GenerationConfig) -> dict:
    trace = list(generate(pair, prompt, config))
    finished = trace[-1]
    assert isinstance(finished, Finished)
    s = summarize(trace)
    return {"token_ids": list(finished.token_ids), "decode_tokens_per_s": s.decode_tokens_per_s,
            "e2e_tokens_per_s": s.e2e_tokens_per_s, "mean_accepted": s.mean_accepted if s.steps else None,
            "acceptance_by_position": list(s.acceptance_by_position), "phase_seconds": s.phase_seconds,
            "cmr_overhead_share": s.cmr_overhead_share, "steps": s.steps,
            "retrievals": s.retrievals, "stop_reason": s.stop_reason, "tokens_by_source": s.tokens_by_source}


def run_method(pair: ModelPair, prompt: list[int], name: str, config: GenerationConfig | None, max_new_tokens: int,
               eos: tuple[int, ...]) -> dict:
    if config is None:
        return run_peer(pair, prompt, GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=eos), name)
    return run_engine(pair, prompt, config)


def check_same(reference: tuple[str, list[int]], name: str, ids: list[int], where: str) -> None:
    """Raise GreedyMismatch naming both methods and the first differing position."""
    ref_name, ref = reference
    if ids == ref:
        return
    pos = next((i for i, (a, b) in enumerate(zip(ref, ids)) if a != b), min(len(ref), len(ids)))
    show = lambda seq: seq[pos] if pos < len(seq) else "end"  # noqa: E731
    raise GreedyMismatch(f"{where}: the greedy output of {name!r} differs from {ref_name!r} at new token {pos} "
                         f"({name}: {show(ids)}, {ref_name}: {show(ref)}); outputs must be identical")


# ---------------------------------------------------------------- folds


def spread(values: list) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def cells(runs: list[dict], names: list[str], same_as: dict[str, str]) -> list[dict]:
    """One row per (length, method): medians with min/max over documents and repeats; speedups paired by run."""
    by_key = {(r["length"], r["document"], r["repeat"], r["method"]): r for r in runs}
    rows = []
    for length in sorted({r["length"] for r in runs}):
        for name in names:
            mine = [r for r in runs if r["length"] == length and r["method"] == same_as.get(name, name)]
            if not mine:
                continue
            row = {"length": length, "method": name, "same_as": same_as.get(name),
                   "prompt_tokens": statistics.median(r["prompt_tokens"] for r in mine),
                   "new_tokens": statistics.median(len(r["token_ids"]) for r in mine)}
            for field in ("decode_tokens_per_s", "e2e_tokens_per_s", "mean_accepted", "cmr_overhead_share"):
                row[field] = spread([r[field] for r in mine])
            for base in BASELINES:
                for field, label in (("decode_tokens_per_s", "decode"), ("e2e_tokens_per_s", "e2e")):
                    pairs = [(r, by_key.get((length, r["document"], r["repeat"], same_as.get(base, base)))) for r in mine]
                    row[f"{label}_speedup_vs_{base}"] = spread([r[field] / b[field] for r, b in pairs if b and b[field]])
            positions = [r["acceptance_by_position"] for r in mine if r["acceptance_by_position"]]
            row["acceptance_by_position"] = [statistics.median(p[i] for p in positions if i < len(p))
                                             for i in range(max(map(len, positions), default=0))]
            phases = [r["phase_seconds"] for r in mine if r["phase_seconds"]]
            row["phase_seconds"] = {p: statistics.median(x[p] for x in phases) for p in PHASES} if phases else None
            split = [(r["tokens_by_source"], r["steps"]) for r in mine if r["tokens_by_source"] and r["steps"]]
            row["tokens_per_step_by_source"] = {k: statistics.median(t[k] / n for t, n in split)
                                                for k in split[0][0]} if split else None
            rows.append(row)
    return rows


def goals(rows: list[dict]) -> list[dict]:
    """The issue's goals, checked on the longest and the shortest input length of this run."""
    at = {(r["length"], r["method"]): r for r in rows}
    lengths = sorted({r["length"] for r in rows})
    out = []

    def goal(text: str, value, target: float) -> None:
        out.append({"goal": text, "value": value, "target": target, "met": value is not None and value >= target})

    merged = lengths and at.get((lengths[-1], "specextend_lookup"))
    if merged:  # lookup drafting's goals: against the target alone and transformers' prompt lookup
        for base, target in (("autoregressive", 1.5), (PROMPT_LOOKUP, 2.0)):
            s = merged.get(f"decode_speedup_vs_{base}")
            goal(f"specextend_lookup decode speedup over {base} at {lengths[-1]} tokens", s and s["median"], target)
        s = at.get((lengths[0], "specextend_lookup"), {}).get("decode_speedup_vs_autoregressive")
        goal(f"specextend_lookup decode speedup over autoregressive at {lengths[0]} tokens (no slower)",
             s and s["median"], 1.0)
    if not lengths or (lengths[-1], "specextend") not in at:
        return out
    longest, shortest = at[(lengths[-1], "specextend")], at.get((lengths[0], "specextend"))

    for base in ("autoregressive", "speculative", ASSISTED):  # SpecExtend's own goals
        s = longest.get(f"decode_speedup_vs_{base}")
        goal(f"decode speedup over {base} at {lengths[-1]} tokens", s and s["median"], 2.0)
    s = shortest and shortest.get("decode_speedup_vs_speculative")
    goal(f"decode speedup over speculative at {lengths[0]} tokens (no slower)", s and s["median"], 1.0)
    share = longest["cmr_overhead_share"]
    out.append({"goal": f"CMR overhead share of decode time at {lengths[-1]} tokens", "value": share and share["median"],
                "target": 0.02, "met": share is not None and share["median"] <= 0.02})
    full = at.get((lengths[-1], "speculative"))
    if full and full["mean_accepted"] and longest["mean_accepted"]:
        goal(f"mean accepted length with CMR / with the full draft cache at {lengths[-1]} tokens",
             longest["mean_accepted"]["median"] / full["mean_accepted"]["median"], 1.5)
    return out


# ---------------------------------------------------------------- needle retrieval (Table 1)


def target_answer(target: Target, n: int) -> list[int]:
    """The target's own greedy continuation after its prefill (one token per forward)."""
    tokens = [int(target.logits[-1].argmax())]
    while len(tokens) < n:
        logits = target.verify(tokens[-1], DraftTree.empty())
        target.commit([])
        tokens.append(int(logits[-1].argmax()))
    return tokens


def draft_answer(pair: ModelPair, config: GenerationConfig, policy_name: str, prompt: list[int],
                 scores: torch.Tensor | None, n: int) -> list[int]:
    """The draft alone: prefill under the policy, one retrieval (the target's scores for CMR), n greedy tokens."""
    policy = make_policy(policy_name, config.retrieval)
    drafter = ModelDrafter(pair.draft, config.replace(draft=DraftConfig(k=n)), policy, len(prompt) + n + 2)
    for _ in drafter.prefill(prompt, None):
        pass
    if policy.name is not DraftCache.FULL:
        drafter.rebuild(scores if policy.needs_scores else None)
    return list(drafter.propose(n, None).tokens)


def needle_signals(pair: ModelPair, retrieval: RetrievalConfig) -> dict[str, RetrievalConfig]:
    """The signals the needle section compares, resolved for the pair: the paper's, the default (the pair's calibrated
    one where it has it), and the run's own when --signal chose another."""
    out = {name: replace(retrieval, signal=resolve(name, pair.calibrated)) for name in ("paper", "default")}
    chosen = resolve(retrieval.signal, pair.calibrated)
    if chosen not in (out["paper"].signal, out["default"].signal):
        out["chosen"] = replace(retrieval, signal=chosen)
    return out


def needle_case(pair: ModelPair, tokenizer, signals: dict[str, RetrievalConfig], text: str, depth: float, seed: int,
                answer_tokens: int) -> dict:
    """One planted needle: does each working cache hold it after the first retrieval, and what does each reader
    answer (the target; the draft alone from its full cache, StreamingLLM's window, CMR's cache per signal)."""
    prompt = needle_prompt(tokenizer, text, depth, seed)
    target, scores = read_signals(pair, prompt.ids, {k: v.signal for k, v in signals.items()}, answer_tokens + 2)
    held, answers = {}, {"target": target_answer(target, answer_tokens)}
    for name, retrieval in signals.items():
        selection = make_policy("cmr", retrieval).select(len(prompt.ids) - 1, scores[name])
        held[name] = holds(selection.kept_spans, prompt.span)
        answers[name] = draft_answer(pair, preset("specextend", retrieval=retrieval), "cmr", prompt.ids, scores[name],
                                     answer_tokens)
    config = preset("specextend", retrieval=signals["paper"])
    window = make_policy("streaming", config.retrieval).select(len(prompt.ids) - 1, None)
    held["streaming"] = holds(window.kept_spans, prompt.span)
    for name in ("full", "streaming"):
        answers[name] = draft_answer(pair, config, name, prompt.ids, None, answer_tokens)
    texts = {k: tokenizer.decode(v, skip_special_tokens=True) for k, v in answers.items()}
    planted = prompt.planted
    return {"depth": depth, "actual_depth": planted.actual_depth, "template": planted.template, "seed": seed,
            "prompt_tokens": len(prompt.ids), "needle_span": list(prompt.span), "answer": planted.answer,
            "held": held, "answers": texts, "correct": {k: planted.answer.lower() in v.lower() for k, v in texts.items()}}


def needle_summary(cases: list[dict], signals: dict[str, RetrievalConfig]) -> dict:
    """Hold rate (whole needle in the working cache after the first retrieval) and answer accuracy, overall and by depth."""
    share = lambda group, key, k: sum(c[key][k] for c in group) / len(group)  # noqa: E731
    readers = list(cases[0]["correct"])
    kept = list(cases[0]["held"])
    depths = sorted({c["depth"] for c in cases})
    return {"needles": len(cases), "signals": {k: v.signal.name for k, v in signals.items()},
            "hold_rate": {k: share(cases, "held", k) for k in kept},
            "accuracy": {k: share(cases, "correct", k) for k in readers},
            "by_depth": {str(d): {"hold_rate": {k: share([c for c in cases if c["depth"] == d], "held", k) for k in kept},
                                  "accuracy": {k: share([c for c in cases if c["depth"] == d], "correct", k)
                                               for k in readers}} for d in depths}}


def needle_texts(files: list[str] | None) -> dict[str, str]:
    """name -> text: the bundled documents, or the given files ('bundled' among them adds the bundled documents)."""
    texts = {}
    for item in files or ["bundled"]:
        if item == "bundled":
            texts.update({d.name: d.text() for d in bundled.documents("eval")})
            continue
        text = Path(item).read_text(encoding="utf-8")
        if not text.strip():
            raise ValueError(f"{item} is empty: there is nowhere to plant a needle")
        texts[Path(item).name] = text
    return texts


# ---------------------------------------------------------------- retrieval sweep (Table 5)


def sweep_configs(base: RetrievalConfig) -> dict[str, RetrievalConfig]:
    """One parameter at a time around `base`: working cache (top-k), chunk size at a fixed working cache, frequency,
    and the adaptive retrieval trigger at two acceptance floors."""
    out = {}
    for top_k in (base.top_k // 2, base.top_k * 2):
        if top_k >= 2:
            out[f"working cache {base.chunk_size * top_k} (chunk {base.chunk_size}, top-k {top_k})"] = replace(base, top_k=top_k)
    for chunk in (base.chunk_size // 2, base.chunk_size * 2):
        top_k = base.working_cache // chunk
        if chunk >= 1 and top_k >= 2:
            out[f"chunk {chunk}, top-k {top_k} (working cache {chunk * top_k})"] = replace(base, chunk_size=chunk, top_k=top_k)
    for every in sorted({1, 2, 4, 8} - {base.retrieve_every}):
        out[f"retrieve every {every} steps"] = replace(base, retrieve_every=every)
    for floor in (0.25, 0.5):  # the adaptive trigger against the fixed interval
        out[f"adaptive: acceptance < {floor} over {base.acceptance_window} steps, "
            f"at most every {4 * base.retrieve_every}"] = replace(base, trigger="adaptive", min_acceptance=floor)
    return out


def sweep_row(setting: str, config: RetrievalConfig, results: list[dict]) -> dict:
    return {"setting": setting, **asdict(config), "working_cache": config.working_cache,
            **{f: spread([r[f] for r in results]) for f in
               ("decode_tokens_per_s", "e2e_tokens_per_s", "mean_accepted", "cmr_overhead_share", "retrievals")}}


# ---------------------------------------------------------------- output


def flat(row: dict, prefix: str = "") -> dict:
    """A row with nested spreads, dicts and lists flattened for CSV."""
    out = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, f"{name}_"))
        elif isinstance(value, list):
            out[name] = ";".join(f"{v:.4g}" for v in value)
        else:
            out[name] = value
    return out


def write_csv(rows: list[dict], path: Path) -> None:
    rows = [flat(r) for r in rows]
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def grid_figures(rows: list[dict]) -> dict:
    """The grid's figures: throughput by length, speedup over speculative, acceptance and phases at the longest."""
    import plotly.graph_objects as go
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    names = list(dict.fromkeys(r["method"] for r in rows))
    figs = {}
    fig = make_subplots(rows=1, cols=2, subplot_titles=("decode tokens/s", "end-to-end tokens/s"))
    palette = qualitative.D3
    for i, name in enumerate(names):
        mine = [r for r in rows if r["method"] == name]
        for col, field in ((1, "decode_tokens_per_s"), (2, "e2e_tokens_per_s")):
            med = [r[field]["median"] for r in mine]
            fig.add_trace(go.Scatter(
                x=[r["length"] for r in mine], y=med, name=name, legendgroup=name, showlegend=col == 1,
                line=dict(color=palette[i % len(palette)]),
                error_y=dict(type="data", symmetric=False, array=[r[field]["max"] - m for r, m in zip(mine, med)],
                             arrayminus=[m - r[field]["min"] for r, m in zip(mine, med)])), row=1, col=col)
    fig.update_xaxes(title_text="input tokens", type="log")
    figs["throughput"] = fig.update_layout(title="Throughput by input length (median, min-max)")
    fig = go.Figure()
    for name in names:
        mine = [r for r in rows if r["method"] == name and r["decode_speedup_vs_speculative"]]
        fig.add_bar(x=[str(r["length"]) for r in mine], y=[r["decode_speedup_vs_speculative"]["median"] for r in mine],
                    name=name)
    figs["speedup"] = fig.update_layout(title="Decode speedup over standard speculative decoding", barmode="group",
                                        xaxis_title="input tokens", yaxis_title="x speculative")
    longest = max((r["length"] for r in rows), default=0)
    at_longest = [r for r in rows if r["length"] == longest]
    fig = go.Figure()
    for r in at_longest:
        if r["acceptance_by_position"]:
            fig.add_scatter(x=list(range(1, len(r["acceptance_by_position"]) + 1)), y=r["acceptance_by_position"],
                            name=r["method"])
    figs["acceptance"] = fig.update_layout(title=f"Acceptance by draft position at {longest} tokens",
                                           xaxis_title="draft position", yaxis_title="P(accepted)")
    fig = go.Figure()
    for phase in PHASES:
        timed = [r for r in at_longest if r["phase_seconds"]]
        fig.add_bar(x=[r["method"] for r in timed], y=[r["phase_seconds"][phase] for r in timed], name=phase)
    figs["phases"] = fig.update_layout(title=f"Time per phase at {longest} tokens (median s)", barmode="stack")
    return figs


def figures(report: dict) -> dict:
    """Plotly figures of the report, by file stem."""
    from plotly.subplots import make_subplots

    rows = [r for r in report["cells"] if not r["same_as"]]
    figs = grid_figures(rows) if rows else {}  # a needle-only run has no grid
    if report.get("needle"):
        by_depth = report["needle"]["summary"]["by_depth"]
        fig = make_subplots(rows=1, cols=2, subplot_titles=("whole needle in the working cache after the first retrieval",
                                                            "answers holding the value (the draft alone; the target)"))
        for col, key in ((1, "hold_rate"), (2, "accuracy")):
            for reader in next(iter(by_depth.values()))[key]:
                fig.add_bar(x=list(by_depth), y=[by_depth[d][key][reader] for d in by_depth], name=f"{reader}",
                            legendgroup=reader, showlegend=col == 1 or reader in ("target", "full"), row=1, col=col)
        figs["needle"] = fig.update_layout(title="Needles by depth, per retrieval signal and cache", barmode="group")
    if report.get("sweep"):
        sweep = report["sweep"]
        fig = make_subplots(rows=1, cols=2, subplot_titles=("decode tokens/s", "mean accepted length"))
        fig.add_bar(x=[s["setting"] for s in sweep], y=[s["decode_tokens_per_s"]["median"] for s in sweep], row=1, col=1)
        fig.add_bar(x=[s["setting"] for s in sweep], y=[s["mean_accepted"]["median"] for s in sweep], row=1, col=2)
        figs["sweep"] = fig.update_layout(title=f"SpecExtend retrieval settings at {report['sweep_input']}",
                                          showlegend=False)
    return figs


def write_outputs(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(report["cells"], out / "bench.csv")
    if report.get("sweep"):
        write_csv(report["sweep"], out / "sweep.csv")
    (out / "bench.md").write_text(markdown(report))
    files = ["bench.json", "bench.csv", "bench.md"] + (["sweep.csv"] if report.get("sweep") else [])
    figs = figures(report)
    for stem, fig in figs.items():
        fig.write_html(out / f"{stem}.html", include_plotlyjs="cdn")
        files.append(f"{stem}.html")
    report["png"] = write_pngs(figs, out)
    if report["png"] == "written":
        files += [f"{stem}.png" for stem in figs]
    report["files"] = files
    (out / "bench.json").write_text(json.dumps(report, indent=1))


def write_pngs(figs: dict, out: Path) -> str:
    """PNG copies of the figures through kaleido, which drives a local Chrome or Chromium; says what happened."""
    if importlib.util.find_spec("kaleido") is None:
        return "skipped: kaleido is not installed (pip install -r requirements-dev.txt to get PNG figures)"
    import plotly.io as pio
    from choreographer.errors import BrowserFailedError, ChromeNotFoundError

    try:
        pio.write_images(list(figs.values()), [out / f"{stem}.png" for stem in figs], width=1100, height=550)
    except (ChromeNotFoundError, BrowserFailedError) as err:
        return f"skipped: kaleido found no working Chrome or Chromium ({err})"
    return "written"


def fmt(s: dict | None, places: int = 1) -> str:
    """A spread as 'median [min-max]'."""
    return "-" if not s else f"{s['median']:.{places}f} [{s['min']:.{places}f}-{s['max']:.{places}f}]"


def ratio(s: dict | None) -> str:
    return "-" if not s else f"{s['median']:.2f}x"


def by_source(split: dict | None) -> str:
    """Tokens per step by who proposed them, as 'draft / lookup / both / target'."""
    return "-" if not split else " / ".join(f"{v:.2f}" for v in split.values())


def markdown(report: dict) -> str:
    """The report as Markdown tables: the grid per input length, the goals, the needle and sweep sections."""
    lines = []
    for length in sorted({r["length"] for r in report["cells"]}):
        mine = [r for r in report["cells"] if r["length"] == length]
        lines += [f"**~{length} input tokens** (median [min-max] over {mine[0]['decode_tokens_per_s']['n']} runs; "
                  f"phase seconds are medians)", "",
                  "| method | decode tok/s | e2e tok/s | x AR | x speculative | x hf_assisted | x hf_prompt_lookup | "
                  "mean accepted | per step: draft / lookup / both / target | "
                  + " | ".join(f"{p} s" for p in PHASES) + " | CMR share |",
                  "|---" * (10 + len(PHASES)) + "|"]
        for r in mine:
            name = r["method"] + (f" (= {r['same_as']})" if r["same_as"] else "")
            phases = [f"{r['phase_seconds'][p]:.2f}" if r["phase_seconds"] else "-" for p in PHASES]
            share = r["cmr_overhead_share"]
            lines.append(f"| {name} | {fmt(r['decode_tokens_per_s'])} | {fmt(r['e2e_tokens_per_s'])} | "
                         f"{ratio(r['decode_speedup_vs_autoregressive'])} | {ratio(r['decode_speedup_vs_speculative'])} | "
                         f"{ratio(r[f'decode_speedup_vs_{ASSISTED}'])} | {ratio(r[f'decode_speedup_vs_{PROMPT_LOOKUP}'])} | "
                         f"{fmt(r['mean_accepted'], 2)} | {by_source(r['tokens_per_step_by_source'])} | "
                         + " | ".join(phases) + f" | {'-' if not share else format(share['median'], '.1%')} |")
        lines.append("")
    if report["goals"]:
        lines += ["| goal | target | measured | met |", "|---|---|---|---|"]
    for g in report["goals"]:
        target = f"<= {g['target']:.0%}" if "overhead" in g["goal"] else f">= {g['target']}"
        value = "-" if g["value"] is None else (f"{g['value']:.1%}" if "overhead" in g["goal"] else f"{g['value']:.2f}")
        lines.append(f"| {g['goal']} | {target} | {value} | {'yes' if g['met'] else 'no'} |")
    if report.get("needle"):
        summary = report["needle"]["summary"]
        depths = list(summary["by_depth"])
        names = summary["signals"]
        lines += ["", f"**Needle retrieval**: {summary['needles']} needles in ~{report['needle']['haystack_tokens']}-token "
                  "haystacks from " + ", ".join(report["needle"]["documents"]) + ". Hold: the whole needle in the working "
                  "cache after the first retrieval; answer: the draft alone's answer holds the planted value", "",
                  "| | all | " + " | ".join(f"depth {d}" for d in depths) + " |", "|---" * (2 + len(depths)) + "|"]
        for key, verb in (("hold_rate", "hold"), ("accuracy", "answer")):
            for reader, value in summary[key].items():
                label = {"target": "the target (ceiling)", "full": "full cache", "streaming": "StreamingLLM"}.get(
                    reader, f"CMR, {reader} signal" + (f" ({names[reader]})" if names.get(reader, reader) != reader else ""))
                lines.append(f"| {verb}: {label} | {value:.0%} | "
                             + " | ".join(f"{summary['by_depth'][d][key][reader]:.0%}" for d in depths) + " |")
    if report.get("sweep"):
        lines += ["", f"**Retrieval settings**: specextend on {report['sweep_input']}", "",
                  "| setting | decode tok/s | e2e tok/s | mean accepted | CMR share | retrievals |", "|---|---|---|---|---|---|"]
        for s in report["sweep"]:
            lines.append(f"| {s['setting']} | {fmt(s['decode_tokens_per_s'])} | {fmt(s['e2e_tokens_per_s'])} | "
                         f"{fmt(s['mean_accepted'], 2)} | {s['cmr_overhead_share']['median']:.1%} | "
                         f"{s['retrievals']['median']:.0f} |")
    return "\n".join(lines) + "\n"


def table(report: dict) -> str:
    lines = [f"{'tokens':>6} {'method':<31} {'decode tok/s':>20} {'e2e tok/s':>18} {'xAR':>6} {'xspec':>6} "
             f"{'xHF':>6} {'xHFPL':>6} {'accepted':>17} {'CMR share':>9}"]
    for r in report["cells"]:
        share = r["cmr_overhead_share"]
        name = r["method"] + (f" (={r['same_as']})" if r["same_as"] else "")
        lines.append(f"{r['prompt_tokens']:>6.0f} {name:<31} {fmt(r['decode_tokens_per_s']):>20} "
                     f"{fmt(r['e2e_tokens_per_s']):>18} {ratio(r['decode_speedup_vs_autoregressive']):>6} "
                     f"{ratio(r['decode_speedup_vs_speculative']):>6} {ratio(r[f'decode_speedup_vs_{ASSISTED}']):>6} "
                     f"{ratio(r[f'decode_speedup_vs_{PROMPT_LOOKUP}']):>6} {fmt(r['mean_accepted'], 2):>17} "
                     f"{'-' if not share else format(share['median'], '.1%'):>9}")
    if report.get("needle"):
        summary = report["needle"]["summary"]
        lines.append(f"needle ({summary['needles']} needles, ~{report['needle']['haystack_tokens']} tokens): hold "
                     + ", ".join(f"{k} {v:.0%}" for k, v in summary["hold_rate"].items()) + "; answers "
                     + ", ".join(f"{k} {v:.0%}" for k, v in summary["accuracy"].items()))
    for s in report.get("sweep") or []:
        lines.append(f"sweep {s['setting']:<44} decode {fmt(s['decode_tokens_per_s'])} tok/s, "
                     f"accepted {fmt(s['mean_accepted'], 2)}, CMR share {s['cmr_overhead_share']['median']:.1%}")
    for g in report["goals"]:
        value = "-" if g["value"] is None else f"{g['value']:.3g}"
        lines.append(f"goal: {g['goal']}: {value} (target {g['target']}) {'met' if g['met'] else 'MISSED'}")
    return "\n".join(lines)


# ---------------------------------------------------------------- the run


def load(args) -> tuple[ModelPair, object, tuple[int, ...]]:
    """(pair, tokenizer, stop ids): tiny random-init models with the bundled draft's tokenizer (--quick), or real
    models."""
    from transformers import AutoTokenizer

    if args.quick:  # the draft is a copy of the target, so drafts are accepted and every path runs
        tokenizer = AutoTokenizer.from_pretrained(bundled.draft_dir())
        target = llama(QUICK_SHAPE, len(tokenizer), torch.float32, "cpu", seed=1, max_positions=4096)
        pair = make_pair(target, copy.deepcopy(target))
    else:
        target, draft = bundled.pair_or_default(args.target, args.draft)
        pair = load_pair(target, draft, args.device, args.dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(target))
    return pair, tokenizer, prompting.stop_ids(tokenizer, pair.target)


def machine(pair: ModelPair) -> dict:
    import transformers

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": str(pair.device),
            "gpu": torch.cuda.get_device_name(pair.device) if pair.device.type == "cuda" else None,
            "dtype": str(pair.dtype).replace("torch.", ""), "backend": pair.backend,
            "load_average_start": os.getloadavg() if hasattr(os, "getloadavg") else None}


def run(args, progress) -> dict:
    pair, tokenizer, eos = load(args)
    retrieval = replace(QUICK["retrieval"] if args.quick else RetrievalConfig(), signal=signal_from(args))
    draft = DraftConfig(shape=args.draft_shape, k=args.k)
    base = dict(max_new_tokens=args.max_new_tokens, eos_token_ids=eos, draft=draft, retrieval=retrieval)
    configs = method_configs(base, args.prefill, lookup_from(args, None))
    names = [m for m in METHODS if m in args.methods]
    same_as = {k: v for k, v in aliases(configs).items() if k in names and v in names}
    measured = [m for m in names if m not in same_as]
    limit = pair.max_positions - args.max_new_tokens
    lengths = [min(int(x), limit) for x in args.lengths.split(",")]
    inputs = make_inputs(tokenizer, lengths, args.docs, args.instruction) if "grid" not in args.skip else []
    sweeps = sweep_configs(retrieval) if "sweep" not in args.skip and inputs else {}
    n_needles = args.needles if "needle" not in args.skip else 0
    report = {"machine": machine(pair), "args": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()},
              "methods": names, "retrieval": asdict(retrieval), "draft": asdict(draft)}
    bar = progress(total=(len(measured) * (1 + len(inputs) * args.repeats) if inputs else 0) + len(sweeps) * args.repeats
                   + n_needles)

    runs, references = [], {}
    for name in measured if inputs else ():  # warm-up: every method once on a short input
        bar.set_description(f"warm-up {name}")
        short = inputs[0]["prompt"][:128] + inputs[0]["prompt"][-128:]  # its start and its end (the instruction)
        run_method(pair, short, name, configs[name] and configs[name].replace(max_new_tokens=8), 8, eos)
        bar.update()
    for item in inputs:
        where = f"{item['document']} at {len(item['prompt'])} tokens"
        for repeat in range(args.repeats):
            shift = repeat % len(measured)  # alternate the order of methods between repeats
            for name in measured[shift:] + measured[:shift]:
                bar.set_description(f"{len(item['prompt'])} tok {item['document'][:16]} {name}")
                result = run_method(pair, item["prompt"], name, configs[name], args.max_new_tokens, eos)
                key = (item["document"], item["length"])
                if key in references:
                    check_same(references[key], name, result["token_ids"], where)
                else:
                    references[key] = (name, result["token_ids"])
                runs.append({"method": name, "document": item["document"], "length": item["length"], "repeat": repeat,
                             "prompt_tokens": len(item["prompt"]), **result})
                bar.update()
    report["cells"] = cells(runs, names, same_as)
    report["goals"] = goals(report["cells"])
    report["runs"] = runs

    if sweeps:  # retrieval parameters: SpecExtend on the longest first input (its default row comes from the grid)
        item = max(inputs, key=lambda i: i["length"])
        key = (item["document"], item["length"])
        report["sweep_input"] = f"{item['document']}, {len(item['prompt'])} tokens"
        default = [r for r in runs if r["method"] == "specextend" and (r["document"], r["length"]) == key]
        label = f"default (chunk {retrieval.chunk_size}, top-k {retrieval.top_k}, every {retrieval.retrieve_every})"
        sweep = [sweep_row(label, retrieval, default)]
        for setting, config in sweeps.items():
            results = []
            for _ in range(args.repeats):
                bar.set_description(f"sweep {setting[:30]}")
                results.append(run_engine(pair, item["prompt"], configs["specextend"].replace(retrieval=config)))
                check_same(references[key], f"specextend ({setting})", results[-1]["token_ids"], report["sweep_input"])
                bar.update()
            sweep.append(sweep_row(setting, config, results))
        report["sweep"] = [s for s in sweep if s["decode_tokens_per_s"]]

    if n_needles:  # does each working cache hold a planted needle, and can the draft alone answer from it
        depths = [float(x) for x in args.needle_depths.split(",")]
        texts = needle_texts(args.needle_docs)
        texts = {name: cut_text(tokenizer, text, args.needle_tokens - 48) for name, text in texts.items()}
        signals = needle_signals(pair, retrieval)
        cases = []
        for i in range(n_needles):
            name = list(texts)[(i // len(depths)) % len(texts)]
            bar.set_description(f"needle {i + 1}/{n_needles}")
            cases.append({"document": name, **needle_case(pair, tokenizer, signals, texts[name], depths[i % len(depths)],
                                                          i, args.needle_answer_tokens)})
            bar.update()
        report["needle"] = {"haystack_tokens": args.needle_tokens, "answer_tokens": args.needle_answer_tokens,
                            "documents": list(texts), "summary": needle_summary(cases, signals), "cases": cases}
    bar.close()
    report["machine"]["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specextend.tools.bench", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny random-init models, short inputs, few needles: a check of the whole pipeline in seconds "
                        "(overrides the size arguments below)")
    p.add_argument("--out", default="results", help="results folder")
    p.add_argument("--target", help="target model (default: bundled)")
    p.add_argument("--draft", help="draft model (default: bundled)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma list, from: " + ", ".join(METHODS))
    p.add_argument("--lengths", default="1024,2048,4096,7168", help="input lengths in target tokens")
    p.add_argument("--docs", type=int, default=3, help="eval documents per length")
    p.add_argument("--repeats", type=int, default=2, help="runs of every method on every input")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--instruction", default=prompting.DEFAULT_INSTRUCTION)
    p.add_argument("--prefill", choices=("fused", "eager"), default="fused",
                   help="the baselines' prefill kernel: fused (SDPA, transformers' default) or eager (the paper's)")
    p.add_argument("--draft-shape", choices=("chain", "tree"), default=DraftConfig().shape)
    p.add_argument("--k", type=int, default=DraftConfig().k, help="chain: draft tokens per step")
    add_lookup_arguments(p)
    add_signal_arguments(p)
    p.add_argument("--needles", type=int, default=50, help="needle questions (depths cycle, documents rotate)")
    p.add_argument("--needle-tokens", type=int, default=4096, help="haystack length in target tokens")
    p.add_argument("--needle-depths", default="0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--needle-answer-tokens", type=int, default=16, help="greedy tokens each reader answers with")
    p.add_argument("--needle-docs", nargs="+", default=None, metavar="FILE",
                   help="UTF-8 text files to plant needles in instead of the bundled documents ('bundled' adds those)")
    p.add_argument("--skip", default="", help="comma list of sections to skip: grid, sweep, needle")
    return p


def parse(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            if key != "retrieval":
                setattr(args, key, value)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    args.skip = set(filter(None, args.skip.split(",")))
    if args.repeats < 1 or args.docs < 1 or args.needles < 0:
        raise ValueError("--repeats and --docs must be at least 1, --needles at least 0")
    return args


def main(argv=None) -> int:
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # transformers' generation-flag warnings would bury the table
    try:
        args = parse(argv)
        if args.threads:
            torch.set_num_threads(args.threads)
        start = time.perf_counter()
        report = run(args, lambda total: tqdm(total=total, file=sys.stderr, dynamic_ncols=True))
        report["wall_s"] = time.perf_counter() - start
        write_outputs(report, Path(args.out))
    except GreedyMismatch as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        hf_logging.set_verbosity(verbosity)
    print(table(report))
    print(json.dumps({k: v for k, v in report.items() if k != "runs" and k != "needle"}
                     | {"needle": report.get("needle") and report["needle"]["summary"], "out": str(args.out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
