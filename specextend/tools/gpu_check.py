"""GPU check: `python -m specextend.tools.gpu_check [--quick] [--out DIR]`, one prepared run on one GPU (~5 minutes).

Random-init weights in the shapes of a Llama-2-7B-like target with 8 KV heads, a 68M-like draft (2 layers,
768 wide) and a 1B-like draft (16 layers, 2048 wide), bf16. Acceptance means nothing with random weights;
step costs do. Sections (each runs on its own; a failing one is reported and the rest go on):
- kernels: the CUDA attention paths (bottom-right blocked prefill, one-call, split and hybrid tree attention)
  against an fp32 reference;
- lossless: greedy output of every method, chain and tree, every tree kernel, eager and captured steps (fp32);
- steps: at each length, the autoregressive step, speculative's masked verification and SpecExtend's (eager and
  captured), the drafts' steps over the whole prefix and over a CMR working cache; each step's bandwidth floor
  (bytes of weights and KV read / measured read bandwidth); prefill time and peak memory up to the longest length;
- curve: the captured verification step against the tree's node count (what GPU tree budgets are chosen from);
- engine: the whole loop per method at one length (per-phase milliseconds per step), and its wall time per step
  against the device time of its steps (loop/device: 1.0 when the device never waits on the host);
- profile: where a step's device time goes (kernels, the costliest ones);
- fusion (GPU only): the steps with the families' own layers, FusedRMSNorm alone, and fused layers (fusion.py);
- projection, labelled so: the speedup over autoregressive those step costs would give at 2, 3 and 4 tokens per step.
`--quick` runs tiny shapes in seconds on CPU, static steps standing in for captured ones (a test runs it).
Writes gpu_check.json and gpu_check.md under --out and prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch
from transformers.models.llama import modeling_llama

from ..attention import (AttentionPlan, KeySplits, full_tree_mask, hybrid_tree_attention, math_attention,
                        onecall_tree_attention, prefill_attention, split_attention)
from .. import fusion
from ..cache import KVCache
from ..config import AttentionConfig, DraftConfig, RetrievalConfig, preset
from ..verification import tree_mask
from ..engine import generate
from ..events import Finished, Prefilled
from ..heads import EagleHead, config_like
from ..target import prefill_block
from .kernel_bench import check_lossless, llama, random_tree, timed
from ..metrics import summarize
from ..models import FusedRMSNorm, check_transformers, forward, make_pair, prepare
from ..steps import StepRunner, capacity_for, sizes_up_to

SHAPES = {  # (layers, hidden, heads, kv_heads, intermediate)
    "full": {"target": (32, 4096, 32, 8, 11008), "draft 68M": (2, 768, 12, 12, 3072), "draft 1B": (16, 2048, 32, 8, 8192)},
    "quick": {"target": (2, 128, 4, 2, 256), "draft 68M": (1, 64, 2, 2, 128), "draft 1B": (2, 64, 4, 2, 128)},
}
WORKING = 1056  # a CMR working cache: 32 chunks of 32 plus the newest tokens
NODES = 31  # the verification tree of the step table: 32 tokens with its root
CURVE = (0, 7, 15, 31, 63)  # tree nodes of the verification curve


def read_bandwidth(device: torch.device, gib: float) -> float:
    """Bytes per second a full read of a large tensor reaches (a sum over it)."""
    x = torch.ones(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device)
    ms = timed(lambda: x.sum(), device, 10, 3)
    return x.numel() * 2 / (ms / 1e3)


def weight_bytes(model) -> int:
    """Bytes of weights one forward reads: every parameter but the input embedding (only its rows are gathered)."""
    embedding = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = model.get_output_embeddings().weight is embedding
    return total if tied else total - embedding.numel() * embedding.element_size()


def kv_bytes(model, length: int) -> int:
    c = model.config
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * kv * (c.hidden_size // c.num_attention_heads) * length * model.dtype.itemsize


def prefill_to(model, cache, length: int, vocab: int) -> float:
    """Grow the cache to `length` random tokens in engine-sized blocks: seconds taken."""
    device = model.get_input_embeddings().weight.device
    start = time.perf_counter()
    plan = AttentionPlan("prefill", "fused")
    size = prefill_block(device)
    for begin in range(cache.length, length, size):
        end = min(begin + size, length)
        tokens = torch.randint(0, vocab, (end - begin,), generator=torch.Generator().manual_seed(begin)).tolist()
        forward(model, cache, tokens, torch.arange(begin, end), plan, 1)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def step_ms(runner: StepRunner, nodes: int, kernel: str, device) -> float:
    """Median ms of one forward of a root plus a `nodes`-node tree over the runner's cache (cropped back after each)."""
    base = runner.cache.length
    parents = random_tree(nodes + 1, torch.Generator().manual_seed(nodes)) if nodes else []
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    plan = AttentionPlan("tree", kernel, tree_mask=tree_mask(parents))
    positions = base + torch.tensor([0, *depths])

    def once():
        runner.forward([1] * (nodes + 1), positions, plan, nodes + 1)
        runner.cache.crop(base)

    return timed(once, device, 10, 3)


