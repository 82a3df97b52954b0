"""EAGLE heads: published folder layouts load, a head that does not fit its target is refused before its weights
load, and drafting with a head is lossless (greedy equals the target's own output; sampling keeps its distribution)
for EAGLE-1 and EAGLE-3 heads, with and without a reduced vocabulary and their own embeddings, chain and tree,
under the full, StreamingLLM and CMR caches, with and without lookup."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch
from conftest import VOCAB, bigram_target, reference_greedy, tiny
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare
from transformers import LlamaConfig

from specextend.config import AttentionConfig, DraftConfig, LookupConfig, RetrievalConfig, preset
from specextend.engine import generate
from specextend.events import Drafted, Verified
from specextend.feature_drafting import FeatureDrafter
from specextend.lookup import LookupDrafter, MergedDrafter
from specextend.heads import EAGLE3_ARCHITECTURE, EagleHead, check_head, config_like, load_head, read_head
from specextend.metrics import node_depths
from specextend.models import make_pair
from specextend.retrieval import make_policy

CPU = torch.device("cpu")
REDUCED = tuple(range(0, VOCAB, 2))  # an EAGLE-3 draft vocabulary: the even ids


def head_config(target, draft_vocab: int | None = None, **changes) -> LlamaConfig:
    return config_like(target.config, draft_vocab, initializer_range=0.3, **changes)


def tiny_head(kind: str, target, reduced: bool = False, own_embedding: bool = False, seed: int = 5) -> EagleHead:
    """A random head in a published shape; a reduced EAGLE-3 head drafts only REDUCED (d2t: draft id -> offset)."""
    torch.manual_seed(seed)
    vocab = len(REDUCED) if reduced else None
    head = EagleHead(kind, head_config(target, vocab), target, vocab, own_embedding)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
        if reduced:
            ids = torch.tensor(REDUCED)
            head.d2t.copy_(ids - torch.arange(len(ids)))
            head.t2d.zero_()
            head.t2d[ids] = True
    return head.eval()


def save_published(head: EagleHead, folder, bin_file: bool = False, drop_vocab_map: bool = False):
    """`head` as its authors publish one: config.json and its weights (safetensors or pytorch_model.bin)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = head.config.to_diff_dict()
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    config["architectures"] = [EAGLE3_ARCHITECTURE] if head.kind == "eagle3" else ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in head.state_dict().items() if not (drop_vocab_map and k in ("d2t", "t2d"))}
    if bin_file:
        torch.save(state, folder / "pytorch_model.bin")
    else:
        save_file(state, str(folder / "model.safetensors"))
    return folder


def kind_config(folder):
    head = read_head(folder)
    return head.kind, head.config, "embed_tokens.weight" in head.keys


# the published layouts the tests load: (kind, reduced vocabulary, own embedding, pytorch_model.bin)
LAYOUTS = {
    "eagle1": ("eagle", False, False, False),
    "eagle1-own-embedding-bin": ("eagle", False, True, True),
    "eagle3-reduced": ("eagle3", True, False, False),
    "eagle3-full-vocab-own-embedding-bin": ("eagle3", False, True, True),
}


@pytest.fixture(scope="module")
def target():
    return tiny("llama", layers=6, seed=11)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def head_pair(request, target, tmp_path_factory):
    kind, reduced, own, bin_file = LAYOUTS[request.param]
    head = tiny_head(kind, target, reduced, own)
    folder = save_published(head, tmp_path_factory.mktemp(request.param), bin_file, drop_vocab_map=not reduced)
    return make_pair(target, load_head(folder, target, CPU, torch.float32))


def test_published_layouts_load_to_the_same_head(target, tmp_path):
    for name, (kind, reduced, own, bin_file) in LAYOUTS.items():
        head = tiny_head(kind, target, reduced, own)
        folder = save_published(head, tmp_path / name, bin_file, drop_vocab_map=not reduced)
        found = read_head(folder)
        assert found is not None and found.kind == kind
        loaded = load_head(folder, target, CPU, torch.float32)
        width = 3 * target.config.hidden_size if kind == "eagle3" else target.config.hidden_size
        ids, hidden, positions = torch.tensor([[3, 8, 1]]), torch.randn(1, 3, width), torch.arange(3)[None]
        with torch.no_grad():
            mask = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
            a = head.logits(head(ids, hidden, positions, None, True, mask=mask))
            b = loaded.logits(loaded(ids, hidden, positions, None, True, mask=mask))
        assert torch.equal(a, b), name
        if reduced:  # the head proposes only its draft vocabulary, at the target's ids
            assert torch.isinf(b[..., 1::2]).all() and torch.isfinite(b[..., ::2]).all()


