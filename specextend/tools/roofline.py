"""The CPU step against its roofline: `python -m specextend.tools.roofline [--quick] [--out DIR]`.

Measures, in one process: the memory bandwidth the machine's threads reach (a large tensor copy and a large read);
the target's linear products at their real shapes for 1-32 rows in each kernel the numerics could use (fp32, stock
bf16, oneDNN's packed bf16, `_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`), and whether the packed kernel gives
a row the same bits alone as among others; then, for the bundled target (and its EAGLE-3 head) at each input length
and numerics setting (numerics.py), one decode-time forward of 1 row (the autoregressive step), 5 rows (a 4-token
chain and its root) and 17 / 33 rows (16- / 32-token trees), against the bytes it must read and the FLOPs it does.
Timings alternate over settings and row counts in rounds; medians (and minima) are kept. The KV cache holds random
keys and values of the real shapes (attention costs the same whatever they hold). Writes roofline.json, roofline.md
(the tables) and roofline.png (plotly through kaleido, when a browser is at hand); prints the tables.
`--quick`: tiny random-init models and shapes, seconds (the test's path).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import numerics
from ..attention import AttentionPlan
from ..cache import KVCache
from ..feature_drafting import head_forward
from ..models import forward, prepare
from ..verification import tree_mask
from .kernel_bench import llama, random_tree

ROWS = (1, 5, 17, 33)  # the autoregressive step; a 4-token chain; 16- and 32-token trees (each with its root)
LENGTHS = (1024, 4096, 7680)
HEAD_KEYS = 1024  # the head attends over SpecExtend's working cache (32 chunks of 32), whatever the input's length
KERNEL_ROWS = (1, 4, 16, 32)


def median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def clock(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bandwidth(megabytes: int, rounds: int) -> dict:
    """GB/s of a copy (bytes read + written) and of a read (a sum) over `megabytes`-sized fp32 tensors."""
    n = megabytes * 2**20 // 4
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)  # touch the pages first
    copy, read = [], []
    for _ in range(rounds):
        copy.append(clock(lambda: dst.copy_(src)))
        read.append(clock(lambda: src.sum()))
    size = n * 4 / 1e9
    return {"megabytes": megabytes, "copy_GBps": 2 * size / statistics.median(copy), "read_GBps": size / statistics.median(read),
            "copy_best_GBps": 2 * size / min(copy), "read_best_GBps": size / min(read)}


def kernels(shape: tuple[int, int], rows: int) -> dict:
    """The ways one product of `rows` rows over an (out, in) weight can run: name -> a call."""
    out_features, in_features = shape
    torch.manual_seed(0)
    w = torch.randn(out_features, in_features) * 0.02
    x = torch.randn(rows, in_features)
    wb, xb = w.bfloat16(), x.bfloat16()
    packed = numerics.pack(w)
    scale = w.abs().amax(1) / 127
    w8 = torch.round(w / scale[:, None]).to(torch.int8)
    group = 32  # 4-bit blocks of 32 with a scale and a minimum, as the GGUF's Q4_1 holds them
    blocks = w.view(out_features, in_features // group, group)
    low, step = blocks.amin(-1), (blocks.amax(-1) - blocks.amin(-1)) / 15
    q = torch.round((blocks - low[..., None]) / step[..., None]).clamp(0, 15).to(torch.int32).view(out_features, -1)
    w4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales = torch.stack([step, low + 8 * step], -1).transpose(0, 1).contiguous().bfloat16()  # (in/32, out, 2)
    return {
        "fp32": lambda: F.linear(x, w),
        "bf16 stock": lambda: F.linear(xb, wb),
        "bf16 packed": lambda: torch.ops.mkldnn._linear_pointwise(xb, packed, None, "none", [], ""),
        "int8 (bf16 rows)": lambda: torch._weight_int8pack_mm(xb, w8, scale.bfloat16()),
        "int4 g32 (bf16 rows)": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w4, group, scales),
    }


def same_bits(shape: tuple[int, int], rows: int) -> bool:
    """Whether the packed bf16 product gives each of `rows` rows the same bits as that row alone."""
    torch.manual_seed(1)
    packed = numerics.pack(torch.randn(*shape) * 0.02)
    x = torch.randn(rows, shape[1]).bfloat16()
    run = lambda a: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")  # noqa: E731
    return bool(torch.equal(run(x), torch.cat([run(x[i : i + 1]) for i in range(rows)])))


def bench_kernels(shapes: dict[str, tuple[int, int]], rows: tuple[int, ...], rounds: int) -> list[dict]:
    out = []
    for name, shape in shapes.items():
        print(f"kernels: {name} {shape} ...", file=sys.stderr, flush=True)
        for m in rows:
            calls = kernels(shape, m)
            samples: dict[str, list[float]] = {k: [] for k in calls}
            for fn in calls.values():
                fn()
            for _ in range(rounds):  # the kernels alternate
                for k, fn in calls.items():
                    samples[k].append(clock(fn))
            out.append({"product": name, "shape": list(shape), "rows": m, "same_bits": same_bits(shape, m),
                        **{f"{k} ms": median_ms(v) for k, v in samples.items()},
                        **{f"{k} best ms": 1e3 * min(v) for k, v in samples.items()}})
    return out


def linear_shapes(model) -> dict[str, tuple[int, int]]:
    """The target's distinct linear shapes, named by their first module."""
    shapes: dict[tuple[int, int], str] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            shapes.setdefault((module.out_features, module.in_features), name.split(".")[-1])
    return {name: shape for shape, name in shapes.items()}


