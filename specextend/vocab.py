"""Vocabularies of a pair: a draft's output layer over some of the ids (its own frequency-ranked ones, or the ids the
pair's tokenizer defines before an embedding's padding), a draft's reading of ids past its embedding, and a digest of a
tokenizer's ids (what a draft that ships no tokenizer records of the one it was trained on).
Knows model heads, embeddings and tokenizers' id tables; knows nothing of loading, drafting or the engine.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from transformers import PreTrainedModel

from .compat import id_table

DRAFT_VOCAB_FILE = "draft_vocab.json"  # a model folder's output vocabulary, {"size": N, "ids": [...]}


class ReducedVocabHead(torch.nn.Module):
    """An output layer over some of the vocabulary; every other token gets logit -inf, probability zero.

    A draft whose output layer covers only frequency-ranked tokens drafts only those, at a fraction of
    the cost of the full layer. The target still verifies over the whole vocabulary, and rejection
    sampling stays exact because the draft's q is zero wherever it cannot draw. Logits come out over the
    whole vocabulary, so nothing downstream knows.
    """

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor, out_features: int):
        """`weight` (len(ids), H): the output rows of `ids`; logits come out `out_features` wide."""
        super().__init__()
        self.out_features = out_features
        self.register_buffer("ids", ids.to(device=weight.device, dtype=torch.long), persistent=False)
        # ids 0..n-1 (a tokenizer's ids before an embedding's padding): a slice, not a scatter of every column
        self.prefix = len(ids) if torch.equal(self.ids.cpu(), torch.arange(len(ids))) else None
        self.rows = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.rows.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)

    @classmethod
    def of(cls, full: torch.nn.Linear, ids: torch.Tensor) -> ReducedVocabHead:
        """The head over `ids` cut from a full output layer (its rows copied)."""
        ids = ids.to(torch.long)
        return cls(full.weight.detach()[ids.to(full.weight.device)].clone(), ids, full.out_features)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # (..., H) -> (..., V_out) -> (..., V) with -inf outside `ids`
        out = hidden.new_full((*hidden.shape[:-1], self.out_features), float("-inf"))
        if self.prefix is not None:
            out[..., : self.prefix] = self.rows(hidden)
        else:
            out[..., self.ids] = self.rows(hidden)
        return out


def read_output_vocab(folder: Path) -> list[int] | None:
    """The output vocabulary a model folder lists (DRAFT_VOCAB_FILE), or None when it lists none."""
    vocab_file = folder / DRAFT_VOCAB_FILE
    return json.loads(vocab_file.read_text())["ids"] if vocab_file.is_file() else None


def reduce_output_vocab(model: PreTrainedModel, folder: Path) -> PreTrainedModel:
    """Give `model` a ReducedVocabHead when its folder lists an output vocabulary."""
    ids = read_output_vocab(folder)
    if ids is not None:
        model.set_output_embeddings(ReducedVocabHead.of(model.get_output_embeddings(), torch.tensor(ids)))
    return model


class WideEmbedding(torch.nn.Module):
    """A draft's input embedding read with the target's ids: an id past its rows (a padding row the target has and
    the draft lacks, which only an untrained target would commit) reads as a zero vector, so the draft can read
    whatever the target commits."""

    def __init__(self, inner: torch.nn.Embedding):
        super().__init__()
        self.inner = inner

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    @property
    def num_embeddings(self) -> int:
        return self.inner.num_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inside = ids < self.inner.num_embeddings  # (B, T)
        return self.inner(ids.where(inside, 0)) * inside[..., None].to(self.inner.weight.dtype)


def keep_to_vocab(draft: PreTrainedModel, shared: int, width: int) -> None:
    """Make the draft's logits `width` wide (the target's) with -inf at every id from `shared` on, so that it never
    proposes an id the pair's tokenizer lacks (a padded embedding's rows, or rows only one model has); and let it
    read every id the target may commit."""
    embedding = draft.get_input_embeddings()
    if embedding.num_embeddings < width and not isinstance(embedding, WideEmbedding):
        draft.set_input_embeddings(WideEmbedding(embedding))
    head = draft.get_output_embeddings()
    if isinstance(head, ReducedVocabHead):
        keep = head.ids < shared
        weight, ids = head.rows.weight[keep], head.ids[keep]
    else:
        ids = torch.arange(min(shared, head.out_features), device=head.weight.device)
        weight = head.weight[: len(ids)]  # a view: the tied embedding is not copied
    if len(ids) < head.out_features or head.out_features != width:
        draft.set_output_embeddings(ReducedVocabHead(weight, ids, width))


def check_vocab(target: PreTrainedModel, draft: PreTrainedModel) -> None:
    """Models built in memory come without tokenizers to compare: their output layers must be the same width."""
    t, d = target.get_output_embeddings().out_features, draft.get_output_embeddings().out_features
    if t != d or target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"the target's vocabulary ({t} tokens) and the draft's ({d} tokens) differ: "
                         "speculative decoding needs one shared tokenizer")


def tokenizer_digest(tokenizer) -> str:
    """sha256 of a tokenizer's id table (`compat.id_table`, added tokens included): two tokenizers with one digest map
    the same strings to the same ids, which is all a pair needs of them."""
    return hashlib.sha256(json.dumps(sorted(id_table(tokenizer).items())).encode()).hexdigest()
