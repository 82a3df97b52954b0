"""Measure the bundled draft against the target on held-out text (the bundled documents).

1. Top-1 agreement, teacher-forced, 256-token context: each held-out document is cut into 256-token
   windows (up to --windows per document, spread over it); agreement is the share of positions
   where the draft's argmax equals the target's argmax (both float32). Also: the same over the
   positions where the target gives its argmax at least 0.5, and the share of positions whose target
   argmax the draft can produce at all (its output vocabulary).
2. Long context: on the first 4,096 tokens of each document that long, agreement over the last 512
   positions (a) when the draft attends over all 4K tokens directly, and (b) through a sliding
   window: each block of 256 predictions sees the 256 tokens before it plus itself (256 to 511
   tokens of context, positions renumbered from 0), as the engine's 512-window prefill does.
3. The target's own answers: chat-template prompts built from held-out passages (an instruction such
   as "Summarize the following text."), answered greedily by the target; agreement is then measured
   teacher-forced over the answer positions only. This is the register the app generates in, and
   what the draft must predict during speculative decoding.
4. Decode step: one new token with a KV cache holding about --context tokens, median of --steps
   steps, draft and target alternating, same dtype.

A draft folder with an output vocabulary (draft_vocab.json) is measured as the engine runs it: with
logits only for those tokens, -inf elsewhere, so its argmax never leaves them.

The target's argmaxes and answers are cached in cache/eval/ (they do not change). Prints one JSON object.

    python -m scripts.eval_draft --threads 1
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from scripts import pd_corpus

from specextend.tools import bundled
from specextend.models import load_model
from specextend.vocab import read_output_vocab

CACHE = pd_corpus.CACHE / "eval"


def windows_for(ids: list[int], size: int, count: int) -> list[list[int]]:
    n = len(ids) // size
    step = max(1, n // count)
    return [ids[i * size:(i + 1) * size] for i in range(0, n, step)][:count]


@torch.inference_mode()
def argmax_of(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.argmax(-1)


@torch.inference_mode()
def cached_target_top(target, key: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's argmax and its probability at every position of `ids`."""
    path = CACHE / f"{key}.pt"
    if path.is_file():
        saved = torch.load(path)
        if torch.equal(saved["ids"], ids) and "p_max" in saved:
            return saved["argmax"], saved["p_max"]
    p_max, argmax = torch.softmax(target(input_ids=ids).logits, -1).max(-1)
    CACHE.mkdir(parents=True, exist_ok=True)
    torch.save({"ids": ids, "argmax": argmax, "p_max": p_max}, path)
    return argmax, p_max


