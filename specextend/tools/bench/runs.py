"""One benchmark run (the engine's, or a transformers peer's timed by a streamer), the greedy check across
methods, and the folds of repeated runs into medians, speedups and goals."""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, fields

import torch

from ...config import GenerationConfig
from ...engine import generate
from ...events import Finished
from ...metrics import PHASES, summarize, tokens_per_step_by_window
from ...models import ModelPair
from ...numerics import apply
from .inputs import ASSISTED, BASELINES, GreedyMismatch, HF_LOOKUP_TOKENS, PROMPT_LOOKUP


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
    call), or prompt lookup decoding with its documented settings. It runs the models as loaded (fp32 numerics: an
    engine run before it may have left them in another setting)."""
    for model in (pair.target, pair.draft):
        if model is not None:
            apply(model, "fp32")
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
            "tokens_by_source": None, "windows": None}


def run_engine(pair: ModelPair, prompt: list[int], config: GenerationConfig, window: int = 256) -> dict:
    """One engine run: its output, its summary figures, and its tokens per step by windows of `window` output
    positions (metrics.tokens_per_step_by_window)."""
    trace = list(generate(pair, prompt, config))
    finished = trace[-1]
    assert isinstance(finished, Finished)
    s = summarize(trace)
    # mean_accepted None without steps, so medians skip a run that never stepped
    return {"token_ids": list(finished.token_ids), **s.figures(), "mean_accepted": s.mean_accepted if s.steps else None,
            "windows": tokens_per_step_by_window(trace, window)}


def run_method(pair: ModelPair, prompt: list[int], name: str, config: GenerationConfig | None, max_new_tokens: int,
               eos: tuple[int, ...]) -> dict:
    if config is None:
        return run_peer(pair, prompt, GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=eos), name)
    return run_engine(pair, prompt, config)


def rotated(names: list[str], turn: int) -> list[str]:
    """The methods in the order of the `turn`-th round on the same inputs: shifted by one a round, so that no method
    always runs first."""
    shift = turn % len(names)
    return names[shift:] + names[:shift]


def check_same(reference: tuple[str, list[int]], name: str, ids: list[int], where: str) -> None:
    """Raise GreedyMismatch naming both methods and the first differing position."""
    ref_name, ref = reference
    if ids == ref:
        return
    pos = next((i for i, (a, b) in enumerate(zip(ref, ids)) if a != b), min(len(ref), len(ids)))
    show = lambda seq: seq[pos] if pos < len(seq) else "end"  # noqa: E731
    raise GreedyMismatch(f"{where}: the greedy output of {name!r} differs from {ref_name!r} at new token {pos} "
                         f"({name}: {show(ids)}, {ref_name}: {show(ref)}); outputs must be identical")


def check_or_keep(references: dict, key, name: str, ids: list[int], where: str) -> None:
    """check_same against the first output kept under `key`; the first output under a key becomes its reference."""
    if key in references:
        check_same(references[key], name, ids, where)
    else:
        references[key] = (name, ids)


# ---------------------------------------------------------------- folds


@dataclass(frozen=True)
class Spread:
    """Repeated measurements of one figure: their median, least and most, and how many."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: list) -> Spread | None:
        """The spread of the values that were measured (None where a run has no such figure)."""
        values = [v for v in values if v is not None]
        return cls(statistics.median(values), min(values), max(values), len(values)) if values else None


@dataclass(frozen=True)
class Cell:
    """One row of the grid: a method at an input length, over documents and repeats. Speedups are paired by run
    (the same document and repeat), keyed `decode_speedup_vs_<baseline>` and `e2e_speedup_vs_<baseline>`."""

    length: int
    method: str
    same_as: str | None  # the method whose runs it shares (the same config)
    prompt_tokens: float
    new_tokens: float
    decode_tokens_per_s: Spread | None
    e2e_tokens_per_s: Spread | None
    mean_accepted: Spread | None
    cmr_overhead_share: Spread | None
    speedups: dict[str, Spread | None]
    acceptance_by_position: list[float]
    phase_seconds: dict[str, float] | None
    tokens_per_step_by_source: dict[str, float] | None

    def speedup(self, kind: str, base: str) -> Spread | None:
        return self.speedups.get(f"{kind}_speedup_vs_{base}")

    def to_json(self) -> dict:
        """The row as the report's JSON and CSV write it: speedups beside the other figures."""
        row = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "speedups"}
        return {**row, **self.speedups}


