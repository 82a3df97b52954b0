"""Train the bundled draft: a small plain LlamaForCausalLM distilled from the target on short windows.

Input: the teacher shards in cache/teacher/ (scripts/teacher_topk.py: public-domain text windows;
scripts/chat_samples.py: the target's own greedy answers to document instructions), each row a
window of at most 512 tokens with the target's top-k log-probabilities at every position.

The draft has the target's tokenizer and full input vocabulary (49,152), tied embeddings initialised
from the top principal directions of the target's embedding matrix, and never sees a position past
511. With --vocab N its output layer covers only N frequency-ranked tokens (the tied embedding's rows
for them; the ids are saved as draft_vocab.json, which specextend.models reads): the target's
distribution is then renormalised over those tokens, and both models compute logits only for them.
Loss per position on teacher rows: cross-entropy of the draft's softmax against the target's
top-k distribution (renormalised over those k tokens), plus a small cross-entropy on the target's
argmax. Batches come in four kinds:
- --online-share: random 512-token windows of the training text labelled by the target in the same
  step; the loss is against the target's whole softmax (over the output vocabulary). The target's
  forward is most of such a step, so --replay N adds N steps on windows labelled earlier in the run
  (online and on-policy ones), trained on the target's top REPLAY_K log-probs kept from then.
- --policy-share: on-policy chat windows: a chat-template prompt (a training-text passage and an
  instruction, as scripts/chat_samples.py builds them) followed by the draft's OWN sampled answer,
  labelled by the target in the same step like an online window, prompt and answer alike. The draft
  then learns the target's distribution on text in the register the app generates (answers and
  summaries in modern English) and on its own mistakes; sampling from the small draft costs little
  next to the target's forward. The record's policy_tokens counts every position of these windows.
- --text-share: the same windows with the ordinary next-token loss (cheap: no target).
- the rest: the teacher shards above (the target's own chat answers among them).
Online, on-policy and text windows come from the text sources of --corpus (scripts/pd_corpus.py
SOURCES) in the shares it gives: each batch draws its source, and on-policy prompts are made from
each source in proportion.
The draft starts fresh, from --init (a previous run's folder) or from --cut (the target's own layers).
The learning rate follows a cosine over the wall-clock budget, so a run of --minutes ends annealed.
Every --save-every minutes and at the end the weights are written to --out, compact (model.gguf: 8-bit blocks,
scripts/compact_weights.py) or with --weights safetensors as bfloat16 safetensors (exact, for a run to be continued),
with the target's tokenizer digest in the config (the draft reads its target's tokenizer) and a training record
(train_record.json).

    python -m scripts.train_draft --minutes 40 --seed 0
"""

from __future__ import annotations

import argparse
import copy
import glob
import itertools
import json
import math
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from scripts import compact_weights, pd_corpus

from specextend.tools import bundled
from specextend import compact
from specextend.models import SHARED_EMBEDDING, SHARED_TOKENIZER, cuts_from_target, from_pretrained, share_embedding
from specextend.vocab import DRAFT_VOCAB_FILE, read_output_vocab

CHAT_WEIGHT = 2.0  # how much likelier a chat teacher row is drawn than a text one
POLICY_MAX_NEW = 128  # the longest draft answer in an on-policy window
REPLAY_K = 64  # the target's top log-probs kept per position of a window labelled for replay


def draft_config(target_cfg, layers: int, hidden: int, heads: int, kv_heads: int, ff: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=target_cfg.vocab_size,
        hidden_size=hidden,
        intermediate_size=ff,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        hidden_act="silu",
        max_position_embeddings=target_cfg.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_parameters=dict(target_cfg.rope_parameters),
        tie_word_embeddings=True,
        bos_token_id=target_cfg.bos_token_id,
        eos_token_id=target_cfg.eos_token_id,
        pad_token_id=target_cfg.pad_token_id,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
    )


def init_from_target(model, target_embed: torch.Tensor, hidden: int) -> None:
    """Tied embeddings := the target's embeddings projected on their top `hidden` principal axes."""
    e = target_embed.float()
    mean = e.mean(0, keepdim=True)
    _, _, v = torch.linalg.svd(e - mean, full_matrices=False)  # v: (576, 576)
    proj = (e - mean) @ v[:hidden].T  # (V, hidden)
    proj = proj / proj.std() * 0.05
    model.model.embed_tokens.weight.data.copy_(proj)


