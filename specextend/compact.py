"""Compact weights: a model folder's tensors in one GGUF file, its big matrices in 8-bit blocks, the rest exact.

A matrix (2-D, floating, rows a multiple of the block, at least QUANTIZE_MIN values) is stored as Q8_0: blocks of 32
values, each an int8 times one float16 scale, 1.0625 bytes a value against bf16's 2. It reads back dequantized to
float32, so a model of any dtype takes it as its own load would cast it. Every other tensor (norms, biases, a draft
vocabulary's maps) is stored in its own dtype and reads back bit for bit. The file is written and read with the `gguf`
package; it holds tensors under their PyTorch names, not a llama.cpp model.
Knows tensors and the GGUF container; knows nothing of models, loading, the engine or any UI.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

COMPACT_FILE = "model.gguf"  # a model folder's compact weights, beside its config.json
ARCHITECTURE = "specextend-compact"  # the GGUF's general.architecture: tensors by PyTorch name, not a llama.cpp model
DTYPES_KEY = "specextend.dtypes"  # JSON {name: torch dtype} of every tensor as it was before writing
QUANTIZE_MIN = 1 << 12  # a matrix smaller than this stays exact: the saving is nothing next to the whole file
MAX_NAME = 63  # GGUF's longest tensor name
# torch dtype -> (the numpy dtype its bytes are written as, GGUF's type for them); bool goes as int8 and comes back
EXACT = {torch.float32: (np.float32, "F32"), torch.float16: (np.float16, "F16"), torch.bfloat16: (np.int16, "BF16"),
         torch.int64: (np.int64, "I64"), torch.int32: (np.int32, "I32"), torch.int16: (np.int16, "I16"),
         torch.int8: (np.int8, "I8"), torch.bool: (np.int8, "I8")}


def quantizes(tensor: torch.Tensor) -> bool:
    """Whether `write` stores `tensor` in 8-bit blocks (a big floating matrix whose rows fill whole blocks)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0][0]
    return (tensor.is_floating_point() and tensor.dim() == 2 and tensor.shape[-1] % block == 0
            and tensor.numel() >= QUANTIZE_MIN)


def write(state: dict[str, torch.Tensor], path: str | Path) -> Path:
    """Write `state` to the GGUF file `path`: big matrices as Q8_0, everything else exact. Returns the path."""
    import gguf

    path = Path(path)
    writer = gguf.GGUFWriter(str(path), ARCHITECTURE)
    dtypes = {}
    for name, tensor in state.items():
        if len(name) > MAX_NAME:
            raise ValueError(f"tensor name {name!r} is longer than GGUF's {MAX_NAME} characters")
        tensor = tensor.detach().cpu().contiguous()
        dtypes[name] = str(tensor.dtype).removeprefix("torch.")
        if quantizes(tensor):
            blocks = gguf.quants.quantize(tensor.float().numpy(), gguf.GGMLQuantizationType.Q8_0)  # (rows, bytes) uint8
            writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        if tensor.dtype not in EXACT:
            raise ValueError(f"{name}: dtype {tensor.dtype} has no exact GGUF type")
        as_numpy, kind = EXACT[tensor.dtype]
        raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
        writer.add_tensor(name, raw.numpy().astype(as_numpy, copy=False), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.add_string(DTYPES_KEY, json.dumps(dtypes))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a file `write` wrote: quantized matrices dequantized to float32, the rest in their own dtypes."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.get_field(DTYPES_KEY)
    if field is None:
        raise ValueError(f"{path} is not a compact weights file (no {DTYPES_KEY} in its metadata)")
    dtypes = json.loads(field.contents())
    state = {}
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first (as `shapes`)
        dtype = getattr(torch, dtypes[tensor.name])
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            values = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape))
        else:
            raw = np.array(tensor.data).reshape(-1).view(EXACT[dtype][0]).reshape(shape)  # a copy of the mapped bytes
            values = torch.from_numpy(raw)
            values = values.view(torch.bfloat16) if dtype == torch.bfloat16 else values.to(dtype)
        state[tensor.name] = values
    return state


def shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in a file `write` wrote, read from its header: nothing is dequantized."""
    import gguf

    return {t.name: tuple(int(n) for n in reversed(t.shape)) for t in gguf.GGUFReader(str(path)).tensors}


def weights_file(folder: str | Path) -> Path | None:
    """A model folder's compact weights file, where it holds no ordinary weights (safetensors or .bin files, which are
    read as they are); else None."""
    folder = Path(folder)
    path = folder / COMPACT_FILE
    if not path.is_file() or any(folder.glob("*.safetensors")) or any(folder.glob("*.bin")):
        return None
    return path
