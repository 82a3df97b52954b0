"""Train the EAGLE-3 head online: the target reads each batch as training consumes it, so no stream is ever stored.

One command, in phases under one wall-clock budget (`--minutes`), each stopping in time and the run always writing
what it has:
1. data (scripts/head_data.py): the corpus's ids (built once), the held-out requests' answers, then as many of the
   training requests' answers as `--answers` asks (then as many technical requests, about passages of Django's
   documentation, as `--tech` asks, and written requests as `--written` asks: texts the target writes on modern
   topics) or `--answer-share` of the budget allows, in left-padded batches, into resumable shards of ids;
2. training: each batch of the stream (chats and plain windows) is read by the target (`Reader`: its residual streams
   entering layers 2, L//2 and L-3, and its top-k next-token log-probabilities), in bf16 where that is faster; the head
   learns the target's top-k distribution with training-time test over `--unroll` steps (its own output state fed
   back), at a learning rate that follows the tokens seen, so a resumed run continues its schedule;
3. a checkpoint (head, optimizer, stream position, RNG, counters) every `--checkpoint-minutes` and at the end, the
   agreement curve on a fixed held-out set appended to curve.jsonl at every evaluation, and the head written in the
   bundled format (scripts/train_head.save_head) with its record.

  python -m scripts.head_train_online --work cache/head-online --init assets/models/smollm2-135m-eagle3 --minutes 30
  python -m scripts.head_train_online --work cache/head-online --resume --minutes 30
  python -m scripts.head_train_online --device cuda --target /tmp/target.gguf --work /tmp/work --out $OUT/head ...

(the whole GPU call, the target's staging included: docs/results/head_online/README.md). Imports torch, transformers
and the project only (numpy and gguf through it), so it runs on the GPU image with the carried transformers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from scripts import head_data
from scripts.head_data import Position
from scripts.train_head import (draft_index, draft_vocab, head_loss, head_vocab, make_head, read_streams, save_head,
                                unrolled_steps)
from specextend import models
from specextend.heads import feature_streams, load_head

CHECKPOINT = "checkpoint.pt"
CURVE = "curve.jsonl"
# the held-out rows' kinds, each one's agreement apart in the curve (held_agree_KIND)
KINDS = ("plain", "chats", "written", "tech", "tech_chats")
# fixed by a run's first command (a checkpoint written before one existed takes the command's): the stream's order and
# the held-out set (so the curve stays one curve) depend on them
STREAM_ARGS = ("seed", "window", "chat_share", "held_chats", "held_windows", "held_written", "held_tech",
               "held_tech_windows")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, required=True, help="corpus, answers, checkpoint and curve (resumable)")
    p.add_argument("--out", type=Path, help="the head folder written at the end (default: WORK/head)")
    p.add_argument("--target", type=Path, help="the target's folder or GGUF file (default: the bundled target)")
    p.add_argument("--init", type=Path, help="start from this head folder (its draft vocabulary kept)")
    p.add_argument("--resume", action="store_true", help="continue from WORK/checkpoint.pt")
    p.add_argument("--device", default="cpu")
    p.add_argument("--minutes", type=float, default=0.0, help="wall-clock budget of the whole command (0: none)")
    p.add_argument("--steps", type=int, default=0, help="stop training after this many steps in all (0: no limit)")
    p.add_argument("--reserve-s", type=float, default=30.0, help="seconds kept for the last evaluation and saving")
    p.add_argument("--answers", type=int, default=0, help="training requests answered by the target, in all")
    p.add_argument("--written", type=int, default=0,
                   help="training requests with no document (head_data.written_request: the target writes a text on a "
                        "modern topic), in all; the stream reads them where no answered request is left unread")
    p.add_argument("--write-new", type=int, default=256, help="most tokens of a written text")
    p.add_argument("--tech", type=int, default=0,
                   help="training requests about a passage of the technical corpus (Django's documentation: "
                        "head_data.TECH_TASKS) answered by the target, in all; read after the answered requests, by turns "
                        "with the written ones (--tech-share)")
    p.add_argument("--tech-windows", type=float, default=0.0,
                   help="share of the plain windows read from the technical corpus (may change on a resume)")
    p.add_argument("--tech-share", type=float, default=0.5,
                   help="share of the technical requests among the chats read while technical and written ones are "
                        "both unread (may change on a resume)")
    p.add_argument("--answer-share", type=float, default=0.3, help="most share of the budget spent answering")
    p.add_argument("--held-chats", type=int, default=32)
    p.add_argument("--held-windows", type=int, default=32)
    p.add_argument("--held-written", type=int, default=0,
                   help="written requests on held-out topics in the curve's held-out set, the target's texts")
    p.add_argument("--held-tech", type=int, default=0,
                   help="technical requests on held-out blocks of the technical corpus in the curve's held-out set")
    p.add_argument("--held-tech-windows", type=int, default=0,
                   help="windows of held-out blocks of the technical corpus in the curve's held-out set")
    p.add_argument("--doc-tokens", type=int, default=320, help="most tokens of a passage in a request")
    p.add_argument("--max-new", type=int, default=128, help="most tokens of an answer")
    p.add_argument("--gen-batch", type=int, default=128,
                   help="requests answered together; on this project's CPU (2 cores, bf16) a written request's answer "
                        "tokens come 2.6x as fast in batches of 128 as in batches of 16 (296 against 114 a second: "
                        "head_measure generate --written)")
    p.add_argument("--shard", type=int, default=128, help="requests per shard of answers (answered in --gen-batch)")
    p.add_argument("--gen-dtype", default="auto",
                   help="answers: auto (bf16 on CUDA, else where measured faster: models.prefill_dtype), float32, bfloat16")
    p.add_argument("--read-dtype", default="auto", help="the target's reading for the head: as --gen-dtype")
    p.add_argument("--step-dtype", default="auto",
                   help="the head's training step (forward and backward under autocast; its weights and AdamW stay "
                        "float32): as --gen-dtype; on this project's CPU bf16 halves the step (4.6 s -> 2.2 s a batch)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--chat-share", type=float, default=0.5, help="share of the stream's sequences that are chats")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--groups", type=int, default=2,
                   help="a batch is read and learned in at most this many groups of near length, each padded to its "
                        "own longest (head_data.length_groups; the same loss as one batch padded whole)")
    p.add_argument("--unroll", type=int, default=6)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--vocab-sample", type=int, default=256, help="sequences read to choose a new head's vocabulary")
    p.add_argument("--grow-vocab", type=int, default=0,
                   help="add to the head's draft vocabulary the N tokens it lacks that the target writes most often in "
                        "its answers to the training requests (their rows the target's LM head's through the map "
                        "training moved the old rows by, their optimizer moments zero: grow_vocab)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-tokens", type=float, default=2e5)
    p.add_argument("--schedule-tokens", type=float, default=2e7, help="tokens of the cosine's length (then --lr-floor)")
    p.add_argument("--lr-floor", type=float, default=0.1, help="the cosine's end, a share of --lr")
    p.add_argument("--decay-share", type=float, default=0.0,
                   help="in this last share of the run's training time (its --minutes budget, after answering) the "
                        "learning rate falls linearly to --lr-floor x the schedule's (warmup-stable-decay: the head "
                        "and checkpoint written are the decayed ones; a resume starts back at the schedule)")
    p.add_argument("--checkpoint-minutes", type=float, default=5.0)
    p.add_argument("--eval-every", type=int, default=100, help="steps between evaluations on the held-out set")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def dtype_of(name: str, device: torch.device, measured) -> torch.dtype:
    """float32/bfloat16 by name; auto: bf16 on CUDA, else `measured()`."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else measured()
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def in_dtype(target, dtype: torch.dtype):
    """The target computing in `dtype`, its output layer kept in its own dtype (as the engine's bf16 prefill keeps
    it: bf16 logits would tie the top tokens far more often): itself where `dtype` is its own."""
    if dtype == next(target.parameters()).dtype:
        return target
    return models.reduced_copy(target, dtype, keep=target.get_output_embeddings())


