"""Numerics: the precision a model's products and KV cache run in on the CPU, as a named setting.

- "fp32": every weight, product and cached key in fp32, as loaded (the reference).
- "bf16": each Linear's weight held a second time in bf16, in oneDNN's packed layout (what Inductor's CPU freezing
  hands `mkldnn._linear_pointwise`); a product rounds its input to bf16, accumulates in fp32 inside the kernel, and
  rounds its output to bf16, handed back in the input's dtype. Norms, RoPE, attention, the residual stream and the
  KV cache stay fp32. A step reads half the weight bytes. A row gets the same bits alone as among others (fp32 GEMMs
  do not): the packed kernel does for products up to 1,024 inputs wide and 32 rows, and wider ones (the bundled
  target's 1,536-wide down-projection, where it did not) run in parts of at most PART_WIDTH inputs, summed in fp32,
  taller ones up to a verification's most rows in blocks of ROW_BLOCK rows (AMX CPUs changed kernels past 32). Any
  difference between a row alone and in a verification is rounded up to whole bf16 steps at the next product and
  moves logits by tenths, enough to flip near-ties, so this is what keeps every method's greedy output equal.
- "bf16-kv": "bf16" and the KV cache in bf16: keys and values are rounded as they are written, and attention runs
  its query rounded to bf16 over them (the cache is the larger half of a step's bytes at 7.5K tokens; the CPU kernel
  for it is cpu_kernels.py's where it builds).

`apply(model, setting)` switches a loaded model in place (idempotent; a model packed once keeps its packed weights
when switched back to fp32, so a race's methods switch for free); `kv_dtype(setting)` is the dtype its cache keeps.
So a model runs ONE setting at a time: two requests in different settings on one model at once would switch it under
each other (the app makes the setting a property of a loaded pair). Only CPU models are packed: elsewhere every
setting runs as loaded.
Knows modules and CPU kernels; knows nothing of drafting, verification or retrieval.
"""

from __future__ import annotations

import weakref

import torch

from .config import MAX_DRAFT, NUMERICS, NUMERICS_CHOICES
from .models import SkinnyLinear

# what "auto" picks for an fp32 model on a CPU that packs: its autoregressive step at a 7.5K-token input took 40.9 ms
# against 67.4 ms in fp32 (1.65x; one process, alternating, 2-core AVX-512 BF16 CPU)
CPU_DEFAULT = "bf16-kv"
# module -> (its weight's version, packed weight, bf16 bias): kept beside the module, not in it, so that a copy of a
# model (a bf16 prefill's, models.reduced_copy) does not copy packed weights it never uses
_PACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check(setting: str) -> str:
    if setting not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}; got {setting!r}")
    return setting


def choose(model: torch.nn.Module, setting: str = "auto") -> str:
    """The setting `model` runs in when `setting` is asked: "auto" is CPU_DEFAULT for an fp32 model on a CPU that
    packs (`packs_here`), else fp32; any other setting is checked and kept."""
    if setting not in NUMERICS_CHOICES:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS_CHOICES)}; got {setting!r}")
    if setting != "auto":
        return setting
    weight = next(model.parameters())
    fp32_cpu = weight.device.type == "cpu" and weight.dtype == torch.float32
    return CPU_DEFAULT if fp32_cpu and packs_here() else "fp32"


def packs_here() -> bool:
    """Whether this CPU build runs oneDNN's bf16 products (AVX-512 BF16 or AMX; emulated ones are far slower)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def kv_dtype(setting: str) -> torch.dtype | None:
    """The dtype a model's KV cache keeps in `setting` (None: the dtype its keys come in)."""
    return torch.bfloat16 if check(setting) == "bf16-kv" else None


def bf16_prefill(setting: str, asked: str) -> str:
    """The bf16_prefill choice (AttentionConfig.bf16_prefill) that stands in `setting`: `asked` in fp32; "off" in a
    bf16 setting, which reads the prompt in its own products (no reduced copy of the model)."""
    return asked if check(setting) == "fp32" else "off"


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A (out, in) weight in bf16, reordered into oneDNN's packed layout for `mkldnn._linear_pointwise`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16), None)