def cut_target(target, keep: list[int]):
    """A draft cut from the target: its embedding, the layers listed in `keep` (renumbered 0..), its final
    norm. The embedding (tied to the output layer) stays the target's: frozen here, not saved, and filled in
    from the target when the draft is loaded (config `shared_embedding`)."""
    model = copy.deepcopy(target)
    types = getattr(model.config, "layer_types", None)
    model.model.layers = torch.nn.ModuleList(model.model.layers[i] for i in keep)
    for j, block in enumerate(model.model.layers):
        block.self_attn.layer_idx = j
    model.config.num_hidden_layers = len(keep)
    if types:  # each kept block keeps its layer type
        model.config.layer_types = [types[i] for i in keep]
    setattr(model.config, SHARED_EMBEDDING, True)
    return model


def load_shards(folder: Path):
    """Rows of (kind, input_ids (T,), topk_ids (T, K), topk_logp (T, K), loss mask (T,))."""
    rows = []
    kinds = {"plain": 0, "chat": 0}
    for path in sorted(glob.glob(str(folder / "*.pt"))):
        d = torch.load(path)
        kind = "chat" if Path(path).name.startswith("chat") else "plain"
        n, t = d["input_ids"].shape
        if "mask" in d:
            masks = d["mask"]
        else:  # every position predicts the next token, except the last one
            masks = torch.ones((n, t), dtype=torch.bool)
            masks[:, -1] = False
        for i in range(n):
            rows.append((kind, d["input_ids"][i], d["topk_ids"][i], d["topk_logp"][i], masks[i]))
            kinds[kind] += 1
    return rows, kinds


def corpus_windows(tok_dir: Path, window: int, source: str = "shakespeare") -> torch.Tensor:
    """One source's training text as (N, window) token windows (cached in cache/corpus-ids-SOURCE-WINDOW.pt)."""
    path = pd_corpus.CACHE / f"corpus-ids-{source}-{window}.pt"
    if path.is_file():
        return torch.load(path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    out = []
    for _, text in pd_corpus.SOURCES[source]():
        ids = tok(text, add_special_tokens=False)["input_ids"]
        out += [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]
    t = torch.tensor(out, dtype=torch.int32)
    torch.save(t, path)
    return t


def parse_mix(spec: str) -> list[tuple[str, float]]:
    """"shakespeare:0.5,sotu:0.5" -> [(source, share)], shares normalised to sum to 1."""
    pairs = [(name, float(share)) for name, share in (part.split(":") for part in spec.split(","))]
    unknown = [name for name, _ in pairs if name not in pd_corpus.SOURCES]
    if unknown or any(share <= 0 for _, share in pairs):
        raise ValueError(f"bad --corpus {spec!r}: sources are {sorted(pd_corpus.SOURCES)}, shares above 0")
    total = sum(share for _, share in pairs)
    return [(name, share / total) for name, share in pairs]


def random_windows(stream: torch.Tensor, count: int, window: int, rng: random.Random) -> torch.Tensor:
    """`count` windows of `window` tokens at random offsets of the flat training stream: (count, window)."""
    starts = [rng.randrange(0, stream.numel() - window + 1) for _ in range(count)]
    return torch.stack([stream[o:o + window] for o in starts]).long()


@torch.no_grad()
def draft_answers(model, prompts: list[list[int]], rows, window: int, max_new: int, pad: int, eos: int,
                  temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's own sampled answers to chat prompts, as training windows.

    Returns ids (B, window): prompt + answer right-padded with `pad`, and the loss mask (B, window) over
    the positions that predict a real next token (the prompt's and the answer's: the target labels
    both). An answer ends after eos, after `max_new` tokens, or where its window is full, so no position
    past `window` - 1 is ever sampled. Right padding needs no attention mask in training: a causal
    model never looks ahead. Tokens are drawn from the draft's softmax over its output vocabulary
    (`rows`, or the whole vocabulary when None); `temperature` must be above 0. Sampling runs on the
    model's device; the windows come back on the CPU."""
    from transformers import DynamicCache

    dev = model.device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=dev)  # (B, width), left-padded
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    room = torch.tensor([min(max_new, window - len(p)) for p in prompts], device=dev)  # answer tokens each row may take
    head = output_rows(model, rows)  # (V_out, H)
    cache = DynamicCache(config=model.config)
    answers = torch.empty((len(prompts), 0), dtype=torch.long, device=dev)
    done = room <= 0
    was_training = model.training
    model.eval()
    try:
        while not bool(done.all()):
            h = model.model(input_ids=ids, attention_mask=attn, position_ids=pos, cache=cache,
                            use_cache=True).last_hidden_state[:, -1]  # (B, H)
            pick = torch.multinomial(torch.softmax(F.linear(h, head) / temperature, -1), 1)  # (B, 1)
            ids = (pick if rows is None else rows[pick]).masked_fill(done[:, None], pad)
            answers = torch.cat([answers, ids], 1)  # (B, steps so far)
            done |= (ids[:, 0] == eos) | (answers.shape[1] >= room)
            attn = torch.cat([attn, torch.ones_like(ids)], 1)
            pos = pos[:, -1:] + 1
    finally:
        model.train(was_training)
    answers, room = answers.cpu(), room.cpu()
    out = torch.full((len(prompts), window), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), window), dtype=torch.bool)
    for j, p in enumerate(prompts):
        a = answers[j, : int(room[j])].tolist() if int(room[j]) > 0 else []
        a = a[: a.index(eos) + 1] if eos in a else a
        seq = p[:window] + a
        out[j, : len(seq)] = torch.tensor(seq)
        mask[j, : len(seq) - 1] = True
    return out, mask


