"""The benchmark's two other sections: needle retrieval (the paper's Table 1: does each working cache hold a
planted needle, and can the draft alone answer from it) and the sweep of retrieval settings (Table 5)."""

from __future__ import annotations

import torch
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from .. import bundled
from ...config import DraftConfig, GenerationConfig, RetrievalConfig, preset
from ...drafting import ModelDrafter
from ...engine import generate
from ...methods import DraftCache
from ...models import ModelPair
from ...retrieval import make_policy
from ...signal import resolve
from ..probe import holds, needle_prompt, read_signals
from .runs import Spread


# ---------------------------------------------------------------- needle retrieval (Table 1)


def target_answer(pair: ModelPair, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy continuation: the engine's autoregressive run, n tokens (no end token stops it)."""
    finished = list(generate(pair, prompt, preset("autoregressive", max_new_tokens=n)))[-1]
    return list(finished.token_ids)


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
