"""The retrieval signal: which of the target's attention heads, reading which query rows, score the context for CMR.

The target's queries are kept as it computes them (no extra forward): `QueryWindow` holds the queries of the
scoring heads for the last `rows` tokens the target has read. `head_scores` turns them and the target's cached
keys into one attention distribution per head (causal: a row never sees keys after its own position), and
`combine` folds the heads into one score per token. A pair may carry a calibrated signal (a file beside its
draft, written by scripts/calibrate_signal.py); `resolve` turns a signal's name into the signal for a pair.
Knows tensors, positions and signal files; knows nothing of drafting, verification or the UI.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from .config import RetrievalSignal

SIGNAL_FILE = "retrieval_signal.json"  # beside a draft: {"target": {...shape}, "signal": {...}, "calibration": {...}}

PAPER = RetrievalSignal()
# Calibration-free: every head of every layer reads the last 16 rows; a token scores by its best head; a chunk
# inherits half its neighbours' score; a quarter of the working cache is kept for the newest chunks. The best
# calibration-free candidate on the bundled target (docs/RESULTS.md, "Retrieval signal").
UNCALIBRATED = RetrievalSignal("uncalibrated", layers=(), heads=(), rows=16, combine="max", reserve=0.25, spread=0.5)


class Tail:
    """The last `rows` rows (along `dim`) of what is pushed, written in place into a buffer of twice that: a push copies
    its rows in, and about once in `rows` pushed rows the kept ones move to the front. No step allocates."""

    def __init__(self, rows: int, dim: int) -> None:
        self.rows, self.dim = rows, dim
        self.buffer: torch.Tensor | None = None
        self.n = 0  # rows filled

    @property
    def view(self) -> torch.Tensor | None:
        """The kept rows, oldest first (a view: valid until the next push)."""
        if self.buffer is None:
            return None
        kept = min(self.n, self.rows)
        return self.buffer.narrow(self.dim, self.n - kept, kept)

    def push(self, new: torch.Tensor) -> None:
        """Add `new`'s rows (at most `rows` of them)."""
        k = new.shape[self.dim]
        if self.buffer is None:
            shape = list(new.shape)
            shape[self.dim] = 2 * self.rows
            self.buffer = new.new_empty(shape)
        if self.n + k > 2 * self.rows:  # move the rows still kept after this push to the front (they do not overlap)
            keep = self.rows - k
            self.buffer.narrow(self.dim, 0, keep).copy_(self.buffer.narrow(self.dim, self.n - keep, keep))
            self.n = keep
        self.buffer.narrow(self.dim, self.n, k).copy_(new)
        self.n += k

    def copy(self, rows: int) -> Tail:
        """A tail of `rows` holding copies of this one's last `rows` rows."""
        twin, kept = Tail(rows, self.dim), self.view
        if kept is not None:
            w = kept.shape[self.dim]
            twin.push(kept.narrow(self.dim, max(0, w - rows), min(rows, w)))
        return twin


