"""What the EAGLE-3 head learns from, stored as token ids only: the target's streams and labels are never stored.

- The corpora (CORPORA): the training text of scripts/pd_corpus.py (its one exclusion of the bundled documents),
  tokenized once and kept as uint16 ids (`corpus.npy`: the public-domain plays, poems and addresses; `tech.npy`:
  Django's documentation, technical text), cut in blocks of BLOCK tokens; every HELD_EVERY-th block is held out of
  training for the curve. `pd_corpus.check_disjoint` refuses a corpus holding a line of any document that figures
  are reported on.
- Chat requests: a passage of the corpus and one of TASKS (summarize, answer a question about, continue, explain,
  list), written by the target's chat template; the target's own greedy answers, generated in left-padded batches,
  are kept as ids in resumable shards (`answers/part-NNNNNN.pt`, one request index range each; `held/` for the
  held-out requests). Request i is a pure function of (seed, i), so a run that stops resumes at the next index.
- Technical requests: the same, about a passage of the technical corpus, with one of TECH_TASKS (`tech/`,
  `held-tech/`).
- Written requests: no document; the target writes a text of one of GENRES on one of TOPICS (modern prose and
  technical writing, which the corpus lacks: it is early-modern verse and prose and presidential addresses), in
  its own words; stored as chats (`written/`). Every HELD_TOPIC_EVERY-th topic is kept out of training (held-out
  requests on them are `written_request(..., held=True)`; the curve does not read any yet). No topic is one of the
  texts figures on unseen text are reported on (a software license, Node's sockets, dpkg's triggers).
- The stream training reads: item k is a chat (prompt + answer) or a plain window (each window once per epoch, in a
  seeded order), by a fixed share; a plain window is the technical corpus's by a second share; `Position` says how
  far it has got, for a checkpoint.
Knows token ids, the corpus, shards and the target's `generate`; knows nothing of the head, its features or its loss.
"""

from __future__ import annotations

import functools
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

BLOCK = 4096  # corpus tokens per block; a window or a passage never crosses a block's end
HELD_EVERY = 50  # block b is held out when b % HELD_EVERY == HELD_PHASE
HELD_PHASE = 7
TASKS = {  # the requests the target answers, by kind
    "summarize": ("Summarize the text above in a few sentences.", "Write a short summary of the passage above."),
    "question": ("What is the passage above about? Answer briefly.", "Who speaks or acts in the text above, and why?",
                 "What does the author of the text above want the reader to believe?"),
    "continue": ("Continue the text above for a few sentences, in the same style.",),
    "explain": ("Explain the text above in plain modern English.", "Explain the hardest sentence of the passage above."),
    "list": ("List the main points of the text above.", "List the people, places and things named in the text above."),
}
INSTRUCTIONS = tuple(t for kind in TASKS.values() for t in kind)
TECH_TASKS = {  # the requests about a passage of documentation, by kind
    "summarize": ("Summarize the documentation above in a few sentences.",
                  "What does the section above explain? Answer briefly."),
    "question": ("Which settings, commands or functions does the text above name, and what does each do?",
                 "When would a developer need the section above, and why?"),
    "continue": ("Continue the documentation above for a few sentences, in the same style.",),
    "explain": ("Explain the text above to a beginner.", "Explain the hardest part of the text above in plain English."),
    "list": ("List the steps or rules the text above describes.", "List the main points of the documentation above."),
}
TECH_INSTRUCTIONS = tuple(t for kind in TECH_TASKS.values() for t in kind)
CORPORA = {"corpus": ("shakespeare", "sotu"), "tech": ("django",)}  # a work folder's corpora (NAME.npy): their sources
REQUESTS = ("chat", "tech", "written")  # the kinds of request the target answers (`answer_requests`)
GENRES = ("Write a short how-to guide about {topic}.", "Write the README section of a small tool that helps with {topic}.",
          "Write an encyclopedia entry about {topic}.", "Write a news report about {topic}.",
          "Write a FAQ with four questions and answers about {topic}.", "Write an email to a colleague about {topic}.",
          "Explain {topic} to a beginner, step by step.", "Write the notes of a meeting about {topic}.",
          "Write a product manual section on {topic}.", "Write a short lecture about {topic}.",
          "Compare two ways of handling {topic}, with their pros and cons.", "Write a short story that involves {topic}.")
