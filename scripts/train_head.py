"""Train an EAGLE-3-style head for the bundled target (SmolLM2-135M-Instruct) on the bundled corpus only.

Two stages, both on this machine's CPU:
1. Data (`--data DIR`, built once, reused): windows of the training text (scripts/pd_corpus.py: the Shakespeare and
   Milton texts not held out, and the State of the Union addresses) and chat requests built from such windows with
   the target's own greedy answers (the target regenerates its data, as EAGLE-3 does). The target reads every
   sequence once; its residual streams entering layers 2, 15 and 27 (float16) and its top-k next-token
   log-probabilities are stored.
2. Training: the head (fc over the three streams, one layer, its own reduced-vocabulary LM head initialised from the
   target's rows) learns the target's next-token distribution with training-time test: `--unroll` steps in which
   the head's own output state is fed back, each step's queries seeing the real entries up to their position and
   their own earlier steps at the same position, as a drafted chain does at inference.
Writes a head folder in the published EAGLE-3 layout (config.json; fc, midlayer, norm, lm_head, d2t, t2d), its weights
compact (model.gguf: 8-bit blocks, scripts/compact_weights.py), plus train_record.json with the command, the data and
the curve of agreement against tokens seen.

  python -m scripts.train_head --data cache/head-data --out assets/models/smollm2-135m-eagle3
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from scripts import compact_weights, head_data, pd_corpus
from specextend.heads import EAGLE3_ARCHITECTURE, EagleHead, config_like, feature_streams, load_head
from specextend.tools import bundled, prompting

TASKS = (prompting.DEFAULT_INSTRUCTION, "Summarize the passage above.", "What happens in the text above? Answer briefly.",
         "List the main points of the document above.", "Explain the text above in plain modern English.")
TOP = 16  # target log-probs kept per position


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True, help="the data folder (built when absent)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--init", type=Path, help="continue from this head folder (its draft vocabulary kept)")
    p.add_argument("--windows", type=int, default=1200, help="plain text windows")
    p.add_argument("--chats", type=int, default=640, help="chat requests answered by the target")
    p.add_argument("--window", type=int, default=384)
    p.add_argument("--doc-tokens", type=int, default=256, help="tokens of text in a chat request")
    p.add_argument("--answer", type=int, default=128, help="most tokens of a target answer")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--unroll", type=int, default=3)
    p.add_argument("--epochs", type=float, default=4.0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--minutes", type=float, default=0.0, help="stop training after this long (0: no limit)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load_target(threads: int):
    torch.set_num_threads(threads)
    tdir = bundled.target_dir()
    return AutoTokenizer.from_pretrained(tdir), AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()


def text_stream(tokenizer) -> list[int]:
    ids: list[int] = []
    for source in ("shakespeare", "sotu"):
        for _, text in pd_corpus.SOURCES[source]():
            ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def answers(model, tokenizer, prompts: list[list[int]], max_new: int, batch: int = 16) -> list[list[int]]:
    """The target's greedy answers to `prompts` (head_data.greedy_answers: batched, left-padded), each cut after its
    end of text."""
    pad = head_data.pad_id(tokenizer)
    return head_data.greedy_answers(model, prompts, max_new, prompting.stop_ids(tokenizer, model.generation_config),
                                    pad, batch)


@torch.no_grad()
def read_streams(model, ids: torch.Tensor, streams: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target over (B, T) ids: its residual streams (B, T, 3H) and its logits (B, T, V)."""
    got: dict[int, torch.Tensor] = {}
    layers = model.model.layers
    hooks = [layers[i].register_forward_pre_hook(lambda m, a, i=i: got.__setitem__(i, a[0])) for i in streams]
    try:
        logits = model(input_ids=ids).logits
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([got[i] for i in streams], dim=-1), logits


def build_data(args, tokenizer, model, folder: Path) -> None:
    """Sequences (padded to one width), their loss masks, streams (float16) and the target's top-k log-probs."""
    rng = random.Random(args.seed)
    stream = text_stream(tokenizer)
    seqs = []
    for _ in range(args.windows):
        o = rng.randrange(0, len(stream) - args.window)
        seqs.append(stream[o:o + args.window])
    prompts = []
    for _ in range(args.chats):
        o = rng.randrange(0, len(stream) - args.doc_tokens)
        doc = tokenizer.decode(stream[o:o + args.doc_tokens])
        prompts.append(prompting.encode(tokenizer, doc, rng.choice(TASKS)).ids)
    t0 = time.time()
    for p, a in zip(prompts, answers(model, tokenizer, prompts, args.answer)):
        seqs.append(p + a)
    print(f"answers: {time.time() - t0:.0f} s", file=sys.stderr)
    width = max(map(len, seqs))
    pad = tokenizer.pad_token_id or 0
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = True
    streams = feature_streams("eagle3", model.config.num_hidden_layers)
    feats = torch.zeros((len(seqs), width, 3 * model.config.hidden_size), dtype=torch.float16)
    top_lp = torch.zeros((len(seqs), width, TOP), dtype=torch.float16)
    top_id = torch.zeros((len(seqs), width, TOP), dtype=torch.int32)
    t0 = time.time()
    for b in range(0, len(seqs), 8):
        f, logits = read_streams(model, ids[b:b + 8], streams)
        feats[b:b + 8] = f.half()
        lp, idx = torch.log_softmax(logits, -1).topk(TOP, dim=-1)
        top_lp[b:b + 8], top_id[b:b + 8] = lp.half(), idx.int()
        print(f"  streams {b + 8}/{len(seqs)} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"ids": ids, "mask": mask, "top_lp": top_lp, "top_id": top_id, "chats": args.chats,
                "windows": args.windows}, folder / "labels.pt")
    torch.save(feats, folder / "streams.pt")


