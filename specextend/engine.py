"""The engine: token ids in, events out.

`generate(pair, prompt_ids, config)` is the whole method on one screen: prefill both models, then
draft, verify, commit and (on schedule) retrieve, until max_new_tokens or EOS. Every step yields events
(events.py). The engine imports no UI, no plotting and no tokenizer, and prints nothing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, replace
from typing import Iterator

import torch

from .config import GenerationConfig
from .drafting import Drafter, DraftTree, ModelDrafter, NoDrafter
from .feature_drafting import FeatureDrafter
from .heads import EagleHead
from .lookup import LookupDrafter, MergedDrafter
from .events import Drafted, Event, Finished, Prefilled, Prefilling, Retrieved, Started, Verified
from .models import ModelPair
from .retrieval import make_policy
from .signal import resolve
from .steps import release
from .target import SharedPrefill, Target
from .verification import greedy_accept, sampling_probs, verify_sampling

def check_request(pair: ModelPair, prompt_ids: list[int], config: GenerationConfig) -> list[int]:
    """Every reason to refuse a request, raised as ValueError before any model work."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty: there is nothing to continue")
    if config.uses_draft and pair.draft is None:
        raise ValueError(f"method {config.method!r} needs a draft model, and the pair has none")
    vocab = pair.vocab_size
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise ValueError(f"prompt token ids must lie in [0, {vocab}); got {min(prompt)}..{max(prompt)}")
    limit = pair.max_positions
    if len(prompt) + config.max_new_tokens > limit:
        raise ValueError(
            f"the prompt ({len(prompt)} tokens) plus max_new_tokens ({config.max_new_tokens}) exceeds the "
            f"target's limit of {limit} positions; shorten the document or ask for fewer tokens"
        )
    return prompt


def make_drafter(pair: ModelPair, config: GenerationConfig, capacity: int) -> Drafter:
    """The draft (a draft model or an EAGLE head, under its cache policy), lookup, both merged into one tree, or
    nothing (the target alone)."""
    model = lookup = None
    if config.uses_draft:
        kind = FeatureDrafter if isinstance(pair.draft, EagleHead) else ModelDrafter
        model = kind(pair.draft, config, make_policy(config.draft_cache, config.retrieval), capacity)
    if config.uses_lookup:
        lookup = LookupDrafter(config.lookup)
    if model is not None and lookup is not None:
        return MergedDrafter(model, lookup, config.lookup)
    return model or lookup or NoDrafter()


