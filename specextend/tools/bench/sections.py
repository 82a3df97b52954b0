"""The benchmark's other sections: needle retrieval (the paper's Table 1: does each working cache hold a planted
needle, and can the draft alone answer from it), the sweep of retrieval settings (Table 5), and long outputs (a short
prompt, thousands of new tokens: tokens per step along the output, speed over the target alone)."""

from __future__ import annotations

import torch
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from .. import bundled
from ...config import DraftConfig, GenerationConfig, RetrievalConfig, preset
from ...drafting import ModelDrafter
from ...engine import generate
from ...feature_drafting import FeatureDrafter
from ...heads import EagleHead
from ...methods import DraftCache
from ...metrics import Window
from ...models import ModelPair
from ...retrieval import make_policy
from ...signal import resolve
from ...target import Target
from ..probe import holds, needle_prompt, read_signals
from .runs import Spread


# ---------------------------------------------------------------- needle retrieval (Table 1)


def target_answer(pair: ModelPair, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy continuation: the engine's autoregressive run, n tokens (no end token stops it)."""
    finished = list(generate(pair, prompt, preset("autoregressive", max_new_tokens=n)))[-1]
    return list(finished.token_ids)


def draft_answer(pair: ModelPair, config: GenerationConfig, policy_name: str, prompt: list[int],
                 scores: torch.Tensor | None, n: int) -> list[int]:
    """The draft alone: prefill under the policy, one retrieval (the target's scores for CMR), n greedy tokens. An
    EAGLE head reads the target's streams of the prompt and drafts after the target's own first token (its first
    answer token: the rest are the head's)."""
    policy = make_policy(policy_name, config.retrieval)
    config, room = config.replace(draft=DraftConfig(k=n)), len(prompt) + n + 2
    first: list[int] = []
    if isinstance(pair.draft, EagleHead):
        drafter = FeatureDrafter(pair.draft, config, policy, room)
        target = Target(pair.target, config, room, features=drafter.features)
        for _ in target.prefill(prompt, None):
            pass
        first = [int(target.logits[-1].argmax())]
    else:
        drafter = ModelDrafter(pair.draft, config, policy, room)
    for _ in drafter.prefill(prompt, None):
        pass
    drafter.commit(first)
    if policy.name is not DraftCache.FULL:
        drafter.rebuild(scores if policy.needs_scores else None)
    return first + list(drafter.propose(n - len(first), None).tokens)


def needle_signals(pair: ModelPair, retrieval: RetrievalConfig) -> dict[str, RetrievalConfig]:
    """The signals the needle section compares, resolved for the pair: the paper's, the default (the pair's calibrated
    one where it has it), and the run's own when --signal chose another."""
    out = {name: replace(retrieval, signal=resolve(name, pair.calibrated)) for name in ("paper", "default")}
    chosen = resolve(retrieval.signal, pair.calibrated)
    if chosen not in (out["paper"].signal, out["default"].signal):
        out["chosen"] = replace(retrieval, signal=chosen)
    return out


@dataclass(frozen=True)
class NeedleCase:
    """One planted needle: which working caches hold it whole after the first retrieval, and what each reader
    answers (the target; the draft alone from its full cache, StreamingLLM's window, CMR's cache per signal)."""

    document: str
    depth: float  # asked for, as a share of the haystack
    actual_depth: float  # where the needle landed
    template: str
    seed: int
    prompt_tokens: int
    needle_span: tuple[int, int]  # the needle's token span in the prompt
    answer: str  # the planted value
    held: dict[str, bool]  # working cache -> holds the whole needle
    answers: dict[str, str]  # reader -> its answer
    correct: dict[str, bool]  # reader -> its answer holds the planted value


def needle_case(pair: ModelPair, tokenizer, signals: dict[str, RetrievalConfig], document: str, text: str, depth: float,
                seed: int, answer_tokens: int) -> NeedleCase:
    """Plant one needle in `text` at `depth`, then read it with every cache and reader."""
    prompt = needle_prompt(tokenizer, text, depth, seed)
    _, scores = read_signals(pair, prompt.ids, {k: v.signal for k, v in signals.items()})
    held, answers = {}, {"target": target_answer(pair, prompt.ids, answer_tokens)}
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
    return NeedleCase(document, depth, planted.actual_depth, planted.template, seed, len(prompt.ids), tuple(prompt.span),
                      planted.answer, held, texts, {k: planted.answer.lower() in v.lower() for k, v in texts.items()})


@dataclass(frozen=True)
class NeedleRates:
    """Over a group of needles: the share each working cache held whole, the share each reader answered right."""

    hold_rate: dict[str, float]
    accuracy: dict[str, float]

    @classmethod
    def of(cls, cases: list[NeedleCase]) -> NeedleRates:
        def share(key: str) -> dict[str, float]:
            return {k: sum(getattr(c, key)[k] for c in cases) / len(cases) for k in getattr(cases[0], key)}

        return cls(share("held"), share("correct"))


@dataclass(frozen=True)
class NeedleSummary(NeedleRates):
    """The rates over every needle, and by depth (keyed by the depth as text, as JSON keys go)."""

    needles: int
    signals: dict[str, str]  # signal label -> the signal it resolved to for the pair
    by_depth: dict[str, NeedleRates]

    @classmethod
    def of(cls, cases: list[NeedleCase], signals: dict[str, RetrievalConfig]) -> NeedleSummary:
        overall = NeedleRates.of(cases)
        depths = sorted({c.depth for c in cases})
        return cls(overall.hold_rate, overall.accuracy, len(cases), {k: v.signal.name for k, v in signals.items()},
                   {str(d): NeedleRates.of([c for c in cases if c.depth == d]) for d in depths})


@dataclass(frozen=True)
class NeedleSection:
    """The needle section of a report."""

    haystack_tokens: int
    answer_tokens: int
    documents: list[str]
    summary: NeedleSummary
    cases: list[NeedleCase]


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


@dataclass(frozen=True)
class SweepRow:
    """SpecExtend under one retrieval setting, over repeats."""

    setting: str
    config: RetrievalConfig
    decode_tokens_per_s: Spread | None
    e2e_tokens_per_s: Spread | None
    mean_accepted: Spread | None
    cmr_overhead_share: Spread | None
    retrievals: Spread | None

    def to_json(self) -> dict:
        """The row as the report's JSON and CSV write it: the setting's config fields beside its figures."""
        figures = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("setting", "config")}
        return {"setting": self.setting, **asdict(self.config), "working_cache": self.config.working_cache, **figures}


