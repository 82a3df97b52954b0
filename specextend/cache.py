"""The KV cache: one small type with a few verbs.

`KVCache` is a transformers `Cache` whose layers keep keys and values in preallocated buffers and hand
the model views of the filled part, so appending a step costs a copy of the new tokens only (not of the
whole prefix, as concatenation would). The layers on one device share one STACKED buffer (keys
(L, B, H_kv, S, D), values likewise), so a verb is one op per device, not one per layer: a step's commit
on a 32-layer target is one gather and one write, not 64 of each. Verbs: `length`, `crop(n)`,
`keep(slots)`, `gather(slots)`, `append(kv)`, `replace(kv)`. Slot i of a cache always holds the key
rotated to RoPE position `rope_positions[i]`; `reposition` re-rotates keys so the draft sees compact
positions.

Knows tensors and RoPE; knows nothing of drafting, verification or retrieval.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

# per group of layers that share a device (one group unless a model is spread over several devices):
# (keys (L_g, B, H_kv, T, D), values (L_g, B, H_kv, T, D_v))
KV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Group:
    """Consecutive layers on one device and the stacked buffers they share (None until a forward first writes)."""

    first: int
    count: int
    keys: torch.Tensor | None = None  # (L_g, B, H_kv, S, D)
    values: torch.Tensor | None = None  # (L_g, B, H_kv, S, D_v)

    @property
    def size(self) -> int:
        return 0 if self.keys is None else self.keys.shape[3]


class BufferLayer(CacheLayerMixin):
    """One layer's keys and values: views of its group's stacked buffers.

    While `static` is set to (slots, bucket), a forward writes its new keys at the slots a tensor holds and
    sees the first `bucket` slots, filled or not (a mask hides the rest): shapes that do not depend on the
    length, so the forward can be captured (steps.py). The caller then sets `length`."""

    is_croppable = True

    def __init__(self, cache: KVCache, group: Group) -> None:
        super().__init__()
        self.cache = weakref.proxy(cache)  # the cache holds its layers: a strong link back would make a cycle, and a
        self.group = group  # dropped cache's buffers would wait for the cyclic collector (on a GPU, in device memory)
        self.length = 0
        self.static: tuple[torch.Tensor, int] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.cache.allocate(self.group, key_states, value_states, key_states.shape[2])

    @torch.no_grad()  # a cache holds what was computed; no gradient flows through it
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.static is not None:
            slots, bucket = self.static
            self.keys.index_copy_(2, slots, key_states.to(self.keys.dtype))
            self.values.index_copy_(2, slots, value_states.to(self.values.dtype))
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

    @torch.no_grad()
    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite slots [start, start + T) of this layer and set its length to their end."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        end = start + keys.shape[2]
        self.cache.reserve(self.group, end)
        self.keys[:, :, start:end] = keys
        self.values[:, :, start:end] = values
        self.length = end


class KVCache(Cache):
    """A model's KV cache plus the RoPE position each slot's key was rotated to. `devices`: each layer's device, for
    a model spread over several (None: one device, one stacked buffer). `dtype`: what the buffers keep (a numerics
    setting's, numerics.kv_dtype; keys and values are rounded as they are written), None: the dtype the keys come in."""

    def __init__(self, num_layers: int, capacity: int = 0, devices: tuple[torch.device, ...] | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.capacity = capacity
        self.dtype = dtype
        self.groups: list[Group] = []
        per_layer = devices or (None,) * num_layers
        for i, device in enumerate(per_layer):
            if not self.groups or device != per_layer[i - 1]:
                self.groups.append(Group(i, 0))
            self.groups[-1].count += 1
        super().__init__(layers=[BufferLayer(self, g) for g in self.groups for _ in range(g.count)])
        self.rope_positions = torch.zeros(0, dtype=torch.long)

    @property
    def length(self) -> int:
        return self.layers[0].length

    def allocate(self, group: Group, keys: torch.Tensor, values: torch.Tensor, tokens: int,
                 dtype: torch.dtype | None = None) -> None:
        """Make `group`'s stacked buffers in the shape, dtype and device of one layer's `keys` and `values`, with room
        for the cache's capacity (and at least `tokens`); zeros, not garbage: a static forward reads unused slots
        under a -inf mask, and NaN * 0 is NaN."""
        batch, heads, _, dim = keys.shape
        size = max(self.capacity, tokens, 16)
        dtype = self.dtype or dtype
        group.keys = keys.new_zeros((group.count, batch, heads, size, dim), dtype=dtype or keys.dtype)
        group.values = values.new_zeros((group.count, batch, heads, size, values.shape[-1]), dtype=dtype or values.dtype)
        self._point(group)

    def reserve(self, group: Group, needed: int) -> None:
        """Grow `group`'s buffers by doubling until `needed` slots fit, keeping their contents."""
        size = group.size
        if needed <= size:
            return
        while size < needed:
            size *= 2
        old = group.keys, group.values
        group.keys = old[0].new_zeros((*old[0].shape[:3], size, old[0].shape[4]))
        group.values = old[1].new_zeros((*old[1].shape[:3], size, old[1].shape[4]))
        group.keys[:, :, :, : old[0].shape[3]], group.values[:, :, :, : old[1].shape[3]] = old
        self._point(group)

    def _point(self, group: Group) -> None:
        for j, layer in enumerate(self.layers[group.first : group.first + group.count]):
            layer.keys, layer.values = group.keys[j], group.values[j]
            layer.device, layer.is_initialized = group.keys.device, True

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

    def filled(self) -> KV:
        """Views of every layer's filled slots, per group."""
        n = self.length
        return [(g.keys[:, :, :, :n], g.values[:, :, :, :n]) for g in self.groups]

    def gather(self, slots: torch.Tensor) -> KV:
        """Copies of the keys and values at `slots` (a 1-D LongTensor), per group: one index_select each."""
        out = []
        for keys, values in self.filled():
            index = slots.to(keys.device)
            out.append((keys.index_select(3, index), values.index_select(3, index)))
        return out

    def keep(self, slots: torch.Tensor) -> None:
        """Keep only `slots` (ascending), moved to the front in order: (B, H, T, D) -> (B, H, len(slots), D).
        Slots already in place (the committed prefix) are not copied: only the tail from the first moved slot is."""
        slots = slots.cpu()
        moved = (slots != torch.arange(slots.shape[0])).nonzero()
        start = int(moved[0]) if moved.numel() else slots.shape[0]
        if start < slots.shape[0]:
            self._write(start, self.gather(slots[start:]))
        for layer in self.layers:
            layer.crop(slots.shape[0])
        self.rope_positions = self.rope_positions[slots]

    def append(self, kv: KV, rope_positions: torch.Tensor) -> None:
        """Append slots taken from another cache with `gather`, keys rotated as `rope_positions` says."""
        self._write(self.length, kv)
        self.note_appended(rope_positions)

    def replace(self, kv: KV, rope_positions: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Make the cache exactly these slots, converted to its dtype as they are copied (`dtype`: the dtype of a cache
        that holds nothing yet; kv's by default)."""
        self._write(0, kv, dtype)
        self.rope_positions = rope_positions.to("cpu", torch.long)

    @torch.no_grad()
    def _write(self, start: int, kv: KV, dtype: torch.dtype | None = None) -> None:
        """Overwrite slots [start, start + T) of every layer, one copy per group and buffer, and set the length."""
        end = start + kv[0][0].shape[3]
        for g, (keys, values) in zip(self.groups, kv):
            if g.keys is None:
                self.allocate(g, keys[0], values[0], end, dtype)
            self.reserve(g, end)
            g.keys[:, :, :, start:end] = keys
            g.values[:, :, :, start:end] = values
        for layer in self.layers:
            layer.length = end


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