TOPICS = (
    "backing up a laptop", "solar panels on a house", "the water cycle", "compiling a C program", "database indexes",
    "HTTP caching", "password managers", "a city's bus network", "drought and crops", "learning a second language",
    "training for a marathon", "baking sourdough bread", "vaccines", "index funds", "renting an apartment",
    "machine learning", "version control with git", "unit testing", "Python virtual environments",
    "regular expressions", "spreadsheets", "electric cars", "recycling plastics", "volcanoes", "the human heart",
    "photosynthesis", "black holes", "the Roman Empire", "the printing press", "coffee farming", "phone batteries",
    "Wi-Fi routers", "cloud storage", "email spam filters", "a library's lending rules", "job interviews",
    "first aid for burns", "home insurance", "filing a tax return", "public speaking", "chess openings",
    "football tactics", "birdwatching", "growing tomatoes", "composting", "earthquakes", "the immune system", "sleep",
    "nutrition labels", "JSON configuration files", "reading log files", "keyboard shortcuts", "memory leaks",
    "sorting algorithms", "hash tables", "time zones", "Unicode text", "screen readers", "3D printing", "drones",
    "weather forecasts", "ocean tides", "honey bees", "the moon landing", "the Industrial Revolution", "jazz",
    "film editing", "podcasts", "online privacy", "two-factor authentication", "customer support tickets",
    "project deadlines", "remote work", "a school timetable", "hospital triage", "wind turbines", "nuclear power",
    "water treatment", "traffic lights", "airport security", "night trains", "a camping trip", "avalanche safety",
    "bicycle repair", "changing a car's oil", "a kitchen renovation", "a leaking pipe", "painting a room", "knitting",
    "photography", "video games", "board games", "a museum exhibit", "elections", "jury duty", "invoices",
    "a warranty claim", "a web server's configuration", "shell scripts", "a REST API", "data compression",
    "SQL queries", "containers and images", "continuous integration", "a compiler's error messages",
    "floating-point numbers", "a CPU cache", "disk partitions", "a home network", "a printer that will not print",
    "a smart thermostat", "a budget spreadsheet", "a wedding plan", "a dog's training", "a cat's diet",
    "a flu season", "a rainforest", "glaciers", "the stock market", "inflation", "a small business loan",
    "a city council meeting", "a public library", "a marathon's logistics", "a music festival", "a theatre rehearsal",
)
HELD_TOPIC_EVERY = 8  # topic i is held out when i % HELD_TOPIC_EVERY == 0
VOICES = ("", " Keep it under 150 words.", " Write it for a reader new to the subject.", " Write it for an expert.",
          " Use a friendly tone.", " Use a formal tone.", " Include one concrete example.",
          " Use a numbered list where it helps.")  # appended to a genre: the same genre and topic, another text

# a prompt maker: (passage ids, instruction) -> the request's ids; the real one writes the target's chat template
Prompter = Callable[[list[int], str], list[int]]


@dataclass(frozen=True)
class Corpus:
    """The training text's tokens in order, cut in blocks; `held[b]`: block b is held out (the curve's text)."""

    ids: np.ndarray  # (N,) uint16

    @property
    def blocks(self) -> int:
        return len(self.ids) // BLOCK

    def is_held(self, block: int) -> bool:
        return block % HELD_EVERY == HELD_PHASE

    def windows(self, length: int, held: bool) -> list[int]:
        """Start offsets of the non-overlapping windows of `length` inside the blocks of one split, in order."""
        per = BLOCK // length
        return [b * BLOCK + i * length for b in range(self.blocks) if self.is_held(b) == held for i in range(per)]

    def passage(self, rng: random.Random, length: int, held: bool) -> list[int]:
        """A random run of `length` tokens inside one block of the split."""
        blocks = [b for b in range(self.blocks) if self.is_held(b) == held]
        b = blocks[rng.randrange(len(blocks))]
        start = b * BLOCK + rng.randrange(BLOCK - length + 1)
        return self.ids[start:start + length].tolist()