@torch.inference_mode()
def target_answers(target, tok, docs, count: int, max_new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's greedy answers to `count` chat prompts built from passages of `docs` (cached).

    Returns ids (N, T): prompt + answer, right-padded, and a mask (N, T) over the positions that predict
    an answer token. Answers are generated one prompt at a time, so no padding touches the numbers."""
    from scripts import chat_samples

    # make_prompts drops prompts too long for a 512-token window; ask for enough
    prompts = chat_samples.make_prompts(tok, random.Random(2718), 4 * count, [(d.name, d.text()) for d in docs])[:count]
    path = CACHE / "answers" / f"{count}x{max_new}.pt"
    if path.is_file():
        saved = torch.load(path)
        if saved["prompts"] == prompts:  # same documents, template and tokenizer
            return saved["ids"], saved["mask"]
    rows = []
    for p in prompts:
        out = target.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
        rows.append((p, out[0, len(p):].tolist()))
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for j, (p, a) in enumerate(rows):
        ids[j, : len(p) + len(a)] = torch.tensor(p + a)
        mask[j, len(p) - 1: len(p) + len(a) - 1] = True  # position i predicts token i + 1
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"prompts": prompts, "ids": ids, "mask": mask}, path)
    return ids, mask


@torch.inference_mode()
def decode_step_ms(model, context: int, steps: int, vocab: int) -> list[float]:
    from transformers import DynamicCache

    ids = torch.randint(100, vocab, (1, context))
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, cache=cache, use_cache=True)
    times = []
    for _ in range(steps):
        tok = torch.randint(100, vocab, (1, 1))
        t = time.perf_counter()
        model(input_ids=tok, cache=cache, use_cache=True)
        times.append((time.perf_counter() - t) * 1000)
        cache.crop(-1)  # drop the new token: the cache stays at `context`
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--windows", type=int, default=4, help="256-token windows per document")
    ap.add_argument("--long-docs", type=int, default=2)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--answers", type=int, default=16, help="target answers to held-out chat prompts (0: skip)")
    ap.add_argument("--answer-tokens", type=int, default=96)
    ap.add_argument("--skip-long", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tdir = bundled.target_dir()
    ddir = Path(args.draft) if args.draft else bundled.draft_dir()
    tok = AutoTokenizer.from_pretrained(tdir)
    target = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    draft = load_model(ddir, torch.device("cpu"), torch.float32, target=target)
    result: dict = {"draft": str(ddir), "threads": args.threads}

    docs = [d for d in bundled.documents() if d.split == "eval"]
    per_doc = {}
    same, confident, drawable = [], [], []
    listed = read_output_vocab(ddir)
    output_ids = torch.tensor(listed) if listed is not None else None
    for d in docs:
        ids = tok(d.text(), add_special_tokens=False)["input_ids"]
        w = torch.tensor(windows_for(ids, 256, args.windows))
        t_arg, t_p = cached_target_top(target, f"{d.name}-256x{len(w)}", w)
        hit = (t_arg == argmax_of(draft, w)).flatten()
        per_doc[d.name] = round(float(hit.float().mean()), 4)
        same.append(hit)
        confident.append((t_p >= 0.5).flatten())
        drawable.append(torch.isin(t_arg, output_ids).flatten() if output_ids is not None else torch.ones_like(hit))
    same, confident, drawable = torch.cat(same), torch.cat(confident), torch.cat(drawable)
    result["agreement_256"] = round(float(same.float().mean()), 4)
    result["agreement_256_positions"] = same.numel()
    result["agreement_256_by_document"] = per_doc
    # where the target puts at least half its probability on its argmax (the tokens a draft can hope to get)
    result["target_confident_share"] = round(float(confident.float().mean()), 4)
    result["agreement_256_target_confident"] = round(float(same[confident].float().mean()), 4)
    result["target_argmax_in_draft_output_vocabulary"] = round(float(drawable.float().mean()), 4)

    if args.answers:
        ids, mask = target_answers(target, tok, docs, args.answers, args.answer_tokens)
        t_arg = cached_target_top(target, f"answers-{args.answers}x{args.answer_tokens}", ids)[0]
        hit = (t_arg == argmax_of(draft, ids))[mask]
        # t_arg equals the next answer token wherever the batched forward matches one-by-one generation
        result["agreement_target_answers"] = round(float(hit.float().mean()), 4)
        result["agreement_target_answers_positions"] = hit.numel()
        result["target_answers_reproduced"] = round(float((t_arg[:, :-1] == ids[:, 1:])[mask[:, :-1]].float().mean()), 4)

    if not args.skip_long:
        long_docs = [d for d in docs if d.tokens >= 4096][: args.long_docs]
        direct_h = window_h = n_long = 0
        for d in long_docs:
            ids = torch.tensor([tok(d.text(), add_special_tokens=False)["input_ids"][:4096]])
            t_arg = cached_target_top(target, f"{d.name}-4096", ids)[0][0, -512:]
            direct = argmax_of(draft, ids)[0, -512:]
            windowed = []
            for s in (4096 - 512, 4096 - 256):  # two blocks of 256 predictions
                ctx = ids[:, s - 256: s + 256]  # 512 tokens, positions 0..511
                windowed.append(argmax_of(draft, ctx)[0, 256:])
            windowed = torch.cat(windowed)
            direct_h += int((direct == t_arg).sum())
            window_h += int((windowed == t_arg).sum())
            n_long += 512
        result["long_documents"] = [d.name for d in long_docs]
        result["agreement_4k_direct"] = round(direct_h / max(1, n_long), 4)
        result["agreement_4k_window512"] = round(window_h / max(1, n_long), 4)
        result["agreement_4k_positions"] = n_long

    if not args.skip_timing:
        for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            tm = target.to(dtype)
            dm = draft.to(dtype)
            t_ms, d_ms = [], []
            for _ in range(2):  # alternate to share whatever else the machine is doing
                d_ms += decode_step_ms(dm, args.context, args.steps // 2, tok.vocab_size)
                t_ms += decode_step_ms(tm, args.context, args.steps // 2, tok.vocab_size)
            dmed, tmed = statistics.median(d_ms), statistics.median(t_ms)
            result[f"decode_ms_{dtype_name}"] = {"draft": round(dmed, 2), "target": round(tmed, 2),
                                                 "ratio_target_over_draft": round(tmed / dmed, 2),
                                                 "context": args.context, "steps_each": len(d_ms)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
