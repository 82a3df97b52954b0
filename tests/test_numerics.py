"""Numerics settings (specextend/numerics.py): packed bf16 products and a bf16 KV cache keep every method's greedy
output equal to the target alone in the same numerics; fp32 comes back exactly as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import VOCAB, tiny
from specextend import events as ev
from specextend import numerics
from specextend.config import MAX_DRAFT, AttentionConfig, DraftConfig, LookupConfig, RetrievalConfig, exact_trees, preset
from specextend.engine import generate
from specextend.models import SkinnyLinear, make_pair
from specextend.target import Target

pytestmark = pytest.mark.skipif(not numerics.packs_here(), reason="this CPU runs no oneDNN bf16 products")
N_NEW = 20
RETRIEVAL = RetrievalConfig(chunk_size=16, top_k=3, retrieve_every=2, prefill_window=32)


@pytest.fixture(scope="module")
def pair():  # its own pair: the numerics switch a model in place
    return make_pair(tiny("llama", layers=3, seed=11), tiny("llama", layers=1, hidden=32, heads=2, kv_heads=1, seed=12))


def greedy(pair, prompt, method: str, setting: str, new: int = N_NEW, **kw) -> list[int]:
    config = preset(method, max_new_tokens=new, retrieval=RETRIEVAL, attention=AttentionConfig(numerics=setting, **kw))
    return list(list(generate(pair, prompt, config))[-1].token_ids)


def test_packed_linear_is_a_bf16_product_and_fp32_comes_back(pair):
    linear = pair.target.model.layers[0].mlp.up_proj
    weight = linear.weight
    x = torch.randn(5, linear.in_features)
    before = linear(x)
    numerics.apply(pair.target, "bf16")
    assert type(linear) is numerics.PackedLinear and linear.weight is weight  # parameters (and ties) untouched
    packed = linear.packed
    ref = F.linear(x.bfloat16().float(), weight.bfloat16().float())
    out = linear(x)
    assert out.dtype == torch.float32 and not torch.equal(out, before)
    assert torch.allclose(out, ref, rtol=1e-2, atol=1e-2)
    numerics.apply(pair.target, "bf16")
    assert linear.packed is packed  # packed once per model
    numerics.apply(pair.target, "fp32")
    assert type(linear) is SkinnyLinear and torch.equal(linear(x), before)


def test_fp32_gives_each_linear_the_class_it_had_before_packing():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), SkinnyLinear(8, 4))
    numerics.apply(model, "bf16")
    numerics.apply(model, "bf16-kv")  # packed twice: the class before the first packing is the one kept
    assert [type(m) for m in model] == [numerics.PackedLinear] * 2
    numerics.apply(model, "fp32")
    assert [type(m) for m in model] == [torch.nn.Linear, SkinnyLinear]
    assert not {"packed", "packed_bias", "unpacked"} & vars(model[0]).keys()


@pytest.mark.parametrize("shape", [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)])  # the bundled target's
def test_a_packed_product_gives_a_row_the_same_bits_alone_as_among_others(shape):
    """What keeps greedy output equal across methods in bf16: a verification's rows computed as the autoregressive
    step computes each alone. The 1,536-wide down-projection runs in parts (numerics.PART_WIDTH); in one product,
    1-3 rows in 2-33 got other bits (measured on the bundled target's weights). On an AMX CPU rows from 33 on got other
    bits at every shape, so taller products up to a verification's most rows run in blocks (numerics.ROW_BLOCK)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(shape[1], shape[0], bias=False)
    numerics.apply(torch.nn.Sequential(linear), "bf16")
    assert len(linear.packed) == numerics.parts(shape[1]) and (shape[1] <= numerics.PART_WIDTH) == (len(linear.packed) == 1)
    for rows in [*range(2, 18), 32, 33, 47, 64, 100, numerics.VERIFY_ROWS]:
        for _ in range(2):
            x = torch.randn(rows, shape[1]) * torch.rand(rows, shape[1]) * 3  # heavy tails: more roundings at stake
            together = linear(x)
            alone = torch.cat([linear(x[i : i + 1]) for i in range(rows)])
            assert torch.equal(together, alone), (shape, rows)


def test_kv_cache_in_bf16(pair):
    from specextend.target import Target

    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    target = Target(pair.target, preset("autoregressive", attention=AttentionConfig(numerics="bf16-kv")), 64)
    list(target.prefill(prompt, None))
    assert target.cache.groups[0].keys.dtype == torch.bfloat16 and target.cache.length == 40
    assert numerics.kv_dtype("bf16") is None and numerics.kv_dtype("fp32") is None
    numerics.apply(pair.target, "fp32")


@pytest.mark.parametrize("setting", ["bf16", "bf16-kv"])
@pytest.mark.parametrize("prompt_len", [9, 150])
def test_every_method_equals_the_target_alone_in_its_numerics(pair, setting, prompt_len):
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    alone = greedy(pair, prompt, "autoregressive", setting)
    fp32 = greedy(pair, prompt, "autoregressive", "fp32")
    assert len(alone) == N_NEW
    attention = AttentionConfig(numerics=setting, verify="auto")
    for method in ("speculative", "streaming", "specextend", "lookup"):
        config = preset(method, max_new_tokens=N_NEW, retrieval=RETRIEVAL, attention=attention)
        assert list(list(generate(pair, prompt, config))[-1].token_ids) == alone, (setting, method)
    assert greedy(pair, prompt, "autoregressive", "fp32") == fp32  # fp32 after a bf16 run: as before it


def test_verifications_taller_than_a_row_block_equal_the_target_alone_in_bf16_kv(pair):
    """Lookup branches of up to MAX_DRAFT tokens (no adaptive shortening) on a prompt that repeats itself: the target
    verifies more than ROW_BLOCK rows at once, and its output is still the target alone's."""
    pattern = torch.randint(0, VOCAB, (90,), generator=torch.Generator().manual_seed(11)).tolist()
    prompt = pattern * 3
    new = 4 * numerics.ROW_BLOCK
    alone = greedy(pair, prompt, "autoregressive", "bf16-kv", new=new)
    config = preset("lookup", max_new_tokens=new, attention=AttentionConfig(numerics="bf16-kv"),
                    lookup=LookupConfig(max_tokens=MAX_DRAFT, adaptive=False, min_ngram=1))
    trace = list(generate(pair, prompt, config))
    assert max(len(e.tokens) for e in trace if isinstance(e, ev.Drafted)) > numerics.ROW_BLOCK
    assert list(trace[-1].token_ids) == alone
    numerics.apply(pair.target, "fp32")


@pytest.mark.parametrize("setting,steps", [("bf16", "eager"), ("bf16", "auto"), ("bf16-kv", "static")])
def test_a_branching_draft_is_refused_where_its_nodes_sums_depend_on_their_slots(setting, steps):
    """Tree nodes sit in other cache slots than the tokens they commit; on the bundled target a tree left the target
    alone's greedy output in bf16 (hamlet at 2K, token 40-77) and not in fp32: such configs are refused there, chains
    kept. bf16-kv's CPU attention attends a node as it will be committed (test_cpu_kernels), but static steps do not
    go through it."""
    attention = AttentionConfig(numerics=setting, steps=steps)
    for method, changes in [("specextend", dict(draft=DraftConfig(shape="tree"))),
                            ("speculative", dict(draft=DraftConfig(shape="tree"))),
                            ("lookup", dict(lookup=LookupConfig(branches=2))),
                            ("specextend", dict(lookup=LookupConfig(enabled=True, with_draft="always")))]:
        with pytest.raises(ValueError, match=f"cannot be verified exactly in {setting} numerics with {steps} steps"):
            preset(method, attention=attention, **changes)
        assert preset(method, **changes).branching  # in fp32: allowed
        assert preset(method, attention=AttentionConfig(numerics="bf16-kv"), **changes).branching  # eager bf16-kv too
    assert not preset("specextend", attention=attention, lookup=LookupConfig(enabled=True)).branching


def test_a_tree_in_bf16_kv_is_refused_off_the_cpu():
    """On another device a bf16 cache is not attended by the CPU's kernel: the target refuses the tree there."""
    config = preset("specextend", draft=DraftConfig(shape="tree"), attention=AttentionConfig(numerics="bf16-kv"))
    assert exact_trees(config.attention) and not exact_trees(config.attention, "cuda")
    model = tiny("llama", layers=1, hidden=64, heads=2, kv_heads=1, seed=3).to("meta")
    with pytest.raises(ValueError, match="cannot be verified exactly in bf16-kv numerics on meta"):
        Target(model, config, 64)


def test_static_steps_in_bf16_kv(pair):
    prompt = torch.randint(0, VOCAB, (77,), generator=torch.Generator().manual_seed(5)).tolist()
    alone = greedy(pair, prompt, "autoregressive", "bf16-kv")
    assert greedy(pair, prompt, "specextend", "bf16-kv", steps="static") == alone
    numerics.apply(pair.target, "fp32")


def test_auto_is_the_cpu_default_for_an_fp32_model_on_a_cpu_that_packs(monkeypatch):
    fp32, bf16 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).bfloat16()
    assert numerics.choose(fp32) == numerics.choose(fp32, "auto") == numerics.CPU_DEFAULT == "bf16-kv"
    assert numerics.choose(bf16) == "fp32"  # a model loaded in bf16 runs as loaded
    assert [numerics.choose(bf16, s) for s in numerics.NUMERICS] == list(numerics.NUMERICS)  # asked: kept
    with pytest.raises(ValueError, match="auto, fp32, bf16, bf16-kv; got 'fp16'"):
        numerics.choose(fp32, "fp16")
    monkeypatch.setattr(numerics, "packs_here", lambda: False)
    assert numerics.choose(fp32) == "fp32"