def tokenize_corpus(tokenizer, sources: Sequence[str] = CORPORA["corpus"]) -> np.ndarray:
    """pd_corpus's training text of `sources`, checked against every document figures are reported on: (N,) uint16."""
    from scripts import pd_corpus

    texts = [t for s in sources for t in pd_corpus.SOURCES[s]()]
    pd_corpus.check_disjoint(texts)
    ids: list[int] = []
    for _, text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(tokenizer) > 1 << 16:
        raise ValueError(f"a vocabulary of {len(tokenizer)} ids does not fit uint16")
    return np.asarray(ids, dtype=np.uint16)


def load_corpus(folder: Path, tokenizer=None, name: str = "corpus") -> Corpus:
    """The corpus `name` (CORPORA) kept in `folder` (NAME.npy), tokenized with `tokenizer` the first time."""
    path = folder / f"{name}.npy"
    if not path.is_file():
        if tokenizer is None:
            raise FileNotFoundError(f"{path} is missing and no tokenizer was given to build it")
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npy")
        np.save(tmp, tokenize_corpus(tokenizer, CORPORA[name]))
        os.replace(tmp, path)
    return Corpus(np.load(path))


def chat_prompter(tokenizer) -> Prompter:
    """The real prompt maker: the passage as the document of the target's chat template, the instruction after it."""
    from specextend.tools import prompting

    return lambda passage, instruction: prompting.encode(tokenizer, tokenizer.decode(passage), instruction).ids


def pad_id(tokenizer) -> int:
    """The id batches are padded with: the tokenizer's pad id, else 0 (padded positions are masked out)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def request(corpus: Corpus, prompter: Prompter, seed: int, index: int, held: bool, doc_tokens: int,
            kind: str = "chat") -> list[int]:
    """Request `index` of a split about a passage of `corpus`: a chat request (one of TASKS) or, `kind` "tech", a
    technical one (one of TECH_TASKS, its own draws): a pure function of its arguments."""
    rng = random.Random(f"{kind}:{seed}:{'held' if held else 'train'}:{index}")
    passage = corpus.passage(rng, rng.randint(doc_tokens // 3, doc_tokens), held)
    return prompter(passage, rng.choice(TECH_INSTRUCTIONS if kind == "tech" else INSTRUCTIONS))


@functools.lru_cache(maxsize=4)
def written_instructions(seed: int, held: bool) -> tuple[str, ...]:
    """Every instruction of a split (a genre, a topic of the split and a voice), in a seeded order: greedy answers
    to the same instruction are the same text, so requests are drawn without replacement."""
    topics = [t for i, t in enumerate(TOPICS) if (i % HELD_TOPIC_EVERY == 0) == held]
    every = [g.format(topic=t) + v for t in topics for g in GENRES for v in VOICES]
    random.Random(f"write:{seed}:{'held' if held else 'train'}").shuffle(every)
    return tuple(every)


def written_request(prompter: Prompter, seed: int, index: int, held: bool) -> list[int]:
    """Written request `index` of a split (no document): a pure function of its arguments, distinct from every
    other index of the split up to `len(written_instructions(seed, held))` (10,560 train, 1,536 held out)."""
    every = written_instructions(seed, held)
    if index >= len(every):
        raise ValueError(f"written request {index}: the split has {len(every)} distinct instructions")
    return prompter([], every[index])


@torch.no_grad()
def greedy_answers(model, prompts: list[list[int]], max_new: int, stop: Sequence[int], pad: int,
                   batch: int) -> list[list[int]]:
    """The model's greedy answers to `prompts`, each cut after its first stop id: left-padded batches of prompts of
    near lengths (sorted) through `generate`, answers returned in the prompts' order."""
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    stops = set(stop)
    for b in range(0, len(order), batch):
        group = [prompts[i] for i in order[b:b + batch]]
        width = max(map(len, group))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=device)  # (B, W)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=device)
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                             pad_token_id=pad, eos_token_id=list(stop), top_k=None, top_p=None, temperature=None)
        for i, row in zip(order[b:b + batch], gen[:, width:].tolist()):
            cut = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
            out[i] = row[:cut]
    return out


@dataclass(frozen=True)
class Chat:
    """One answered request: its ids (prompt then answer) and where the answer starts."""

    index: int
    ids: list[int]
    prompt_len: int