def ranked_vocab(size: int, text: torch.Tensor, rows, vocab_size: int, corpus_share: float = 0.75) -> list[int]:
    """`size` output token ids: the most frequent in the training text and the target's chat answers
    (`corpus_share` of them), then the lowest ids not yet taken (a BPE vocabulary's ids follow its merge
    order, roughly the frequency in the tokenizer's own, modern-English corpus). Sorted."""
    counts = torch.bincount(text.long().flatten(), minlength=vocab_size).float()
    for kind, ids, _, _, mask in rows:
        if kind == "chat":
            counts += torch.bincount(ids.long()[1:][mask[:-1]], minlength=vocab_size).float() * 4
    chosen = set(torch.argsort(counts, descending=True)[: int(size * corpus_share)].tolist())
    for i in range(vocab_size):
        if len(chosen) == size:
            break
        chosen.add(i)
    return sorted(chosen)


def output_rows(model, rows):
    """The output layer's rows for the token ids in `rows` (all of them when None): (V_out, H). Gathered per
    call, so gradients reach a tied embedding."""
    head = model.get_output_embeddings().weight
    return head if rows is None else head[rows]


def output_logits(model, ids, rows):
    """Logits over the output vocabulary: (B, T, V) for the full head (`rows` None), else only for the token
    ids in `rows`, (B, T, len(rows))."""
    return F.linear(model.model(input_ids=ids).last_hidden_state, output_rows(model, rows))  # (B, T, H) -> (B, T, V_out)


def to_output_ids(tid, tlp, mask, position):
    """Stage-1 top-k rows in output-vocabulary positions: tokens outside it get log-prob -inf, and
    positions with none of their top-k inside are masked out."""
    if position is None:
        return tid, tlp, mask
    mapped = position[tid]  # (B, T, K), -1 outside
    inside = mapped >= 0
    mask = mask & inside[..., 0]  # the target's argmax must be drawable
    return mapped.clamp(min=0), tlp.masked_fill(~inside, float("-inf")).masked_fill(~mask[..., None], 0.0), mask


def text_loss(logits, ids):
    """Plain next-token cross-entropy on real text (no target involved)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def online_loss(logits, teacher_logits, mask, ce_weight: float):
    """Full-vocabulary distillation: cross-entropy of the draft against the target's whole softmax."""
    logq = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    p = torch.softmax(teacher_logits.float(), dim=-1)  # (B, T, V)
    top = teacher_logits.argmax(-1, keepdim=True)  # (B, T, 1)
    per = -(p * logq).sum(-1) - ce_weight * logq.gather(-1, top)[..., 0]
    return masked_mean_and_agreement(per, logits, top[..., 0], mask)


