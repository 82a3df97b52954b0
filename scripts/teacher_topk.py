"""Precompute the target's top-k log-probabilities over the draft's training text, once.

Windows of WINDOW tokens are cut from the training texts (scripts/pd_corpus.py decides which text
may be trained on), shuffled with a seed, and run through the target (float32, one thread; bfloat16 is
emulated and slow on this CPU); every SHARD windows are saved to cache/teacher/plain-NNNN.pt as
  input_ids (N, T) int32, topk_ids (N, T, K) int32, topk_logp (N, T, K) float16
where row t holds the target's distribution for the token after position t.
Stops after --minutes of work or when the windows run out; the draft trainer reads every shard.

    python -m scripts.teacher_topk --minutes 12
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from scripts import pd_corpus

WINDOW = 512
TOPK = 32
SHARD = 8


def windows_of(ids: list[int], window: int) -> list[list[int]]:
    return [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=12.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=str(pd_corpus.CACHE / "teacher"))
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    tok, model = pd_corpus.load_teacher(args.seed)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    prose: list[tuple[str, list[int]]] = []
    verse: list[tuple[str, list[int]]] = []
    for source, text in pd_corpus.training_texts():
        ids = tok(text, add_special_tokens=False)["input_ids"]
        ws = [(source, w) for w in windows_of(ids, WINDOW)]
        (prose if "britannica" in source else verse).extend(ws)
    rng.shuffle(prose)
    rng.shuffle(verse)
    # Prose first (closest to what the target writes in the app), then interleave the rest.
    order = prose + verse
    meta = {"window": WINDOW, "topk": TOPK, "seed": args.seed, "prose_windows": len(prose),
            "verse_windows": len(verse), "teacher": str(model.name_or_path), "teacher_dtype": "float32"}
    (out / "plain-meta.json").write_text(json.dumps(meta, indent=2))
    print(f"{len(prose)} prose and {len(verse)} verse windows of {WINDOW}", flush=True)

    start = time.time()
    done = 0
    shard = 0
    buf_ids, buf_tid, buf_tlp = [], [], []
    for i in range(0, len(order), args.batch):
        batch = torch.tensor([w for _, w in order[i:i + args.batch]], dtype=torch.long)
        with torch.inference_mode():
            logits = model(input_ids=batch).logits.float()  # (B, T, V)
            logp = torch.log_softmax(logits, dim=-1)
            tlp, tid = logp.topk(TOPK, dim=-1)  # (B, T, K)
        buf_ids.append(batch.int())
        buf_tid.append(tid.int())
        buf_tlp.append(tlp.half())
        done += batch.numel()
        if sum(b.shape[0] for b in buf_ids) >= SHARD or i + args.batch >= len(order):
            torch.save({"input_ids": torch.cat(buf_ids), "topk_ids": torch.cat(buf_tid),
                        "topk_logp": torch.cat(buf_tlp)}, out / f"plain-{shard:04d}.pt")
            shard += 1
            buf_ids, buf_tid, buf_tlp = [], [], []
            el = time.time() - start
            print(f"shard {shard} tokens {done} {done / el:.0f} tok/s {el / 60:.1f} min", flush=True)
            if el > args.minutes * 60:
                break
    print("done", flush=True)


if __name__ == "__main__":
    main()
