"""Captured steps: decode-time forwards with static shapes, captured once as CUDA graphs and replayed.

A `StepRunner` serves one model and its KV cache. A decode-time forward of T new tokens (a verification
tree, a draft chain or tree level) is padded to the next allowed size P; its keys go to slots a tensor
holds, and it attends over a key bucket (the slots in use, rounded up to a multiple of BUCKET) under a
mask that hides the unused slots, shows each padding row only itself, and applies the tree mask. Nothing
in that forward depends on the cache's length, so on CUDA each (P, bucket) forward is captured once as a
CUDA graph and then replayed with new buffer contents; CMR's working-cache rebuilds and the cache verbs
only change buffer contents and lengths, never a captured shape. In "static" mode the same forward runs
eagerly: the path the CPU tests check. Prefill, and any forward that does not fit the buffers, runs the
eager way (models.forward).
Knows models, caches and CUDA graphs; knows nothing of drafting, verification or retrieval.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import torch

from .attention import AttentionPlan, KeySplits
from .cache import KVCache
from .models import forward, layer_devices

BUCKET = 512  # key slots are attended in multiples of this
KEEP = 8  # captured steps a runner keeps; the least recently used goes first
MODES = ("eager", "static", "captured")
# captured runners between requests, one per (model, sizes, cache dtype): a request takes the one whose cache is large enough
# and gives it back when it ends, so each step shape is captured once per process rather than once per request
_FREE: dict[tuple, StepRunner] = {}
_FREE_LOCK = threading.Lock()
_DROPPED: weakref.WeakSet = weakref.WeakSet()  # models let go of (`forget`): a run still on one keeps nothing back


def resolve_mode(mode: str, device: torch.device) -> str:
    """"auto" is "captured" on CUDA and "eager" elsewhere; "captured" needs CUDA."""
    if mode == "auto":
        return "captured" if device.type == "cuda" else "eager"
    if mode not in MODES:
        raise ValueError(f"steps must be auto, {', '.join(MODES)}; got {mode!r}")
    if mode == "captured" and device.type != "cuda":
        raise ValueError("captured steps need a CUDA device; use steps 'static' or 'eager' here")
    return mode


def sizes_up_to(n: int) -> tuple[int, ...]:
    """The padded sizes a runner may use: powers of two up to the first >= n."""
    out = [1]
    while out[-1] < n:
        out.append(out[-1] * 2)
    return tuple(out)


def splits_for(bucket: int, rows: int) -> int:
    """Key splits per attention call over `rows` folded query rows: a power of two up to 32 (so a bucket's splits
    stay 16-aligned), each of at least 256 keys, and at most 2048 rows over all splits. On an H200 (7B-shaped
    target, 16K keys): one token's 4 folded rows went from 1.75 to 1.37 ms of attention per step with 32 splits
    instead of 16, while a 32-token tree's 128 rows went from 2.65 to 2.93 ms (docs/RESULTS.md, "GPU path")."""
    splits = 1
    while splits < 32 and bucket // (2 * splits) >= 256 and 2 * splits * rows <= 2048:
        splits *= 2
    return splits