def masked_mean_and_agreement(per, logits, target_top, mask):
    """(mean of the per-position loss over `mask`, share of masked positions where the draft's argmax is the target's)."""
    m = mask.float()
    agree = ((logits.argmax(-1) == target_top).float() * m).sum() / m.sum()
    return (per * m).sum() / m.sum(), agree


def topk_loss(logits, tid, tlp, mask, ce_weight: float):
    """Distillation on stored labels: cross-entropy of the draft against the target's top-k distribution
    (renormalised over those k tokens), plus `ce_weight` times the cross-entropy on the target's argmax."""
    logq = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    p = torch.softmax(tlp, dim=-1)  # (B, T, K) target top-k, renormalised
    q_on_top = logq.gather(-1, tid)  # (B, T, K)
    kd = -(p * q_on_top).sum(-1)
    ce = -q_on_top[..., 0]
    per = kd + ce_weight * ce
    return masked_mean_and_agreement(per, logits, tid[..., 0], mask)


def save(model, out: Path, record: dict, sub: list[int] | None, compact_file: bool = True) -> None:
    """The draft as a model folder in `out`: its weights compact (or bf16 safetensors), its config, the record and its
    output vocabulary."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / (out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    half = copy.deepcopy(model).to("cpu", torch.bfloat16)  # a copy: training goes on in float32
    state = None
    if getattr(model.config, SHARED_EMBEDDING, False):  # the loader takes the embedding from the target
        state = {k: v for k, v in half.state_dict().items() if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    tdir = bundled.target_dir()
    if (tdir / "tokenizer.json").is_file():  # the draft ships no tokenizer: it reads its target's
        setattr(half.config, SHARED_TOKENIZER, compact_weights.target_digest(tdir))
    half.save_pretrained(str(tmp), safe_serialization=True, state_dict=state)
    if compact_file:
        compact_weights.compact_folder(tmp)
    (tmp / "train_record.json").write_text(json.dumps(record, indent=2) + "\n")
    if sub is not None:
        (tmp / DRAFT_VOCAB_FILE).write_text(json.dumps({"size": len(sub), "ids": sub}) + "\n")
    for f in tmp.iterdir():
        shutil.copy(f, out / f.name)
    (out / (compact_weights.ORDINARY if compact_file else compact.COMPACT_FILE)).unlink(missing_ok=True)  # stale
    shutil.rmtree(tmp)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[tuple[str, float]]]:
    """The run's flags, checked, and its corpus mix ([(source, share)])."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=40.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ff", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--ce-weight", type=float, default=0.2)
    ap.add_argument("--text-share", type=float, default=0.5,
                    help="share of batches of plain text with next-token cross-entropy (cheap: no target)")
    ap.add_argument("--online-share", type=float, default=0.0,
                    help="share of batches of training text labelled by the target in the same step (full-vocabulary "
                         "distillation; costs a target forward per batch)")
    ap.add_argument("--policy-share", type=float, default=0.0,
                    help="share of batches of chat prompts answered by the draft itself and labelled by the target "
                         "in the same step (on-policy distillation; costs a target forward per batch)")
    ap.add_argument("--policy-temperature", type=float, default=1.0)
    ap.add_argument("--offsets", choices=("aligned", "random"), default="aligned",
                    help="online and text windows: the fixed 512-token cuts of each text, or random offsets into "
                         "those cuts laid end to end (every pass sees new cuts; a window may span two texts)")
    ap.add_argument("--replay", type=int, default=0,
                    help="after each step, this many extra steps on windows labelled earlier (online and "
                         "on-policy), trained on the target's top log-probs kept from when they were "
                         "labelled (the target's forward is most of a step's cost)")
    ap.add_argument("--corpus", default="shakespeare:1",
                    help="text sources and their shares of the text, online and on-policy windows, e.g. "
                         "shakespeare:0.5,sotu:0.5 (sources: scripts/pd_corpus.py SOURCES)")
    ap.add_argument("--save-every", type=float, default=10.0)
    ap.add_argument("--weights", choices=("compact", "safetensors"), default="compact",
                    help="how the weights are written: 8-bit blocks (model.gguf) or bf16 safetensors (exact)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu",
                    help="where the target and the draft run, e.g. cuda (the labelled windows kept for replay stay on "
                         "the CPU)")
    ap.add_argument("--teacher", default=str(pd_corpus.CACHE / "teacher"))
    ap.add_argument("--out", default=str(pd_corpus.REPO_ROOT / "assets" / "models" / bundled.DRAFT_NAME))
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--init", default=None, help="continue from the weights in this draft folder")
    ap.add_argument("--cut", default=None,
                    help="start from the target's own layers listed here (e.g. 0,1,2,3), its embedding and final "
                         "norm; the embedding stays the target's (frozen, not saved)")
    ap.add_argument("--vocab", type=int, default=0,
                    help="output vocabulary size (0: the target's whole vocabulary); an --init folder's own wins")
    args = ap.parse_args(argv)
    if args.policy_temperature <= 0:
        ap.error("--policy-temperature must be above 0")
    try:
        return args, parse_mix(args.corpus)
    except ValueError as e:
        ap.error(str(e))


