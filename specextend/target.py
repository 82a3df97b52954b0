"""The target: the model that verifies, and what it exposes of what it computes.

`Target` owns the target model's KV cache and runs its prefill, verification and commit. While it does, it hands
over what it already computes, with no extra forward: the queries of the scoring heads (retrieval, signal.py) and,
for a feature drafter (an EAGLE head), the residual streams of the committed tokens (`FeatureRows`). Residual stream
i is the hidden state entering layer i; stream L leaves the last layer, before the final norm. `SharedPrefill`
keeps one prompt's prefill for the next request on it (the methods of a race read one document).
Knows the target model, its cache and its captures; knows nothing of drafting policy, the loop or any UI.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator

import torch

from . import numerics
from .attention import AttentionPlan, Capture
from .cache import KVCache
from .config import GenerationConfig, RetrievalSignal, exact_trees
from .drafting import DraftTree
from .models import final_layer, forward, layer_devices, prefill_dtype, reduced_copy
from .signal import QueryWindow, combine, head_scores, kv_heads_of
from .steps import make_runner

Streams = dict[int, torch.Tensor]  # stream index -> (T, H) rows


def prefill_block(device: torch.device) -> int:
    """The target's prefill block: it bounds memory, and Stop and the progress readout act between blocks. On the
    project's 2-core CPU, 512-token blocks read 7.5K tokens as fast as 2048-token ones (14.4 against 15.4 s) and
    report progress every 1.5 s instead of every 5; a GPU reads 2048 at once."""
    return 2048 if device.type == "cuda" else 512


def watch_streams(model, streams: frozenset[int]) -> None:
    """Hook the target's layers (once per stream) so that a forward whose plan's capture asks for stream i leaves it
    in `capture.hidden[i]` as (B, T, H)."""
    layers = model.base_model.layers
    watched: set[int] = model.__dict__.setdefault("_watched_streams", set())

    def keep(index: int, kwargs: dict, hidden) -> None:
        plan = kwargs.get("attention_plan")
        if plan is not None and plan.capture is not None and index in plan.capture.streams:
            plan.capture.hidden[index] = hidden[0] if isinstance(hidden, tuple) else hidden

    for i in sorted(streams - watched):
        if not 0 <= i <= len(layers):
            raise ValueError(f"residual stream {i} does not exist: the target has {len(layers)} layers")
        if i < len(layers):
            layers[i].register_forward_pre_hook(
                lambda m, args, kwargs, i=i: keep(i, kwargs, args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
        else:
            layers[-1].register_forward_hook(lambda m, args, kwargs, out, i=i: keep(i, kwargs, out), with_kwargs=True)
        watched.add(i)


class FeatureRows:
    """The residual streams of the tokens the target has read and committed, queued for a feature drafter in order:
    the prompt's rows after prefill, then the root's and the accepted nodes' after each verification. The drafter
    takes them (`take`) as its features (`convert`: streams (T, H) each -> (T, F), e.g. an EAGLE head's fc input).
    Rows are written in place into one buffer per stream (grown by doubling), so a step allocates nothing here."""

    def __init__(self, streams: tuple[int, ...], convert: Callable[[Streams], torch.Tensor]) -> None:
        self.streams = streams
        self.convert = convert
        self.buffers: Streams = {}  # stream -> (capacity, H)
        self.n = 0  # rows queued

    @torch.no_grad()
    def push(self, hidden: Streams, rows: torch.Tensor | None = None) -> None:
        """Queue rows `rows` (all when None) of one forward's captured streams {i: (B, T, H)}; copied."""
        for i in self.streams:
            h = hidden[i][0]  # (T, H)
            k = h.shape[0] if rows is None else rows.shape[0]
            out = self._room(i, h, self.n + k)[self.n : self.n + k]
            if rows is None:
                out.copy_(h)
            else:
                torch.index_select(h, 0, rows.to(h.device), out=out)
        self.n += k

    def _room(self, stream: int, like: torch.Tensor, needed: int) -> torch.Tensor:
        buffer = self.buffers.get(stream)
        if buffer is None or buffer.shape[0] < needed or buffer.dtype != like.dtype:
            grown = like.new_empty((max(needed, 2 * (0 if buffer is None else buffer.shape[0]), 64), like.shape[-1]))
            if buffer is not None:
                grown[: self.n] = buffer[: self.n]
            buffer = self.buffers[stream] = grown
        return buffer

    def queued(self) -> Streams:
        """The queued rows, oldest first, per stream ({} when none are queued; views, valid until the next push);
        the queue stays."""
        return {i: self.buffers[i][: self.n] for i in self.streams} if self.n else {}

    def take(self) -> torch.Tensor | None:
        """The queued rows as features (T, F), oldest first (None when none are queued); the queue empties."""
        joined = self.queued()
        self.n = 0
        return self.convert(joined) if joined else None


@dataclass
class SharedPrefill:
    """The target's prefill of one prompt, kept for the next request on the same prompt and kernel (the methods of
    a race read one document): its KV, its last logits, the query window and the residual streams if they were
    kept, and what it took."""

    key: tuple = ()
    kv: list = field(default_factory=list)
    rope_positions: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    window: QueryWindow | None = None  # a copy of the scoring heads' queries, when the prefill kept them
    streams: Streams = field(default_factory=dict)  # copies of the prompt's residual streams, when kept
    seconds: float = 0.0

    def serves(self, key: tuple, window: QueryWindow | None, streams: tuple[int, ...] = ()) -> bool:
        """Whether this prefill can stand in for one of prompt and kernel `key` that keeps `window` and `streams`."""
        return (self.key == key and (window is None or (self.window is not None and self.window.serves(window)))
                and all(i in self.streams for i in streams))

    def hold(self, target: Target, seconds: float) -> None:
        """Keep a copy of `target`'s finished prefill (replacing any earlier one); it took `seconds`."""
        self.key, self.seconds, self.logits = target.read, seconds, target.logits
        self.kv = target.cache.gather(torch.arange(target.cache.length))
        self.rope_positions = target.cache.rope_positions.clone()
        self.window = None if target.window is None else target.window.copy()
        self.streams = {i: h.clone() for i, h in target.features.queued().items()} if target.features is not None else {}


class Target:
    """The target model, its KV cache, and (when retrieval scores) the queries of its scoring heads, and (for a
    feature drafter) the residual streams of what it commits."""

    def __init__(self, model, config: GenerationConfig, capacity: int, signal: RetrievalSignal | None = None,
                 features: FeatureRows | None = None) -> None:
        device = model.get_input_embeddings().weight.device
        if config.branching and not exact_trees(config.attention, device.type):  # the config checked the CPU's case
            raise ValueError(f"a draft tree cannot be verified exactly in {config.attention.numerics} numerics on "
                             f"{device.type}: draft a chain, or use numerics fp32")
        self.model = numerics.apply(model, config.attention.numerics)
        self.kernels = config.attention
        # verification forwards: one token (autoregressive) or padded to the fixed tree budget
        self.runner = make_runner(self.model, capacity, config.attention.steps, config.tree_budget + 1, fixed=True,
                                  kv_dtype=numerics.kv_dtype(config.attention.numerics))
        self.cache = self.runner.cache
        self.scale = final_layer(self.model)[1]
        self.window = None
        self.features = features
        layers: frozenset[int] = frozenset()
        if signal is not None:
            c = self.model.config
            heads = signal.head_sets(c.num_hidden_layers, c.num_attention_heads)
            self.window = QueryWindow(heads, signal.rows)
            layers = self.window.layers
            kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
            self.kv_of = {layer: kv_heads_of(h, c.num_attention_heads, kv) for layer, h in heads.items()}
            self.combine = signal.combine
        streams = frozenset(features.streams) if features is not None else frozenset()
        if streams:
            watch_streams(self.model, streams)
        self.capture = Capture(layers, streams) if layers or streams else None
        self.base = 0  # cache slots before the latest verified root
        self.shared_s: float | None = None  # a prefill copied from SharedPrefill: the seconds the original took
        self.read: tuple | None = None  # (prompt, prefill kernel, dtype, numerics) once this target has read a whole prompt
        # what the prompt is read in: a bf16 numerics setting reads it in its own products, with no copy of the model
        self.prefill_dtype = prefill_dtype(self.model, numerics.bf16_prefill(config.attention.numerics,
                                                                             config.attention.bf16_prefill))

    def prefill(self, prompt: list[int], stop, shared: SharedPrefill | None = None) -> Iterator[int]:
        """Read the prompt in blocks; the last block's logits are kept for the first token. With `shared`, copy a
        prefill of the same prompt instead (`self.shared_s` is then what it took). In a prefill dtype other than the
        model's (bf16 for an fp32 model, `models.prefill_dtype`), a copy of the model in that dtype reads the prompt
        into a cache of its own, handed over in the model's dtype, as are the queries and streams it captured: decoding
        then runs as after any prefill."""
        key = (tuple(prompt), self.kernels.prefill, self.prefill_dtype, self.kernels.numerics)
        streams = self.features.streams if self.features is not None else ()
        if shared is not None and shared.serves(key, self.window, streams):
            self.cache.replace(shared.kv, shared.rope_positions)
            self.logits, self.shared_s = shared.logits, shared.seconds
            if self.window is not None:
                self.window = shared.window.copy(self.window.rows)
            if self.features is not None:
                self.features.push({i: shared.streams[i][None] for i in streams})
            yield len(prompt)
            return
        plan = AttentionPlan("prefill", self.kernels.prefill, capture=self.capture)
        size = prefill_block(self.runner.device)
        dtype = self.runner.dtype
        if self.prefill_dtype == dtype:
            read = self.runner.forward
        else:  # the copy carries the hooks that keep the streams; the logits come out of the model's own output layer
            model = reduced_copy(self.model, self.prefill_dtype, keep=self.model.get_output_embeddings())
            cache = KVCache(len(self.cache.layers), len(prompt), layer_devices(model))
            read = partial(forward, model, cache)
        for start in range(0, len(prompt), size):
            if stop is not None and stop.is_set():
                return
            block = prompt[start : start + size]
            positions = torch.arange(start, start + len(block))
            self.logits = read(block, positions, plan, 1)
            if self.window is not None:
                queries = {layer: q.to(dtype) for layer, q in self.capture.queries.items()}
                self.window.push(queries, torch.arange(len(block)), positions)
            if self.features is not None:
                self.features.push({i: h.to(dtype) for i, h in self.capture.hidden.items()})
            yield start + len(block)
        if self.prefill_dtype != dtype:  # converted to the model's dtype as it is copied
            self.cache.replace(cache.filled(), cache.rope_positions, dtype)
        self.read = key

    def verify(self, root: int, tree: DraftTree) -> torch.Tensor:
        """One forward over [root] + tree nodes: logits (N+1, V)."""
        base = self.base = self.cache.length
        positions = base + torch.tensor((0, *tree.depths))
        plan = AttentionPlan("tree", self.kernels.verify, tree_mask=tree.mask, capture=self.capture)
        return self.runner.forward([root, *tree.tokens], positions, plan, len(tree.tokens) + 1)

    def commit(self, path: list[int]) -> None:
        """Keep the prefix, the root and the accepted path; drop the rejected nodes' KV; the read rows join the window
        and the feature rows."""
        kept = self.base + 1  # the committed prefix and the root
        self.cache.keep(torch.cat([torch.arange(kept), kept + torch.tensor(path, dtype=torch.long)]))
        rows = torch.tensor([0, *(n + 1 for n in path)], dtype=torch.long)  # the root and the accepted nodes
        if self.window is not None:
            self.window.push(self.capture.queries, rows, self.base + torch.arange(len(rows)))
        if self.features is not None:
            self.features.push(self.capture.hidden, rows)

    def head_scores(self, rows: int | None = None) -> torch.Tensor:
        """Each scoring head's attention over every committed token, averaged over the window's last `rows` rows
        (all when None): (H_sel, T), layer by layer in the window's head order."""
        w = self.window
        rows = rows or w.rows
        scores = []
        for layer in sorted(w.layers):  # each layer's queries beside its keys (a target spread over devices)
            keys = self.cache.layers[layer].filled()[0]
            scores.append(head_scores(w.queries[layer][:, -rows:].to(keys.device), self.kv_of[layer], keys,
                                      w.positions[-rows:], self.scale).to(self.runner.device))
        return torch.cat(scores)

    def token_scores(self) -> torch.Tensor:
        """The retrieval signal's score of every committed token: the scoring heads combined, (T,)."""
        return combine(self.head_scores(), self.combine).cpu()
