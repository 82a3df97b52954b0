"""Measure what the online head pipeline's choices rest on, with the bundled target on this machine; prints JSON lines.

  read      the target reading batches of corpus windows for the head (scripts/head_train_online.Reader) in float32
            and in bfloat16, alternating: tokens/s each, and how far bf16 moves the labels and the streams
  generate  answers to chat requests, one at a time against left-padded batches (head_data.greedy_answers):
            answer tokens/s
  online    one training step's parts per token: the target's reading, the head's step (training-time test), and
            writing then reading the same batch's streams and labels as a shard would (float16 streams)
  agree     heads side by side (`--heads`): agreement with the target's argmax per unrolled step, as the training
            curve measures it, on written requests about held-out topics (the target's own answers) and on windows
            of `--files` (text nobody tuned for), the target reading in bf16 as training does, the share of
            those positions whose target argmax the head's draft vocabulary holds (`in_vocab`), and the first
            token's agreement apart by how sure the target was of its argmax (`by_confidence`)
  groups    a training step (the target's reading, the head's training-time test, AdamW) on the stream's next
            batches after the checkpoint's position, each batch padded whole against read and learned in `--groups`
            length groups (head_data.length_groups), alternating, at learning rate 0 (the head stays as it is):
            seconds a step, and the padding each way
  inputs    whether a head reads its inputs where they belong: its first-token agreement on the target's texts about
            held-out topics as read (teacher-forced), then with the target's features taken one position later or
            earlier, the token it reads one position earlier or random, and no features at all; a head trained on
            misplaced inputs would agree more with one of the shifted readings than as read

  python -m scripts.head_measure read --work cache/head-online --repeats 5
  python -m scripts.head_measure generate --work cache/head-online --prompts 16 --max-new 64
  python -m scripts.head_measure generate --work cache/head-online --written --prompts 128 --single 0 --max-new 96 \
      --dtypes bfloat16 --batches 16 64 128 --repeats 2
  python -m scripts.head_measure online --work cache/head-online --repeats 3
  python -m scripts.head_measure groups --work cache/head-online3 --repeats 10 --groups 2
  python -m scripts.head_measure inputs --heads assets/models/smollm2-135m-eagle3 --prompts 16 --max-new 200
  python -m scripts.head_measure agree --heads assets/models/smollm2-135m-eagle3 cache/head-online2/head --prompts 32 \
      --max-new 256 --files /usr/share/common-licenses/GPL-3

Timings on a shared machine are noisy: each compares alternating runs and reports medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from scripts import head_data
from scripts.head_data import Position
from scripts.head_train_online import (CHECKPOINT, Reader, in_dtype, labelled, open_stream, read_groups, start_head,
                                       train_step, wants_tech)
from scripts.train_head import draft_index, head_loss, head_vocab, make_head, unrolled_steps

CONFIDENCE = (0.0, 0.3, 0.5, 0.7, 0.9)  # agree: the lower edges of the target's top-1 probability buckets


def load(threads: int):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specextend.tools import bundled

    torch.set_num_threads(threads)
    folder = bundled.target_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return tokenizer, target


def timed(fn):
    began = time.perf_counter()
    out = fn()
    return time.perf_counter() - began, out


def windows(corpus: head_data.Corpus, count: int, length: int) -> list[list[int]]:
    starts = corpus.windows(length, held=False)[:: 97][:count]
    return [corpus.ids[s:s + length].tolist() for s in starts]


def measure_read(args, tokenizer, target, corpus) -> None:
    readers = {"float32": Reader(target, torch.float32, 16), "bfloat16": Reader(target, torch.bfloat16, 16)}
    seqs = windows(corpus, args.batch * args.repeats, args.window)
    times: dict[str, list[float]] = {name: [] for name in readers}
    labels: dict[str, list[dict]] = {name: [] for name in readers}
    for r in range(args.repeats):
        batch = seqs[r * args.batch:(r + 1) * args.batch]
        for name in (readers if r % 2 == 0 else reversed(list(readers))):  # alternating which goes first
            took, got = timed(lambda: labelled(readers[name], batch, 0, "cpu"))
            times[name].append(took)
            labels[name].append(got)
    tokens = args.batch * args.window
    for name, ts in times.items():
        print(json.dumps({"measure": "read", "dtype": name, "batch": args.batch, "window": args.window,
                          "tokens_per_s": round(tokens / statistics.median(ts)), "seconds": [round(t, 2) for t in ts]}))
    f32, b16 = labels["float32"], labels["bfloat16"]
    same_top1 = torch.cat([(a["top_id"][..., 0] == b["top_id"][..., 0]).flatten() for a, b in zip(f32, b16)])
    overlap = torch.cat([(a["top_id"][..., :, None] == b["top_id"][..., None, :]).any(-1).float().mean(-1).flatten()
                         for a, b in zip(f32, b16)])
    err = [float((a["feats"].float() - b["feats"].float()).norm() / a["feats"].float().norm()) for a, b in zip(f32, b16)]
    print(json.dumps({"measure": "labels", "bf16_vs_fp32_top1_same": round(float(same_top1.float().mean()), 4),
                      "top16_overlap": round(float(overlap.mean()), 4),
                      "streams_relative_error": round(statistics.median(err), 4)}))


def measure_generate(args, tokenizer, target, corpus) -> None:
    from specextend.tools import prompting

    prompter = head_data.chat_prompter(tokenizer)
    prompts = [head_data.written_request(prompter, 99, i, False) if args.written else
               head_data.request(corpus, prompter, 99, i, False, args.doc_tokens) for i in range(args.prompts)]
    stop = prompting.stop_ids(tokenizer, target)
    pad = head_data.pad_id(tokenizer)
    ways = [("float32", 1, prompts[:args.single]), *((d, b, prompts) for d in args.dtypes for b in args.batches)]
    ways = [way for way in ways if way[2]]  # --single 0: no prompts answered one at a time
    for r in range(args.repeats):
        for dtype, batch, group in (ways if r % 2 == 0 else ways[::-1]):
            model = in_dtype(target, getattr(torch, dtype))
            took, answers = timed(lambda: head_data.greedy_answers(model, group, args.max_new, stop, pad, batch))
            made = sum(map(len, answers))
            print(json.dumps({"measure": "generate", "dtype": dtype, "batch": batch, "prompts": len(group),
                              "prompt_tokens": sum(map(len, group)), "answer_tokens": made, "seconds": round(took, 1),
                              "answer_tokens_per_s": round(made / took, 1)}), flush=True)


def measure_online(args, tokenizer, target, corpus) -> None:
    reader = Reader(target, torch.bfloat16, 16)
    head = make_head(target, torch.arange(8192)).train()
    to_draft = draft_index(torch.arange(8192), target.config.vocab_size)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4)
    seqs = windows(corpus, args.batch * args.repeats, args.window)
    parts: dict[str, list[float]] = {"read": [], "head_step": [], "shard_write": [], "shard_read": []}
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        for r in range(args.repeats):
            took, batch = timed(lambda: labelled(reader, seqs[r * args.batch:(r + 1) * args.batch], 0, "cpu"))
            parts["read"].append(took)
            stored = {"ids": batch["ids"].int(), "feats": batch["feats"].half(), "top_lp": batch["top_lp"].half(),
                      "top_id": batch["top_id"].int()}
            path = Path(tmp) / f"shard-{r}.pt"
            parts["shard_write"].append(timed(lambda: (torch.save(stored, path), os.sync()))[0])
            os.posix_fadvise(os.open(path, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)  # read it from the disk
            parts["shard_read"].append(timed(lambda: torch.load(path))[0])

            def step():
                loss, _ = head_loss(head, batch, to_draft, args.unroll)
                opt.zero_grad()
                loss.backward()
                opt.step()
            parts["head_step"].append(timed(step)[0])
        size = path.stat().st_size
    tokens = args.batch * args.window
    per = {k: round(tokens / statistics.median(v)) for k, v in parts.items()}
    print(json.dumps({"measure": "online", "batch": args.batch, "window": args.window, "unroll": args.unroll,
                      "tokens_per_s": per, "shard_bytes_per_token": round(size / tokens),
                      "seconds": {k: [round(t, 2) for t in v] for k, v in parts.items()}}))


def measure_groups(args, tokenizer, target, corpus) -> None:
    ckpt = torch.load(args.work / CHECKPOINT, weights_only=False)
    run = argparse.Namespace(**ckpt["args"] | {"work": args.work})  # the run's stream, batch and unroll
    stream = open_stream(run, corpus, head_data.load_corpus(args.work, tokenizer, "tech") if wants_tech(run) else None)
    reader, pad = Reader(target, torch.bfloat16, run.topk), head_data.pad_id(tokenizer)
    head, vocab_ids = start_head(run, target, reader, stream, ckpt, pad, ())  # the checkpoint's head, training mode
    to_draft = draft_index(vocab_ids, target.config.vocab_size)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.0, weight_decay=0.0)
    cast = torch.autocast("cpu", dtype=torch.bfloat16)
    pos, seconds, real, padded = Position(**ckpt["state"]["pos"]), {1: [], args.groups: []}, 0, {1: 0, args.groups: 0}
    for r in range(args.repeats):
        seqs, pos = stream.take(pos, run.batch)
        real += sum(map(len, seqs))
        for groups in (1, args.groups)[::1 if r % 2 else -1]:
            took, parts = timed(lambda: read_groups(reader, seqs, groups, pad, "cpu"))
            seconds[groups].append(took + timed(lambda: train_step(head, opt, params, parts, to_draft, run.unroll,
                                                                   cast))[0])
            padded[groups] += sum(part["mask"].numel() for part in parts)
    median = {g: statistics.median(v) for g, v in seconds.items()}
    print(json.dumps({"measure": "groups", "batches": args.repeats, "batch": run.batch, "groups": args.groups,
                      "positions": real, "padded": {"whole": padded[1], "grouped": padded[args.groups]},
                      "seconds_a_step": {"whole": round(median[1], 3), "grouped": round(median[args.groups], 3)},
                      "speedup": round(median[1] / median[args.groups], 3),
                      "seconds": {g: [round(t, 2) for t in v] for g, v in seconds.items()}}))


def measure_agree(args, tokenizer, target, corpus) -> None:
    from specextend.heads import load_head

    from scripts.head_train_online import evaluate

    pad = head_data.pad_id(tokenizer)
    sets = {"written, held-out topics": held_texts(args, tokenizer, target)}
    for name in args.files:
        ids = tokenizer(Path(name).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        sets[Path(name).name] = [ids[i:i + args.window] for i in range(0, len(ids) - args.window + 1, args.window)]
    reader = Reader(target, torch.bfloat16, 16)
    batches = {k: [labelled(reader, seqs[i:i + args.batch], pad, "cpu") for i in range(0, len(seqs), args.batch)]
               for k, seqs in sets.items()}
    for folder in args.heads:
        head = load_head(folder, target, torch.device("cpu"), torch.float32)
        to_draft = draft_index(head_vocab(head), target.config.vocab_size)
        for k, b in batches.items():
            got = evaluate(head, b, to_draft, args.unroll)
            print(json.dumps({"measure": "agree", "head": str(folder), "set": k, "sequences": len(sets[k]),
                              "agree": got["held_agree"], "chain": got["held_chain"],
                              "positions": got["held_positions"], "vocab": len(head.d2t),
                              "in_vocab": in_vocab(b, to_draft),
                              "by_confidence": by_confidence(*first_token_hits(head, b, to_draft))}), flush=True)


def held_texts(args, tokenizer, target) -> list[list[int]]:
    """The target's bf16 greedy texts for `--prompts` written requests on held-out topics, prompt and text."""
    from specextend.tools import prompting

    prompter = head_data.chat_prompter(tokenizer)
    stop = prompting.stop_ids(tokenizer, target)
    pad = head_data.pad_id(tokenizer)
    prompts = [head_data.written_request(prompter, args.seed, i, held=True) for i in range(args.prompts)]
    answers = head_data.greedy_answers(in_dtype(target, torch.bfloat16), prompts, args.max_new, stop, pad, 16)
    return [(p + a)[:args.window] for p, a in zip(prompts, answers)]


