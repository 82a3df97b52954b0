"""Kernel and device benchmark: `python -m specextend.tools.kernel_bench [--shape 7b] [--device cuda]`.

Times Hybrid Tree Attention against masked tree attention (transformers' SDPA path with a full boolean
mask and repeated KV heads) and fused against eager prefill at long contexts, checks both against an fp32
reference, checks lossless greedy output of every method on random-init models on the chosen device
(fp32), and times the engine's phases on a realistically shaped target/draft pair. Prints a table and,
as its last line, one JSON object. Random-init weights: acceptance is meaningless here, kernels are not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from dataclasses import replace

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..attention import full_tree_mask, hybrid_tree_attention, math_attention, prefill_attention
from ..config import AttentionConfig, DraftConfig, LookupConfig, RetrievalConfig, RetrievalSignal, preset
from ..verification import tree_mask
from ..engine import generate
from ..methods import METHOD_TABLE
from ..metrics import summarize
from ..models import make_pair
from ..signal import PAPER, UNCALIBRATED

SHAPES = {  # target, draft: (layers, hidden, heads, kv_heads, intermediate)
    "7b": ((32, 4096, 32, 8, 14336), (16, 2048, 32, 8, 8192)),
    "tiny": ((2, 128, 4, 2, 256), (1, 64, 2, 1, 128)),
}


def timed(fn, device: torch.device, repeat: int = 10, warmup: int = 2) -> float:
    """Median milliseconds of fn()."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


class _Module:  # what sdpa_attention_forward reads from an attention module
    def __init__(self, groups: int) -> None:
        self.num_key_value_groups, self.is_causal = groups, True


def random_tree(n: int, generator: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(-1, i, (1,), generator=generator)) for i in range(1, n - 1)]