def test_an_ordinary_model_folder_is_not_a_head(tmp_path):
    tiny("llama", layers=1).save_pretrained(tmp_path)
    assert read_head(tmp_path) is None


@pytest.mark.parametrize("change, reason", [
    (dict(hidden_size=32), "hidden size 32"),
    (dict(hidden_size=32, target_hidden_size=64), "ships no embedding"),
    (dict(vocab_size=VOCAB + 3), "token ids"),
    (dict(target_hidden_size=48), "hidden size 48"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "RoPE"),
])
def test_a_head_that_does_not_fit_is_refused_with_the_reason(target, tmp_path, change, reason):
    head = tiny_head("eagle3", target)
    folder = save_published(head, tmp_path / "head")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=reason):
        check_head(target.config, *kind_config(folder), folder)
    with pytest.raises(ValueError, match=reason):  # the loader refuses before reading the weights
        load_head(folder, target, CPU, torch.float32)


def test_an_eagle3_config_may_name_the_layers_it_reads(target, tmp_path):
    """Trainers that list `eagle_aux_hidden_state_layer_ids` name the layers whose OUTPUT the head reads: the streams
    entering the next layers."""
    folder = save_published(tiny_head("eagle3", target), tmp_path / "head")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}}))
    assert load_head(folder, target, CPU, torch.float32).streams == (1, 3, 5)
    (folder / "config.json").write_text(json.dumps({**config, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 9]}}))
    with pytest.raises(ValueError, match=r"layers \[0, 2, 9\]"):
        check_head(target.config, *kind_config(folder), folder)


def test_an_eagle3_head_needs_a_target_deep_enough(tmp_path):
    shallow = tiny("llama", layers=3)
    folder = save_published(tiny_head("eagle3", tiny("llama", layers=6)), tmp_path / "head")
    with pytest.raises(ValueError, match="layers 2, L//2 and L-3"):
        check_head(shallow.config, *kind_config(folder), folder)


def misfit(folder, bin_file: bool, **changed: tuple[int, ...]):
    """A published head's weights with the tensors in `changed` replaced by random ones of these shapes (its config
    left as it is, so only the weights can tell)."""
    weights = folder / ("pytorch_model.bin" if bin_file else "model.safetensors")
    state = torch.load(weights, weights_only=True) if bin_file else load_file(str(weights))
    state = {**state, **{k.replace("__", "."): torch.zeros(shape, dtype=state[k.replace("__", ".")].dtype)
                         for k, shape in changed.items()}}
    torch.save(state, weights) if bin_file else save_file(state, str(weights))
    return folder