def load_models(args, tdir: Path, cfg):
    """(draft, teacher) on the run's device: the draft from --init, --cut or fresh (`cfg`, its embedding the
    target's projected); the teacher (the target, fp32) only when a batch kind or the draft needs it."""
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    dev = torch.device(args.device)
    teacher = None
    if args.online_share + args.policy_share > 0 or args.cut or (args.init and cuts_from_target(Path(args.init))):
        teacher = LlamaForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval().to(dev)
    if args.init:  # continue a previous run (its architecture wins over the flags)
        model = from_pretrained(args.init, dtype=torch.float32)  # safetensors or compact
    elif args.cut:
        model = cut_target(teacher, [int(i) for i in args.cut.split(",")])
    else:
        model = LlamaForCausalLM(cfg)
        with safe_open(str(tdir / "model.safetensors"), "pt") as f:
            init_from_target(model, f.get_tensor("model.embed_tokens.weight"), args.hidden)
        model.tie_weights()
    if getattr(model.config, SHARED_EMBEDDING, False):  # the target's embedding, as the loader gives it: frozen, never saved
        share_embedding(model, teacher, args.init or "the cut")
        model.get_input_embeddings().weight.requires_grad_(False)
    return model.to(dev), teacher


@dataclass
class Corpus:
    """What a run trains on: the teacher rows (some held back to validate), the training text as windows
    per source, and the chat prompts on-policy windows start from."""

    rows: list  # (kind, ids (T,), top ids (T, K), top log-probs (T, K), mask (T,)), from load_shards
    kinds: dict[str, int]
    train: list[int]  # indices into rows
    val: list[int]
    window: int  # T
    texts: dict[str, torch.Tensor]  # source -> (N, T)
    prompts: list[list[int]]

    @classmethod
    def load(cls, args, mix, tdir: Path) -> Corpus:
        rows, kinds = load_shards(Path(args.teacher))
        val = [i for i, r in enumerate(rows) if r[0] == "plain"][-8:]  # held back from training
        train = [i for i in range(len(rows)) if i not in set(val)]
        window = int(rows[0][1].shape[0])
        texts = {name: corpus_windows(tdir, window, name) for name, _ in mix}
        prompts: list[list[int]] = []
        if args.policy_share > 0:
            from transformers import AutoTokenizer

            from scripts import chat_samples

            tok = AutoTokenizer.from_pretrained(tdir)
            prompt_rng = random.Random(args.seed + 1)
            for name, share in mix:
                prompts += chat_samples.make_prompts(tok, prompt_rng, round(4000 * share), pd_corpus.SOURCES[name]())
        return cls(rows, kinds, train, val, window, texts, prompts)

    def batch(self, pick: list[int], dev, vocab: OutputVocab):
        """Teacher rows `pick` in output-vocabulary positions, on `dev`: ids (B, T), top ids and top log-probs
        (B, T, K), loss mask (B, T)."""
        ids = torch.stack([self.rows[i][1] for i in pick]).long().to(dev)
        tid = torch.stack([self.rows[i][2] for i in pick]).long().to(dev)
        tlp = torch.stack([self.rows[i][3] for i in pick]).float().to(dev)
        mask = torch.stack([self.rows[i][4] for i in pick]).to(dev)
        return (ids, *to_output_ids(tid, tlp, mask, vocab.position))


