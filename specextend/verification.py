"""Verification: which draft tokens the target keeps, and its bonus token. Pure functions.

A draft is a tree given as `parents` (parent node index per node, -1 for the root's children; parents
precede children) and `tokens`. Row 0 of the target's outputs belongs to the root (the last committed
token), row i + 1 to node i. Children of a node are tried in node order.

- Greedy: follow the child whose token is the target's argmax; the first miss gives the bonus token.
  The output is exactly the target's own greedy output.
- Sampling: recursive rejection sampling (SpecInfer / multi-draft). At a node whose children were drawn
  WITHOUT replacement from q, try them in order: accept x with probability min(1, p(x)/q(x)); on a
  rejection set p <- norm(max(0, p - q)) and remove x from q (renormalised). If all are rejected, the
  bonus is drawn from the residual p. For a chain (one child per node) this is exactly Leviathan et al.'s
  rule. A node proposed deterministically (a lookup copy) has a point mass for q: it is tried before the
  drawn siblings, accepted with probability p(x), and on a rejection x leaves both p and q. The drawn
  siblings without x are a draw without replacement from q without x, so the rule stays exact. Either way
  each committed token is distributed as the target's p.
Knows probabilities and trees; knows nothing of models or caches.
"""

from __future__ import annotations

from typing import Sequence

import torch


def children_of(parents: Sequence[int]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    return kids


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Temperature, then nucleus (top-p) filtering: (..., V) logits -> (..., V) fp32 probabilities."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly above each token
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    filtered = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def tree_mask(parents: tuple[int, ...] | list[int]) -> torch.Tensor:
    """(N+1, N+1) bool over [root] + nodes: row i sees column j iff j is i itself or an ancestor."""
    n = len(parents) + 1
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(parents):
        row = i + 1
        if p >= 0:
            mask[row] = mask[p + 1]
        mask[row, row] = True
    return mask


def greedy_accept(parents: Sequence[int], tokens: Sequence[int], logits: torch.Tensor,
                  mask: torch.Tensor | None = None) -> tuple[list[int], int]:
    """`verify_greedy` decided where the target's logits (N+1, V) lie: what comes back to the host is the deepest
    accepted row and the bonus token (two ids), not N+1 rows of logits or argmaxes. `mask`: the tree's
    `tree_mask(parents)`, where the caller has it already.

    A node matches when its token is the argmax of its parent's row and no earlier sibling has the same token (the
    first such child is the one followed); a row is accepted when it and all its ancestors match. The accepted rows
    form one chain from the root; the deepest ends the path and its argmax is the bonus."""
    argmax = logits.argmax(dim=-1)  # (N+1,)
    if not tokens:
        return [], int(argmax[0])
    first, met = [], set()
    for pair in zip(parents, tokens):
        first.append(pair not in met)
        met.add(pair)
    nodes = torch.tensor([list(tokens), [p + 1 for p in parents], first], dtype=torch.long).to(logits.device)  # (3, N)
    seen = (tree_mask(parents) if mask is None else mask).to(logits.device)  # (N+1, N+1): row i's ancestors and itself
    match = (nodes[0] == argmax[nodes[1]]) & nodes[2].bool()  # (N,)
    ok = torch.cat([match.new_ones(1), match])  # (N+1,): the root always stands
    accepted = ~(seen & ~ok).any(dim=-1)  # (N+1,)
    deepest = torch.where(accepted, seen.sum(dim=-1), 0).argmax()  # the root's depth counts 1, so a lone root wins
    row, bonus = torch.stack((deepest, argmax[deepest])).tolist()
    path = []
    node = row - 1
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1], bonus


def verify_greedy(parents: Sequence[int], tokens: Sequence[int], target_argmax: Sequence[int]) -> tuple[list[int], int]:
    """(accepted node path, bonus token) for greedy decoding. target_argmax has one entry per row."""
    kids = children_of(parents)
    path: list[int] = []
    node, row = -1, 0
    while True:
        want = int(target_argmax[row])
        nxt = next((c for c in kids.get(node, ()) if int(tokens[c]) == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node, row = nxt, nxt + 1


def _normalise(x: torch.Tensor) -> torch.Tensor | None:
    total = x.sum()
    return x / total if total > 0 else None


def verify_sampling(
    parents: Sequence[int],
    tokens: Sequence[int],
    p: torch.Tensor,
    q: torch.Tensor,
    generator: torch.Generator,
    point: Sequence[bool] = (),
) -> tuple[list[int], int]:
    """(accepted node path, bonus token) by recursive rejection sampling.

    p: (N+1, V) target probabilities per row. q: (N+1, V) draft probabilities per row, used for rows with
    drawn children (the distribution they were drawn from without replacement). point: per node, True where
    the node's proposal is a point mass on its token (empty: none); such nodes precede drawn siblings.
    """
    kids = children_of(parents)
    point = tuple(point) or (False,) * len(tokens)
    path: list[int] = []
    node, row = -1, 0
    while True:
        residual = p[row].float().cpu()
        drawn = any(not point[c] for c in kids.get(node, ()))
        proposal = q[row].float().cpu() if drawn else None
        accepted = None
        for child in kids.get(node, ()):
            x = int(tokens[child])
            if not point[child] and proposal is None:  # q's whole support was tried: nothing further was drawn
                break
            mass = torch.zeros_like(residual).index_fill_(0, torch.tensor([x]), 1.0) if point[child] else proposal
            if torch.rand((), generator=generator) < residual[x] / mass[x]:
                accepted = child
                break
            left = _normalise(torch.clamp(residual - mass, min=0.0))
            residual = residual if left is None else left  # None only when p == q, where x is always accepted
            if proposal is not None:
                proposal = proposal.clone()
                proposal[x] = 0.0
                proposal = _normalise(proposal)
        if accepted is None:
            bonus = int(torch.multinomial(residual, 1, generator=generator))
            return path, bonus
        path.append(accepted)
        node, row = accepted, accepted + 1
