"""Preset check: `python -m app.preset_check [--shrink] [--out DIR]`, the app's own run handler on random-init pairs
in each GPU preset's shapes, one request each (a race of SpecExtend, speculative decoding and the target alone), on a
long document or (`--long-output`) a short prompt written on at length.

No weights travel: each preset's target and draft are built from their published shapes (families, widths, heads,
rope scaling, embedding rows) with random weights, over a word tokenizer with as many ids as the pair shares, and
checked with the same `compat.check_pair` a download would meet. The pair is then served exactly as a loaded one
(`backend.serve`) to `Studio.run`, which tokenizes, races the methods, and checks that their greedy outputs agree.
Pairs run one at a time, so each change of pair also exercises the freeing of the last one. `--shrink` keeps every
shape but two layers and a narrow width, so the CPU runs it in seconds (a test does).
Writes preset_check.json under --out (again after each preset) and prints one line per preset.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch

from specextend.tools.prompting import LONG_OUTPUT_TOKENS

from .backend import serve
from .runner import Knobs
from .settings import PRESETS, Settings
from .studio import KNOB_NAMES, SessionState, Studio

# published config fields per model: family, layers, hidden, heads, KV heads, head dim, intermediate, embedding rows,
# context, tied embeddings, rope
LLAMA3 = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
LLAMA_8B = dict(model_type="llama", layers=32, hidden=4096, heads=32, kv=8, head_dim=128, inter=14336, rows=128256,
                context=131072, tied=False, rope={**LLAMA3, "factor": 8.0})  # Llama 3.1 8B and the R1 distill
QWEN3_8B = dict(model_type="qwen3", layers=36, hidden=4096, heads=32, kv=8, head_dim=128, inter=12288, rows=151936,
                context=40960, tied=False, rope={"rope_type": "default", "rope_theta": 1e6})
LLAMA_8B_EAGLE3 = dict(model_type="eagle3", hidden=4096, heads=32, kv=8, head_dim=128, inter=14336, rows=128256,
                       draft_vocab=32000, context=2048, rope={"rope_type": "default", "rope_theta": 500000.0})
HEAD_KINDS = ("eagle", "eagle3")
SHAPES = {
    "qwen2.5-7b": (
        dict(model_type="qwen2", layers=28, hidden=3584, heads=28, kv=4, head_dim=128, inter=18944, rows=152064,
             context=32768, tied=False, rope={"rope_type": "default", "rope_theta": 1e6}),
        dict(model_type="qwen2", layers=24, hidden=896, heads=14, kv=2, head_dim=64, inter=4864, rows=151936,
             context=32768, tied=True, rope={"rope_type": "default", "rope_theta": 1e6}),
        151665),  # the ids the tokenizer defines
    "llama-3.1-8b": (
        LLAMA_8B,
        dict(model_type="llama", layers=16, hidden=2048, heads=32, kv=8, head_dim=64, inter=8192, rows=128256,
             context=131072, tied=True, rope={**LLAMA3, "factor": 32.0}),
        128256),
    "qwen3-8b": (
        QWEN3_8B,
        dict(model_type="qwen3", layers=28, hidden=1024, heads=16, kv=8, head_dim=128, inter=3072, rows=151936,
             context=40960, tied=True, rope={"rope_type": "default", "rope_theta": 1e6}),
        151669),
    "vicuna-7b-16k": (
        dict(model_type="llama", layers=32, hidden=4096, heads=32, kv=32, head_dim=128, inter=11008, rows=32000,
             context=4096, tied=False, rope={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
        dict(model_type="llama", layers=2, hidden=768, heads=12, kv=12, head_dim=64, inter=3072, rows=32000,
             context=2048, tied=False, rope={"rope_type": "default", "rope_theta": 10000.0}),
        32000),
    # EAGLE heads (a draft shape's model_type names the kind): hidden, heads, intermediate, vocabulary as published
    "llama-3.1-8b-eagle3": (
        LLAMA_8B,
        LLAMA_8B_EAGLE3,
        128256),
    "vicuna-7b-eagle": (
        dict(model_type="llama", layers=32, hidden=4096, heads=32, kv=32, head_dim=128, inter=11008, rows=32000,
             context=2048, tied=False, rope={"rope_type": "default", "rope_theta": 10000.0}),
        dict(model_type="eagle", hidden=4096, heads=32, kv=32, head_dim=128, inter=11008, rows=32000, context=2048,
             rope={"rope_type": "default", "rope_theta": 10000.0}),
        32000),
    "deepseek-r1-llama-8b-eagle3": (
        LLAMA_8B,
        LLAMA_8B_EAGLE3,
        128256),
    "qwen3-8b-eagle3": (
        QWEN3_8B,
        dict(model_type="eagle3", hidden=4096, heads=32, kv=8, head_dim=128, inter=12288, rows=151936,
             draft_vocab=32000, context=40960, rope={"rope_type": "default", "rope_theta": 1e6}),
        151669),
}


def shrunk(shape: dict, layers: int = 2) -> dict:
    """The same family, rows, context and rope; `layers` layers (an EAGLE-3 head's target keeps 6), narrow."""
    return {**shape, "layers": min(shape.get("layers", 1), layers), "hidden": 64, "heads": 4, "kv": min(shape["kv"], 2),
            "head_dim": 16, "inter": 128}


def build_head(shape: dict, target, device: torch.device, dtype: torch.dtype, seed: int):
    """A random EAGLE head of `shape` for `target`, checked against it as a published one would be."""
    from transformers import LlamaConfig

    from specextend.heads import EagleHead, check_head

    config = LlamaConfig(hidden_size=shape["hidden"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"],
                         head_dim=shape["head_dim"], intermediate_size=shape["inter"], vocab_size=shape["rows"],
                         max_position_embeddings=shape["context"], rope_parameters=shape["rope"], num_hidden_layers=1,
                         initializer_range=0.02, draft_vocab_size=shape.get("draft_vocab"))
    check_head(target.config, shape["model_type"], config, False, shape["model_type"])
    torch.manual_seed(seed)
    with torch.device(device):
        head = EagleHead(shape["model_type"], config, target, shape.get("draft_vocab"))
    if shape.get("draft_vocab"):  # draft id d proposes target id d * spacing
        spacing = shape["rows"] // len(head.d2t)
        with torch.no_grad():
            head.d2t.copy_(torch.arange(len(head.d2t)) * (spacing - 1))
    return head.to(dtype).eval()


def build(shape: dict, device: torch.device, dtype: torch.dtype, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        shape["model_type"], num_hidden_layers=shape["layers"], hidden_size=shape["hidden"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"], head_dim=shape["head_dim"],
        intermediate_size=shape["inter"], vocab_size=shape["rows"], max_position_embeddings=shape["context"],
        tie_word_embeddings=shape["tied"], rope_parameters=shape["rope"], initializer_range=0.02)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def word_tokenizer(ids: int):
    """A whitespace tokenizer of `ids` words (w0, w1, ...; <s>, </s>, <unk> first) with a one-turn chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(ids - 3)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = "{{ bos_token }}{{ messages[0]['content'] }} w1 w2 w3"
    return tokenizer


def factory_for(shrink: bool, device: torch.device, dtype: torch.dtype, timings: dict):
    """An engine factory that builds each preset's pair at random instead of downloading it."""
    from specextend.compat import check_pair
    from specextend.models import make_pair

    def factory(choice, progress):
        start = time.perf_counter()
        target_shape, draft_shape, ids = SHAPES[choice.key]
        head = draft_shape["model_type"] in HEAD_KINDS
        if shrink:
            target_shape, draft_shape = shrunk(target_shape, 6 if head else 2), shrunk(draft_shape)
        tokenizer = word_tokenizer(ids)
        progress(f"Building {choice.key} at random")
        target = build(target_shape, device, dtype, 1)
        if head:
            check_pair((target.config, tokenizer, choice.target), None)
            pair = make_pair(target, build_head(draft_shape, target, device, dtype, 2))
        else:
            draft = build(draft_shape, device, dtype, 2)
            facts = check_pair((target.config, tokenizer, choice.target), (draft.config, tokenizer, choice.draft))
            pair = make_pair(target, draft, shared_vocab=facts.shared_vocab)
        timings[choice.key] = time.perf_counter() - start
        return serve(choice, tokenizer, pair)

    return factory


RACE = ("specextend", "speculative", "autoregressive")  # a click's race: SpecExtend first; the drafting runs with lookup


def device_dtype() -> tuple[torch.device, torch.dtype]:
    """CUDA in bf16 where there is one, else the CPU in fp32."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def document_for(key: str, tokens: int, max_new: int) -> str:
    """A document of `tokens` words (one token each under `word_tokenizer`), or as many as preset `key`'s target holds
    with `max_new` new tokens and the template's few (vicuna-7b-eagle's target has 2,048 positions)."""
    return " ".join(f"w{(i * 7919) % 30000 + 10}" for i in range(min(tokens, SHAPES[key][0]["context"] - max_new - 16)))


def studio_for(shrink: bool, presets: list[str], max_new: int, timings: dict):
    """A Studio serving `presets`, each built at random when chosen (its build seconds go to `timings`), and the knob
    values a race asks with: the defaults, `max_new` new tokens."""
    settings = Settings(pairs=tuple(PRESETS[p] for p in presets), max_new_tokens=max_new)
    knobs = replace(Knobs(), max_new_tokens=max_new)
    return Studio(factory_for(shrink, *device_dtype(), timings), settings), [getattr(knobs, n) for n in KNOB_NAMES]


def race(studio, key: str, document: str, values: list, workload: str = "document"):
    """One click's race through `Studio.run` on preset `key`: the finished job and each method's output ids."""
    state = SessionState()
    *_, last = studio.run(state, document, "w5 w6 w7", key, RACE[0], list(RACE[1:]), "0.3", *values, workload=workload)
    if state.job is None:  # refused before it began: the status says why
        raise ValueError(last[0])
    runs = state.job.runs
    return state.job, {m: list(events[-1].token_ids) for m, events in runs.items() if hasattr(events[-1], "token_ids")}


def agree(outputs: dict[str, list[int]]) -> bool:
    """Every method of the race ran and wrote the same tokens (greedy decoding is lossless)."""
    return len(outputs) == len(RACE) and len({tuple(ids) for ids in outputs.values()}) == 1


def run(shrink: bool, tokens: int, max_new: int, presets: list[str], workload: str = "document") -> Iterator[dict]:
    """One race per preset through `Studio.run`; `workload` "long_output" asks for a long output from a short prompt."""
    device, dtype = device_dtype()
    timings: dict[str, float] = {}
    studio, values = studio_for(shrink, presets, max_new, timings)
    for key in presets:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        job, outputs = race(studio, key, document_for(key, tokens, max_new), values, workload)
        yield {
            "preset": key, "workload": workload, "error": job.error, "build_s": round(timings.get(key, 0.0), 2),
            "run_s": round(time.perf_counter() - start, 2), "prompt_tokens": len(job.prompt.ids) if job.prompt else 0,
            "methods": sorted(outputs), "new_tokens": {m: len(ids) for m, ids in outputs.items()},
            "draft": next((e.draft_name for e in job.runs.get("specextend", ()) if hasattr(e, "draft_name")), ""),
            "outputs_agree": agree(outputs), "device": str(device), "dtype": str(dtype).replace("torch.", ""),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if device.type == "cuda" else None,
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.preset_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shrink", action="store_true", help="two narrow layers per model (CPU, seconds)")
    p.add_argument("--tokens", type=int, help="document length in words (one token each; default 8000, 64 with "
                                              "--long-output), or as many as the target's context holds")
    p.add_argument("--max-new-tokens", type=int, help=f"default 32 ({LONG_OUTPUT_TOKENS} with --long-output)")
    p.add_argument("--long-output", action="store_true", help="the long-output workload: a short prompt, a long output")
    p.add_argument("--presets", default=",".join(SHAPES), help="comma-separated preset names")
    p.add_argument("--out", type=Path, default=Path("results/preset_check"))
    args = p.parse_args(argv)
    tokens, max_new = (64, LONG_OUTPUT_TOKENS) if args.long_output else (8000, 32)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for r in run(args.shrink, args.tokens or tokens, args.max_new_tokens or max_new,
                 [k.strip() for k in args.presets.split(",")], "long_output" if args.long_output else "document"):
        results.append(r)
        (args.out / "preset_check.json").write_text(json.dumps(results, indent=1))  # after each: a cut run keeps these
        print(json.dumps(r), flush=True)
    return 0 if all(r["outputs_agree"] and not r["error"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
