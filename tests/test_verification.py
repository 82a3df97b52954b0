"""Verification: greedy acceptance on hand-built and random trees, and distribution-exact sampling.

Greedy: scripted trees (all right, all wrong, right for the first j then wrong, the right token on a
later sibling, the empty tree) and a property test against a deterministic toy target: the committed
tokens are always the target's own greedy continuation, as far as the tree allows.
Sampling: chi-square tests on a 6-token vocabulary with fixed p and q show that the first committed
token, and the joint of the first two, follow the target's p, for a depth-2 chain and for trees whose
children are drawn without replacement by `draw_children`, also with lookup branches (point masses)
grafted on. The same chi-square rejects deliberately wrong rules (a greedy draft treated as a sample,
top-k tree children, a bonus drawn from p instead of the residual, lookup nodes treated as draws from
q), so the tests can see a bias. Also the temperature / top-p filter `sampling_probs`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from specextend.drafting import DraftTree, draw_children
from specextend.lookup import graft
from specextend.verification import children_of, greedy_accept, sampling_probs, tree_mask, verify_greedy, verify_sampling

V = 6
ALPHA = 1e-3  # an exact rule must pass at this level; a wrong one must fail it


# ------------------------------------------------------------------------------------ greedy


def test_greedy_all_right_accepts_the_whole_chain():
    parents, tokens = [-1, 0, 1], [5, 6, 7]
    assert verify_greedy(parents, tokens, [5, 6, 7, 8]) == ([0, 1, 2], 8)


def test_greedy_all_wrong_gives_the_bonus_only():
    parents, tokens = [-1, 0, 1], [5, 6, 7]
    assert verify_greedy(parents, tokens, [9, 6, 7, 8]) == ([], 9)


@pytest.mark.parametrize("j", [0, 1, 2, 3])
def test_greedy_right_for_the_first_j_then_wrong(j):
    parents, tokens = [-1, 0, 1, 2], [10, 11, 12, 13]
    target = [10, 11, 12, 13, 14]
    target[j] = 20 + j  # row j (the root for j = 0) wants something else
    path, bonus = verify_greedy(parents, tokens, target)
    assert path == list(range(j))
    assert bonus == 20 + j


def test_greedy_follows_the_second_child_when_it_is_the_right_one():
    # root -> {0: 3, 1: 4}; 0 -> {2: 5}; 1 -> {3: 5, 4: 6}; 4 -> {5: 7}
    parents, tokens = [-1, -1, 0, 1, 1, 4], [3, 4, 5, 5, 6, 7]
    rows = {0: 4, 2: 6, 5: 7, 6: 9}  # root wants 4 (node 1), node 1 wants 6 (node 4), node 4 wants 7 (node 5)
    target = [rows.get(r, 0) for r in range(7)]
    assert verify_greedy(parents, tokens, target) == ([1, 4, 5], 9)
    # the first child is the right one at the root, the second one below it
    parents2, tokens2 = [-1, -1, 0, 0], [3, 4, 0, 1]
    assert verify_greedy(parents2, tokens2, [3, 1, 0, 0, 5]) == ([0, 3], 5)


def test_greedy_empty_tree_is_the_bonus_only():
    assert verify_greedy([], [], [7]) == ([], 7)
    assert verify_greedy((), (), torch.tensor([3])) == ([], 3)


def toy_target(context: tuple[int, ...], vocab: int) -> int:
    """A deterministic 'greedy target': the next token as a function of the whole context."""
    return (sum((i + 3) * t for i, t in enumerate(context)) * 7 + len(context)) % vocab


@st.composite
def trees_with_distinct_siblings(draw, vocab):
    parents: list[int] = []
    tokens: list[int] = []
    for _ in range(draw(st.integers(0, 14))):
        parent = draw(st.integers(-1, len(parents) - 1))
        used = {tokens[i] for i, p in enumerate(parents) if p == parent}
        options = [t for t in range(vocab) if t not in used]
        if options:
            parents.append(parent)
            tokens.append(draw(st.sampled_from(options)))
    return parents, tokens


def node_path(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@settings(max_examples=100, deadline=None)
@given(data=st.data(), vocab=st.integers(2, 4), prefix=st.lists(st.integers(0, 3), max_size=5))
def test_greedy_commits_the_target_greedy_continuation(data, vocab, prefix):
    prefix = tuple(t % vocab for t in prefix)
    parents, tokens = data.draw(trees_with_distinct_siblings(vocab))
    if data.draw(st.booleans(), label="plant"):  # plant the right continuation along a fresh branch
        node, context = -1, prefix
        for _ in range(data.draw(st.integers(1, 4), label="planted depth")):
            want = toy_target(context, vocab)
            child = next((c for c in children_of(parents).get(node, ()) if tokens[c] == want), None)
            if child is None:
                parents.append(node)
                tokens.append(want)
                child = len(tokens) - 1
            node, context = child, context + (want,)
    rows = [toy_target(prefix, vocab)]
    rows += [toy_target(prefix + tuple(tokens[n] for n in node_path(parents, i)), vocab) for i in range(len(tokens))]
    path, bonus = verify_greedy(parents, tokens, rows)
    # the path is a root-to-node chain
    assert [parents[n] for n in path] == [-1, *path][: len(path)]
    # committed tokens == the target's own greedy continuation
    continuation, context = [], prefix
    for _ in range(len(path) + 1):
        continuation.append(toy_target(context, vocab))
        context += (continuation[-1],)
    assert [tokens[n] for n in path] + [bonus] == continuation
    # and it is the longest agreeing path the tree holds
    longest = max(
        (len(node_path(parents, i)) for i in range(len(tokens))
         if [tokens[n] for n in node_path(parents, i)] == continuation_of(prefix, vocab, len(node_path(parents, i)))),
        default=0,
    )
    assert len(path) == longest


def continuation_of(prefix, vocab, n):
    out, context = [], prefix
    for _ in range(n):
        out.append(toy_target(context, vocab))
        context += (out[-1],)
    return out


# ------------------------------------------------------------------------ sampling, fixed p and q


def distribution(gen: torch.Generator, floor: float = 0.04, sharp: float = 1.2) -> torch.Tensor:
    """A fixed random distribution over V tokens with every probability at least `floor`."""
    probs = torch.softmax(torch.randn(V, generator=gen, dtype=torch.float64) * sharp, 0)
    return (floor + (1 - V * floor) * probs).float()


def model_pq(seed: int, p_zero: int | None = None):
    """p0, q0 at the root; p1[x], q1[x] after first token x; p2: any fixed row for deeper nodes."""
    gen = torch.Generator().manual_seed(seed)
    p0, q0 = distribution(gen), distribution(gen, floor=0.02, sharp=2.0)
    if p_zero is not None:  # a token the target never produces but the draft likes
        p0[p_zero] = 0.0
        p0 /= p0.sum()
        q0[p_zero] = 0.3
        q0 /= q0.sum()
    p1 = torch.stack([distribution(gen) for _ in range(V)])
    q1 = torch.stack([distribution(gen, floor=0.02, sharp=2.0) for _ in range(V)])
    p2 = distribution(gen)
    return p0, q0, p1, q1, p2


def chi2_pvalue(cells: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of observed cell ids to `probs`; any hit on a zero-probability cell is p = 0."""
    counts = np.bincount(cells, minlength=probs.size)
    support = probs > 0
    if counts[~support].any():
        return 0.0
    expected = probs[support] / probs[support].sum() * counts.sum()
    assert expected.min() >= 5, "too few samples per cell for a chi-square"
    return float(chisquare(counts[support], expected).pvalue)