class Reader:
    """The target reading batches for the head in `dtype` (`in_dtype`): the residual streams the head takes and the
    top-k next-token log-probabilities."""

    def __init__(self, target, dtype: torch.dtype, topk: int) -> None:
        self.model = in_dtype(target, dtype)
        self.streams = feature_streams("eagle3", target.config.num_hidden_layers)
        self.topk, self.dtype = topk, dtype

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> dict:
        """ids (B, T) -> feats (B, T, 3H) in the reading dtype, top_lp (B, T, K) float32, top_id (B, T, K)."""
        feats, logits = read_streams(self.model, ids, self.streams)
        lp, idx = torch.log_softmax(logits.float(), -1).topk(self.topk, dim=-1)
        return {"feats": feats, "top_lp": lp, "top_id": idx}


def learning_rate(args, tokens: int) -> float:
    """Warm-up, then a cosine from --lr to --lr-floor x --lr over --schedule-tokens, then the floor: a function of
    the tokens seen, so that a resumed run continues its schedule."""
    warm = min(1.0, (tokens + 1) / args.warmup_tokens)
    done = min(1.0, tokens / args.schedule_tokens)
    return args.lr * warm * (args.lr_floor + (1 - args.lr_floor) * 0.5 * (1 + math.cos(math.pi * done)))