@dataclass
class OutputVocab:
    """The draft's output vocabulary: the token ids it covers, in order (None: every id), as `rows` (V_out,)
    on the device, and `position` (V,): each id's index among them, -1 outside."""

    ids: list[int] | None
    rows: torch.Tensor | None = None
    position: torch.Tensor | None = None

    @classmethod
    def of(cls, ids: list[int] | None, vocab_size: int, dev) -> OutputVocab:
        if ids is None:
            return cls(None)
        rows = torch.tensor(ids, device=dev)
        position = torch.full((vocab_size,), -1, dtype=torch.long, device=dev)
        position[rows] = torch.arange(len(ids), device=dev)
        return cls(ids, rows, position)


@dataclass
class Seen:
    """Loss positions trained on so far: fresh ones (every kind), and of those the text, online and
    on-policy ones; replayed ones apart."""

    tokens: int = 0
    text_tokens: int = 0
    online_tokens: int = 0
    policy_tokens: int = 0
    replay_tokens: int = 0

    def add(self, kind: str, positions: int) -> None:
        """Count the fresh positions of a text, online or on-policy batch under its kind."""
        name = {"text": "text_tokens", "online": "online_tokens", "policy": "policy_tokens"}[kind]
        setattr(self, name, getattr(self, name) + positions)


