"""The retrieval signal: config checks, the pure scoring, the query window the target keeps, names and files."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specextend import signal
from specextend.config import GenerationConfig, RetrievalConfig, RetrievalSignal
from specextend.drafting import DraftTree
from specextend.target import Target
from specextend.models import prepare
from specextend.retrieval import make_policy
from specextend.signal import PAPER, UNCALIBRATED, QueryWindow, combine, head_scores, kv_heads_of, resolve, span_mass

from conftest import VOCAB, tiny

Q_HEADS, KV_HEADS, DIM = 6, 2, 16


def test_signal_config_checks():
    assert PAPER.name == "paper" and PAPER.layers == (-1,) and PAPER.rows == 1 and PAPER.combine == "mean"
    for bad in (dict(rows=0), dict(combine="median"), dict(reserve=-0.1), dict(reserve=1.0), dict(reserve=float("nan")),
                dict(spread=1.5), dict(spread=float("nan")), dict(heads=((1, -1),))):
        with pytest.raises(ValueError):
            RetrievalSignal(**bad)
    with pytest.raises(ValueError, match="signal"):
        RetrievalConfig(signal="loudest")
    with pytest.raises(ValueError, match="resolved"):
        make_policy("cmr", RetrievalConfig())  # a name must be resolved for a pair first


def test_reserve_is_a_share_of_the_working_cache_and_at_least_the_newest_chunk():
    assert PAPER.reserved(32) == 1 and PAPER.reserved(2) == 1
    assert RetrievalSignal(reserve=0.25).reserved(32) == 8 and RetrievalSignal(reserve=0.25).reserved(8) == 2
    assert RetrievalSignal(reserve=0.25).reserved(2) == 1


def test_head_sets_count_layers_from_the_end_and_refuse_what_the_target_lacks():
    assert PAPER.head_sets(4, 3) == {3: (0, 1, 2)}
    assert RetrievalSignal(layers=(0, -2)).head_sets(4, 2) == {0: (0, 1), 2: (0, 1)}
    assert RetrievalSignal(layers=()).head_sets(2, 2) == {0: (0, 1), 1: (0, 1)}  # every head of every layer
    assert RetrievalSignal(heads=((2, 1), (0, 0), (2, 0))).head_sets(4, 3) == {0: (0,), 2: (0, 1)}
    with pytest.raises(ValueError, match="layer"):
        RetrievalSignal(layers=(4,)).head_sets(4, 3)
    with pytest.raises(ValueError, match="head"):
        RetrievalSignal(heads=((0, 3),)).head_sets(4, 3)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 5), keys=st.integers(1, 30), seed=st.integers(0, 1000),
       heads=st.sampled_from([(0, 2, 3, 5), (0, 1, 2, 3, 4, 5), (0, 3, 5), (4,), (1, 2)]))
def test_head_scores_are_causal_row_averaged_softmaxes(rows, keys, seed, heads):
    """Both paths: equally many heads per KV head (one batched product) and unequal groups (one product each)."""
    gen = torch.Generator().manual_seed(seed)
    q_all = torch.randn(Q_HEADS, rows, DIM, generator=gen)
    k = torch.randn(1, KV_HEADS, keys, DIM, generator=gen)
    positions = torch.randint(0, keys, (rows,), generator=gen)
    kv_of = kv_heads_of(heads, Q_HEADS, KV_HEADS)
    assert kv_of.tolist() == [h // 3 for h in heads]
    got = head_scores(q_all[list(heads)], kv_of, k, positions, DIM**-0.5)
    assert got.shape == (len(heads), keys)
    for i, h in enumerate(heads):  # by hand: one softmax per row over the keys it saw, then the mean of the rows
        want = torch.zeros(keys, dtype=torch.float64)
        for w in range(rows):
            p = int(positions[w])
            logits = (q_all[h, w].double() @ k[0, h // 3, : p + 1].double().T) * DIM**-0.5
            want[: p + 1] += torch.softmax(logits, 0) / rows
        torch.testing.assert_close(got[i].double(), want, atol=1e-5, rtol=1e-4)
    last = int(positions.max())
    assert float(got[:, last + 1 :].abs().sum()) == 0.0  # no row sees a key after its own position


def test_combine_and_span_mass():
    scores = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.0, 0.0, 0.5, 0.5]])
    assert combine(scores, "mean").tolist() == [0.25, 0.125, 0.375, 0.25]
    assert combine(scores, "max").tolist() == [0.5, 0.25, 0.5, 0.5]
    assert span_mass(scores, (2, 4)).tolist() == [0.25, 1.0]


def test_query_window_keeps_the_newest_rows_in_order():
    window = QueryWindow({1: (0, 2)}, rows=3)
    q = torch.arange(1 * 4 * 5 * 2, dtype=torch.float32).view(1, 4, 5, 2)  # (B, H, T, D)
    window.push({1: q}, torch.arange(5), torch.arange(10, 15))  # a prefill block of 5 rows: the last 3 stay
    assert window.positions.tolist() == [12, 13, 14]
    assert torch.equal(window.queries[1], q[0, [0, 2]][:, 2:])
    window.push({1: q}, torch.tensor([0, 3]), torch.tensor([15, 16]))  # a step: the root and one accepted node
    assert window.positions.tolist() == [14, 15, 16]
    assert torch.equal(window.queries[1], torch.cat([q[0, [0, 2]][:, 4:], q[0, [0, 2]][:, [0, 3]]], dim=1))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), pushes=st.lists(st.integers(1, 9), min_size=1, max_size=30), dim=st.sampled_from([0, 1]))
def test_tail_keeps_the_last_rows_in_one_buffer(rows, pushes, dim):
    """`Tail` (the window's storage) holds the last `rows` rows in order, written into one buffer that no push
    reallocates, however the pushes fall against its move to the front."""
    tail, seen, counter, buffer = signal.Tail(rows, dim), [], 0, None
    for k in pushes:
        k = min(k, rows)
        new = torch.arange(counter, counter + k, dtype=torch.float32)
        new = new[:, None].expand(k, 3) if dim == 0 else new[None, :, None].expand(2, k, 3)
        tail.push(new)
        seen.extend(range(counter, counter + k))
        counter += k
        buffer = buffer if buffer is not None else tail.buffer.data_ptr()
        assert tail.buffer.data_ptr() == buffer
        kept = tail.view if dim == 0 else tail.view[0]
        assert kept[:, 0].tolist() == seen[-rows:]
    twin = tail.copy(max(1, rows - 1))
    kept = twin.view if dim == 0 else twin.view[0]
    assert kept[:, 0].tolist() == seen[-max(1, rows - 1):]


def test_target_window_holds_the_queries_of_the_rows_it_read():
    """After a prefill and a few verified steps, the window's rows are exactly the queries a single forward over
    the same committed tokens computes at the same positions."""
    model = prepare(tiny("llama", layers=3, seed=5))
    sig = RetrievalSignal("t", layers=(0, 2), rows=6)
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    target = Target(model, GenerationConfig(), 64, sig)
    for _ in target.prefill(prompt, None):
        pass
    tokens = list(prompt)
    root = int(target.logits[-1].argmax())
    for _ in range(3):  # a two-node chain each step, the first node accepted; the bonus token roots the next step
        tree = DraftTree(tokens=(3, 4), parents=(-1, 0), depths=(1, 2), probs=(1.0, 1.0), q=None, forwards=1)
        logits = target.verify(root, tree)
        target.commit([0])
        tokens += [root, 3]
        root = int(logits[2].argmax())
    reference = Target(model, GenerationConfig(), 64, sig)
    for _ in reference.prefill(tokens, None):
        pass
    assert target.window.positions.tolist() == list(range(len(tokens) - 6, len(tokens)))
    for layer in (0, 2):
        torch.testing.assert_close(target.window.queries[layer], reference.window.queries[layer], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(target.token_scores(), reference.token_scores(), atol=1e-5, rtol=1e-4)


def test_resolve_names_and_the_calibration_file(tmp_path):
    calibrated = RetrievalSignal("calibrated", layers=(), heads=((1, 0), (0, 1)), rows=4, reserve=0.25)
    assert resolve("paper", calibrated) == PAPER
    assert resolve("default", calibrated) == calibrated and resolve("calibrated", calibrated) == calibrated
    assert resolve("default", None) == UNCALIBRATED
    with pytest.raises(ValueError, match="calibrate"):
        resolve("calibrated", None)
    model = tiny("llama", layers=2, seed=0)
    shape = signal.target_shape(model)
    signal.save(tmp_path / signal.SIGNAL_FILE, calibrated, shape, {"needles": 3})
    assert signal.load(tmp_path, shape) == calibrated
    assert signal.load(tmp_path, {**shape, "num_hidden_layers": 3}) is None  # another target's calibration
    assert signal.load(tmp_path / "missing", shape) is None and signal.load(None, shape) is None


def test_target_without_a_signal_keeps_no_queries():
    target = Target(prepare(tiny("llama", layers=2)), GenerationConfig(), 16)
    assert target.window is None and target.capture is None


def test_layer_head_picture_is_each_heads_share_on_the_span():
    from specextend.models import make_pair
    from specextend.tools.probe import ALL_HEADS, head_map, holds, map_heads, read

    pair = make_pair(tiny("llama", layers=3, seed=5), None)
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    picture = map_heads(pair, prompt, (10, 14), {"paper's signal": PAPER})
    assert len(picture.share) == 3 and all(len(row) == 4 for row in picture.share)
    assert picture.rows == PAPER.rows and picture.signals == {"paper's signal": ((2, 0), (2, 1), (2, 2), (2, 3))}
    target = read(pair, prompt, ALL_HEADS)  # by hand: each head's last-row attention summed over the span
    scores = target.head_scores(1)
    torch.testing.assert_close(torch.tensor(picture.share).flatten(), scores[:, 10:14].sum(dim=1), atol=1e-5, rtol=1e-4)
    assert head_map(target, (0, 40), 1).allclose(torch.ones(3, 4), atol=1e-5)  # all of it on the whole prompt
    assert holds(((0, 8), (10, 20)), (12, 15)) and not holds(((0, 8), (10, 13)), (12, 15))


def test_one_prefill_scores_several_signals_as_the_engine_would():
    from specextend.models import make_pair
    from specextend.tools.probe import read, read_signals

    pair = make_pair(tiny("llama", layers=3, seed=5), None)
    prompt = torch.randint(0, VOCAB, (50,), generator=torch.Generator().manual_seed(4)).tolist()
    signals = {"paper": PAPER, "own": RetrievalSignal("own", heads=((0, 1), (2, 3), (1, 0)), rows=7, combine="max"),
               "every": UNCALIBRATED}
    _, scores = read_signals(pair, prompt, signals)
    for name, sig in signals.items():  # each as its own target would score it
        torch.testing.assert_close(scores[name], read(pair, prompt, sig).token_scores(), atol=1e-6, rtol=1e-5)


def test_calibration_picks_the_cheapest_signal_that_holds_and_needs_spread_for_straddling_needles():
    """Synthetic needles: heads 0-3 (of 8) see the needle's value chunk, the others look at random chunks; the needle
    straddles into the chunk before its value, which only spreading brings along."""
    from scripts.calibrate_signal import ROWS, choose, hold_rate

    gen = torch.Generator().manual_seed(0)
    cases = []
    for i in range(12):
        n_chunks = 60
        value = 10 + 3 * i
        chunks = {}
        for rows in ROWS:
            scores = torch.rand(8, n_chunks, generator=gen) * 0.01
            scores[:4, value] = 0.5  # the finding heads
            scores[:, value - 1] = 0.001  # the needle's first words: nobody looks there
            chunks[rows] = scores
        cases.append({"document": f"doc{i % 3}", "needle": {value - 1, value}, "chunks": chunks,
                      "share": {rows: torch.tensor([0.3] * 4 + [0.0] * 4) + 0.01 * torch.arange(8) for rows in ROWS}})
    pick = choose(cases)
    assert pick["n"] == 4 and sorted(pick["heads"]) == [0, 1, 2, 3] and pick["rows"] == ROWS[1]  # fewest heads x rows
    assert pick["spread"] > 0 and pick["key"][0] == 1.0
    no_spread = hold_rate(cases, lambda c: c["chunks"][ROWS[1]][:4].mean(dim=0))
    assert no_spread == 0.0  # without spread the first words' chunk is never kept