class QueryWindow:
    """The queries of the scoring heads for the last `rows` tokens the target has read, and their positions.

    Per layer (H_sel, W, D) with W <= rows, oldest first; `positions` (W,) the tokens' positions. One verb: `push`.
    Every scoring head of every layer sits in one buffer (`Tail`, written in place), so a push is a few ops whatever
    the number of layers: join the layers' queries over the rows read, gather the scoring heads' rows, copy them in.
    """

    def __init__(self, heads: dict[int, tuple[int, ...]], rows: int) -> None:
        self.heads = heads
        self.rows = rows
        self.order = sorted(heads)
        self.spans: dict[int, tuple[int, int]] = {}  # layer -> (first, count) along the buffer's head axis
        for layer in self.order:
            self.spans[layer] = (sum(c for _, c in self.spans.values()), len(heads[layer]))
        self._tail = Tail(rows, 1)  # (H_sel over all layers, W, D)
        self._positions = Tail(rows, 0)
        self._pick: dict[tuple, torch.Tensor] = {}  # (device, H_q) -> each scoring head's row in the joined queries

    @property
    def layers(self) -> frozenset[int]:
        return frozenset(self.heads)

    @property
    def queries(self) -> dict[int, torch.Tensor]:
        """Per layer the kept queries (H_sel, W, D), oldest first (views: valid until the next push)."""
        kept = self._tail.view
        if kept is None:
            return {}
        return {layer: kept.narrow(0, first, count) for layer, (first, count) in self.spans.items()}

    @property
    def positions(self) -> torch.Tensor:
        """(W,) the kept rows' positions, on the CPU."""
        view = self._positions.view
        return torch.zeros(0, dtype=torch.long) if view is None else view

    def copy(self, rows: int | None = None) -> QueryWindow:
        """A window of the same heads holding copies of the last `rows` (default: all of this window's) rows."""
        rows = rows or self.rows
        twin = QueryWindow(self.heads, rows)
        twin._tail, twin._positions = self._tail.copy(rows), self._positions.copy(rows)
        return twin

    def serves(self, other: QueryWindow) -> bool:
        """Whether this window holds everything `other` would keep: the same heads, at least as many rows."""
        return self.heads == other.heads and self.rows >= other.rows

    def push(self, queries: dict[int, torch.Tensor], rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Add rows `rows` (indices into each forward's T_q, on the CPU) of queries {layer: (1, H_q, T_q, D)} at
        `positions`."""
        rows = rows[-self.rows :]
        lo, hi = int(rows.min()), int(rows.max()) + 1  # only the rows read are joined
        first = queries[self.order[0]]
        device, n_heads = first.device, first.shape[1]
        joined = torch.cat([queries[layer][0, :, lo:hi].to(device) for layer in self.order])  # (L_sel * H_q, hi - lo, D)
        pick = self._pick.get((device, n_heads))
        if pick is None:
            flat = [i * n_heads + h for i, layer in enumerate(self.order) for h in self.heads[layer]]
            pick = self._pick[(device, n_heads)] = torch.tensor(flat, device=device)
        self._tail.push(joined[pick[:, None], (rows - lo).to(device)[None, :]])  # (H_sel, rows, D)
        self._positions.push(positions[-self.rows :].cpu())


def head_scores(queries: torch.Tensor, kv_of: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Attention of each scoring head over `keys`, averaged over its query rows.

    queries (H_sel, W, D) in KV-head order; kv_of (H_sel,) the KV head each query head reads; keys (1, H_kv, T, D);
    positions (W,) on the CPU: row w sees keys [0, positions[w]]. Returns (H_sel, T) fp32, each row summing to 1.
    The query heads of each KV head are folded into one product (one for the layer when they are equally many);
    only the keys after the earliest row can be hidden, so only those are masked.
    """
    n_keys, rows = keys.shape[2], queries.shape[1]
    first = int(positions.min()) + 1  # keys before this are visible to every row
    hidden = torch.arange(first, n_keys)[None, :] > positions[:, None]  # (W, T - first)
    hidden = hidden.to(keys.device)

    def probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:  # q (B, G, W, D), k (B, T, D) -> (B, G, T)
        b, g = q.shape[:2]
        logits = torch.matmul(q.float().reshape(b, g * rows, -1), k.float().transpose(-1, -2))  # (B, G*W, T)
        logits = logits.mul_(scale).view(b, g, rows, n_keys)
        logits[..., first:].masked_fill_(hidden, float("-inf"))
        return torch.softmax(logits, dim=-1).mean(dim=2)

    kvs, counts = kv_of.unique_consecutive(return_counts=True)
    ids = kvs.tolist()
    if counts.min() == counts.max():  # the same number of heads per KV head: one product for the layer
        k = keys[0, ids[0] : ids[-1] + 1] if ids == list(range(ids[0], ids[-1] + 1)) else keys[0, ids]  # (H_kv', T, D)
        return probs(queries.reshape(len(ids), int(counts[0]), rows, -1), k).reshape(-1, n_keys)
    out, start = [], 0
    for kv, count in zip(ids, counts.tolist()):
        out.append(probs(queries[None, start : start + count], keys[0, kv : kv + 1])[0])  # (count, T)
        start += count
    return torch.cat(out)


def combine(scores: torch.Tensor, how: str) -> torch.Tensor:
    """(H, T) per-head scores -> (T,): their mean, or per token the best head's score."""
    return scores.mean(dim=0) if how == "mean" else scores.max(dim=0).values


def kv_heads_of(heads: tuple[int, ...], num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The KV head each query head reads under grouped-query attention: (len(heads),)."""
    return torch.tensor([h // (num_heads // num_kv_heads) for h in heads], dtype=torch.long)


def span_mass(scores: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    """The share of each row's score on [start, end): (..., T) -> (...)."""
    return scores[..., span[0] : span[1]].sum(dim=-1) / scores.sum(dim=-1).clamp_min(1e-30)


# ---------------------------------------------------------------- signals by name, and the pair's calibrated signal


def target_shape(model) -> dict:
    """What a calibrated signal depends on: the target's family and attention shape."""
    c = model.config
    return {"model_type": c.model_type, "num_hidden_layers": c.num_hidden_layers, "num_attention_heads":
            c.num_attention_heads, "num_key_value_heads": getattr(c, "num_key_value_heads", c.num_attention_heads),
            "hidden_size": c.hidden_size, "vocab_size": c.vocab_size}


def save(path: Path, signal: RetrievalSignal, target: dict, calibration: dict) -> None:
    data = {"target": target, "signal": asdict(signal), "calibration": calibration}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def load(folder: str | Path | None, target: dict) -> RetrievalSignal | None:
    """The calibrated signal stored in `folder` for a target of this shape; None when there is none or it is another's."""
    path = Path(folder) / SIGNAL_FILE if folder is not None else None
    if path is None or not path.is_file():
        return None
    data = json.loads(path.read_text())
    if data.get("target") != target:
        return None
    fields = data["signal"]
    return RetrievalSignal(**{**fields, "layers": tuple(fields["layers"]), "heads": tuple(map(tuple, fields["heads"]))})


def resolve(signal: str | RetrievalSignal, calibrated: RetrievalSignal | None) -> RetrievalSignal:
    """A signal by name for a pair whose calibrated signal is `calibrated` (None: the pair has none)."""
    if isinstance(signal, RetrievalSignal):
        return signal
    if signal == "paper":
        return PAPER
    if signal == "calibrated" and calibrated is None:
        raise ValueError("this pair has no calibrated retrieval signal (run scripts/calibrate_signal.py); "
                         "use 'default' or 'paper'")
    return calibrated or UNCALIBRATED