class Batches:
    """Each step's batch: its kind (drawn by the shares of the flags), then its windows. One random stream
    draws them all, in the order every earlier run drew them, so a seed still picks the same batches."""

    def __init__(self, args, mix, corpus: Corpus, vocab: OutputVocab, model, tcfg, rng: random.Random):
        self.args, self.mix, self.corpus, self.vocab, self.model, self.tcfg, self.rng = (
            args, mix, corpus, vocab, model, tcfg, rng)
        self.streams = {name: t.flatten() for name, t in corpus.texts.items()}
        self.weights = [CHAT_WEIGHT if corpus.rows[i][0] == "chat" else 1.0 for i in corpus.train]
        self.answered: list = []  # (ids (T,), mask (T,)) per on-policy window not yet trained on
        # a uniform draw below an edge picks that kind, above them all the teacher rows
        self.edges = list(zip(("policy", "online", "text"),
                              itertools.accumulate((args.policy_share, args.online_share, args.text_share))))

    def kind(self) -> str:
        draw = self.rng.random()
        return next((k for k, edge in self.edges if draw < edge), "teacher rows")

    def policy(self) -> tuple[torch.Tensor, torch.Tensor]:
        """On-policy windows: chat prompts and the draft's own answers (B, T), with their loss mask."""
        b = self.args.batch
        if len(self.answered) < b:  # sampling several at once amortises the draft's decode steps
            more = draft_answers(self.model, self.rng.sample(self.corpus.prompts, 4 * b), self.vocab.rows,
                                 self.corpus.window, POLICY_MAX_NEW, self.tcfg.pad_token_id, self.tcfg.eos_token_id,
                                 self.args.policy_temperature)
            self.answered += zip(*more)
        ids, mask = (torch.stack(x) for x in zip(*self.answered[:b]))
        del self.answered[:b]
        return ids, mask

    def text(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows of training text (B, T), from one source drawn by its share, with their loss mask."""
        rng, texts, b = self.rng, self.corpus.texts, self.args.batch
        # one source draws nothing, so runs from before --corpus replay their random stream
        source = self.mix[0][0] if len(self.mix) == 1 else rng.choices(*zip(*self.mix))[0]
        ids = (random_windows(self.streams[source], b, self.corpus.window, rng) if self.args.offsets == "random"
               else texts[source][rng.sample(range(len(texts[source])), b)].long())
        mask = torch.ones(ids.shape, dtype=torch.bool)
        mask[:, -1] = False
        return ids, mask

    def teacher_rows(self, dev):
        """Teacher rows drawn by weight, in output-vocabulary positions: ids, top ids, top log-probs, mask."""
        pick = self.rng.choices(self.corpus.train, weights=self.weights, k=self.args.batch)
        return self.corpus.batch(pick, dev, self.vocab)


def labelled_loss(model, teacher, ids, mask, vocab: OutputVocab, ce_weight: float, replay: list | None):
    """(loss, agreement) of the draft against the target's softmax on windows the target labels now. With a
    `replay` store, the target's top REPLAY_K log-probs of the windows are kept there for later passes."""
    with torch.no_grad():
        teacher_logits = output_logits(teacher, ids, vocab.rows)  # (B, T, V_out)
    if replay is not None:
        top = torch.log_softmax(teacher_logits.float(), dim=-1).topk(REPLAY_K, dim=-1)
        replay += zip(ids.to("cpu", torch.int32), top.indices.to("cpu", torch.int32),
                      top.values.to("cpu", torch.half), mask.cpu())
    return online_loss(output_logits(model, ids, vocab.rows), teacher_logits, mask, ce_weight)


def fresh_step(kind: str, batches: Batches, model, teacher, replay: list | None, seen: Seen, dev):
    """The loss of one step's fresh batch of `kind`, and the agreement with the target (None for text)."""
    args, vocab = batches.args, batches.vocab
    if kind == "teacher rows":
        ids, tid, tlp, mask = batches.teacher_rows(dev)
        loss, agree = topk_loss(output_logits(model, ids, vocab.rows), tid, tlp, mask, args.ce_weight)
    else:
        ids, mask = batches.policy() if kind == "policy" else batches.text()
        ids, mask = ids.to(dev), mask.to(dev)
        if kind == "text":
            loss, agree = text_loss(model(input_ids=ids).logits, ids), None  # the full head: real text may be anywhere
        else:
            loss, agree = labelled_loss(model, teacher, ids, mask, vocab, args.ce_weight, replay)
        seen.add(kind, int(mask.sum()))
    seen.tokens += int(mask.sum())
    return loss, agree


def replay_step(store: list, rng: random.Random, batch: int, model, vocab: OutputVocab, ce_weight: float, dev):
    """The loss of a batch drawn from windows labelled earlier, and its count of loss positions."""
    pick = rng.sample(range(len(store)), min(batch, len(store)))
    ids, tid, tlp, mask = (torch.stack(x).to(dev) for x in zip(*(store[i] for i in pick)))
    loss, _ = topk_loss(output_logits(model, ids.long(), vocab.rows), tid.long(), tlp.float(), mask, ce_weight)
    return loss, int(mask.sum())


@torch.no_grad()
def validate(model, corpus: Corpus, vocab: OutputVocab, ce_weight: float, dev) -> tuple[float, float]:
    """(loss, agreement) on the held-back teacher rows."""
    model.eval()
    ids, tid, tlp, mask = corpus.batch(corpus.val, dev, vocab)
    loss, agree = topk_loss(output_logits(model, ids, vocab.rows), tid, tlp, mask, ce_weight)
    model.train()
    return float(loss), float(agree)


def learning_rate(args, step: int, frac: float) -> float:
    """Linear warm-up over --warmup steps, then a cosine from --lr to a tenth of it over the wall-clock budget."""
    return args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def optimizer(model, lr: float):
    """AdamW over the trainable weights, with weight decay on matrices only."""
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trained if p.dim() >= 2], "weight_decay": 0.01},
              {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-8)