def first_two(committed: list[list[int]], p1: torch.Tensor, gen: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
    """First and second committed token per sample. Where a step committed only one token, the second
    comes from the next step; it is drawn from the target's p1 here, so only this step is under test."""
    first = torch.tensor([c[0] for c in committed])
    second = torch.tensor([c[1] if len(c) > 1 else -1 for c in committed])
    short = second < 0
    if short.any():
        second[short] = torch.multinomial(p1[first[short]], 1, generator=gen).squeeze(1)
    return first.numpy(), second.numpy()


def expected_first_two(p0: torch.Tensor, p1: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    return p0.double().numpy(), (p0.double()[:, None] * p1.double()).flatten().numpy()


def pvalues(committed: list[list[int]], p0: torch.Tensor, p1: torch.Tensor, seed: int) -> tuple[float, float]:
    """Chi-square p-values of the first committed token, and of the first two, against the target's p."""
    first, second = first_two(committed, p1, torch.Generator().manual_seed(seed))
    want_first, want_joint = expected_first_two(p0, p1)
    return chi2_pvalue(first, want_first), chi2_pvalue(first * V + second, want_joint)


def sample_chain(n: int, seed: int, draft: str = "sampled") -> list[list[int]]:
    """n depth-2 chain steps: x1 ~ q0, x2 ~ q1[x1] (or the top-q tokens, for a wrong draft), verified."""
    p0, q0, p1, q1, p2 = model_pq(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    sampler = gen if draft == "sampled" else None
    x1 = draw_children(q0.log().expand(n, V), 1, sampler).squeeze(1)
    x2 = draw_children(q1[x1].log(), 1, sampler).squeeze(1)
    p = torch.stack([p0.expand(n, V), p1[x1], p2.expand(n, V)], dim=1)  # (n, 3, V)
    q = torch.stack([q0.expand(n, V), q1[x1], torch.zeros(n, V)], dim=1)
    committed = []
    for i in range(n):
        tokens = [int(x1[i]), int(x2[i])]
        path, bonus = verify_sampling([-1, 0], tokens, p[i], q[i], gen)
        committed.append([tokens[j] for j in path] + [bonus])
    return committed


def sample_tree(n: int, seed: int, root_children: int, grandchildren: int, children: str = "sampled",
                p_zero: int | None = None) -> tuple[list[list[int]], tuple]:
    """n trees: `root_children` drawn without replacement from q0, each with `grandchildren` drawn without
    replacement from q1[its token]; verified by recursive rejection sampling."""
    pq = p0, q0, p1, q1, p2 = model_pq(seed, p_zero)
    gen = torch.Generator().manual_seed(seed + 1)
    sampler = gen if children == "sampled" else None
    first = draw_children(q0.log().expand(n, V), root_children, sampler)  # (n, c)
    parents = [-1] * root_children
    columns = [first]
    p_rows = [p0.expand(n, V)] + [p1[first[:, j]] for j in range(root_children)]
    q_rows = [q0.expand(n, V)] + [q1[first[:, j]] for j in range(root_children)]
    for j in range(root_children):
        if grandchildren:
            columns.append(draw_children(q1[first[:, j]].log(), grandchildren, sampler))
            parents += [j] * grandchildren
            p_rows += [p2.expand(n, V)] * grandchildren
            q_rows += [torch.zeros(n, V)] * grandchildren
    tokens = torch.cat(columns, dim=1)  # (n, nodes)
    p, q = torch.stack(p_rows, dim=1), torch.stack(q_rows, dim=1)  # (n, nodes + 1, V)
    committed = []
    for i in range(n):
        row = tokens[i].tolist()
        assert len(set(row[:root_children])) == root_children  # siblings are distinct
        path, bonus = verify_sampling(parents, row, p[i], q[i], gen)
        assert [parents[j] for j in path] == [-1, *path][: len(path)]
        committed.append([row[j] for j in path] + [bonus])
    return committed, pq


N_CHAIN = 20_000
N_TREE = 12_000
N_WRONG = 3_000  # a wrong rule must fail even with a fraction of the samples


def test_chain_sampling_keeps_the_target_distribution():
    p0, _, p1, _, _ = model_pq(0)
    committed = sample_chain(N_CHAIN, seed=0)
    p_first, p_joint = pvalues(committed, p0, p1, seed=9)
    assert p_first > ALPHA and p_joint > ALPHA
    # both draft tokens were accepted often enough for the joint to test the second verification
    assert sum(len(c) == 3 for c in committed) > N_CHAIN // 10


def test_chain_chi_square_rejects_a_greedy_draft_treated_as_a_sample():
    p0, _, p1, _, _ = model_pq(0)
    committed = sample_chain(N_WRONG, seed=0, draft="top-q")
    p_first, p_joint = pvalues(committed, p0, p1, seed=9)
    assert p_first < ALPHA and p_joint < ALPHA


def test_chain_chi_square_rejects_a_bonus_drawn_from_p_instead_of_the_residual():
    """The classic slip: on a rejection, draw the bonus from p rather than norm(max(0, p - q))."""
    p0, q0, p1, q1, _ = model_pq(0)
    gen = torch.Generator().manual_seed(3)
    n = N_WRONG
    x1 = torch.multinomial(q0, n, replacement=True, generator=gen)
    ok1 = torch.rand(n, generator=gen) < p0[x1] / q0[x1]
    first = torch.where(ok1, x1, torch.multinomial(p0, n, replacement=True, generator=gen))
    x2 = torch.multinomial(q1[first], 1, generator=gen).squeeze(1)
    ok2 = torch.rand(n, generator=gen) < p1[first, x2] / q1[first, x2]
    second = torch.where(ok1 & ok2, x2, torch.multinomial(p1[first], 1, generator=gen).squeeze(1))
    want_first, want_joint = expected_first_two(p0, p1)
    assert chi2_pvalue(first.numpy(), want_first) < ALPHA
    assert chi2_pvalue((first * V + second).numpy(), want_joint) < ALPHA


def test_tree_sampling_keeps_the_target_distribution():
    committed, (p0, _, p1, _, _) = sample_tree(N_TREE, seed=1, root_children=3, grandchildren=2, p_zero=5)
    p_first, p_joint = pvalues(committed, p0, p1, seed=8)
    assert p0[5] == 0  # the draft proposes token 5 often; the target never emits it
    assert p_first > ALPHA and p_joint > ALPHA
    # a later sibling and a depth-2 node were accepted, so every branch of the rule was exercised
    assert sum(len(c) == 3 for c in committed) > N_TREE // 10


def test_tree_sampling_with_the_whole_vocabulary_at_the_root():
    """Every token is a root child: the proposal runs out, and the residual must still be right."""
    committed, (p0, _, p1, _, _) = sample_tree(N_TREE // 2, seed=2, root_children=V, grandchildren=0)
    p_first, p_joint = pvalues(committed, p0, p1, seed=7)
    assert p_first > ALPHA and p_joint > ALPHA


def test_tree_chi_square_rejects_top_k_children():
    """Children taken deterministically as the top-k of q (not drawn without replacement) bias the output."""
    committed, (p0, _, p1, _, _) = sample_tree(N_WRONG, seed=1, root_children=3, grandchildren=2, children="top-k",
                                               p_zero=5)
    p_first, p_joint = pvalues(committed, p0, p1, seed=8)
    assert p_first < ALPHA and p_joint < ALPHA


def sample_grafted(n: int, seed: int, lookups: list[tuple[int, ...]], point: bool = True) -> tuple[list[list[int]], tuple]:
    """n draft trees (3 root children drawn without replacement from q0, 2 grandchildren each from q1[token]) with
    fixed lookup branches grafted at the root, verified with the lookup nodes as point masses (or, as a wrong
    rule, as if they had been drawn from q)."""
    pq = p0, q0, p1, q1, p2 = model_pq(seed, p_zero=5)
    gen = torch.Generator().manual_seed(seed + 1)
    first = draw_children(q0.log().expand(n, V), 3, gen)  # (n, 3)
    second = [draw_children(q1[first[:, j]].log(), 2, gen) for j in range(3)]  # 3 x (n, 2)
    parents, depths = (-1, -1, -1, 0, 0, 1, 1, 2, 2), (1, 1, 1, 2, 2, 2, 2, 2, 2)
    committed, shared = [], 0
    for i in range(n):
        kids = first[i].tolist()
        tokens = kids + [t for j in range(3) for t in second[j][i].tolist()]
        q = torch.stack([q0, *(q1[x] for x in kids), *[torch.zeros(V)] * 6])
        tree = graft(DraftTree(tuple(tokens), parents, depths, (0.5,) * 9, q, 1), [(b, 0) for b in lookups])
        shared += tree.sources.count("both")
        p = torch.stack([p0, *(p1[t] if d == 1 else p2 for t, d in zip(tree.tokens, tree.depths))])
        path, bonus = verify_sampling(tree.parents, tree.tokens, p, tree.q, gen, tree.point if point else ())
        committed.append([tree.tokens[j] for j in path] + [bonus])
    assert shared > n // 2  # lookup and draft often proposed the same node, so the merge is under test too
    return committed, pq


LOOKUP_BRANCHES = [(5, 1), (2, 4, 0), (0,)]  # 5: the target never emits it; 2 and 0: common draft picks too


def test_tree_with_lookup_branches_keeps_the_target_distribution():
    committed, (p0, _, p1, _, _) = sample_grafted(N_TREE, seed=4, lookups=LOOKUP_BRANCHES)
    p_first, p_joint = pvalues(committed, p0, p1, seed=6)
    assert p_first > ALPHA and p_joint > ALPHA
    assert sum(len(c) == 3 for c in committed) > N_TREE // 10


def test_tree_chi_square_rejects_lookup_nodes_treated_as_draws_from_q():
    committed, (p0, _, p1, _, _) = sample_grafted(N_WRONG, seed=4, lookups=LOOKUP_BRANCHES, point=False)
    assert pvalues(committed, p0, p1, seed=6)[1] < ALPHA


def test_sampling_edge_cases():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0, 0.0])
    rows = torch.stack([p, p, p])
    for _ in range(100):  # p == q: every draft token is accepted
        assert verify_sampling([-1, 0], [2, 3], rows, rows, gen)[0] == [0, 1]
    one_hot = torch.zeros(2, V)
    one_hot[:, 1] = 1.0
    q = torch.stack([p, torch.zeros(V)])
    for _ in range(100):  # the target only ever says 1: the draft's 3 is rejected and the bonus is 1
        assert verify_sampling([-1], [3], one_hot, q, gen) == ([], 1)
    bonuses = {verify_sampling([], [], p[None], torch.zeros(1, V), gen)[1] for _ in range(200)}
    assert bonuses == {0, 1, 2, 3}  # the empty tree: a draw from p's support, all of it


# ---------------------------------------------------------------------------- sampling_probs


def test_temperature_scales_logits():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 0.0, 3.0, 1.0]])
    for t in (0.25, 0.7, 1.0, 3.0):
        torch.testing.assert_close(sampling_probs(logits, t, 1.0), torch.softmax(logits / t, dim=-1))
    assert float(sampling_probs(logits, 1e-3, 1.0)[0, 0]) > 0.999
    flat = sampling_probs(logits, 1e4, 1.0)
    torch.testing.assert_close(flat, torch.full_like(flat, 0.25), atol=1e-3, rtol=0)
    assert sampling_probs(logits.bfloat16(), 1.0, 1.0).dtype == torch.float32