def misread(batch: dict, how: str, vocab: int, generator: torch.Generator) -> dict:
    """The batch with one of a head's inputs misplaced (`how`: INPUTS; random tokens drawn from `vocab` ids); the labels
    and the mask as they were."""
    ids, feats = batch["ids"], batch["feats"]
    if how == "features one position later":
        feats = torch.cat([feats[:, 1:], feats[:, -1:]], dim=1)
    elif how == "features one position earlier":
        feats = torch.cat([feats[:, :1], feats[:, :-1]], dim=1)
    elif how == "no features":
        feats = torch.zeros_like(feats)
    elif how == "the token one position earlier":
        ids = torch.cat([ids[:, :1], ids[:, :-1]], dim=1)
    elif how == "random tokens":
        ids = torch.randint(0, vocab, ids.shape, generator=generator)
    return {**batch, "ids": ids, "feats": feats}


INPUTS = ("as read", "features one position later", "features one position earlier", "the token one position earlier",
          "random tokens", "no features")


def measure_inputs(args, tokenizer, target, corpus) -> None:
    from specextend.heads import load_head

    pad = head_data.pad_id(tokenizer)
    seqs = held_texts(args, tokenizer, target)
    reader = Reader(target, torch.bfloat16, 16)
    batches = [labelled(reader, seqs[i:i + args.batch], pad, "cpu") for i in range(0, len(seqs), args.batch)]
    for folder in args.heads:
        head = load_head(folder, target, torch.device("cpu"), torch.float32)
        to_draft = draft_index(head_vocab(head), target.config.vocab_size)
        generator = torch.Generator().manual_seed(0)
        for how in INPUTS:
            hits, _ = first_token_hits(head, [misread(b, how, target.config.vocab_size, generator) for b in batches], to_draft)
            print(json.dumps({"measure": "inputs", "head": str(folder), "inputs": how, "positions": len(hits),
                              "agree": round(float(hits.float().mean()), 4)}), flush=True)