def run_record(args, mix, cfg, nparams: int, corpus: Corpus, vocab: OutputVocab) -> dict:
    """The training record saved beside the weights: the architecture, the command and every setting."""
    return {
        "architecture": "LlamaForCausalLM", "params": nparams, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
        "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "ff": cfg.intermediate_size,
        "cut_from_target": args.cut, "seed": args.seed,
        "max_positions_trained": corpus.window, "teacher_rows": corpus.kinds,
        "command": "python " + " ".join(sys.argv),
        "init": args.init or ("target layers " + args.cut if args.cut else "target embedding PCA"),
        "lr": args.lr, "batch": args.batch,
        "ce_weight": args.ce_weight, "chat_weight": CHAT_WEIGHT, "text_share": args.text_share,
        "online_share": args.online_share,
        "policy_share": args.policy_share, "policy_max_new": POLICY_MAX_NEW,
        "policy_temperature": args.policy_temperature, "offsets": args.offsets, "corpus": dict(mix),
        "replay": args.replay, "replay_k": REPLAY_K, "threads": args.threads, "device": args.device,
        "output_vocabulary": len(vocab.ids) if vocab.ids else cfg.vocab_size, "log": [],
    }


def train(args, model, teacher, corpus: Corpus, batches: Batches, record: dict) -> None:
    """Steps until the wall-clock budget (or --max-steps): a fresh batch, then --replay passes over windows
    labelled earlier; a log entry every 25 steps, the weights saved every --save-every minutes and at the end."""
    dev, vocab = torch.device(args.device), batches.vocab
    opt = optimizer(model, args.lr)

    def update(loss):
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    seen, step, agree = Seen(), 0, float("nan")
    replay: list = []  # (ids (T,), top ids (T, K), top log-probs (T, K), mask (T,)) per labelled window
    start = last_save = time.time()
    budget = args.minutes * 60
    model.train()
    while True:
        el = time.time() - start
        lr = learning_rate(args, step, min(1.0, el / budget))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, fresh_agree = fresh_step(batches.kind(), batches, model, teacher, replay if args.replay else None, seen, dev)
        agree = agree if fresh_agree is None else fresh_agree
        update(loss)
        for _ in range(args.replay if replay else 0):  # more passes over labels already paid for
            rloss, positions = replay_step(replay, batches.rng, args.batch, model, vocab, args.ce_weight, dev)
            update(rloss)
            seen.replay_tokens += positions
        step += 1
        done = el >= budget or (args.max_steps and step >= args.max_steps)
        if step % 25 == 0 or done:
            vloss, vagree = validate(model, corpus, vocab, args.ce_weight, dev)
            entry = {"step": step, "minutes": round(el / 60, 2), **asdict(seen), "lr": lr,
                     "loss": round(float(loss.detach()), 4), "agree": round(float(agree), 4),
                     "val_loss": round(vloss, 4), "val_agree": round(vagree, 4),
                     "tok_per_s": round(seen.tokens / max(el, 1e-9), 1)}
            record["log"].append(entry)
            print(json.dumps(entry), flush=True)
        if time.time() - last_save > args.save_every * 60 or done:
            record["train_minutes"] = round((time.time() - start) / 60, 2)
            record.update({f"{name}_seen": count for name, count in asdict(seen).items()}, steps=step)
            save(model, Path(args.out), record, vocab.ids, args.weights == "compact")
            last_save = time.time()
            print(f"saved to {args.out}", flush=True)
        if done:
            break


def main() -> None:
    args, mix = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import AutoConfig

    tdir = bundled.target_dir()
    tcfg = AutoConfig.from_pretrained(tdir)
    model, teacher = load_models(args, tdir, draft_config(tcfg, args.layers, args.hidden, args.heads, args.kv_heads, args.ff))
    cfg = model.config
    corpus = Corpus.load(args, mix, tdir)
    ids = read_output_vocab(Path(args.init)) if args.init else None
    if ids is None and args.vocab:
        ids = ranked_vocab(args.vocab, torch.cat(list(corpus.texts.values())), corpus.rows, cfg.vocab_size)
    vocab = OutputVocab.of(ids, cfg.vocab_size, args.device)
    nparams = sum(p.numel() for p in model.parameters())
    windows = {n: len(t) for n, t in corpus.texts.items()}
    print(f"params {nparams} rows {corpus.kinds} train {len(corpus.train)} val {len(corpus.val)} text windows {windows} "
          f"output vocabulary {len(ids) if ids else cfg.vocab_size}", flush=True)
    batches = Batches(args, mix, corpus, vocab, model, tcfg, random.Random(args.seed))
    train(args, model, teacher, corpus, batches, run_record(args, mix, cfg, nparams, corpus, vocab))


if __name__ == "__main__":
    main()
