"""The target's own greedy answers to document instructions, with its top-k log-probabilities.

The app asks the target things like "Summarize the document" about a long text, so the draft must
predict the target's own answers, not only book text. This script cuts passages (120 to 380 tokens)
from the training texts, wraps each in the target's chat template with one of several instructions,
lets the target answer greedily (float32, one thread) and keeps the target's top-k log-probabilities
of every answer step. Shards go to cache/teacher/chat-NNNN.pt with input_ids / topk_ids / topk_logp
like teacher_topk.py, padded to 512 positions, plus a loss `mask` (N, T) that covers only the
positions predicting answer tokens (the prompt is context, not a target).

    python -m scripts.chat_samples --minutes 10
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from scripts import pd_corpus

WINDOW = 512
TOPK = 32
SHARD = 16

INSTRUCTIONS = (
    "Summarize the following text.",
    "Summarize the document in a few sentences.",
    "What are the main points of this passage?",
    "Explain this passage in simple modern English.",
    "Who are the people in this text, and what do they do?",
    "List three key facts from this text.",
    "Write a short title and a one-paragraph summary for this text.",
    "What happens in this passage?",
    "Describe the tone and the subject of this text.",
    "Give a brief summary of the text below, then one question it raises.",
)


def make_prompts(tok, rng: random.Random, n: int, texts: list[tuple[str, str]] | None = None) -> list[list[int]]:
    """Up to `n` chat-template prompts (token ids, at most WINDOW - 128): a passage of one of `texts`
    ((label, text) pairs, the training texts by default) with an instruction before or after it."""
    texts = texts if texts is not None else pd_corpus.training_texts()
    weights = [len(t) for _, t in texts]
    prompts = []
    for _ in range(n):
        _, text = rng.choices(texts, weights=weights)[0]
        lines = text.split("\n")
        start = rng.randrange(0, max(1, len(lines) - 40))
        size = rng.randint(120, 380)
        passage, j, chars = [], start, 0
        while j < len(lines) and chars < size * 4:  # about 4 characters per token
            passage.append(lines[j])
            chars += len(lines[j]) + 1
            j += 1
        body = "\n".join(passage).strip()
        instruction = rng.choice(INSTRUCTIONS)
        content = f"{instruction}\n\n{body}" if rng.random() < 0.6 else f"{body}\n\n{instruction}"
        ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
        if len(ids) <= WINDOW - 128:  # room for the answer inside the window
            prompts.append(list(ids))
    return prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--out", default=str(pd_corpus.CACHE / "teacher"))
    args = ap.parse_args()
    tok, model = pd_corpus.load_teacher(args.seed)
    tok.padding_side = "left"
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(tok, rng, 400)
    pad = tok.pad_token_id
    start = time.time()
    shard, done = 0, 0
    rows: list[tuple[list[int], int, torch.Tensor, torch.Tensor]] = []
    for i in range(0, len(prompts), args.batch):
        group = prompts[i:i + args.batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_new,
                                 do_sample=False, pad_token_id=pad, output_logits=True,
                                 return_dict_in_generate=True)
            logits = torch.stack(gen.logits, dim=1).float()  # (B, S, V): step s predicts answer[s]
            tlp, tid = torch.log_softmax(logits, dim=-1).topk(TOPK, dim=-1)  # (B, S, K)
        for j, p in enumerate(group):
            answer = gen.sequences[j, width:].tolist()
            if tok.eos_token_id in answer:
                answer = answer[: answer.index(tok.eos_token_id) + 1]
            answer = answer[: WINDOW - len(p)]
            rows.append((p + answer, len(p), tid[j, : len(answer)], tlp[j, : len(answer)]))
            done += len(answer)
        if len(rows) >= SHARD:
            save(rows, out / f"chat-{shard:04d}.pt", pad)
            shard += 1
            rows = []
            el = time.time() - start
            print(f"shard {shard} answer tokens {done} {done / el:.1f} tok/s {el / 60:.1f} min", flush=True)
            if el > args.minutes * 60:
                break
    if rows:
        save(rows, out / f"chat-{shard:04d}.pt", pad)
    print("done", flush=True)


def save(rows, path: Path, pad: int) -> None:
    """Rows padded to WINDOW; the loss mask covers the positions that predict answer tokens."""
    n = len(rows)
    ids = torch.full((n, WINDOW), pad, dtype=torch.int32)
    tid = torch.zeros((n, WINDOW, TOPK), dtype=torch.int32)
    tlp = torch.zeros((n, WINDOW, TOPK), dtype=torch.float16)
    mask = torch.zeros((n, WINDOW), dtype=torch.bool)
    for j, (seq, plen, ix, lp) in enumerate(rows):
        a = ix.shape[0]
        ids[j, : len(seq)] = torch.tensor(seq, dtype=torch.int32)
        tid[j, plen - 1: plen - 1 + a] = ix.int()
        tlp[j, plen - 1: plen - 1 + a] = lp.half()
        mask[j, plen - 1: plen - 1 + a] = True
    torch.save({"input_ids": ids, "topk_ids": tid, "topk_logp": tlp, "mask": mask}, path)


if __name__ == "__main__":
    main()