def write_shard(folder: Path, chats: list[Chat], note: dict) -> Path:
    """`chats` (consecutive indices) as one shard, written whole or not at all."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"part-{chats[0].index:06d}.pt"
    lengths = torch.tensor([len(c.ids) for c in chats], dtype=torch.int32)
    data = {"index": torch.tensor([c.index for c in chats]), "length": lengths,
            "prompt_len": torch.tensor([c.prompt_len for c in chats], dtype=torch.int32),
            "ids": torch.tensor([t for c in chats for t in c.ids], dtype=torch.int32), "note": note}
    tmp = path.with_suffix(".tmp")
    torch.save(data, tmp)
    os.replace(tmp, path)
    return path


def read_chats(folder: Path) -> list[Chat]:
    """Every answered request in `folder`'s shards, by index (a gap ends the list: requests run in order)."""
    chats: dict[int, Chat] = {}
    for path in sorted(folder.glob("part-*.pt")):
        data = torch.load(path)
        flat, at = data["ids"].tolist(), 0
        for index, length, prompt_len in zip(data["index"].tolist(), data["length"].tolist(),
                                             data["prompt_len"].tolist()):
            chats[index] = Chat(index, flat[at:at + length], prompt_len)
            at += length
    ordered = []
    while len(ordered) in chats:
        ordered.append(chats[len(ordered)])
    return ordered


def answer_requests(model, corpus: Corpus, prompter: Prompter, folder: Path, *, count: int, held: bool, seed: int,
                    doc_tokens: int, max_new: int, stop: Sequence[int], pad: int, batch: int, shard: int,
                    time_left: Callable[[], float] = lambda: float("inf"), say: Callable[[str], None] = print,
                    kind: str = "chat") -> int:
    """Answer requests of a split and `kind` (REQUESTS: chat or technical requests about a passage of `corpus`, or
    written ones) until `folder` holds `count` or `time_left()` runs out, `shard` requests a shard, resuming after the
    last one stored. Returns how many `folder` holds (written requests: at most the split's distinct ones,
    `written_instructions`)."""
    if kind not in REQUESTS:
        raise ValueError(f"no request kind {kind!r}: one of {REQUESTS}")
    written = kind == "written"
    done = len(read_chats(folder))
    count = min(count, len(written_instructions(seed, held))) if written else count
    note = {"seed": seed, "held": held, "kind": kind, "doc_tokens": doc_tokens, "max_new": max_new,
            "dtype": str(next(model.parameters()).dtype), "device": str(next(model.parameters()).device)}
    while done < count and time_left() > 0:
        indices = range(done, min(count, done + shard))
        prompts = [written_request(prompter, seed, i, held) if written else
                   request(corpus, prompter, seed, i, held, doc_tokens, kind) for i in indices]
        answers = greedy_answers(model, prompts, max_new, stop, pad, batch)
        write_shard(folder, [Chat(i, p + a, len(p)) for i, p, a in zip(indices, prompts, answers)], note)
        done = indices[-1] + 1
        say(f"{folder.name}: {done}/{count} requests answered ({sum(map(len, answers))} answer tokens in the last shard)")
    return done


@dataclass(frozen=True)
class Position:
    """How far the training stream has got: items read, and of them answered chats, plain windows, written chats,
    technical chats and technical windows."""

    item: int = 0
    chat: int = 0
    plain: int = 0
    written: int = 0
    tech: int = 0
    tech_plain: int = 0


def is_chat(item: int, share: float) -> bool:
    """Whether item `item` is a chat, `share` of items spread evenly."""
    return int((item + 1) * share) > int(item * share)