def in_vocab(batches: list[dict], to_draft: torch.Tensor) -> float:
    """The share of the first draft token's positions (as `evaluate` counts them) whose target argmax is in the
    head's draft vocabulary: the most its first-token agreement can be."""
    hit = total = 0
    for b in batches:
        where = b["mask"][:, 1:] & b["mask"][:, :-1]
        top = b["top_id"][:, 1:, 0].long()[where]
        hit, total = hit + int((to_draft[top] >= 0).sum()), total + len(top)
    return round(hit / max(total, 1), 4)


@torch.no_grad()
def first_token_hits(head, batches: list[dict], to_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Over the first draft token's positions (as `evaluate` counts them): whether the head's argmax is the
    target's (N,) bool, and the target's probability of its argmax there (N,)."""
    hits, sure = [], []
    head.eval()
    for b in batches:
        _, hit, valid = next(unrolled_steps(head, b, to_draft, 1))
        hits.append(hit[valid])
        sure.append(b["top_lp"][:, 1:, 0].float().exp()[valid])
    return torch.cat(hits), torch.cat(sure)


def by_confidence(hits: torch.Tensor, sure: torch.Tensor, edges: tuple[float, ...] = CONFIDENCE) -> list[dict]:
    """The agreement `hits` (N,) apart by the target's top-1 probability `sure` (N,), in buckets from each of
    `edges` to the next (the last to 1): each bucket's lower edge, its share of the positions and its agreement
    (None where it is empty)."""
    out = []
    for lo, hi in zip(edges, (*edges[1:], float("inf"))):
        where = (sure >= lo) & (sure < hi)
        n = int(where.sum())
        out.append({"from": lo, "share": round(n / max(len(sure), 1), 4),
                    "agree": round(float(hits[where].float().mean()), 4) if n else None})
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("read", "generate", "online", "groups", "agree", "inputs"))
    p.add_argument("--work", type=Path, default=Path("cache/head-online"))
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--unroll", type=int, default=6)
    p.add_argument("--groups", type=int, default=2, help="groups: length groups a batch is read and learned in")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--single", type=int, default=4, help="prompts answered one at a time")
    p.add_argument("--batches", type=int, nargs="+", default=[16])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--doc-tokens", type=int, default=320)
    p.add_argument("--written", action="store_true", help="generate: written requests (no document) in place of "
                                                          "requests about a corpus passage")
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--heads", type=Path, nargs="*", default=(), help="agree, inputs: the head folders compared")
    p.add_argument("--files", nargs="*", default=(), help="agree: UTF-8 text files read in windows")
    p.add_argument("--seed", type=int, default=0, help="agree: the written requests' seed")
    args = p.parse_args(argv)
    tokenizer, target = load(args.threads)
    corpus = head_data.load_corpus(args.work, tokenizer)
    {"read": measure_read, "generate": measure_generate, "online": measure_online, "groups": measure_groups,
     "agree": measure_agree, "inputs": measure_inputs}[args.what](args, tokenizer, target, corpus)


if __name__ == "__main__":
    main()