def step_cost(model, setting: str, length: int, rows: int) -> tuple[float, float]:
    """(bytes read, FLOPs) of one forward of `rows` rows over `length` cached tokens in `setting`: every Linear's
    weight once (the output layer for the kept rows too), the KV cache once (heads folded onto their KV head), the
    new rows' activations neglected."""
    weight_bytes = 2 if setting != "fp32" else 4
    kv_bytes = 2 if setting == "bf16-kv" else 4
    c = model.config
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    layers = c.num_hidden_layers
    kv = 2 * layers * kv_heads * dim * length
    attention = 4 * rows * layers * c.num_attention_heads * dim * (length + rows)
    return linear * weight_bytes + kv * kv_bytes, 2 * rows * linear + attention


def filled_cache(layers: int, kv_heads: int, dim: int, length: int, room: int, dtype: torch.dtype) -> KVCache:
    torch.manual_seed(2)
    cache = KVCache(layers, length + room)
    keys = torch.randn(layers, 1, kv_heads, length, dim)
    cache.replace([(keys, torch.randn_like(keys))], torch.arange(length), dtype)
    return cache


def plan_for(rows: int) -> AttentionPlan:
    """A verification forward's plan: one token, a chain (rows - 1 tokens after the root) or a random tree."""
    if rows == 1:
        return AttentionPlan("tree", "hybrid", tree_mask=torch.ones(1, 1, dtype=torch.bool))
    parents = list(range(-1, rows - 2)) if rows <= 5 else random_tree(rows, torch.Generator().manual_seed(rows))
    return AttentionPlan("tree", "hybrid", tree_mask=tree_mask(parents))


def bench_steps(model, head, settings: tuple[str, ...], lengths: tuple[int, ...], rows: tuple[int, ...],
                rounds: int) -> list[dict]:
    """Median ms of the target's decode-time forwards (and the head's rounds) per length, setting and rows."""
    c = model.config
    dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    plans = {r: plan_for(r) for r in rows}
    out = []
    for length in lengths:
        print(f"steps over {length} tokens ...", file=sys.stderr, flush=True)
        caches = {s: filled_cache(c.num_hidden_layers, kv_heads, dim, length, max(rows), numerics.kv_dtype(s) or torch.float32)
                  for s in settings}
        head_keys = min(length, HEAD_KEYS)
        head_caches = {} if head is None else {
            s: filled_cache(1, head.config.num_key_value_heads, dim, head_keys, max(rows),
                            numerics.kv_dtype(s) or torch.float32) for s in settings}
        samples = {(s, r, who): [] for s in settings for r in rows for who in ("target", "head")}
        for i in range(rounds + 1):  # the first round warms up (oneDNN builds its kernels, "auto" paths time)
            for s in settings:
                numerics.apply(model, s)
                for r in rows:
                    positions = torch.arange(length, length + r)
                    tokens = torch.randint(0, c.vocab_size, (r,)).tolist()
                    cache = caches[s]
                    t = clock(lambda: forward(model, cache, tokens, positions, plans[r], r))
                    cache.crop(length)
                    if i:
                        samples[(s, r, "target")].append(t)
                    if head is None or r > 17:
                        continue
                    numerics.apply(head, s)
                    hc = head_caches[s]
                    feats = torch.randn(r, head.fc.in_features)
                    hpos = torch.arange(head_keys, head_keys + r)
                    t = clock(lambda: head.logits(head_forward(head, hc, tokens, feats, hpos, plans[r], True)))
                    hc.crop(head_keys)
                    if i:
                        samples[(s, r, "head")].append(t)
        for s in settings:
            for r in rows:
                nbytes, flops = step_cost(model, s, length, r)
                row = {"length": length, "numerics": s, "rows": r, "bytes": nbytes, "flops": flops,
                       "target_ms": median_ms(samples[(s, r, "target")]),
                       "target_best_ms": 1e3 * min(samples[(s, r, "target")])}
                if samples[(s, r, "head")]:
                    row["head_ms"] = median_ms(samples[(s, r, "head")])
                    row["head_keys"] = head_keys
                out.append(row)
    numerics.apply(model, "fp32")
    return out