def test_a_served_pair_runs_every_request_in_the_numerics_chosen_for_it(pair):
    """The app's loaded pair (backend.serve): "auto" is resolved once for the pair, the target switched to it, and
    every request on the pair runs in it whatever its config says, so two at once cannot switch the model under each
    other; the exactness check then compares like with like."""
    from types import SimpleNamespace

    from app.backend import serve
    from app.settings import PairChoice

    choice, tokenizer = PairChoice("tiny", "tiny"), SimpleNamespace(eos_token_id=0)
    loaded = serve(choice, tokenizer, pair)
    assert loaded.numerics == "bf16-kv" and loaded.dtype == "float32"
    assert type(pair.target.model.layers[0].mlp.up_proj) is numerics.PackedLinear  # switched once, when served
    prompt = torch.randint(0, VOCAB, (33,), generator=torch.Generator().manual_seed(6)).tolist()
    asked = preset("speculative", max_new_tokens=N_NEW, retrieval=RETRIEVAL)  # the engine's default: fp32
    alone = greedy(pair, prompt, "autoregressive", "bf16-kv")
    for run in (loaded.generate, loaded.for_click()):
        events = list(run(prompt, asked, None))
        assert events[0].numerics == "bf16-kv" and list(events[-1].token_ids) == alone
    assert serve(choice, tokenizer, pair, "fp32").numerics == "fp32"
    assert type(pair.target.model.layers[0].mlp.up_proj) is SkinnyLinear


