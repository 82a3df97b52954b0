"""The KV cache: one small type with a few verbs.

`KVCache` is a transformers `Cache` whose layers keep keys and values in preallocated buffers and hand
the model views of the filled part, so appending a step costs a copy of the new tokens only (not of the
whole prefix, as concatenation would). Verbs: `length`, `crop(n)`, `keep(slots)`, `gather(slots)`,
`append(kv)`, `rotate(slots, delta)`. Slot i of a cache always holds the key rotated to RoPE position
`rope_positions[i]`; `reposition` re-rotates keys so the draft sees compact positions.

Knows tensors and RoPE; knows nothing of drafting, verification or retrieval.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each (B, H_kv, T, D)


class BufferLayer(CacheLayerMixin):
    """One layer's keys and values in a buffer that grows by doubling.

    While `static` is set to (slots, bucket), a forward writes its new keys at the slots a tensor holds and
    sees the first `bucket` slots, filled or not (a mask hides the rest): shapes that do not depend on the
    length, so the forward can be captured (steps.py). The caller then sets `length`."""

    is_croppable = True

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.length = 0
        self.capacity = capacity
        self.static: tuple[torch.Tensor, int] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, tokens, dim = key_states.shape
        size = max(self.capacity, tokens, 16)
        # zeros, not garbage: a static forward reads unused slots under a -inf mask, and NaN * 0 is NaN
        self.keys = key_states.new_zeros((batch, heads, size, dim))
        self.values = value_states.new_zeros((batch, heads, size, value_states.shape[-1]))
        self.device = key_states.device
        self.is_initialized = True

    def _reserve(self, needed: int) -> None:
        size = self.keys.shape[2]
        if needed <= size:
            return
        while size < needed:
            size *= 2
        old = self.filled()
        self.keys = self.keys.new_zeros((*self.keys.shape[:2], size, self.keys.shape[3]))
        self.values = self.values.new_zeros((*self.values.shape[:2], size, self.values.shape[3]))
        self.keys[:, :, : self.length], self.values[:, :, : self.length] = old

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.static is not None:
            slots, bucket = self.static
            self.keys.index_copy_(2, slots, key_states)
            self.values.index_copy_(2, slots, value_states)
            return self.keys[:, :, :bucket], self.values[:, :, :bucket]
        self.write(self.length, key_states, value_states)
        return self.filled()

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def reset(self) -> None:
        self.length = 0

    def crop(self, max_length: int) -> None:
        self.length = min(self.length, max_length)

    def filled(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite slots [start, start + T) and set the length to their end."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        end = start + keys.shape[2]
        self._reserve(end)
        self.keys[:, :, start:end] = keys
        self.values[:, :, start:end] = values
        self.length = end


class KVCache(Cache):
    """A model's KV cache plus the RoPE position each slot's key was rotated to."""

    def __init__(self, num_layers: int, capacity: int = 0) -> None:
        super().__init__(layers=[BufferLayer(capacity) for _ in range(num_layers)])
        self.rope_positions = torch.zeros(0, dtype=torch.long)

    @property
    def length(self) -> int:
        return self.layers[0].length

    def crop(self, max_length: int) -> None:
        """Drop every slot from `max_length` on."""
        if max_length < 0:
            raise ValueError(f"crop takes the length to keep (>= 0), got {max_length}")
        for layer in self.layers:
            layer.crop(max_length)
        self.rope_positions = self.rope_positions[:max_length]

    def note_appended(self, positions: torch.Tensor) -> None:
        """Record the RoPE positions of the slots a model forward just appended."""
        self.rope_positions = torch.cat([self.rope_positions, positions.to("cpu", torch.long)])

    def gather(self, slots: torch.Tensor) -> KV:
        """Copies of the keys and values at `slots` (a 1-D LongTensor), per layer."""
        out = []
        index = slots
        for layer in self.layers:
            keys, values = layer.filled()
            index = index.to(keys.device)  # moved once (layers share a device unless the model is spread)
            out.append((keys.index_select(2, index), values.index_select(2, index)))
        return out

    def keep(self, slots: torch.Tensor) -> None:
        """Keep only `slots` (ascending), moved to the front in order: (B, H, T, D) -> (B, H, len(slots), D).
        Slots already in place (the committed prefix) are not copied: only the tail from the first moved slot is."""
        slots = slots.cpu()
        moved = (slots != torch.arange(slots.shape[0])).nonzero()
        start = int(moved[0]) if moved.numel() else slots.shape[0]
        if start < slots.shape[0]:
            for layer, (keys, values) in zip(self.layers, self.gather(slots[start:])):
                layer.write(start, keys, values)
        for layer in self.layers:
            layer.crop(slots.shape[0])
        self.rope_positions = self.rope_positions[slots]

    def append(self, kv: KV, rope_positions: torch.Tensor) -> None:
        """Append slots taken from another cache with `gather`, keys rotated as `rope_positions` says."""
        start = self.length
        for layer, (keys, values) in zip(self.layers, kv):
            layer.write(start, keys, values)
        self.note_appended(rope_positions)

    def replace(self, kv: KV, rope_positions: torch.Tensor) -> None:
        """Make the cache exactly these slots."""
        for layer, (keys, values) in zip(self.layers, kv):
            layer.write(0, keys, values)
        self.rope_positions = rope_positions.to("cpu", torch.long)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reposition(kv: KV, old_positions: torch.Tensor, new_positions: torch.Tensor, inv_freq: torch.Tensor) -> KV:
    """Re-rotate cached keys from RoPE position old to new. Rotations compose: R(new) = R(new - old) R(old).

    Assumes the transformers RoPE layout (rotate_half over two halves) with frequencies `inv_freq` (D/2,).
    Values are untouched. Works in fp32 and casts back.
    """
    delta = (new_positions - old_positions).to(inv_freq.device, torch.float32)
    if not torch.any(delta):
        return kv
    freqs = delta[:, None] * inv_freq.float()[None, :]  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
    out = []
    for keys, values in kv:
        cos, sin = emb.cos().to(keys.device), emb.sin().to(keys.device)
        k32 = keys.float()
        out.append(((k32 * cos + rotate_half(k32) * sin).to(keys.dtype), values))
    return out