def decayed(args, passed: float) -> float:
    """The schedule's multiplier once `passed` (a share) of the run's training time has gone: 1 until its last
    --decay-share, then falling linearly to --lr-floor at its end."""
    if not args.decay_share:
        return 1.0
    into = (passed - (1.0 - args.decay_share)) / args.decay_share
    return 1.0 - (1.0 - args.lr_floor) * min(1.0, max(0.0, into))


def labelled(reader: Reader, seqs: list[list[int]], pad: int, device) -> dict:
    ids, mask = head_data.pad_batch(seqs, pad, device)
    return {"ids": ids, "mask": mask, **reader(ids)}


@torch.no_grad()
def evaluate(head, batches: list[dict], to_draft: torch.Tensor, unroll: int) -> dict:
    """On the held-out batches: each unrolled step's agreement with the target's argmax (tokens teacher-forced), and
    `chain`: the mean number of leading steps that agree, where all are defined (a chain's accepted tokens, as if
    the tokens read were the target's own); where a batch gives its rows' kinds (`kind`, (B,): KINDS), the agreement
    again over each kind apart."""
    was = head.training
    head.eval()
    kinds = ("", *(f"_{k}" for k in KINDS))
    hits, counts = {k: [0.0] * unroll for k in kinds}, {k: [0] * unroll for k in kinds}
    chain, chained = 0.0, 0
    for batch in batches:
        steps = list(unrolled_steps(head, batch, to_draft, unroll))
        last = steps[-1][2].shape[1]
        lead = torch.ones_like(steps[-1][2], dtype=torch.float)
        run = torch.zeros_like(lead)
        kind = batch.get("kind")
        for j, (_, hit, valid) in enumerate(steps):
            rows = {"": valid} if kind is None else {"": valid} | {
                f"_{k}": valid & (kind == i)[:, None] for i, k in enumerate(KINDS)}
            for k, where in rows.items():
                hits[k][j] += float(hit[where].sum())
                counts[k][j] += int(where.sum())
            lead = lead * hit[:, :last]
            run += lead
        every = steps[-1][2]
        chain += float(run[every].sum())
        chained += int(every.sum())
    head.train(was)
    agree = {f"held_agree{k}": [round(h / max(c, 1), 4) for h, c in zip(hits[k], counts[k])]
             for k in kinds if counts[k][0]}
    return {**agree, "held_chain": round(chain / max(chained, 1), 4), "held_positions": counts[""][0]}