def test_top_p_by_hand():
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    torch.testing.assert_close(sampling_probs(logits, 1.0, 0.4), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(sampling_probs(logits, 1.0, 0.6), torch.tensor([0.625, 0.375, 0.0]))
    torch.testing.assert_close(sampling_probs(logits, 1.0, 0.9), torch.tensor([0.5, 0.3, 0.2]))
    reordered = torch.tensor([0.2, 0.5, 0.3]).log()  # the kept set follows the sorted order, not the index
    torch.testing.assert_close(sampling_probs(reordered, 1.0, 0.6), torch.tensor([0.0, 0.625, 0.375]))


@settings(max_examples=100, deadline=None)
@given(
    logits=st.lists(st.floats(-6, 6, width=32), min_size=2, max_size=12, unique=True),
    temperature=st.floats(0.3, 2.0),
    top_p=st.floats(0.01, 1.0),
)
def test_top_p_keeps_the_smallest_prefix_reaching_top_p(logits, temperature, top_p):
    x = torch.tensor(logits)
    probs = torch.softmax(x.double() / temperature, 0)
    ordered, order = torch.sort(probs, descending=True)
    assume(bool((ordered[:-1] - ordered[1:]).min() > 1e-6))  # no near-ties in the order
    mass = torch.cumsum(ordered, 0)
    assume(bool((mass - top_p).abs().min() > 1e-4))  # no float-rounding ambiguity at the boundary
    keep = int((mass < top_p).sum()) + 1  # smallest prefix whose mass reaches top_p
    kept = set(order[:keep].tolist())
    want = torch.zeros_like(probs)
    want[order[:keep]] = probs[order[:keep]] / probs[order[:keep]].sum()
    got = sampling_probs(torch.stack([x, x.flip(0)]), temperature, top_p)  # (2, V): rows are independent
    assert got.dtype == torch.float32
    assert set(torch.nonzero(got[0]).flatten().tolist()) == kept
    torch.testing.assert_close(got[0].double(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1].double(), want.flip(0), atol=1e-5, rtol=0)
    assert abs(float(got[0].sum()) - 1.0) < 1e-5


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_greedy_accept_on_the_logits_device_equals_verify_greedy(data):
    """The device-side decision (two ids back) is `verify_greedy` exactly: random trees, sibling tokens that repeat
    (a lookup copy beside a draft guess), argmaxes that follow any branch or none."""
    n = data.draw(st.integers(0, 12), label="nodes")
    parents = [data.draw(st.integers(-1, i - 1), label="parent") for i in range(n)]
    tokens = [data.draw(st.integers(0, 3), label="token") for _ in range(n)]
    argmax = [data.draw(st.integers(0, 3), label="argmax") for _ in range(n + 1)]
    logits = torch.randn(n + 1, 4) - 10.0
    logits[torch.arange(n + 1), torch.tensor(argmax)] = 10.0
    assert greedy_accept(parents, tokens, logits) == verify_greedy(parents, tokens, argmax)
    assert greedy_accept(parents, tokens, logits, tree_mask(parents)) == verify_greedy(parents, tokens, argmax)