def sweep_row(setting: str, config: RetrievalConfig, results: list[dict]) -> SweepRow:
    return SweepRow(setting, config, **{f: Spread.of([r[f] for r in results]) for f in
                                        ("decode_tokens_per_s", "e2e_tokens_per_s", "mean_accepted", "cmr_overhead_share",
                                         "retrievals")})



# ---------------------------------------------------------------- long outputs


@dataclass(frozen=True)
class LongOutputRun:
    """One method on one short prompt: how long its output ran and why it stopped, its speed, its tokens per step by
    window of output positions, and its speed over the target alone on the same prompt and repeat (None without one)."""

    method: str
    prompt: str
    repeat: int
    prompt_tokens: int
    new_tokens: int
    stop_reason: str
    decode_tokens_per_s: float
    e2e_tokens_per_s: float
    mean_accepted: float | None
    decode_speedup_vs_autoregressive: float | None
    e2e_speedup_vs_autoregressive: float | None
    windows: list[Window]
    tokens_by_source: dict[str, int]
    token_ids: list[int]


@dataclass(frozen=True)
class LongOutputRow:
    """One method over every prompt and repeat: tokens per step per window (keyed 'start-end'; a run that stopped
    early has no later windows), output length, speeds and speedups over the target alone (paired by run)."""

    method: str
    new_tokens: Spread
    stopped_at_eos: int  # runs that ended at an end token before the limit
    windows: dict[str, Spread]
    mean_accepted: Spread | None
    decode_tokens_per_s: Spread
    e2e_tokens_per_s: Spread
    decode_speedup_vs_autoregressive: Spread | None
    e2e_speedup_vs_autoregressive: Spread | None


@dataclass(frozen=True)
class LongOutputSection:
    """The long-output section of a report: the limit and window, the prompts, a row per method, every run, and
    each prompt's output as text (the same for every method: greedy outputs are checked equal)."""

    max_new_tokens: int
    window: int
    prompts: list[str]
    rows: list[LongOutputRow]
    runs: list[LongOutputRun]
    outputs: dict[str, str]


def long_output_section(runs: list[dict], names: list[str], max_new_tokens: int, window: int,
                        outputs: dict[str, str]) -> LongOutputSection:
    """The section from the runs (dicts of run_engine's figures with method, prompt, repeat and prompt_tokens):
    speedups paired with the target alone's run on the same prompt and repeat, then one row per method."""
    alone = {(r["prompt"], r["repeat"]): r for r in runs if r["method"] == "autoregressive"}

    def over(r: dict, field: str) -> float | None:
        base = alone.get((r["prompt"], r["repeat"]))
        return r[field] / base[field] if base and base[field] else None

    done = [LongOutputRun(r["method"], r["prompt"], r["repeat"], r["prompt_tokens"], len(r["token_ids"]),
                          r["stop_reason"], r["decode_tokens_per_s"], r["e2e_tokens_per_s"], r["mean_accepted"],
                          over(r, "decode_tokens_per_s"), over(r, "e2e_tokens_per_s"), r["windows"],
                          r["tokens_by_source"], r["token_ids"]) for r in runs]
    rows = []
    for name in names:
        mine = [r for r in done if r.method == name]
        if not mine:
            continue
        starts = sorted({w.start for r in mine for w in r.windows})
        windows = {f"{s}-{s + window}": Spread.of([w.per_step for r in mine for w in r.windows if w.start == s])
                   for s in starts}
        rows.append(LongOutputRow(
            name, Spread.of([r.new_tokens for r in mine]), sum(r.stop_reason == "eos" for r in mine), windows,
            **{f: Spread.of([getattr(r, f) for r in mine]) for f in
               ("mean_accepted", "decode_tokens_per_s", "e2e_tokens_per_s", "decode_speedup_vs_autoregressive",
                "e2e_speedup_vs_autoregressive")}))
    return LongOutputSection(max_new_tokens, window, list(dict.fromkeys(r.prompt for r in done)), rows, done, outputs)