def save_checkpoint(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


class Clock:
    """The command's wall-clock budget (0: none) and a stop asked by a signal."""

    def __init__(self, minutes: float, reserve_s: float) -> None:
        self.start = time.time()
        self.end = self.start + minutes * 60 if minutes else float("inf")
        self.reserve = reserve_s
        self.stopped = False

    def left(self) -> float:
        """Seconds left before the reserve kept for the end (negative once past it)."""
        return -1.0 if self.stopped else self.end - self.reserve - time.time()

    def passed(self, since: float) -> float:
        """The share gone of the time from `since` to the budget's reserve (0 with no budget)."""
        if self.end == float("inf"):
            return 0.0
        return min(1.0, (time.time() - since) / max(1e-9, self.end - self.reserve - since))

    def before(self, share: float) -> float:
        """Seconds left before `share` of the budget has passed."""
        if self.stopped:
            return -1.0
        return (self.start + share * (self.end - self.start) - time.time()) if self.end != float("inf") else float("inf")

    def stop(self, *_) -> None:
        self.stopped = True


def wants_tech(args) -> bool:
    """Whether a run reads the technical corpus."""
    return bool(args.tech or args.tech_windows or args.held_tech or args.held_tech_windows)


def prepare_data(args, target, prompter, pad: int, stop: tuple[int, ...], clock: Clock, say):
    """Phase 1: the held-out requests' answers, then the training requests' within their share of the budget.
    Returns (the stream, held-out sequences, their kinds (KINDS' indices))."""
    corpus = head_data.load_corpus(args.work)
    tech = head_data.load_corpus(args.work, name="tech") if wants_tech(args) else None
    gen_model = in_dtype(target, dtype_of(args.gen_dtype, torch.device(args.device),
                                          lambda: models.prefill_dtype(target, "auto")))
    answering = dict(seed=args.seed, doc_tokens=args.doc_tokens, max_new=args.max_new, stop=stop, pad=pad,
                     batch=args.gen_batch, shard=args.shard, say=say)
    writing = answering | {"max_new": args.write_new}
    head_data.answer_requests(gen_model, corpus, prompter, args.work / "held", count=args.held_chats, held=True,
                              time_left=clock.left, **answering)
    head_data.answer_requests(gen_model, corpus, prompter, args.work / "held-written", count=args.held_written,
                              held=True, time_left=clock.left, kind="written", **writing)
    if tech is not None:
        head_data.answer_requests(gen_model, tech, prompter, args.work / "held-tech", count=args.held_tech, held=True,
                                  time_left=clock.left, kind="tech", **answering)
    share = lambda: min(clock.before(args.answer_share), clock.left())  # noqa: E731  (the training requests' time)
    head_data.answer_requests(gen_model, corpus, prompter, args.work / "answers", count=args.answers, held=False,
                              time_left=share, **answering)
    if tech is not None:
        head_data.answer_requests(gen_model, tech, prompter, args.work / "tech", count=args.tech, held=False,
                                  time_left=share, kind="tech", **answering)
    head_data.answer_requests(gen_model, corpus, prompter, args.work / "written", count=args.written, held=False,
                              time_left=share, kind="written", **writing)
    held_chats = head_data.read_chats(args.work / "held")[:args.held_chats]
    held_written = head_data.read_chats(args.work / "held-written")[:args.held_written]
    held_seqs = head_data.held_out(corpus, held_chats + held_written, args.window, args.held_windows)
    kinds = [KINDS.index("chats")] * len(held_chats) + [KINDS.index("written")] * len(held_written)
    kinds += [KINDS.index("plain")] * (len(held_seqs) - len(kinds))
    if tech is not None:
        held_tech = head_data.read_chats(args.work / "held-tech")[:args.held_tech]
        more = head_data.held_out(tech, held_tech, args.window, args.held_tech_windows)
        held_seqs += more
        kinds += [KINDS.index("tech_chats")] * len(held_tech) + [KINDS.index("tech")] * (len(more) - len(held_tech))
    return open_stream(args, corpus, tech), held_seqs, kinds


def open_stream(args, corpus: head_data.Corpus, tech: head_data.Corpus | None) -> head_data.Stream:
    """The training stream over WORK's answered requests, in the order and shares `args` set."""
    return head_data.Stream(corpus, head_data.read_chats(args.work / "answers"), args.window, args.chat_share,
                            args.seed, head_data.read_chats(args.work / "written"), tech,
                            head_data.read_chats(args.work / "tech") if tech is not None else (), args.tech_windows,
                            args.tech_share)


def read_groups(reader: Reader, seqs: list[list[int]], groups: int, pad: int, device) -> list[dict]:
    """A batch as the target reads it for training: in at most `groups` length groups (head_data.length_groups)."""
    return [labelled(reader, [seqs[i] for i in group], pad, device)
            for group in head_data.length_groups([len(q) for q in seqs], groups)]


def train_step(head, opt, params, parts: list[dict], to_draft, unroll: int, cast) -> tuple[float, list[float]]:
    """One AdamW step of training-time test on a batch read in `parts` (gradient norm clipped to 1), under `cast`
    (the step's autocast): the loss and the agreement per unrolled step."""
    with cast:
        loss, agree = head_loss(head, parts, to_draft, unroll)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return float(loss.detach()), agree


def start_head(args, target, reader: Reader, stream: head_data.Stream, ckpt: dict | None, pad: int,
               stop: tuple[int, ...]):
    """The head and its draft vocabulary (target ids, sorted): from the checkpoint, a head folder (`--init`), or
    afresh, its vocabulary the `--draft-vocab` ids the target predicts most often over the stream's first
    `--vocab-sample` sequences."""
    if ckpt is not None:
        vocab_ids = ckpt["vocab_ids"]
        head = make_head(target, vocab_ids)
        head.load_state_dict(ckpt["head"])
    elif args.init:
        head = load_head(args.init, target, torch.device("cpu"), torch.float32)
        vocab_ids = head_vocab(head)
    else:
        sample, _ = stream.take(Position(), args.vocab_sample)
        read = [labelled(reader, sample[i:i + args.batch], pad, args.device) for i in range(0, len(sample), args.batch)]
        ids, mask, top = (torch.cat([b[k].reshape(-1, *b[k].shape[2:]).cpu() for b in read])
                          for k in ("ids", "mask", "top_id"))
        vocab_ids = draft_vocab(ids, mask, top, args.draft_vocab, target.config.vocab_size, stop)
        head = make_head(target, vocab_ids)
    return head.to(device=args.device, dtype=torch.float32).train(), vocab_ids


def most_written(chats: list[head_data.Chat], vocab_ids: torch.Tensor, vocab: int, count: int) -> torch.Tensor:
    """The `count` target ids outside `vocab_ids` that the target wrote most often in the answers of `chats` (its
    own greedy tokens: the argmax a head must draft), most frequent first; fewer where fewer were written."""
    answers = torch.tensor([t for chat in chats for t in chat.ids[chat.prompt_len:]], dtype=torch.long)
    counts = torch.bincount(answers, minlength=vocab)
    counts[vocab_ids] = 0
    order = torch.argsort(counts, descending=True, stable=True)
    return order[:min(count, int((counts > 0).sum()))]


def grow_vocab(head, vocab_ids: torch.Tensor, extra: torch.Tensor, target, opt_state: dict | None = None):
    """The head with `extra` target ids added to its draft vocabulary (kept sorted), every other weight as it was.
    A new id's row is the target's LM head row carried through the linear map that best takes the target's rows of
    the old ids to the head's trained ones (least squares): the target's own rows would score the head's states as
    the trained rows no longer do (grown so, a head's first-token agreement fell from 0.45 to 0.09 before training;
    with the map it stays). With the AdamW state of its trainable parameters (`opt_state`), the same state with zero
    moments for the new rows. Returns (head, vocab_ids, opt_state)."""
    ids = torch.cat([vocab_ids.cpu(), extra.cpu()])
    order = torch.argsort(ids)  # the merged vocabulary, sorted: draft id d is ids[order[d]]
    grown = make_head(target, ids[order]).to(head.lm_head.weight.device)
    old_rows = head.lm_head.weight.detach()
    with torch.no_grad():
        rows = target.get_output_embeddings().weight.to(old_rows.device, torch.float64)
        carry = torch.linalg.lstsq(rows[vocab_ids.to(rows.device)], old_rows.double()).solution  # (H, H)
        new_rows = (rows[extra.to(rows.device)] @ carry).to(old_rows.dtype)
        state = {k: v for k, v in head.state_dict().items() if not k.startswith(("lm_head.", "d2t", "t2d"))}
        grown.load_state_dict(state, strict=False)
        grown.lm_head.weight.copy_(torch.cat([old_rows, new_rows])[order.to(old_rows.device)])
    if opt_state is not None:
        at = [p is head.lm_head.weight for p in head.parameters() if p.requires_grad].index(True)
        moments = dict(opt_state["state"][at])  # a new state: the one given may be a live optimizer's
        for name in ("exp_avg", "exp_avg_sq"):
            m = moments[name]
            moments[name] = torch.cat([m, m.new_zeros(len(extra), m.shape[1])])[order.to(m.device)]
        opt_state = {**opt_state, "state": {**opt_state["state"], at: moments}}
    return grown.to(dtype=head.lm_head.weight.dtype).train(head.training), ids[order], opt_state


def run(args, target, prompter, pad: int, stop: tuple[int, ...], say=print, clock: Clock | None = None) -> dict:
    """All phases on a loaded target (float32, on `--device`); WORK must hold corpus.npy. Returns the record written
    beside the head."""
    clock = clock or Clock(args.minutes, args.reserve_s)
    device = torch.device(args.device)
    work, out = args.work, args.out or args.work / "head"
    ckpt_path, curve_path = work / CHECKPOINT, work / CURVE
    ckpt = torch.load(ckpt_path, weights_only=False) if args.resume and ckpt_path.is_file() else None
    if args.resume and ckpt is None:
        say(f"no checkpoint in {work}: starting afresh")
    if ckpt is not None:
        for name in STREAM_ARGS:
            setattr(args, name, ckpt["args"].get(name, getattr(args, name)))
    for p in target.parameters():
        p.requires_grad_(False)
    torch.manual_seed(args.seed)  # a new head's initial weights
    stream, held, held_kinds = prepare_data(args, target, prompter, pad, stop, clock, say)
    read_dtype = dtype_of(args.read_dtype, device, lambda: models.prefill_dtype(target, "auto"))
    reader = Reader(target, read_dtype, args.topk)
    head, vocab_ids = start_head(args, target, reader, stream, ckpt, pad, stop)
    opt_state = ckpt["opt"] if ckpt is not None else None
    if args.grow_vocab:
        chats = [*stream.chats, *stream.tech_chats, *stream.written]
        extra = most_written(chats, vocab_ids, target.config.vocab_size, args.grow_vocab)
        head, vocab_ids, opt_state = grow_vocab(head, vocab_ids, extra, target, opt_state)
        say(f"draft vocabulary grown by {len(extra)} to {len(vocab_ids)} ids")
    to_draft = draft_index(vocab_ids, target.config.vocab_size).to(device)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    state = {"step": 0, "tokens": 0, "minutes": 0.0, "pos": Position()}
    if ckpt is not None:
        opt.load_state_dict(opt_state)
        state = {**ckpt["state"], "pos": Position(**ckpt["state"]["pos"])}
        torch.set_rng_state(ckpt["rng"]["torch"])
        random.setstate(ckpt["rng"]["python"])
    held_batches = [labelled(reader, held[i:i + args.batch], pad, device) | {
        "kind": torch.tensor(held_kinds[i:i + args.batch], device=device)} for i in range(0, len(held), args.batch)]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    step_dtype = dtype_of(args.step_dtype, device, lambda: models.prefill_dtype(target, "auto"))
    step_cast = torch.autocast(device.type, dtype=step_dtype, enabled=step_dtype != torch.float32)
    dtypes = {"read_dtype": str(read_dtype).replace("torch.", ""), "step_dtype": str(step_dtype).replace("torch.", "")}
    began, minutes0 = time.time(), state["minutes"]

    def lr_now() -> float:
        return learning_rate(args, state["tokens"]) * decayed(args, clock.passed(began))

    def distinct(pos: Position) -> int:
        """Token-positions of distinct sequences read so far (each chat once; plain windows up to one epoch)."""
        read = [*stream.chats[:pos.chat], *stream.tech_chats[:pos.tech], *stream.written[:pos.written]]
        windows = min(pos.plain, len(stream.starts)) + min(pos.tech_plain, len(stream.tech_starts))
        return sum(len(c.ids[:args.window]) for c in read) + windows * args.window

    def checkpoint() -> None:
        state["minutes"] = minutes0 + (time.time() - began) / 60
        save_checkpoint(ckpt_path, {"head": head.state_dict(), "opt": opt.state_dict(), "vocab_ids": vocab_ids,
                                    "state": {**state, "pos": asdict(state["pos"])}, "args": vars(args),
                                    "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}})

    def point(losses: list[float], agrees: list[list[float]]) -> dict:
        with autocast:
            got = evaluate(head, held_batches, to_draft, args.unroll)
        row = {"step": state["step"], "tokens": state["tokens"], "distinct_tokens": distinct(state["pos"]),
               "minutes": round(minutes0 + (time.time() - began) / 60, 2), "lr": lr_now(),
               "loss": round(sum(losses) / len(losses), 4) if losses else None,
               "train_agree": [round(sum(a[j] for a in agrees) / len(agrees), 4) for j in range(args.unroll)]
               if agrees else None, **got, "device": device.type, **dtypes}
        with curve_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        say(json.dumps(row))
        return row

    # 2. training until the budget's reserve, evaluating and checkpointing as it goes
    losses, agrees, last_ckpt, rows = [], [], time.time(), []
    if state["step"] == 0:
        rows.append(point([], []))
    while clock.left() > 0 and not (args.steps and state["step"] >= args.steps):
        seqs, pos = stream.take(state["pos"], args.batch)
        for g in opt.param_groups:
            g["lr"] = lr_now()
        loss, agree = train_step(head, opt, params, read_groups(reader, seqs, args.groups, pad, device), to_draft,
                                 args.unroll, step_cast)
        state.update(step=state["step"] + 1, tokens=state["tokens"] + sum(len(q) for q in seqs), pos=pos)
        losses.append(loss)
        agrees.append(agree)
        if state["step"] % args.eval_every == 0:
            rows.append(point(losses, agrees))
            losses, agrees = [], []
        if time.time() - last_ckpt > args.checkpoint_minutes * 60:
            checkpoint()
            last_ckpt = time.time()

    # 3. the last point, the checkpoint and the head
    if losses or not rows:
        rows.append(point(losses, agrees))
    checkpoint()
    record = {"command": "python -m scripts.head_train_online " + " ".join(sys.argv[1:]),
              "data": head_data.summary(work) | {"position": asdict(state["pos"]),
                                                 "distinct_tokens": distinct(state["pos"])},
              "steps": state["step"], "tokens_seen": state["tokens"], "minutes": round(state["minutes"], 2),
              "unroll": args.unroll, "topk": args.topk, "draft_vocab": len(vocab_ids), "streams": list(head.streams),
              **dtypes, "device": device.type, "last": rows[-1], "curve": CURVE}
    save_head(head, out, record)
    return record


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specextend.tools import bundled, prompting

    clock = Clock(args.minutes, args.reserve_s)
    signal.signal(signal.SIGTERM, clock.stop)  # a stop asked from outside ends training and still writes everything
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    path = args.target or bundled.target_dir()
    # a folder, or a GGUF file (the bundled target's own Q4_1 file, dequantized here: what a GPU call can carry)
    where = dict(pretrained_model_name_or_path=path.parent, gguf_file=path.name) if path.suffix == ".gguf" else dict(
        pretrained_model_name_or_path=path)
    tokenizer = AutoTokenizer.from_pretrained(**where)
    target = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).to(args.device).eval()
    head_data.load_corpus(args.work, tokenizer)
    if wants_tech(args):
        head_data.load_corpus(args.work, tokenizer, "tech")
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    pad = head_data.pad_id(tokenizer)
    run(args, target, head_data.chat_prompter(tokenizer), pad, prompting.stop_ids(tokenizer, target), say, clock)


if __name__ == "__main__":
    main()