class Stream:
    """The sequences training reads, in a fixed order: chats (the answered requests as long as any are unread, then the
    technical and the written ones, technical at `tech_share` of them while both are unread) and plain windows (the
    technical corpus's at `tech_windows` of them, else the corpus's). Each kind keeps its own count, so answers added
    on a resume are read next, nothing is read twice, and the shares may change on a resume."""

    def __init__(self, corpus: Corpus, chats: list[Chat], window: int, chat_share: float, seed: int,
                 written: Sequence[Chat] = (), tech: Corpus | None = None, tech_chats: Sequence[Chat] = (),
                 tech_windows: float = 0.0, tech_share: float = 0.5) -> None:
        self.corpus, self.chats, self.written, self.window, self.share = corpus, chats, written, window, chat_share
        self.tech, self.tech_chats, self.tech_windows = tech, tech_chats, tech_windows if tech is not None else 0.0
        self.tech_share = tech_share
        self.starts = corpus.windows(window, held=False)
        random.Random(f"plain:{seed}").shuffle(self.starts)
        self.tech_starts = tech.windows(window, held=False) if tech is not None else []
        random.Random(f"tech:{seed}").shuffle(self.tech_starts)

    def take(self, pos: Position, n: int) -> tuple[list[list[int]], Position]:
        """The next `n` sequences after `pos` (each at most `window` ids) and the position after them."""
        seqs = []
        p = asdict(pos)
        for _ in range(n):
            chat = is_chat(p["item"], self.share)
            tech_left, written_left = p["tech"] < len(self.tech_chats), p["written"] < len(self.written)
            if chat and p["chat"] < len(self.chats):
                seqs.append(self.chats[p["chat"]].ids[:self.window])
                p["chat"] += 1
            elif chat and tech_left and (not written_left or is_chat(p["tech"] + p["written"], self.tech_share)):
                seqs.append(self.tech_chats[p["tech"]].ids[:self.window])
                p["tech"] += 1
            elif chat and written_left:
                seqs.append(self.written[p["written"]].ids[:self.window])
                p["written"] += 1
            elif is_chat(p["plain"] + p["tech_plain"], self.tech_windows):
                start = self.tech_starts[p["tech_plain"] % len(self.tech_starts)]
                seqs.append(self.tech.ids[start:start + self.window].tolist())
                p["tech_plain"] += 1
            else:
                start = self.starts[p["plain"] % len(self.starts)]
                seqs.append(self.corpus.ids[start:start + self.window].tolist())
                p["plain"] += 1
            p["item"] += 1
        return seqs, Position(**p)


def held_out(corpus: Corpus, chats: list[Chat], window: int, plain: int) -> list[list[int]]:
    """The fixed held-out set the curve is measured on: the held-out chats and `plain` windows of held-out blocks."""
    starts = corpus.windows(window, held=True)
    starts = starts[::max(1, len(starts) // max(plain, 1))][:plain]  # spread over the held-out blocks
    return [c.ids[:window] for c in chats] + [corpus.ids[s:s + window].tolist() for s in starts]


def length_groups(lengths: Sequence[int], parts: int = 2) -> list[list[int]]:
    """The indices of a batch's sequences cut into at most `parts` groups of near length (by length, shortest first),
    where each group padded to its own longest pads least in all (ties: fewer groups). A batch of answered requests
    (~300 ids) and 512-id windows padded whole is a third padding; read and learned in two groups, ~a tenth."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    size = [lengths[i] for i in order]
    best = {0: (0, [])}  # sequences grouped so far -> (padded ids, the group ends)
    for _ in range(max(1, parts)):
        step = dict(best)
        for done, (area, ends) in best.items():
            for end in range(done + 1, len(order) + 1):
                cand = (area + (end - done) * size[end - 1], ends + [end])
                if end not in step or cand[0] < step[end][0]:
                    step[end] = cand
        best = step
    ends = best[len(order)][1] if order else []
    return [order[a:b] for a, b in zip([0, *ends], ends)]


def pad_batch(seqs: list[list[int]], pad: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (B, T) and their mask (B, T) bool."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = True
    return ids.to(device), mask.to(device)


def summary(folder: Path) -> dict:
    """What a data folder holds: each corpus's tokens and held-out blocks, answered requests and their answer tokens."""
    out = {}
    for name in CORPORA:
        if (folder / f"{name}.npy").is_file():
            corpus = Corpus(np.load(folder / f"{name}.npy"))
            out |= {f"{name}_tokens": int(len(corpus.ids)),
                    f"{name}_held_blocks": sum(corpus.is_held(b) for b in range(corpus.blocks))}
    for split in ("answers", "written", "tech", "held", "held-written", "held-tech"):
        chats = read_chats(folder / split)
        out[split] = {"requests": len(chats), "answer_tokens": sum(len(c.ids) - c.prompt_len for c in chats)}
    return out