def no_weight_loads(monkeypatch):
    """Fail the test if a head's weights are read into tensors or a module (only their shapes may be read)."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights were read before the head was refused")

    real_load = torch.load
    monkeypatch.setattr(EagleHead, "load_state_dict", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(torch, "load", lambda *a, **k: real_load(*a, **k) if k.get("map_location") == "meta" else refuse())


@pytest.mark.parametrize("kind, changed, reason", [
    ("eagle3", dict(fc__weight=(64, 3 * 96)), r"EAGLE-3 head expects a target of width 96 \(fc.weight 64x288\) but "
                                               r"this target has width 64"),
    ("eagle", dict(fc__weight=(64, 2 * 48)), r"EAGLE head expects a target of width 48 \(fc.weight 64x96\) but this "
                                              r"target has width 64"),
    ("eagle3", dict(t2d=(VOCAB + 5,)), rf"EAGLE-3 head expects a target of {VOCAB + 5} token ids "
                                       rf"\(t2d {VOCAB + 5}\) but this target has {VOCAB}"),
    ("eagle3", dict(midlayer__mlp__down_proj__weight=(64, 100)),
     r"EAGLE-3 head's weights do not fit this target \(width 64, 6 layers, 97 token ids\) and its config.json: "
     r"midlayer.mlp.down_proj.weight 64x100, where 64x128 is needed"),
])
@pytest.mark.parametrize("bin_file", [False, True], ids=["safetensors", "bin"])
def test_a_head_whose_weights_misfit_is_refused_by_their_shapes_before_they_load(target, tmp_path, monkeypatch, kind,
                                                                                 changed, reason, bin_file):
    folder = misfit(save_published(tiny_head(kind, target, reduced=kind == "eagle3"), tmp_path / "head", bin_file),
                    bin_file, **changed)
    no_weight_loads(monkeypatch)
    with pytest.raises(ValueError, match=f"^{folder}: this {reason}"):
        load_head(folder, target, CPU, torch.float32)


def test_the_cli_refuses_a_misfit_head_with_one_message_before_any_model_loads(tmp_path, monkeypatch, capsys):
    from conftest import save_tiny
    from transformers import AutoTokenizer

    from specextend import models
    from specextend.tools import bundled
    from specextend.tools.cli import main

    tokenizer = AutoTokenizer.from_pretrained(bundled.target_dir())
    target_dir = save_tiny(tmp_path / "target", tokenizer, len(tokenizer), seed=1, layers=2)
    target_config = LlamaConfig.from_pretrained(target_dir)
    with torch.device("meta"):
        built = EagleHead("eagle", config_like(target_config), SimpleNamespace(config=target_config))
    head_dir = tmp_path / "head"
    head_dir.mkdir()
    (head_dir / "config.json").write_text(json.dumps({**built.config.to_diff_dict(), "architectures": ["LlamaForCausalLM"]}))
    wide = {k: torch.zeros(v.shape) for k, v in built.state_dict().items()} | {"fc.weight": torch.zeros(32, 2 * 4096)}
    save_file(wide, str(head_dir / "model.safetensors"))
    doc = tmp_path / "doc.txt"
    doc.write_text("The river flooded the valley. " * 20)
    capsys.readouterr()  # saving the target printed its progress
    no_weight_loads(monkeypatch)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model loaded before the head's refusal"))
    assert main(["generate", "--input", str(doc), "--method", "speculative", "--target", str(target_dir),
                 "--draft", str(head_dir)]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {head_dir}: this EAGLE head expects a target of width 4096 (fc.weight 32x8192) but the "
                   f"target {target_dir} has width 32\n")


SMALL_CACHE = RetrievalConfig(chunk_size=4, top_k=4, retrieve_every=2, prefill_window=8, sink_tokens=2)
SHAPES = {"chain": DraftConfig(shape="chain", k=3),
          "tree": DraftConfig(shape="tree", max_depth=3, node_budget=8, branch=2, children=2, stop_threshold=0.0)}


@pytest.mark.parametrize("method", ["speculative", "streaming", "specextend"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("lookup", [False, True], ids=["model", "with-lookup"])
def test_greedy_with_a_head_is_the_targets_own_output(head_pair, method, shape, lookup):
    prompt = [int(t) for t in torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(3))]
    config = preset(method, max_new_tokens=24, draft=SHAPES[shape], retrieval=SMALL_CACHE,
                    lookup=LookupConfig(enabled=lookup or None, draft_gate=0.0))
    trace = list(generate(head_pair, prompt, config))
    assert list(trace[-1].token_ids) == reference_greedy(head_pair.target, prompt, 24)
    drafted = [e for e in trace if isinstance(e, Drafted)]
    assert drafted and all("draft" in e.sources or "both" in e.sources for e in drafted[:1])


@pytest.mark.parametrize("method", ["speculative", "specextend"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_heads_rounds_run_from_static_buffers_and_stay_lossless(head_pair, monkeypatch, method, shape):
    """With static steps (the code a CUDA graph captures) the head's rounds run from its runner's buffers as the
    target's do: the pending entries with the target's features, then each tree level with the head's own states
    fed back; the output is still the target's own, and no round fell back to the eager path."""
    from specextend.feature_drafting import HeadRunner

    ran, eager = [], []
    run_static, run_eager = HeadRunner._run, HeadRunner._eager
    monkeypatch.setattr(HeadRunner, "_run", lambda self, step, plan, variant: ran.append(variant)
                        or run_static(self, step, plan, variant))
    monkeypatch.setattr(HeadRunner, "_eager", lambda self, *a: eager.append(1) or run_eager(self, *a))
    prompt = [int(t) for t in torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(4))]
    config = preset(method, max_new_tokens=24, draft=SHAPES[shape], retrieval=SMALL_CACHE,
                    attention=AttentionConfig(verify="auto", steps="static"))
    trace = list(generate(head_pair, prompt, config))
    assert list(trace[-1].token_ids) == reference_greedy(head_pair.target, prompt, 24)
    drafted = [e for e in trace if isinstance(e, Drafted)]
    assert ran.count(True) == len(drafted) and not eager  # one round of pending entries per drafting step
    assert ran.count(False) == sum(e.draft_forwards - 1 for e in drafted)  # and one per fed tree level