def capacity_for(room: int, sizes: tuple[int, ...]) -> int:
    """Cache slots to preallocate so every static forward fits: room for the padding, in whole buckets."""
    need = room + max(sizes)
    return -(-need // BUCKET) * BUCKET


def make_runner(model, capacity: int, steps: str, largest: int, fixed: bool = False,
                kind: type[StepRunner] | None = None, kv_dtype: torch.dtype | None = None) -> StepRunner:
    """A KV cache for `capacity` tokens and the runner over it, for forwards of up to `largest` new tokens: padded
    to a power of two, or (`fixed`) every forward of more than one token padded to the same size. `kind`: the runner
    class (a StepRunner by default; an EAGLE head's in feature_drafting.py). `kv_dtype`: what the cache keeps
    (KVCache's `dtype`); a kept runner serves only a request whose cache keeps the same."""
    device = model.get_input_embeddings().weight.device
    mode = resolve_mode(steps, device)
    sizes = sizes_up_to(largest)
    if fixed:
        sizes = tuple(sorted({1, sizes[-1]}))
    slots = capacity if mode == "eager" else capacity_for(capacity, sizes)
    if mode == "captured":
        with _FREE_LOCK:
            runner = _FREE.pop((id(model), sizes, kv_dtype), None)
        if runner is not None and runner.slots >= slots:
            runner.cache.crop(0)
            return runner
    cache = KVCache(model.config.num_hidden_layers, slots, layer_devices(model), kv_dtype)
    return (kind or StepRunner)(model, cache, mode, sizes)


def release(runner: StepRunner) -> None:
    """A request is done with `runner`: keep it (the largest per model, sizes and cache dtype) when its steps are
    captured."""
    if runner.mode != "captured":
        return
    key = (id(runner.model), runner.sizes, runner.cache.dtype)
    with _FREE_LOCK:
        if runner.model in _DROPPED:
            return
        held = _FREE.get(key)
        if held is None or held.slots < runner.slots:
            _FREE[key] = runner


def forget(models: tuple[weakref.ref, ...]) -> None:
    """These models (weak references: the caller keeps nothing alive) are being dropped: let go of their kept runners
    (captured graphs and caches), and of those a run still using them hands back later; then collect and hand the
    freed CUDA memory back, so that a pair loaded next finds it."""
    with _FREE_LOCK:
        for ref in models:
            model = ref()
            if model is not None:
                _DROPPED.add(model)
                for key in [k for k in _FREE if k[0] == id(model)]:
                    del _FREE[key]
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class Step:
    """The static buffers of one (P, bucket) forward, and its CUDA graph once captured."""

    ids: torch.Tensor  # (1, P) token ids
    positions: torch.Tensor  # (1, P) RoPE positions
    slots: torch.Tensor  # (P,) cache slots the new keys go to
    keys: KeySplits  # the mask over the bucket
    bucket: int
    inputs: torch.Tensor | None = None  # (1, P, W): hidden-state inputs, for a runner whose model takes them
    outputs: tuple[torch.Tensor, ...] = ()  # the captured forward's outputs, logits (P, V) first
    graph: torch.cuda.CUDAGraph | None = None
    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # the captured forward's query tensors
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # ... and residual streams


class StepRunner:
    """Runs one model's forwards over its cache: eagerly, or from static buffers (captured on CUDA). A forward's
    outputs are the logits, then whatever else the model gives (`outputs`: an EAGLE head's states); those of the
    last forward stay in `outputs`, valid until the next one."""

    def __init__(self, model, cache: KVCache, mode: str, sizes: tuple[int, ...]) -> None:
        self.model, self.cache, self.mode, self.sizes = model, cache, mode, sizes
        c = model.config
        self.groups = c.num_attention_heads // (getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
        self.device = model.get_input_embeddings().weight.device
        self.dtype = model.get_input_embeddings().weight.dtype
        self.steps: OrderedDict[tuple, Step] = OrderedDict()
        self.captures = 0  # forwards captured so far (each a new (P, bucket) shape)
        self.outputs: tuple[torch.Tensor, ...] = ()  # the last forward's kept rows of each output

    @property
    def slots(self) -> int:
        """The cache's preallocated slots."""
        layer = self.cache.layers[0]
        return layer.keys.shape[2] if layer.is_initialized else self.cache.capacity

    def forward(self, tokens: list[int], positions: torch.Tensor, plan: AttentionPlan, keep: int,
                inputs: torch.Tensor | None = None, variant: bool = False) -> torch.Tensor:
        """Run `tokens` at `positions` (appending their KV), with hidden-state `inputs` (T, W) for a model that takes
        them (`variant`: which of its two input kinds): logits of the last `keep` tokens (keep, V), fp32 on the
        model's device (what the caller needs of them, it reduces there first: an argmax, a top-k); valid until the
        next forward."""
        t = len(tokens)
        size = next((s for s in self.sizes if s >= t), None)
        layer = self.cache.layers[0]
        base = self.cache.length
        if (self.mode == "eager" or plan.kind != "tree" or size is None or not layer.is_initialized
                or base + size > layer.keys.shape[2]):
            self.outputs = self._eager(tokens, positions, plan, keep, inputs, variant)
            return self.outputs[0]
        bucket = min(-(-(base + size) // BUCKET) * BUCKET, layer.keys.shape[2])
        width = None if inputs is None else inputs.shape[-1]
        step = self._step(size, bucket, (layer.keys.data_ptr(), layer.keys.shape[2]),
                          plan.capture.key if plan.capture is not None else None, (variant, width))
        self._fill(step, tokens, positions, plan.tree_mask, base, inputs)
        static = replace(plan, kind="static", kernel="split", tree_mask=None, keys=step.keys)
        if self.mode == "static":
            outputs = self._run(step, static, variant)
        else:
            if step.graph is None:
                self._capture(step, static, variant)
            step.graph.replay()
            outputs = step.outputs
            if plan.capture is not None:
                plan.capture.queries.update(step.queries)
                plan.capture.hidden.update(step.hidden)
        for kv in self.cache.layers:
            kv.length = base + t
        self.cache.note_appended(positions)
        kept = [out[t - keep : t] for out in outputs]
        self.outputs = (kept[0].float(), *kept[1:])
        return self.outputs[0]

    def _eager(self, tokens: list[int], positions: torch.Tensor, plan: AttentionPlan, keep: int,
               inputs: torch.Tensor | None, variant: bool) -> tuple[torch.Tensor, ...]:
        """The forward the usual way (prefill; a forward that does not fit the buffers): its kept outputs."""
        return (forward(self.model, self.cache, tokens, positions, plan, keep),)

    def _call(self, step: Step, plan: AttentionPlan, variant: bool) -> tuple[torch.Tensor, ...]:
        """The model over a step's buffers: its outputs over all P rows, logits first."""
        out = self.model(input_ids=step.ids, position_ids=step.positions, cache=self.cache, use_cache=True,
                         attention_plan=plan, logits_to_keep=0)
        return (out.logits[0],)

    def _step(self, size: int, bucket: int, buffer: tuple[int, int], layers: tuple | None, inputs: tuple) -> Step:
        # a reallocated cache buffer (its address and slots: a stacked buffer's strides follow its slots) makes every
        # step captured over the old one stale; a step captured for some
        # layers' queries (and streams), or for one kind and width of inputs, serves only forwards that keep the same
        key = (size, bucket, buffer, layers, inputs)
        if key in self.steps:
            self.steps.move_to_end(key)
            return self.steps[key]
        mask = torch.zeros(size, bucket, dtype=torch.bool, device=self.device)
        new = lambda: torch.zeros(1, size, dtype=torch.long, device=self.device)  # noqa: E731
        width = inputs[1]
        step = Step(new(), new(), torch.arange(size, device=self.device),
                    KeySplits.of(mask, self.groups, splits_for(bucket, self.groups * size), self.dtype), bucket,
                    None if width is None else torch.zeros(1, size, width, dtype=self.dtype, device=self.device))
        self.steps[key] = step
        if len(self.steps) > KEEP:
            self.steps.popitem(last=False)
        return step

    def _fill(self, step: Step, tokens: list[int], positions: torch.Tensor, tree_mask: torch.Tensor, base: int,
              inputs: torch.Tensor | None = None) -> None:
        """Load one forward's inputs and mask into the step's buffers. Padding rows repeat the last token (and input
        row) at its position and write to the slots after the real ones, which stay outside the cache's length."""
        t, size = len(tokens), step.ids.shape[1]
        ids = torch.tensor(tokens + tokens[-1:] * (size - t), dtype=torch.long)
        pos = torch.cat([positions, positions[-1:].expand(size - t)])
        step.ids.copy_(ids[None], non_blocking=True)
        step.positions.copy_(pos[None], non_blocking=True)
        if inputs is not None:
            step.inputs[0, :t].copy_(inputs)
            step.inputs[0, t:].copy_(inputs[-1:].expand(size - t, -1))
        step.slots.copy_(torch.arange(base, base + size), non_blocking=True)
        tail = tree_mask.shape[1]
        prefix = base + t - tail
        mask = torch.zeros(size, step.bucket, dtype=torch.bool, device=self.device)  # (P, bucket)
        mask[:t, :prefix] = True
        mask[:t, prefix : base + t] = tree_mask.to(self.device)
        pad = torch.arange(t, size, device=self.device)
        mask[pad, base + pad] = True
        step.keys.fill_(mask, self.groups)

    @torch.no_grad()
    def _run(self, step: Step, plan: AttentionPlan, variant: bool) -> tuple[torch.Tensor, ...]:
        """The static forward: its outputs over P rows, logits (P, V) first."""
        for kv in self.cache.layers:
            kv.static = (step.slots, step.bucket)
        try:
            return self._call(step, plan, variant)
        finally:
            for kv in self.cache.layers:
                kv.static = None

    def _capture(self, step: Step, plan: AttentionPlan, variant: bool) -> None:
        """Warm the forward up on a side stream (lazy kernel set-up must not happen in a capture), then capture it."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._run(step, plan, variant)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        step.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(step.graph):
            step.outputs = self._run(step, plan, variant)
        if plan.capture is not None:
            step.queries = {layer: plan.capture.queries[layer] for layer in plan.capture.layers}
            step.hidden = {stream: plan.capture.hidden[stream] for stream in plan.capture.streams}
        self.captures += 1