def test_bad_numerics_is_refused():
    with pytest.raises(ValueError, match="numerics"):
        AttentionConfig(numerics="int3")
    with pytest.raises(ValueError, match="numerics"):
        numerics.kv_dtype("fp16")


def test_roofline_quick_measures_every_setting(tmp_path):
    """The roofline tool end to end on tiny shapes: bandwidth, kernels, each setting's forwards with bytes and FLOPs."""
    import json

    from specextend.tools import roofline

    assert roofline.main(["--quick", "--out", str(tmp_path), "--rounds", "1", "--no-figure"]) == 0
    report = json.loads((tmp_path / "roofline.json").read_text())
    assert report["bandwidth"]["copy_GBps"] > 0 and report["bandwidth"]["read_GBps"] > 0
    steps = report["steps"]
    assert {(s["numerics"], s["rows"]) for s in steps} == {(n, r) for n in numerics.NUMERICS for r in roofline.ROWS}
    by = {(s["length"], s["numerics"], s["rows"]): s for s in steps}
    assert by[(64, "bf16", 1)]["bytes"] < by[(64, "fp32", 1)]["bytes"]  # half the weight bytes
    assert by[(128, "bf16-kv", 1)]["bytes"] < by[(128, "bf16", 1)]["bytes"] < by[(128, "fp32", 1)]["bytes"]
    assert all(s["target_ms"] > 0 and s["floor_ms"] > 0 and s["flops"] > 0 for s in steps)
    assert {k["product"] for k in report["kernels"]} == {"q_proj", "up_proj"}
    assert "| 128 | bf16-kv | 33 |" in (tmp_path / "roofline.md").read_text()
