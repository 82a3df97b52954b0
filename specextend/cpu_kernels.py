"""The project's own CPU kernels: C sources under csrc/, compiled on first use for this machine and loaded with ctypes.

One kernel today: attention of a few query rows over a bf16 KV cache (csrc/bf16_attention.c), for CPUs with AVX-512
BF16. PyTorch's products over so few rows ran on one thread and well below the memory's speed (about 0.3 ms a layer
for one token over 7,680 cached keys and 3 KV heads of 64); the kernel reads each key once for every query row, on all
threads. It is built with the C compiler (`cc`, `-O3 -march=native -fopenmp`) into SPECEXTEND_CACHE/kernels, keyed by
the source and this CPU, and shares PyTorch's OpenMP threads. Where it cannot be built or run (no compiler, another
CPU, SPECEXTEND_CPU_KERNELS=off), `supports()` is False and callers keep their PyTorch path; `status()` says why.
Knows tensors and the C calling convention; knows nothing of models, plans or numerics settings.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "bf16_attention.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
_WHY: list[str] = []  # why the kernel is not in use, once asked


def cpu_flags() -> set[str]:
    """This CPU's feature flags (Linux), or none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def build(head_dim: int, source: Path = SOURCE) -> Path:
    """The compiled library for `source` with HEAD_DIM `head_dim` on this CPU (compiled once, then reused); raises
    OSError or subprocess.SubprocessError when it cannot be built."""
    from .tools.bundled import cache_root

    flags = (*FLAGS, f"-DHEAD_DIM={head_dim}")
    key = hashlib.sha256(source.read_bytes() + " ".join((*flags, *sorted(cpu_flags()))).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{source.stem}-d{head_dim}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([os.environ.get("CC", "cc"), *flags, "-o", str(built), str(source), "-lm"],
                           check=True, capture_output=True, timeout=300)
            built.replace(target)  # atomic: another process may be building the same file
    return target


@cache
def library(head_dim: int = 64) -> ctypes.CDLL | None:
    """The attention kernel's library for heads of `head_dim`, or None (`status()` says why)."""
    if os.environ.get("SPECEXTEND_CPU_KERNELS", "on") == "off":
        _WHY.append("turned off (SPECEXTEND_CPU_KERNELS=off)")
        return None
    if platform.system() != "Linux" or platform.machine() != "x86_64" or "avx512_bf16" not in cpu_flags():
        _WHY.append("this CPU has no AVX-512 BF16")
        return None
    try:
        lib = ctypes.CDLL(str(build(head_dim)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        _WHY.append(f"could not be built: {exc} {detail.decode(errors='replace')[-300:]}".strip())
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.se_bf16_attention.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, ptr, i64,
                                      ptr, i64, i64, i64, i64]
    lib.se_bf16_attention.restype = ctypes.c_int
    lib.se_transpose_check.argtypes = [ptr, ptr]
    return lib


def status(head_dim: int = 64) -> str:
    """'built' or why the kernel is not in use."""
    return "built" if library(head_dim) is not None else _WHY[-1]


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: bf16 on the CPU, head dim a multiple of 32 up to 256, rows contiguous."""
    d = key.shape[-1]
    return (key.device.type == "cpu" and key.dtype == torch.bfloat16 and d % 32 == 0 and d <= 256
            and key.stride(-1) == 1 and value.stride(-1) == 1 and query.shape[-1] == d and library(d) is not None)


def tail_order(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (R, tail) bool (True: row r does not see tail key j) -> each row's seen tail keys, ascending, first
    (R, tail) int32, and how many it sees (R,) int32."""
    order = torch.argsort(hidden.to(torch.uint8), dim=1, stable=True).to(torch.int32)
    return order.contiguous(), (~hidden).sum(1, dtype=torch.int32)


def bf16_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, hidden: torch.Tensor,
                   tail: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """query (B, H_kv, R, D) bf16 (already scaled), key and value (B, H_kv, T, D) bf16, hidden (R, tail) bool (True: row
    r does not see key T - tail + j) -> (B, H_kv, R, D) fp32. A row attends to the tail keys it sees as if they sat
    right after the prefix, in order (a tree node over its ancestors as the autoregressive step will see them once
    they are committed). `tail`: `tail_order(hidden)` where the caller has it already. Check `supports` first."""
    lib = library(key.shape[-1])
    q = query.contiguous()
    order, count = tail or tail_order(hidden)
    b, h, rows, d = q.shape
    out = torch.empty(b, h, rows, d, dtype=torch.float32)
    failed = lib.se_bf16_attention(q.data_ptr(), *q.stride()[:3], key.data_ptr(), *key.stride()[:3],
                                   value.data_ptr(), *value.stride()[:3], order.data_ptr(), count.data_ptr(),
                                   hidden.shape[1], out.data_ptr(), b, h, rows, key.shape[2])
    if failed:
        raise MemoryError("the bf16 attention kernel could not allocate its scratch memory")
    return out