def with_floor(steps: list[dict], read_gbps: float) -> list[dict]:
    """Each step's bytes floor (its bytes at the measured read bandwidth) and its ratios."""
    ar = {(s["length"], s["numerics"]): s["target_ms"] for s in steps if s["rows"] == 1}
    fp32 = {s["length"]: s["target_ms"] for s in steps if s["rows"] == 1 and s["numerics"] == "fp32"}
    for s in steps:
        s["floor_ms"] = s["bytes"] / read_gbps / 1e6
        s["x_floor"] = s["target_ms"] / s["floor_ms"]
        s["GBps"] = s["bytes"] / s["target_ms"] / 1e6
        s["GFLOPs"] = s["flops"] / s["target_ms"] / 1e6
        s["x_own_ar"] = s["target_ms"] / ar[(s["length"], s["numerics"])]
        if s["length"] in fp32:
            s["fp32_ar_over"] = fp32[s["length"]] / s["target_ms"]
    return steps


def tables(report: dict) -> str:
    bw = report["bandwidth"]
    lines = [f"Bandwidth ({bw['megabytes']} MB tensors, {report['threads']} threads): copy {bw['copy_GBps']:.1f} GB/s "
             f"(best {bw['copy_best_GBps']:.1f}), read {bw['read_GBps']:.1f} GB/s (best {bw['read_best_GBps']:.1f}); "
             "medians.", "",
             "| input | numerics | rows | MB read | GFLOP | target ms | floor ms | x floor | GB/s | x its own 1-row step "
             "| fp32 1-row step / this | head ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in report["steps"]:
        head = f"{s['head_ms']:.2f}" if "head_ms" in s else ""
        lines.append(f"| {s['length']} | {s['numerics']} | {s['rows']} | {s['bytes'] / 1e6:.0f} | {s['flops'] / 1e9:.2f} | "
                     f"{s['target_ms']:.1f} | {s['floor_ms']:.1f} | {s['x_floor']:.2f} | {s['GBps']:.1f} | "
                     f"{s['x_own_ar']:.2f} | {s.get('fp32_ar_over', float('nan')):.2f} | {head} |")
    if not report["kernels"]:
        return "\n".join(lines)
    names = [k[:-3] for k in report["kernels"][0] if k.endswith(" ms") and not k.endswith("best ms")]
    lines += ["", "| product | out x in | rows | " + " | ".join(f"{n} us" for n in names) + " | packed: same bits |",
              "|---" * (len(names) + 4) + "|"]
    for k in report["kernels"]:
        cells = " | ".join(f"{1e3 * k[n + ' ms']:.0f}" for n in names)
        lines.append(f"| {k['product']} | {k['shape'][0]}x{k['shape'][1]} | {k['rows']} | {cells} | {k['same_bits']} |")
    return "\n".join(lines)


def figure(report: dict):
    """Measured step time against its bytes floor, per input length: one bar group per numerics setting."""
    from plotly.subplots import make_subplots

    lengths = sorted({s["length"] for s in report["steps"]})
    fig = make_subplots(rows=1, cols=len(lengths), subplot_titles=[f"{n} tokens" for n in lengths], shared_yaxes=True)
    colours = {"fp32": "#636efa", "bf16": "#ef553b", "bf16-kv": "#00cc96"}
    for col, length in enumerate(lengths, 1):
        for setting in dict.fromkeys(s["numerics"] for s in report["steps"]):
            here = [s for s in report["steps"] if s["length"] == length and s["numerics"] == setting]
            x = [f"{s['rows']} / {setting}" for s in here]
            fig.add_bar(x=x, y=[s["target_ms"] for s in here], name=setting, legendgroup=setting, showlegend=col == 1,
                        marker_color=colours.get(setting), row=1, col=col)
            fig.add_scatter(x=x, y=[s["floor_ms"] for s in here], mode="markers", marker_symbol="line-ew-open",
                            marker_size=14, marker_color="black", marker_line_width=3, name="bytes floor",
                            legendgroup="floor", showlegend=col == 1 and setting == "fp32", row=1, col=col)
    fig.update_layout(title="Target forward (rows / numerics): measured ms (bars) against its bytes at the read "
                            "bandwidth (marks)", yaxis_title="ms per forward")
    return fig


def margin(model, ids: list[int], setting: str) -> tuple[int, float]:
    """The target's greedy token after `ids` in `setting`, and its logit margin over the runner-up."""
    numerics.apply(model, setting)
    cache = KVCache(model.config.num_hidden_layers, dtype=numerics.kv_dtype(setting))
    logits = forward(model, cache, ids, torch.arange(len(ids)), AttentionPlan("prefill", "fused"), 1)[-1]
    top = logits.topk(2)
    return int(top.indices[0]), float(top.values[0] - top.values[1])


def races(pair, prompts: dict[str, list[int]], settings: tuple[str, ...], new_tokens: int,
          methods: tuple[str, ...] = ("autoregressive", "speculative", "specextend")) -> list[dict]:
    """Per prompt and setting: whether every method's greedy output equals the target alone's in that setting, and
    where it first departs from fp32's, with both settings' logit margins there (a near-tie, or a bug)."""
    from ..engine import generate
    from ..config import AttentionConfig, preset

    out = []
    for name, prompt in prompts.items():
        outputs: dict[str, dict[str, list[int]]] = {}
        for s in settings:
            outputs[s] = {}
            for method in methods:
                base = preset(method, max_new_tokens=new_tokens)
                config = base.replace(attention=AttentionConfig(**{**base.attention.__dict__, "numerics": s}))
                outputs[s][method] = list(list(generate(pair, prompt, config))[-1].token_ids)
        for s in settings:
            alone = outputs[s]["autoregressive"]
            row = {"prompt": name, "tokens": len(prompt), "numerics": s, "new_tokens": len(alone),
                   "methods_equal": all(o == alone for o in outputs[s].values())}
            ref = outputs["fp32"]["autoregressive"] if "fp32" in outputs else alone
            first = next((i for i, (a, b) in enumerate(zip(alone, ref)) if a != b), None)
            row["first_divergence_from_fp32"] = first
            if first is not None and s != "fp32":
                ids = prompt + ref[:first]
                row["fp32_token"], row["fp32_margin"] = margin(pair.target, ids, "fp32")
                row["its_token"], row["its_margin"] = margin(pair.target, ids, s)
            out.append(row)
    numerics.apply(pair.target, "fp32")
    return out


def race_main(args, settings: tuple[str, ...]) -> int:
    from ..models import load_pair, read_tokenizer
    from . import bundled, prompting

    target, draft = bundled.default_pair()
    tokenizer = read_tokenizer(target)
    pair = load_pair(target, draft, tokenizer=tokenizer)
    prompts = {d.name: prompting.encode(tokenizer, d.text(), prompting.DEFAULT_INSTRUCTION).ids
               for d in bundled.documents("eval")[: args.races]}
    rows = races(pair, prompts, settings, args.new_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "races.json").write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(json.dumps(r))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m specextend.tools.roofline", description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny random-init models and shapes (seconds)")
    p.add_argument("--out", default="docs/results/cpu_roofline")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--numerics", default=",".join(numerics.NUMERICS))
    p.add_argument("--no-figure", action="store_true", help="the JSON and the tables only")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="rows of the timed forwards")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, one per core)")
    p.add_argument("--skip-kernels", action="store_true", help="no single-product table")
    p.add_argument("--races", type=int, default=0, metavar="N",
                   help="instead: the first N bundled eval documents raced in each setting (races.json)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--redraw", action="store_true", help="the tables and figure again from DIR/roofline.json")
    args = p.parse_args(argv)
    if args.redraw:
        return write(json.loads((Path(args.out) / "roofline.json").read_text()), Path(args.out), args.no_figure)
    settings = tuple(numerics.check(s) for s in args.numerics.split(","))
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.races:
        return race_main(args, settings)
    if args.quick:
        model = prepare(llama((2, 64, 4, 2, 128), 97, torch.float32, "cpu", 0))
        head, lengths, megabytes, rounds = None, (64, 128), 16, 2
        shapes = {"q_proj": (64, 64), "up_proj": (128, 64)}
    else:
        from ..models import load_pair
        from .bundled import default_pair

        pair = load_pair(*default_pair())
        model, head, rounds = pair.target, pair.draft, args.rounds
        lengths, megabytes, shapes = tuple(int(x) for x in args.lengths.split(",")), 1024, linear_shapes(model)
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(), "quick": args.quick,
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "settings": list(settings)}
    report["bandwidth"] = bandwidth(megabytes, max(rounds, 3))
    report["kernels"] = [] if args.skip_kernels else bench_kernels(shapes, KERNEL_ROWS, rounds)
    steps = bench_steps(model, head, settings, lengths, tuple(int(r) for r in args.rows.split(",")), rounds)
    report["steps"] = with_floor(steps, report["bandwidth"]["read_GBps"])
    return write(report, Path(args.out), args.no_figure)


def write(report: dict, out: Path, no_figure: bool) -> int:
    """roofline.json, roofline.md and (unless `no_figure`) roofline.png under `out`; prints the tables."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "roofline.json").write_text(json.dumps(report, indent=1))
    text = tables(report)
    (out / "roofline.md").write_text(text + "\n")
    print(text)
    if no_figure:
        return 0
    from .bench.report import write_pngs

    print("figure:", write_pngs({"roofline": figure(report)}, out))
    return 0

if __name__ == "__main__":
    raise SystemExit(main())