def check_kernels(device, dtype, quick: bool) -> dict:
    """Max abs error of each attention path against fp32 math (7B head shapes; small ones when quick): a later
    prefill block (bottom-right causal), and a 32-token tree by one call, by HTA and split over 16 key splits with
    whole splits unseen (as a key bucket's unused slots are)."""
    heads, kv_heads, dim, rows, keys = (8, 2, 32, 64, 512) if quick else (32, 8, 128, 512, 4096)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, heads, rows, dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(1, kv_heads, keys, dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(1, kv_heads, keys, dim, device=device, dtype=dtype, generator=gen)
    scale = dim ** -0.5
    causal = torch.ones(rows, keys, dtype=torch.bool, device=device).tril(keys - rows)
    err = lambda got, mask: (got.float() - math_attention(q[:, :, : got.shape[2]].float(), k.float(), v.float(), mask,  # noqa: E731
                                                          scale)[0]).abs().max().item()
    errors = {"prefill bottom-right": err(prefill_attention(q, k, v, None, "fused", scale), causal)}
    tq = q[:, :, :32]
    mask = tree_mask(random_tree(32, torch.Generator().manual_seed(1))).to(device)  # (32, 32)
    full = full_tree_mask(mask, keys)
    errors["tree one call"] = err(onecall_tree_attention(tq, k, v, mask, scale), full)
    errors["tree hybrid"] = err(hybrid_tree_attention(tq, k, v, mask, scale), full)
    hidden = full.clone()
    hidden[:, keys // 2 : -32] = False
    errors["tree split (16)"] = err(split_attention(tq, k, v, KeySplits.of(hidden, heads // kv_heads, 16, dtype), scale), hidden)
    return errors


def bench_steps(models: dict, device, lengths: list[int], vocab: int, fast: str, bandwidth: float) -> dict:
    """Per-step times, floors and prefill up to each length; the verification curve at the middle length."""
    target = models["target"]
    sizes = sizes_up_to(max(CURVE) + 1)
    cache_cap = capacity_for(max(lengths) + 64, sizes)
    eager = StepRunner(target, KVCache(target.config.num_hidden_layers, cache_cap), "eager", sizes)
    captured = StepRunner(target, eager.cache, fast, sizes)  # the same cache, forwards from static buffers
    rows, curve, prefill = [], {}, {}
    drafts = {name: (m, KVCache(m.config.num_hidden_layers, cache_cap)) for name, m in models.items() if name != "target"}
    weights = weight_bytes(target)
    for length in lengths:
        prefill[length] = prefill_to(target, eager.cache, length, vocab)
        row = {"tokens": length, "prefill_s": sum(prefill.values())}
        floor = (weights + kv_bytes(target, length)) / bandwidth * 1e3
        row["floor_ms"] = floor
        row["ar_eager_ms"] = step_ms(eager, 0, "hybrid", device)
        row[f"ar_{fast}_ms"] = step_ms(captured, 0, "hybrid", device)
        row["verify_masked_ms"] = step_ms(eager, NODES, "masked", device)
        row["verify_auto_eager_ms"] = step_ms(eager, NODES, "auto", device)
        row[f"verify_{fast}_ms"] = step_ms(captured, NODES, "hybrid", device)
        for name, (model, cache) in drafts.items():
            prefill_to(model, cache, length, vocab)
            runner = StepRunner(model, cache, fast, sizes)
            row[f"{name} full_{fast}_ms"] = step_ms(runner, 0, "hybrid", device)
            row[f"{name} full_floor_ms"] = (weight_bytes(model) + kv_bytes(model, length)) / bandwidth * 1e3
        if length == lengths[len(lengths) // 2]:
            curve = {n: {f"{fast}_ms": step_ms(captured, n, "hybrid", device), "masked_ms": step_ms(eager, n, "masked", device),
                         "auto_eager_ms": step_ms(eager, n, "auto", device)} for n in CURVE}
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        rows.append(row)
    working = {}
    for name, (model, _) in drafts.items():
        cache = KVCache(model.config.num_hidden_layers, capacity_for(WORKING + 64, sizes))
        prefill_to(model, cache, WORKING, vocab)
        for mode in ("eager", fast):
            working[f"{name} working_{mode}_ms"] = step_ms(StepRunner(model, cache, mode, sizes), 0, "hybrid", device)
        working[f"{name} working_floor_ms"] = (weight_bytes(model) + kv_bytes(model, WORKING)) / bandwidth * 1e3
    return {"rows": rows, "curve": curve, "working": working}


def device_us(event) -> float:
    """A profiler event's own time on the device (the CPU's, when the CPU is the device), in microseconds."""
    if event.device_type == torch.autograd.DeviceType.CPU:
        return event.self_cpu_time_total if not torch.cuda.is_available() else 0.0
    return getattr(event, "self_device_time_total", 0.0)


def profile_steps(target, device, length: int, vocab: int, fast: str, repeats: int = 5) -> dict:
    """Where a step's device time goes, per step: the total, the kernel count and the costliest kernels, for the
    autoregressive step and the 32-token verification, static (every kernel visible) and captured."""
    from torch.profiler import ProfilerActivity, profile

    sizes = (1, NODES + 1)
    cache = KVCache(target.config.num_hidden_layers, capacity_for(length + 64, sizes))
    prefill_to(target, cache, length, vocab)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    out = {}
    for mode in dict.fromkeys(("static", fast)):
        runner = StepRunner(target, cache, mode, sizes)
        for nodes in (0, NODES):
            step_ms(runner, nodes, "hybrid", device)  # warm: captures, kernel set-up
            with profile(activities=activities) as prof:
                step_ms(runner, nodes, "hybrid", device)
            events = [e for e in prof.key_averages() if device_us(e) > 0]
            calls = 13  # step_ms runs 3 warm-ups and 10 timed steps
            top = sorted(events, key=device_us, reverse=True)[:10]
            out[f"{mode} {nodes + 1} tokens"] = {
                "device_ms": sum(map(device_us, events)) / calls / 1e3,
                "kernels": sum(e.count for e in events) / calls,
                "top": [(e.key[:70], round(device_us(e) / calls / 1e3, 3), round(e.count / calls, 1)) for e in top]}
    return out


def bench_fusion(target, device, length: int, vocab: int, fast: str) -> dict:
    """The steps with the families' own layers, with FusedRMSNorm alone, and with fused layers (fusion.fuse: what
    `prepare` gives on CUDA), each in a fresh runner: the autoregressive step, the verification, and the first use
    (compiles, captures)."""
    sizes = (1, NODES + 1)
    cache = KVCache(target.config.num_hidden_layers, capacity_for(length + 64, sizes))
    prefill_to(target, cache, length, vocab)
    norms = [m for m in target.modules() if isinstance(m, FusedRMSNorm)]
    fused = fusion.unfuse(target)  # layers fused on entry, fused again on the way out
    out = {}
    try:
        for variant in ("own", "fused norms", "fused layers"):
            for m in norms:
                m.__class__ = modeling_llama.LlamaRMSNorm if variant == "own" else FusedRMSNorm  # the check's target is a Llama
            (fusion.fuse if variant == "fused layers" else fusion.unfuse)(target)
            start = time.perf_counter()
            runner = StepRunner(target, cache, fast, sizes)
            out[variant] = {"ar_ms": step_ms(runner, 0, "hybrid", device), "verify_ms": step_ms(runner, NODES, "hybrid", device),
                            "first_s": time.perf_counter() - start}
    finally:
        for m in norms:
            m.__class__ = FusedRMSNorm
        (fusion.fuse if fused else fusion.unfuse)(target)
    return out


def decode_device_ms(pair, prompt: list[int], config) -> float:
    """The device time of one request's decoding (from the first token to the last), per step: what the profiler saw
    the device run (kernels on CUDA, the ops' own time on a CPU), host gaps excluded."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if pair.device.type == "cuda" else [])
    prof, steps = profile(activities=activities), 1
    for event in generate(pair, prompt, config):
        if isinstance(event, Prefilled):
            prof.start()
        elif isinstance(event, Finished):
            if pair.device.type == "cuda":
                torch.cuda.synchronize(pair.device)
            prof.stop()
            steps = max(event.steps, 1)
    return sum(device_us(e) for e in prof.key_averages()) / steps / 1e3


def bench_engine(models: dict, device, length: int, vocab: int) -> dict:
    """The whole loop at one length, 32 new tokens, the 1B-like draft or an EAGLE-3 head in the target's shape (random:
    its acceptance means nothing, its draft cost does): per-phase ms per step, and the whole loop's wall time per step
    against the device time its steps took (`loop_over_device`: 1.0 when the device never waits on the host). Each
    method runs twice unprofiled, then once under the profiler for the device time; the first run's seconds show what
    a first request pays (captures, kernel choices)."""
    target = models["target"]
    pair = make_pair(target, models["draft 1B"])
    kind, dv = ("eagle3", 32000) if target.config.num_hidden_layers >= 6 else ("eagle", None)  # --quick: 2 layers
    head = EagleHead(kind, config_like(target.config, dv), target, dv).to(target.dtype)
    head_pair = make_pair(target, head.to(next(target.parameters()).device))
    prompt = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(7)).tolist()
    tree = DraftConfig(shape="tree", max_depth=5, node_budget=NODES, branch=4, children=4)
    configs = {"autoregressive (eager)": preset("autoregressive", attention=AttentionConfig("fused", "auto", "eager")),
               "autoregressive": preset("autoregressive"),
               "speculative": preset("speculative", draft=tree),
               "specextend (eager)": preset("specextend", draft=tree, attention=AttentionConfig("fused", "auto", "eager")),
               "specextend": preset("specextend", draft=tree, retrieval=RetrievalConfig()),
               "specextend (EAGLE head)": preset("specextend", draft=tree, retrieval=RetrievalConfig())}
    out = {}
    for name, config in configs.items():
        runs, seconds = [], []
        p, config = (head_pair if "head" in name else pair), config.replace(max_new_tokens=32)
        for _ in range(2):
            start = time.perf_counter()
            runs.append(list(generate(p, prompt, config)))
            seconds.append(time.perf_counter() - start)
        s = summarize(runs[-1])  # the first run warms up (captures, kernel choices)
        steps = max(s.steps, 1)
        first = next(e for e in runs[-1] if isinstance(e, Prefilled))
        loop_ms = 1e3 * (runs[-1][-1].t_s - first.t_s) / steps
        device_ms = decode_device_ms(p, prompt, config)
        out[name] = {"steps": s.steps, "first_run_s": seconds[0], "second_run_s": seconds[1],
                     "verify_ms": 1e3 * s.phase_seconds["verification"] / steps,
                     "draft_ms": 1e3 * s.phase_seconds["drafting"] / steps,
                     "retrieval_ms": 1e3 * s.phase_seconds["retrieval"] / steps,
                     "prefill_s": s.phase_seconds["target_prefill"] + s.phase_seconds["draft_prefill"],
                     "loop_ms": loop_ms, "device_ms": device_ms, "loop_over_device": loop_ms / max(device_ms, 1e-9)}
    return out


def project(steps: dict, fast: str, middle: int, draft_forwards: int = 5) -> dict:
    """A PROJECTION, not a measurement: speedup over the captured autoregressive step if a step committed tau tokens
    at these step costs, drafting with `draft_forwards` draft forwards over a CMR working cache."""
    row = next(r for r in steps["rows"] if r["tokens"] == middle)
    out = {}
    for name in ("draft 68M", "draft 1B"):
        step = draft_forwards * steps["working"][f"{name} working_{fast}_ms"] + row[f"verify_{fast}_ms"]
        out[name] = {tau: tau * row[f"ar_{fast}_ms"] / step for tau in (2, 3, 4)}
    return out


def criteria(report: dict, fast: str) -> dict:
    rows = report.get("steps", {}).get("rows", [])
    out = {f"ar step <= 2x floor at {r['tokens']}": r[f"ar_{fast}_ms"] <= 2 * r["floor_ms"] for r in rows}
    for r in rows:
        out[f"specextend verify <= masked at {r['tokens']}"] = r[f"verify_{fast}_ms"] <= r["verify_masked_ms"]
    middle = [r for r in rows if r["tokens"] == report.get("middle")]
    if middle:
        r = middle[0]
        out[f"{NODES + 1}-token verify <= 1.25x ar step at {r['tokens']}"] = r[f"verify_{fast}_ms"] <= 1.25 * r[f"ar_{fast}_ms"]
    if rows:
        out[f"{rows[-1]['tokens']} tokens ran"] = True
    engine = report.get("engine", {}).get("specextend")
    if engine:
        out[f"specextend whole loop <= 1.15x its device time at {report.get('middle')}"] = engine["loop_over_device"] <= 1.15
    return out


def markdown(report: dict, fast: str) -> str:
    lines = [f"# GPU check: {report['device']}, {report['dtype']}, torch {report['torch']}", ""]
    errors = json.dumps(report.get("errors", {}))
    lines += [f"Read bandwidth measured: {report.get('bandwidth_gbs', 0):.0f} GB/s. Errors: {errors}", ""]
    if "kernels" in report:
        lines += ["## Kernels, max abs error against fp32", ""] + [f"- {k}: {v:.2e}" for k, v in report["kernels"].items()] + [""]
    if "lossless" in report:
        bad = [k for k, ok in report["lossless"].items() if not ok]
        lines += [f"## Lossless (fp32): {len(report['lossless']) - len(bad)} of {len(report['lossless'])} equal", ""]
        lines += [f"- differs: {k}" for k in bad] + [""]
    steps = report.get("steps")
    if steps:
        lines += ["## Step times (ms, median)", "",
                  f"| tokens | prefill s | floor | AR eager | AR {fast} | AR/floor | verify masked | verify auto eager | "
                  f"verify {fast} | 1B full | 68M full | peak GiB |", "|" + "---|" * 12]
        for r in steps["rows"]:
            lines.append(f"| {r['tokens']} | {r['prefill_s']:.2f} | {r['floor_ms']:.2f} | {r['ar_eager_ms']:.2f} | "
                         f"{r[f'ar_{fast}_ms']:.2f} | {r[f'ar_{fast}_ms'] / r['floor_ms']:.2f} | {r['verify_masked_ms']:.2f} | "
                         f"{r['verify_auto_eager_ms']:.2f} | {r[f'verify_{fast}_ms']:.2f} | "
                         f"{r[f'draft 1B full_{fast}_ms']:.2f} | "
                         f"{r[f'draft 68M full_{fast}_ms']:.2f} | {r.get('peak_gib', 0):.1f} |")
        lines += ["", f"Verification over {NODES + 1} tokens (a root and a {NODES}-node tree). Draft steps over a "
                  f"{WORKING}-token working cache: " + ", ".join(f"{k} {v:.2f}" for k, v in steps["working"].items()), ""]
        lines += [f"## Verification against tree size at {report.get('middle')} tokens (ms)", "",
                  f"| nodes | {fast} | masked (eager) | auto (eager) |", "|---|---|---|---|"]
        for n, c in steps["curve"].items():
            lines.append(f"| {n} | {c[f'{fast}_ms']:.2f} | {c['masked_ms']:.2f} | {c['auto_eager_ms']:.2f} |")
        lines.append("")
    if "engine" in report:
        lines += [f"## The whole loop at {report.get('middle')} tokens, 32 new tokens (ms per step)", "",
                  "| method | steps | verify | draft | retrieval | whole loop | its device time | loop/device | prefill s | "
                  "first run s | second run s |", "|" + "---|" * 11]
        for name, e in report["engine"].items():
            lines.append(f"| {name} | {e['steps']} | {e['verify_ms']:.2f} | {e['draft_ms']:.2f} | {e['retrieval_ms']:.2f} | "
                         f"{e['loop_ms']:.2f} | {e['device_ms']:.2f} | {e['loop_over_device']:.2f} | "
                         f"{e['prefill_s']:.2f} | {e['first_run_s']:.2f} | {e['second_run_s']:.2f} |")
        lines += ["", "Whole loop: wall time per step from the first token to the last. Its device time: what the device "
                  "ran in that span (profiled in a third run), per step. loop/device 1.0: the device never waited.", ""]
    if "profile" in report:
        lines += [f"## Where a step's device time goes, at {report.get('middle')} tokens (per step)", ""]
        for name, p in report["profile"].items():
            lines.append(f"- {name}: {p['device_ms']:.2f} ms on the device in {p['kernels']:.0f} kernels; costliest: "
                         + "; ".join(f"{k} {ms:.3f} ms x{n}" for k, ms, n in p["top"][:6]))
        lines.append("")
    if "fusion" in report:
        lines += ["## The families' own layers, FusedRMSNorm alone, and fused layers (ms)", ""] + [
            f"- {k}: AR {v['ar_ms']:.2f}, {NODES + 1}-token verify {v['verify_ms']:.2f}, first use {v['first_s']:.1f} s"
            for k, v in report["fusion"].items()] + [""]
    if "projection" in report:
        lines += ["## PROJECTION (not measured): speedup over autoregressive at tau tokens per step", "",
                  "Five draft forwards over the working cache plus one captured verification, against the captured "
                  "autoregressive step, at the middle length.", ""]
        for name, p in report["projection"].items():
            lines.append(f"- {name}: " + ", ".join(f"tau={t}: {x:.2f}x" for t, x in p.items()))
        lines.append("")
    if "criteria" in report:
        lines += ["## Criteria", ""] + [f"- {'PASS' if ok else 'FAIL'}: {k}" for k, ok in report["criteria"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m specextend.tools.gpu_check", description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny shapes on any device, in seconds")
    p.add_argument("--out", default="results/gpu_check")
    p.add_argument("--lengths", default=None, help="comma list (default 4096,16384,32768; quick 64,256,512)")
    p.add_argument("--skip", default="", help="comma list of sections: kernels,lossless,steps,engine")
    args = p.parse_args(argv)
    check_transformers()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = args.quick or device.type != "cuda"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fast = "captured" if device.type == "cuda" else "static"
    lengths = [int(x) for x in (args.lengths or ("64,256,512" if quick else "4096,16384,32768")).split(",")]
    vocab = 1000 if quick else 32000
    skip = set(filter(None, args.skip.split(",")))
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "dtype": str(dtype),
              "torch": torch.__version__, "quick": quick, "lengths": lengths, "middle": lengths[len(lengths) // 2],
              "errors": {}}
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> str:  # after every section, so a run cut short keeps what it measured
        report["criteria"] = criteria(report, fast)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
        text = markdown(report, fast)
        (out / "gpu_check.md").write_text(text)
        return text

    def section(name, fn):
        if name in skip:
            return
        start = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as error:  # noqa: BLE001  (a failed section is reported; the others still run)
            report["errors"][name] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=6)}"
        report.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 1)
        save()

    report["bandwidth_gbs"] = read_bandwidth(device, 0.0625 if quick else 2.0) / 1e9
    section("kernels", lambda: check_kernels(device, dtype, quick))
    section("lossless", lambda: check_lossless(device, 150 if quick else 3000, 8 if quick else 32, ("eager", fast)))
    models = {name: prepare(llama(shape, vocab, dtype, device, seed, max_positions=max(lengths) + 4096))
              for seed, (name, shape) in enumerate(SHAPES["quick" if quick else "full"].items(), start=1)}
    section("steps", lambda: bench_steps(models, device, lengths, vocab, fast, report["bandwidth_gbs"] * 1e9))
    if "steps" in report:
        report["projection"] = project(report["steps"], fast, report["middle"])
    section("engine", lambda: bench_engine(models, device, report["middle"], vocab))
    section("profile", lambda: profile_steps(models["target"], device, report["middle"], vocab, fast))
    if not quick:  # an experiment for GPUs (compiling on a CPU takes longer than the whole quick run)
        section("fusion", lambda: bench_fusion(models["target"], device, report["middle"], vocab, fast))
    print(save())
    return 0 if not report["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
