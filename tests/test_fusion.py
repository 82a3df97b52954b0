"""Fused decoder layers (specextend/fusion.py) on tiny random-init models (fp32): the same logits as the families' own
layers, the target's own greedy output through the engine, and one compiled graph per row kind serving every layer.
The CPU has no Triton, so these compile with "aot_eager" (the graph dynamo traces, run op by op: exact) and, once,
with Inductor's C++ code."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from conftest import VOCAB, reference_greedy, tiny
from specextend import fusion
from specextend.config import AttentionConfig, DraftConfig, preset
from specextend.engine import generate
from specextend.models import make_pair, prepare

CPU_BACKEND = "aot_eager"
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


@pytest.fixture(autouse=True)
def fresh_compiles():
    """Each test counts its own compiles: forget every compiled graph before and after."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_layers_give_the_families_logits_from_one_graph_per_row_kind(family):
    own = prepare(tiny(family, layers=3, seed=1))
    fused = copy.deepcopy(own)
    assert fusion.fuse(fused, CPU_BACKEND) == 3
    with torch.no_grad():
        for length in (1, 32):
            assert torch.equal(fused(input_ids=ids(length)).logits, own(input_ids=ids(length)).logits)
        # two functions, each compiled for one row and for a dynamic number of rows: 4 graphs, whatever the layers
        assert graphs() == 4
        for length in (2, 16, 31, fusion.FUSED_ROWS):
            assert torch.equal(fused(input_ids=ids(length, length)).logits, own(input_ids=ids(length, length)).logits)
        assert graphs() == 4
        long = ids(fusion.FUSED_ROWS + 1)  # prefill-sized: the family's own forward
        assert torch.equal(fused(input_ids=long).logits, own(input_ids=long).logits)
    assert graphs() == 4
    assert counters["graph_break"] == {}


def test_decode_time_forwards_never_take_the_familys_forward_and_hooks_still_fire(monkeypatch):
    model = prepare(tiny("llama", layers=2, seed=1))
    fusion.fuse(model, CPU_BACKEND)
    family = LlamaDecoderLayer.forward
    rows, hooked = [], []
    monkeypatch.setattr(LlamaDecoderLayer, "forward", lambda self, h, **kw: rows.append(h.shape[1]) or family(self, h, **kw))
    model.model.layers[1].register_forward_hook(lambda module, args, out: hooked.append(out.shape[1]))  # target.py's kind
    with torch.no_grad():
        for length in (1, 32, fusion.FUSED_ROWS + 1):
            model(input_ids=ids(length))
        with torch.enable_grad():  # a forward that may record gradients
            model(input_ids=ids(2))
    assert rows == [fusion.FUSED_ROWS + 1] * 2 + [2] * 2
    assert hooked == [1, 32, fusion.FUSED_ROWS + 1, 2]


@pytest.mark.parametrize("family", ("llama", "qwen3"))
def test_greedy_output_through_the_engine_is_the_targets_own(family):
    target, draft = tiny(family, layers=2, seed=5), tiny(family, layers=1, hidden=32, heads=2, kv_heads=1, seed=6)
    prompt = ids(150, 10)[0].tolist()
    want = reference_greedy(target, prompt, 24)
    pair = make_pair(target, draft)
    assert fusion.fuse(pair.target, CPU_BACKEND) == 2 and fusion.fuse(pair.draft, CPU_BACKEND) == 1
    for method in ("autoregressive", "specextend"):
        for shape in ("chain", "tree"):
            config = preset(method, max_new_tokens=24, draft=DraftConfig(shape=shape),
                            attention=AttentionConfig(steps="static"))
            assert list(list(generate(pair, prompt, config))[-1].token_ids) == want, (method, shape)
    # per model (target, draft): each function compiled for one row and for the padded sizes; no layer adds any
    assert graphs() == 8


def test_many_model_shapes_keep_their_graphs():
    """Past torch's default of 8 graphs per function (a process may hold several targets and drafts). Traced only
    ("eager" backend): what is counted is dynamo's graphs, not their code."""
    models = [prepare(tiny("llama", layers=1, hidden=16 * (i + 1), heads=2, kv_heads=1, seed=i)) for i in range(9)]
    with torch.no_grad():
        for model in models:
            want = model(input_ids=ids(1)).logits
            fusion.fuse(model, "eager")
            assert torch.equal(model(input_ids=ids(1)).logits, want)
    assert graphs() == 2 * len(models)


def test_inductor_code_rounds_half_precision_as_the_family_does():
    """Generated code for a dynamic number of rows (the verification's graph), in bf16: with the casts emulated the
    logits are the family's to the bit here (with fused intermediates kept in fp32 they differed by up to 0.28 and
    changed 1 argmax in 32). A first run on a machine spends ~35 s of the two cores setting up the C++ compiler; later
    runs read the compiled code from Inductor's cache."""
    own = prepare(tiny("qwen3", layers=2, seed=2).to(torch.bfloat16))
    fused = copy.deepcopy(own)
    fusion.fuse(fused)
    with torch.no_grad():
        assert torch.equal(fused(input_ids=ids(32)).logits, own(input_ids=ids(32)).logits)
    assert graphs() == 2


def test_only_the_supported_families_fuse_and_unfuse_restores_them():
    model = prepare(tiny("llama", layers=2, seed=1))
    assert not any(isinstance(m, fusion.FusedLayer) for m in model.modules())  # prepare leaves the CPU unfused
    assert fusion.fuse(model, CPU_BACKEND) == 2
    assert all(isinstance(layer, LlamaDecoderLayer) for layer in model.model.layers)
    assert fusion.fuse(model) == 2 and model.model.layers[0].fusion_backend == fusion.BACKEND
    assert fusion.unfuse(model) == 2
    assert all(type(layer) is LlamaDecoderLayer for layer in model.model.layers)
    gelu = tiny("llama", layers=1, seed=1)
    for layer in gelu.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    assert fusion.fuse(gelu, CPU_BACKEND) == 0