@dataclass(frozen=True)
class Goal:
    goal: str
    value: float | None
    target: float
    met: bool


def cells(runs: list[dict], names: list[str], same_as: dict[str, str]) -> list[Cell]:
    """One row per (length, method): medians with min/max over documents and repeats; speedups paired by run."""
    by_key = {(r["length"], r["document"], r["repeat"], r["method"]): r for r in runs}
    rows = []
    for length in sorted({r["length"] for r in runs}):
        for name in names:
            mine = [r for r in runs if r["length"] == length and r["method"] == same_as.get(name, name)]
            if not mine:
                continue
            speedups = {}
            for base in BASELINES:
                for field, kind in (("decode_tokens_per_s", "decode"), ("e2e_tokens_per_s", "e2e")):
                    pairs = [(r, by_key.get((length, r["document"], r["repeat"], same_as.get(base, base)))) for r in mine]
                    speedups[f"{kind}_speedup_vs_{base}"] = Spread.of([r[field] / b[field] for r, b in pairs
                                                                        if b and b[field]])
            positions = [r["acceptance_by_position"] for r in mine if r["acceptance_by_position"]]
            phases = [r["phase_seconds"] for r in mine if r["phase_seconds"]]
            split = [(r["tokens_by_source"], r["steps"]) for r in mine if r["tokens_by_source"] and r["steps"]]
            rows.append(Cell(
                length=length, method=name, same_as=same_as.get(name),
                prompt_tokens=statistics.median(r["prompt_tokens"] for r in mine),
                new_tokens=statistics.median(len(r["token_ids"]) for r in mine),
                **{f: Spread.of([r[f] for r in mine])
                   for f in ("decode_tokens_per_s", "e2e_tokens_per_s", "mean_accepted", "cmr_overhead_share")},
                speedups=speedups,
                acceptance_by_position=[statistics.median(p[i] for p in positions if i < len(p))
                                        for i in range(max(map(len, positions), default=0))],
                phase_seconds={p: statistics.median(x[p] for x in phases) for p in PHASES} if phases else None,
                tokens_per_step_by_source={k: statistics.median(t[k] / n for t, n in split)
                                           for k in split[0][0]} if split else None))
    return rows


def goals(rows: list[Cell]) -> list[Goal]:
    """The issue's goals, checked on the longest and the shortest input length of this run."""
    at = {(r.length, r.method): r for r in rows}
    lengths = sorted({r.length for r in rows})
    out = []
    median = lambda s: s and s.median  # noqa: E731

    def goal(text: str, value, target: float) -> None:
        out.append(Goal(text, value, target, value is not None and value >= target))

    merged = lengths and at.get((lengths[-1], "specextend_lookup"))
    if merged:  # lookup drafting's goals: against the target alone and transformers' prompt lookup
        for base, target in (("autoregressive", 1.5), (PROMPT_LOOKUP, 2.0)):
            goal(f"specextend_lookup decode speedup over {base} at {lengths[-1]} tokens",
                 median(merged.speedup("decode", base)), target)
        first = at.get((lengths[0], "specextend_lookup"))
        goal(f"specextend_lookup decode speedup over autoregressive at {lengths[0]} tokens (no slower)",
             median(first and first.speedup("decode", "autoregressive")), 1.0)
    if not lengths or (lengths[-1], "specextend") not in at:
        return out
    longest, shortest = at[(lengths[-1], "specextend")], at.get((lengths[0], "specextend"))

    for base in ("autoregressive", "speculative", ASSISTED):  # SpecExtend's own goals
        goal(f"decode speedup over {base} at {lengths[-1]} tokens", median(longest.speedup("decode", base)), 2.0)
    goal(f"decode speedup over speculative at {lengths[0]} tokens (no slower)",
         median(shortest and shortest.speedup("decode", "speculative")), 1.0)
    share = longest.cmr_overhead_share
    out.append(Goal(f"CMR overhead share of decode time at {lengths[-1]} tokens", median(share), 0.02,
                    share is not None and share.median <= 0.02))
    full = at.get((lengths[-1], "speculative"))
    if full and full.mean_accepted and longest.mean_accepted:
        goal(f"mean accepted length with CMR / with the full draft cache at {lengths[-1]} tokens",
             longest.mean_accepted.median / full.mean_accepted.median, 1.5)
    return out