def draft_vocab(ids: torch.Tensor, mask: torch.Tensor, top_id: torch.Tensor, size: int, vocab: int,
                keep: tuple[int, ...]) -> torch.Tensor:
    """The `size` target ids the target predicts most often (its argmax over the data), plus `keep`: sorted."""
    counts = torch.bincount(top_id[..., 0][mask].long().flatten(), minlength=vocab).float()
    counts += 1e-3 * torch.bincount(ids[mask].flatten(), minlength=vocab).float()
    counts[list(keep)] = float("inf")
    return torch.sort(torch.argsort(counts, descending=True)[:size]).values


class Unrolled:
    """Keys and values of every unrolled step so far (training-time test): a step's queries see them all, under a
    mask that shows step 0's causally and each later step's at the same position only."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, keys, values, layer_idx, **kwargs):
        self.keys.append(keys)
        self.values.append(values)
        return torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2)


def unrolled_mask(t: int, step: int, device=None) -> torch.Tensor:
    """(1, 1, t, (step + 1) t) bool: step 0 causal, steps 1..step the diagonal."""
    blocks = [torch.ones(t, t, dtype=torch.bool, device=device).tril()]
    blocks += [torch.eye(t, dtype=torch.bool, device=device)] * step
    return torch.cat(blocks, dim=1)[None, None]


def unrolled_steps(head: EagleHead, batch: dict, to_draft: torch.Tensor, unroll: int):
    """Training-time test over `unroll` steps, yielding for each step j its loss per index (B, t-1-j) against the
    target's top-k distribution, whether its argmax is the target's (B, t-1-j) and where both are defined (B, t-1-j).
    Step j at index i reads token i+1+j (and, from step 1 on, its own state of step j-1 at i) at position i+j and
    learns the target's distribution at position i+1+j."""
    ids, mask, feats, top_lp, top_id = batch["ids"], batch["mask"], batch["feats"], batch["top_lp"], batch["top_id"]
    b, t = ids.shape
    n, device = t - 1, ids.device
    cache = Unrolled()
    hidden, from_target = feats[:, :n].float(), True
    for j in range(unroll):
        shift = 1 + j
        tok = torch.zeros(b, n, dtype=torch.long, device=device)
        tok[:, : t - shift] = ids[:, shift:]
        pos = (torch.arange(n, device=device) + j)[None].expand(b, n)
        states = head(tok, hidden, pos, cache, from_target, mask=unrolled_mask(n, j, device))
        logq = torch.log_softmax(head.draft_logits(states).float(), -1)[:, : t - shift]  # (B, t - shift, V_draft)
        lab_id = to_draft[top_id[:, shift:].long()]  # (B, t - shift, TOP): draft ids, -1 outside
        lab_p = top_lp[:, shift:].float().exp() * (lab_id >= 0)
        per = -(lab_p * logq.gather(-1, lab_id.clamp(min=0))).sum(-1)  # (B, t - shift)
        yield per, logq.argmax(-1) == lab_id[..., 0], mask[:, shift:] & mask[:, : t - shift]
        hidden, from_target = states, False


def head_loss(head: EagleHead, batch: dict | Sequence[dict], to_draft: torch.Tensor,
              unroll: int) -> tuple[torch.Tensor, list[float]]:
    """Training-time test over `unroll` steps (`unrolled_steps`) on a batch, or on the groups of one batch each padded
    to its own width (head_data.length_groups; the same loss as the batch padded whole): the loss, step j's mean over
    every position weighted 0.8^j, and each step's agreement with the target's argmax."""
    sums, hits, counts = [0.0] * unroll, [0.0] * unroll, [0] * unroll
    for part in [batch] if isinstance(batch, dict) else batch:
        for j, (per, hit, valid) in enumerate(unrolled_steps(head, part, to_draft, unroll)):
            sums[j] = sums[j] + per[valid].sum()
            hits[j] += float(hit[valid].sum())
            counts[j] += int(valid.sum())
    total = sum((0.8 ** j) * sums[j] / max(counts[j], 1) for j in range(unroll))
    return total, [h / max(c, 1) for h, c in zip(hits, counts)]