def oracle_pair():
    """A target whose layers add nothing and whose embeddings have RMS 1 (so its final norm changes nothing): its next
    token is f(last token), and an EAGLE-1 head whose fc passes the embedding through and whose layer adds nothing
    predicts f(next token) exactly: every draft token is right, at every depth."""
    target = tiny("llama", layers=2, seed=1)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        e = target.model.embed_tokens.weight
        e.div_(e.pow(2).mean(-1, keepdim=True).sqrt())
    head = tiny_head("eagle", target)
    with torch.no_grad():
        h = target.config.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, :h] = torch.eye(h)
        head.fc.bias.zero_()
        head.layers[0].self_attn.o_proj.weight.zero_()
        head.layers[0].mlp.down_proj.weight.zero_()
    return make_pair(target, head)


@pytest.mark.parametrize("method", ["speculative", "specextend"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_right_head_is_accepted_to_full_depth(method, shape):
    pair = oracle_pair()
    prompt = [5, 17, 42, 8, 60, 33, 2, 71, 14, 9, 88, 23, 51, 40, 6, 77, 19]
    config = preset(method, max_new_tokens=32, draft=SHAPES[shape], retrieval=SMALL_CACHE)
    trace = list(generate(pair, prompt, config))
    assert list(trace[-1].token_ids) == reference_greedy(pair.target, prompt, 32)
    verified = [e for e in trace if isinstance(e, Verified)]
    assert all(e.num_accepted == 3 for e in verified[:-1])  # every step takes the whole depth-3 draft


def stream_pairs(target):
    """(pair, head, drafter's lookup share) cases: EAGLE-1 and EAGLE-3 heads on a random target (steps seldom accept
    anything: the streams chosen are what counts), and an EAGLE-1 head beside lookup on a target that repeats itself
    (steps accept copied nodes, whose rows the target hands over too)."""
    for kind in ("eagle", "eagle3"):
        head = tiny_head(kind, target, reduced=kind == "eagle3")
        yield make_pair(target, head), head, False
    repeating = bigram_target()
    head = tiny_head("eagle", repeating)
    yield make_pair(repeating, head), head, True


def test_the_head_reads_the_targets_streams_of_every_committed_token(target):
    """After a greedy run (full cache) the head's stored keys are the ones a single pass of the head over the whole
    sequence computes from the target's own hidden states: every feature row sits beside its next token."""
    for pair, head, lookup in stream_pairs(target):
        prompt = [int(t) for t in torch.randint(0, VOCAB, (21,), generator=torch.Generator().manual_seed(4))]
        config = preset("speculative", max_new_tokens=24, draft=SHAPES["tree"],
                        lookup=LookupConfig(enabled=lookup or None, draft_gate=0.0))
        drafter = FeatureDrafter(head, config, make_policy(config.draft_cache, config.retrieval), 128)
        trace = list(generate(pair, prompt, config, drafter=MergedDrafter(drafter, LookupDrafter(config.lookup),
                                                                        config.lookup) if lookup else drafter))
        out = list(trace[-1].token_ids)
        if lookup:
            assert sum(e.num_accepted for e in trace if isinstance(e, Verified)) >= 5
        seq = prompt + out
        with torch.no_grad():
            hs = pair.target(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
            feats = hs[-1] if head.kind == "eagle" else torch.cat([hs[i] for i in head.streams], dim=-1)
            n = drafter.store.length
            keys = []

            class Keys:
                def update(self, k, v, layer_idx, **kwargs):
                    keys.append(k)
                    return k, v

            mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
            head(torch.tensor([seq[1 : n + 1]]), feats[:, :n], torch.arange(n)[None], Keys(), True, mask=mask)
        assert n + len(drafter.tokens) == len(seq) - 1  # each token after the first is stored or pending
        assert n >= len(prompt) - 1 + 8
        stored = drafter.store.layers[0].filled()[0]
        assert torch.allclose(stored, keys[0], atol=1e-4), (head.kind, lookup)


V = 6


def sampling_pair(kind: str):
    torch.manual_seed(1)
    target = tiny("llama", layers=6, hidden=32, heads=2, kv_heads=1, seed=1)
    target.resize_token_embeddings(V)
    target.config.vocab_size = V
    with torch.no_grad():
        for p in target.parameters():
            p.mul_(3.0)
    head = EagleHead(kind, head_config(target, 4 if kind == "eagle3" else None, num_attention_heads=2,
                                       num_key_value_heads=1), target, 4 if kind == "eagle3" else None)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0)
        if kind == "eagle3":  # drafts only ids 0, 2, 3, 5
            ids = torch.tensor([0, 2, 3, 5])
            head.d2t.copy_(ids - torch.arange(4))
    return make_pair(target.eval(), head.eval())


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_sampling_with_a_head_tree_keeps_the_targets_distribution(kind):
    pair = sampling_pair(kind)
    prompt = [1, 4, 2, 5, 0, 3, 3, 1]
    temperature = 1.3

    def probs(ids):
        with torch.no_grad():
            return torch.softmax(pair.target(input_ids=torch.tensor([ids])).logits[0, -1] / temperature, -1)

    joint = torch.zeros(V, V)
    for t1, p1 in enumerate(probs(prompt)):
        for t2, p2 in enumerate(probs(prompt + [t1])):
            joint[t2] += p1 * p2 * probs(prompt + [t1, t2])
    joint = joint.flatten()
    draft = DraftConfig(shape="tree", max_depth=2, node_budget=6, branch=2, children=3, stop_threshold=0.0)
    runs = 1200
    counts = torch.zeros(V * V)
    for seed in range(runs):
        trace = list(generate(pair, prompt, preset("specextend", max_new_tokens=4, temperature=temperature, seed=seed,
                                                   draft=draft)))
        first = next(e for e in trace if isinstance(e, Drafted))
        assert first.step == 1 and max(node_depths(first.parents)) == 2
        out = trace[-1].token_ids
        counts[out[1] * V + out[2]] += 1
    keep = joint * runs >= 5
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    expected = torch.cat([joint[keep], joint[~keep].sum()[None]]) * runs
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3


def test_the_run_and_its_panels_name_the_head(head_pair):
    """A head is a draft like any other; where the panels name the draft they say which kind it is."""
    from visualizers.acceptance import acceptance_spec

    trace = list(generate(head_pair, list(range(3, 30)), preset("specextend", max_new_tokens=8, retrieval=SMALL_CACHE)))
    name = {"eagle": "EAGLE head", "eagle3": "EAGLE-3 head"}[head_pair.draft.kind]
    assert trace[0].draft_name == name
    headline = acceptance_spec(trace, lambda ids: " ".join(map(str, ids)))["layout"]["title"]["text"]
    assert f"the {name}'s tokens" in headline and "draft model" not in headline
    alone = list(generate(head_pair, list(range(3, 30)), preset("autoregressive", max_new_tokens=2)))
    assert alone[0].draft_name == ""


def test_a_race_shares_the_targets_prefill_with_its_streams(head_pair):
    """Methods of a race read one prompt once: a head's run after another head's run copies the prefill, streams
    included, and still gives the target's own output; a run that kept no streams is not copied for a head."""
    from specextend.events import Prefilled
    from specextend.target import SharedPrefill

    prompt = [int(t) for t in torch.randint(0, VOCAB, (41,), generator=torch.Generator().manual_seed(6))]
    shared, reference = SharedPrefill(), reference_greedy(head_pair.target, prompt, 12)
    runs = [list(generate(head_pair, prompt, preset(m, max_new_tokens=12, retrieval=SMALL_CACHE), shared=shared))
            for m in ("autoregressive", "specextend", "speculative")]
    copied = [next(e.shared for e in run if isinstance(e, Prefilled)) for run in runs]
    assert copied == [False, False, True]
    assert all(list(run[-1].token_ids) == reference for run in runs)


def test_feature_rows_queue_in_order_in_place():
    """The target's rows for a feature drafter: a prefill's rows, then each step's root and accepted rows, taken in
    order; after the first steps the buffers hold still (written in place, not reallocated per step)."""
    from specextend.target import FeatureRows

    rows = FeatureRows((0, 2), lambda streams: torch.cat([streams[0], streams[2]], dim=-1))
    hidden = lambda start, t: {i: (torch.arange(start, start + t, dtype=torch.float32)[:, None] + 0.5 * i).expand(t, 3)[None]  # noqa: E731
                               for i in (0, 2)}
    rows.push(hidden(0, 5))
    assert rows.take()[:, 0].tolist() == [0, 1, 2, 3, 4] and rows.take() is None
    pointers = set()
    for step in range(20):
        rows.push(hidden(100 * step, 4), torch.tensor([0, 2, 3]))
        rows.push(hidden(100 * step + 50, 1))
        pointers.add(rows.buffers[0].data_ptr())
        got = rows.take()
        assert got[:, 0].tolist() == [100 * step, 100 * step + 2, 100 * step + 3, 100 * step + 50]
        assert got[:, 3].tolist() == [v + 1.0 for v in got[:, 0].tolist()]  # stream 2's rows beside stream 0's
    assert len(pointers) == 1