# The packed product gave a row the same bits alone as among 2-33 rows for inputs up to 1,024 wide, but not for the
# bundled target's 1,536-wide down-projection (1-3 rows in 2-33 differed, and greedy output with them), so a wider
# product runs as products over parts of at most PART_WIDTH inputs, summed in fp32 in order
PART_WIDTH = 576


# On a CPU with AMX (amx_bf16), the packed product gave a row the same bits alone as among up to 32 rows, but not
# among 33 or more (most row counts from 33 to 79 had rows that differed, at every shape of the bundled target; on
# AVX-512 BF16 CPUs without AMX no count did), so a product over more rows, up to a verification's most, runs in blocks
# of ROW_BLOCK rows. A longer product is a prompt's read, which every method reads alike: it runs whole (blocks of 32
# rows took 1.7-2.9x as long over 2,048 rows)
ROW_BLOCK = 32
VERIFY_ROWS = MAX_DRAFT + 1  # a verification's most rows: the draft tokens and the committed token before them (bf16
# numerics verify one chain, which config bounds by MAX_DRAFT)


def parts(width: int) -> int:
    """How many equal parts a product over `width` inputs runs in (the last may be narrower)."""
    return -(-width // PART_WIDTH)


def part_width(width: int) -> int:
    """The inputs of each of a product's `parts(width)` parts (the last may have fewer)."""
    return -(-width // parts(width))


def pack_parts(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`weight` (out, in) packed in `parts(in)` slices of its inputs, each `pack`ed."""
    step = part_width(weight.shape[1])
    return tuple(pack(weight[:, i : i + step]) for i in range(0, weight.shape[1], step))


class PackedLinear(SkinnyLinear):
    """A Linear whose product runs over its packed bf16 weight while `packed` is set (`apply`), else as a
    SkinnyLinear. Its parameters, their names and ties are unchanged (the fp32 weight stays the reference)."""

    packed: tuple[torch.Tensor, ...] | None = None  # pack_parts
    packed_bias: torch.Tensor | None = None
    unpacked: type | None = None  # the module's class before it was packed, given back in fp32

    @torch.no_grad()  # inference only: with autograd recording (an input that requires grad) the packed call took
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # 0.4 s instead of 0.3 ms for the head's 8,192-row output layer
        if self.packed is None or x.device.type != "cpu":
            return super().forward(x)
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # (rows, in)
        if ROW_BLOCK < len(rows) <= VERIFY_ROWS:
            out = torch.cat([self._product(rows[i : i + ROW_BLOCK]) for i in range(0, len(rows), ROW_BLOCK)])
        else:
            out = self._product(rows)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)  # (..., out)

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        """(rows, in) bf16 -> (rows, out) fp32: one packed product per part, each rounded to bf16, summed in order."""
        step, out = part_width(self.in_features), None
        for i, part in enumerate(self.packed):
            bias = self.packed_bias if i == 0 else None
            y = torch.ops.mkldnn._linear_pointwise(rows[:, i * step : (i + 1) * step].contiguous(), part, bias, "none",
                                                   [], "").float()
            out = y if out is None else out.add_(y)
        return out


def apply(model: torch.nn.Module, setting: str) -> torch.nn.Module:
    """Switch `model`'s Linears (on the CPU) to `setting`'s products, in place; returns the model."""
    bf16 = check(setting) != "fp32" and packs_here()
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or module.weight.device.type != "cpu":
            continue
        if not bf16:
            if isinstance(module, PackedLinear):
                module.__class__ = module.unpacked
                del module.packed, module.packed_bias, module.unpacked
            continue
        kept = _PACKS.get(module)
        if kept is None or kept[0] != module.weight._version:
            bias = None if module.bias is None else module.bias.detach().to(torch.bfloat16)
            _PACKS[module] = kept = (module.weight._version, pack_parts(module.weight), bias)
        if not isinstance(module, PackedLinear):
            module.unpacked, module.__class__ = type(module), PackedLinear
        module.packed, module.packed_bias = kept[1], kept[2]
    return model