def generate(
    pair: ModelPair, prompt_ids: list[int], config: GenerationConfig, stop: threading.Event | None = None,
    drafter: Drafter | None = None, shared: SharedPrefill | None = None,
) -> Iterator[Event]:
    """Yield the events of one request. `stop` ends it between steps; `drafter` replaces the config's drafter;
    `shared` carries the target's prefill from one request on a prompt to the next."""
    prompt = check_request(pair, prompt_ids, config)
    signal = resolve(config.retrieval.signal, pair.calibrated)
    config = config.replace(retrieval=replace(config.retrieval, signal=signal))
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    sync = torch.cuda.synchronize if pair.device.type == "cuda" else (lambda: None)
    generator = None if config.greedy else torch.Generator().manual_seed(config.seed)
    room = len(prompt) + config.max_new_tokens + config.tree_budget + 2
    drafter = drafter or make_drafter(pair, config, room)
    scored = drafter.needs_scores
    target = Target(pair.target, config, room, signal if scored else None, drafter.features)
    try:
        yield Started(t_s=clock(), elapsed_s=0.0, method=config.method, prompt_ids=tuple(prompt), config=asdict(config),
                      target_layers=pair.target.config.num_hidden_layers,
                      draft_layers=pair.draft.config.num_hidden_layers if config.uses_draft else 0,
                      device=str(pair.device), dtype=str(pair.dtype).replace("torch.", ""),
                      draft_name=pair.draft_name if config.uses_draft else "",
                      prefill_dtype=str(target.prefill_dtype).replace("torch.", ""))

        # 1) prefill the target (fused kernel) and the draft (sliding window, per its policy)
        phase = clock()
        for done in target.prefill(prompt, stop, shared):
            sync()
            yield Prefilling(t_s=clock(), elapsed_s=clock() - phase, model="target", done=done, total=len(prompt))
        target_s = clock() - phase
        if target.shared_s is not None:  # a copied prefill: the clock counts what reading the prompt took
            start -= target.shared_s - target_s
            target_s = target.shared_s
        elif shared is not None and target.read is not None:  # kept for the next request on this prompt
            shared.hold(target, target_s)
        phase = clock()
        for done in drafter.prefill(prompt, stop):
            sync()
            yield Prefilling(t_s=clock(), elapsed_s=clock() - phase, model="draft", done=done, total=len(prompt) - 1)
        draft_s = clock() - phase
        if stop is not None and stop.is_set():
            yield Finished(t_s=clock(), elapsed_s=clock(), token_ids=(), stop_reason="stopped", steps=0,
                           prompt_len=len(prompt), message="stopped during prefill")
            return
        first = pick(target.logits, config, generator)
        out = cut([first], 0, config)
        drafter.commit([first])
        yield Prefilled(t_s=clock(), elapsed_s=target_s + draft_s, prompt_len=len(prompt), target_s=target_s,
                        draft_s=draft_s, first_token=first, shared=target.shared_s is not None)
        if drafter.due(0):  # the working cache the first draft reads
            yield retrieve(drafter, target, 0, config, clock, sync)

        # 2) draft, verify, commit, retrieve: until max_new_tokens, EOS or stop
        step = 0
        while (reason := finished_reason(out, config)) is None:
            if stop is not None and stop.is_set():
                reason = "stopped"
                break
            step += 1
            position = len(prompt) + len(out) - 1  # the root: the last committed token
            left = config.max_new_tokens - len(out) - 1  # tokens a tree may add before the bonus token
            tree = DraftTree.empty()
            if drafter.drafts and left > 0:  # a) the draft (from its working cache) and lookup propose
                phase = clock()
                tree = drafter.propose(left, generator)
                sync()
                yield Drafted(t_s=clock(), elapsed_s=clock() - phase, step=step, position=position, tokens=tree.tokens,
                              parents=tree.parents, draft_probs=tree.probs, draft_forwards=tree.forwards,
                              sources=tree.sources, origins=tree.origins, sat_out=tree.sat_out, recent=tree.recent)
            phase = clock()  # b) the target verifies the whole tree in one forward
            logits = target.verify(out[-1], tree)
            if config.greedy:
                path, bonus = greedy_accept(tree.parents, tree.tokens, logits, tree.mask)
            else:
                p = sampling_probs(logits, config.temperature, config.top_p)
                q = tree.q if tree.q is not None else torch.zeros_like(p)
                path, bonus = verify_sampling(tree.parents, tree.tokens, p, q, generator, tree.point)
            target.commit(path)  # c) keep the accepted path and the bonus token; drop rejected KV
            drafter.commit([tree.tokens[n] for n in path] + [bonus])
            sync()
            committed = cut([tree.tokens[n] for n in path] + [bonus], len(out), config)
            out.extend(committed)
            accepted = tuple(i in path for i in range(len(tree.tokens)))
            yield Verified(t_s=clock(), elapsed_s=clock() - phase, step=step, position=position + 1,
                           accepted_nodes=tuple(path), accepted=accepted, num_accepted=len(path), bonus_token=bonus,
                           committed=tuple(committed), total_new=len(out))
            if drafter.due(step, len(path), max(tree.depths, default=0)):  # d) retrieval
                yield retrieve(drafter, target, step, config, clock, sync)
        yield Finished(t_s=clock(), elapsed_s=clock(), token_ids=tuple(out), stop_reason=reason, steps=step,
                       prompt_len=len(prompt))
    finally:  # captured steps are kept for the next request (steps.py)
        for runner in (target.runner, *drafter.runners):
            release(runner)


def pick(logits: torch.Tensor, config: GenerationConfig, generator: torch.Generator | None) -> int:
    """The target's own next token from the last row of logits (T, V)."""
    if config.greedy:
        return int(logits[-1].argmax())
    return int(torch.multinomial(sampling_probs(logits[-1].cpu(), config.temperature, config.top_p), 1, generator=generator))


def cut(tokens: list[int], generated: int, config: GenerationConfig) -> list[int]:
    """The tokens that count: none past max_new_tokens, none after the first EOS."""
    tokens = tokens[: config.max_new_tokens - generated]
    for i, token in enumerate(tokens):
        if token in config.eos_token_ids:
            return tokens[: i + 1]
    return tokens


def finished_reason(out: list[int], config: GenerationConfig) -> str | None:
    if out and out[-1] in config.eos_token_ids:
        return "eos"
    if len(out) >= config.max_new_tokens:
        return "max_new_tokens"
    return None


def retrieve(drafter: Drafter, target: Target, step: int, config: GenerationConfig, clock, sync) -> Retrieved:
    """Rebuild the draft's working cache; CMR scores chunks by the retrieval signal (the target's captured queries)."""
    phase = clock()
    scored = drafter.needs_scores
    selection, seq_len = drafter.rebuild(target.token_scores() if scored else None)
    sync()
    signal = config.retrieval.signal
    return Retrieved(t_s=clock(), elapsed_s=clock() - phase, step=step, policy=config.draft_cache.value, seq_len=seq_len,
                     chunk_size=config.retrieval.chunk_size, chunk_spans=selection.chunk_spans, scores=selection.scores,
                     selected=selection.selected, kept_spans=selection.kept_spans,
                     working_cache_len=int(selection.positions.shape[0]), signal=signal.name if scored else "",
                     reserved=signal.reserved(config.retrieval.top_k) if scored else 0)