def bench_tree_attention(device, dtype, heads, kv_heads, dim, lengths, sizes) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for key_len in lengths:
        k = torch.randn(1, kv_heads, key_len, dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        for q_len in sizes:
            q = torch.randn(1, heads, q_len, dim, device=device, dtype=dtype)
            mask = tree_mask(random_tree(q_len, gen)).to(device)
            scale = dim ** -0.5
            full = full_tree_mask(mask, key_len)[None, None]
            module = _Module(heads // kv_heads)
            ref = math_attention(q.float(), k.float(), v.float(), full[0, 0], scale)[0]
            hybrid = hybrid_tree_attention(q, k, v, mask, scale)
            masked = sdpa_attention_forward(module, q, k, v, full, scaling=scale)[0].transpose(1, 2)
            rows.append({
                "key_len": key_len, "tree_tokens": q_len,
                "hybrid_ms": timed(lambda: hybrid_tree_attention(q, k, v, mask, scale), device),
                "masked_ms": timed(lambda: sdpa_attention_forward(module, q, k, v, full, scaling=scale), device),
                "hybrid_err": float((hybrid.float() - ref).abs().max()),
                "masked_err": float((masked.float() - ref).abs().max()),
            })
    return rows


def bench_prefill(device, dtype, heads, kv_heads, dim, lengths, eager_max: int) -> list[dict]:
    rows = []
    for length in lengths:
        q = torch.randn(1, heads, length, dim, device=device, dtype=dtype)
        k = torch.randn(1, kv_heads, length, dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        row = {"tokens": length, "fused_ms": timed(lambda: prefill_attention(q, k, v, None, "fused", dim ** -0.5), device, 5)}
        if length <= eager_max:
            row["eager_ms"] = timed(lambda: prefill_attention(q, k, v, None, "eager", dim ** -0.5), device, 3, 1)
            fused = prefill_attention(q, k, v, None, "fused", dim ** -0.5).float()
            eager = prefill_attention(q, k, v, None, "eager", dim ** -0.5).float()
            row["max_diff"] = float((fused - eager).abs().max())
        rows.append(row)
    return rows


def llama(shape, vocab: int, dtype, device, seed: int, max_positions: int = 32768):
    layers, hidden, heads, kv_heads, inter = shape
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                         initializer_range=0.02 if hidden > 512 else 0.3)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


@contextlib.contextmanager
def exact_matmuls():
    """fp32 matrix products without TF32 inside the block; the previous settings come back after it."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def heads_signal(shape, n: int = 8, rows: int = 32) -> RetrievalSignal:
    """A calibrated-shaped signal for a random-init target: n heads spread over the middle layers, `rows` rows."""
    layers, heads = shape[0], shape[2]
    picks = tuple((layers // 4 + (i * layers // 2) // n, (3 * i) % heads) for i in range(n))
    return RetrievalSignal(f"{n} heads", layers=(), heads=picks, rows=rows, reserve=0.25)


def check_lossless(device, prompt_len: int, new_tokens: int, steps: tuple[str, ...] = ("eager",)) -> dict:
    """Greedy output of every method (lookup drafting alone and added to SpecExtend too), every tree kernel, and
    each of `steps`, equals the autoregressive target's (eager), fp32 on the device."""
    pair = make_pair(llama((4, 256, 8, 2, 512), 1000, torch.float32, device, 1),
                     llama((1, 128, 4, 1, 256), 1000, torch.float32, device, 2))
    prompt = torch.randint(0, 1000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    retrieval = RetrievalConfig(chunk_size=32, top_k=8, retrieve_every=2, prefill_window=128)
    configs = {}
    for step_mode in steps:
        configs[f"autoregressive/{step_mode}"] = preset("autoregressive", max_new_tokens=new_tokens,
                                                        attention=AttentionConfig("fused", "auto", step_mode))
        for method in (m.name for m in METHOD_TABLE if m.draft_model):
            for shape in ("chain", "tree"):
                for verify in ("hybrid", "onecall", "masked", "auto"):
                    config = preset(method, max_new_tokens=new_tokens, draft=DraftConfig(shape=shape), retrieval=retrieval)
                    configs[f"{method}/{shape}/{verify}/{step_mode}"] = config.replace(
                        attention=AttentionConfig("fused", verify, step_mode))
        for signal in (PAPER, UNCALIBRATED, heads_signal((4, 256, 8, 2, 512))):
            configs[f"specextend/signal {signal.name}/{step_mode}"] = preset(
                "specextend", max_new_tokens=new_tokens, retrieval=replace(retrieval, signal=signal),
                attention=AttentionConfig("fused", "auto", step_mode))
        configs[f"lookup/{step_mode}"] = preset("lookup", max_new_tokens=new_tokens,
                                                attention=AttentionConfig("fused", "auto", step_mode))
        configs[f"specextend+lookup/{step_mode}"] = preset(
            "specextend", max_new_tokens=new_tokens, retrieval=retrieval, lookup=LookupConfig(enabled=True),
            attention=AttentionConfig("fused", "auto", step_mode))
    eager = AttentionConfig("fused", "hybrid", "eager")
    with exact_matmuls():
        alone = preset("autoregressive", max_new_tokens=new_tokens, attention=eager)
        ref = list(list(generate(pair, prompt, alone))[-1].token_ids)
        return {name: list(list(generate(pair, prompt, config))[-1].token_ids) == ref for name, config in configs.items()}


def bench_engine(device, dtype, shapes, prompt_len: int, new_tokens: int, repeats: int = 3) -> list[dict]:
    target_shape, draft_shape = shapes
    pair = make_pair(llama(target_shape, 32000, dtype, device, 1), llama(draft_shape, 32000, dtype, device, 2))
    prompt = torch.randint(0, 32000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    speculative = preset("speculative")
    configs = [("autoregressive", preset("autoregressive")), ("speculative", speculative),
               ("speculative, eager prefill", speculative.replace(attention=AttentionConfig("eager", "masked"))),
               ("speculative, HTA", speculative.replace(attention=AttentionConfig("fused", "hybrid")))]
    for signal in (PAPER, heads_signal(target_shape), UNCALIBRATED):
        heads = len(signal.pairs(target_shape[0], target_shape[2]))
        configs.append((f"specextend, {signal.name} ({heads} heads x {signal.rows} rows)",
                        preset("specextend", retrieval=RetrievalConfig(signal=signal))))
    tree = DraftConfig(shape="tree", max_depth=5, node_budget=32, branch=4, children=4)
    results: dict[str, list] = {name: [] for name, _ in configs}
    for _ in range(repeats):  # methods alternate on the same input; the median of the repeats is kept
        for name, config in configs:
            results[name].append(summarize(list(generate(pair, prompt, config.replace(max_new_tokens=new_tokens, draft=tree)))))
    rows = []
    for name, runs in results.items():
        med = lambda f: statistics.median(f(s) for s in runs[1:] or runs)  # noqa: E731  (the first run warms up)
        rows.append({"method": name, "prefill_s": med(lambda s: s.phase_seconds["target_prefill"]),
                     "draft_prefill_s": med(lambda s: s.phase_seconds["draft_prefill"]),
                     "verify_ms_per_step": med(lambda s: 1e3 * s.phase_seconds["verification"] / max(s.steps, 1)),
                     "draft_ms_per_step": med(lambda s: 1e3 * s.phase_seconds["drafting"] / max(s.steps, 1)),
                     "retrieval_ms_total": med(lambda s: 1e3 * s.phase_seconds["retrieval"]),
                     "retrieval_ms_each": med(lambda s: 1e3 * s.phase_seconds["retrieval"] / max(s.retrievals, 1)),
                     "cmr_share": med(lambda s: s.cmr_overhead_share), "steps": runs[-1].steps})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m specextend.tools.kernel_bench", description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--shape", choices=sorted(SHAPES), default="7b" if torch.cuda.is_available() else "tiny")
    p.add_argument("--lengths", default="4096,8192,16384")
    p.add_argument("--tree-sizes", default="8,32,64")
    p.add_argument("--engine-prompt", type=int, default=8192)
    p.add_argument("--skip", default="", help="comma list of sections to skip: tree,prefill,lossless,engine")
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    skip = set(filter(None, args.skip.split(",")))
    target_shape = SHAPES[args.shape][0]
    heads, kv_heads, dim = target_shape[2], target_shape[3], target_shape[1] // target_shape[2]
    lengths = [int(x) for x in args.lengths.split(",")]
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": args.dtype, "shape": args.shape, "torch": torch.__version__}
    if "tree" not in skip:
        report["tree_attention"] = bench_tree_attention(device, dtype, heads, kv_heads, dim, lengths,
                                                        [int(x) for x in args.tree_sizes.split(",")])
        for r in report["tree_attention"]:
            print(f"tree  Tk={r['key_len']:6d} Tq={r['tree_tokens']:3d}  hybrid {r['hybrid_ms']:8.3f} ms  masked "
                  f"{r['masked_ms']:8.3f} ms  speedup {r['masked_ms'] / r['hybrid_ms']:5.2f}x  "
                  f"err {r['hybrid_err']:.1e}/{r['masked_err']:.1e}")
    if "prefill" not in skip:
        report["prefill"] = bench_prefill(device, dtype, heads, kv_heads, dim, lengths, eager_max=8192)
        for r in report["prefill"]:
            print(f"prefill T={r['tokens']:6d}  fused {r['fused_ms']:9.2f} ms  eager {r.get('eager_ms', float('nan')):9.2f} ms")
    if "lossless" not in skip:
        report["lossless"] = check_lossless(device, 3000, 32)
        print("lossless (fp32):", "all equal" if all(report["lossless"].values()) else report["lossless"])
    if "engine" not in skip:
        report["engine"] = bench_engine(device, dtype, SHAPES[args.shape], args.engine_prompt, 32)
        for r in report["engine"]:
            print(f"engine {r['method']:44s} prefill {r['prefill_s']:7.3f} s  verify {r['verify_ms_per_step']:8.2f} ms/step  "
                  f"draft {r['draft_ms_per_step']:8.2f} ms/step  retrieval {r['retrieval_ms_total']:7.2f} ms "
                  f"({r['retrieval_ms_each']:6.2f} each, {r['cmr_share']:.1%} of decode)")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