def make_head(target, vocab_ids: torch.Tensor) -> EagleHead:
    tc = target.config
    cfg = config_like(tc, len(vocab_ids), bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id)
    head = EagleHead("eagle3", cfg, target, len(vocab_ids))
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight[vocab_ids])
        head.norm.weight.copy_(target.model.norm.weight)
        head.d2t.copy_(vocab_ids - torch.arange(len(vocab_ids)))
        head.t2d.zero_()
        head.t2d[vocab_ids] = True
    return head


def head_vocab(head: EagleHead) -> torch.Tensor:
    """The target ids of a head's draft vocabulary, in draft order (draft id d proposes target id d + d2t[d])."""
    return torch.arange(len(head.d2t)) + head.d2t


def draft_index(vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Target id -> draft id over the target's `vocab_size` ids (V,), -1 outside the draft vocabulary `vocab_ids`."""
    to_draft = torch.full((vocab_size,), -1, dtype=torch.long)
    to_draft[vocab_ids] = torch.arange(len(vocab_ids))
    return to_draft


def save_head(head: EagleHead, out: Path, record: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()
             for k, v in head.state_dict().items()}
    compact_weights.write_weights(state, out)
    config = head.config.to_diff_dict()
    config = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("transformers_version", "dtype")}
    config.update(architectures=[EAGLE3_ARCHITECTURE], model_type="llama", torch_dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "train_record.json").write_text(json.dumps(record, indent=2) + "\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    tokenizer, target = load_target(args.threads)
    if not (args.data / "labels.pt").is_file():
        build_data(args, tokenizer, target, args.data)
    labels = torch.load(args.data / "labels.pt")
    feats = torch.load(args.data / "streams.pt", mmap=True)
    ids, mask, top_lp, top_id = labels["ids"], labels["mask"], labels["top_lp"], labels["top_id"]
    for p in target.parameters():
        p.requires_grad_(False)
    if args.init:
        head = load_head(args.init, target, torch.device("cpu"), torch.float32)
        vocab_ids = head_vocab(head)
    else:
        stops = prompting.stop_ids(tokenizer, target.generation_config)
        vocab_ids = draft_vocab(ids, mask, top_id, args.draft_vocab, target.config.vocab_size, stops)
        head = make_head(target, vocab_ids)
    to_draft = draft_index(vocab_ids, target.config.vocab_size)
    n = ids.shape[0]
    order = list(range(n))
    rng = random.Random(args.seed)
    rng.shuffle(order)
    held_n = min(32, n // 4)
    held, train = order[:held_n], order[held_n:]  # held-out sequences: the curve of agreement
    steps = int(args.epochs * len(train) / args.batch)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    curve, start, seen = [], time.time(), 0

    def batch_of(rows):
        rows = torch.tensor(sorted(rows))
        return {"ids": ids[rows], "mask": mask[rows], "feats": feats[rows], "top_lp": top_lp[rows], "top_id": top_id[rows]}

    def evaluate():
        head.eval()
        with torch.no_grad():
            parts = [head_loss(head, batch_of(held[i:i + 8]), to_draft, args.unroll)[1] for i in range(0, len(held), 8)]
        head.train()
        return [round(sum(p[j] for p in parts) / len(parts), 4) for j in range(args.unroll)]

    head.train()
    for step in range(steps):
        if args.minutes and time.time() - start > args.minutes * 60:
            break
        lr = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr
        rows = [train[(step * args.batch + i) % len(train)] for i in range(args.batch)]
        batch = batch_of(rows)
        loss, agree = head_loss(head, batch, to_draft, args.unroll)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        seen += int(batch["mask"].sum())
        if step % 50 == 0 or step == steps - 1:
            held_agree = evaluate()
            curve.append({"step": step, "tokens_seen": seen, "minutes": round((time.time() - start) / 60, 1),
                          "loss": round(float(loss), 4), "train_agree": [round(a, 3) for a in agree],
                          "held_agree": held_agree})
            print(json.dumps(curve[-1]), file=sys.stderr, flush=True)
    record = {"command": "python -m scripts.train_head " + " ".join(sys.argv[1:] if argv is None else argv),
              "args": {k: str(v) for k, v in vars(args).items()}, "sequences": n, "chats": labels["chats"],
              "windows": labels["windows"], "tokens": int(mask.sum()), "draft_vocab": len(vocab_ids),
              "streams": list(head.streams), "unroll": args.unroll, "curve": curve,
              "data": "scripts/pd_corpus.py training text (Shakespeare and Milton not held out, State of the Union) "
                      "and the target's greedy answers to chat requests built from it"}
    save_head(head, args.out, record)


if __name__ == "__main__":
    main()
