"""The feature drafter: an EAGLE head drafts from the target's own hidden states.

Head entry j pairs the target's features at position j with the token at j+1, at RoPE position j; its output state
predicts the feature at j+1, whose logits propose the token at j+2. After prefill the head's store holds entries
0..n-2 (the prompt's features and next tokens) and the prompt's last features wait for the first token. Each step:
1. the pending entries (the target's features of the last committed tokens, each with its next token) are fed;
   the last one's output state gives the root's distribution;
2. the tree grows as the draft model's does (drafting.PolicyDrafter.grow); a node's entry is its token with its
   parent's output state (the head's own state, fed back), at the parent's position + 1;
3. after verification the pending entries' KV are kept and the draft nodes' are dropped: the committed tokens come
   back as pending entries with the target's real features (`target.FeatureRows`), as EAGLE does.
The working cache follows the same policies as a draft model's (full, StreamingLLM, CMR), re-positioned the same way.
Knows the head and its caches; knows nothing of the target's internals, verification or the UI.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .attention import AttentionPlan
from .cache import KVCache
from .config import GenerationConfig
from .drafting import DraftTree, PolicyDrafter, GrowingTree, working_room
from .heads import EagleHead
from .methods import DraftCache
from .retrieval import DraftCachePolicy
from .target import FeatureRows


class FeatureDrafter(PolicyDrafter):
    """Drafts with an EAGLE head from a policy-managed working cache of head entries."""

    runners = ()

    def __init__(self, head: EagleHead, config: GenerationConfig, policy: DraftCachePolicy, capacity: int) -> None:
        self.head = head
        store = KVCache(1, capacity)
        working = store if policy.name is DraftCache.FULL else KVCache(1, working_room(config, capacity))
        super().__init__(config, policy, head.rotary_emb.inv_freq, store, working)
        # what the target hands over: its streams, turned into this head's features (T, F)
        self.features = FeatureRows(head.streams, lambda streams: head.features({i: h[None] for i, h in streams.items()})[0])
        param = head.fc.weight
        self.device, self.dtype = param.device, param.dtype
        self.tokens: list[int] = []  # pending: the next token of each pending feature row
        self.hidden: torch.Tensor | None = None  # pending: the target's features (m, F), set by prefill
        self._tree: GrowingTree | None = None
        self._states: dict[int, torch.Tensor] = {}  # node (-1: the root) -> the head's output state (H,)

    @torch.no_grad()
    def _forward(self, cache: KVCache, tokens: list[int], hidden: torch.Tensor, positions: torch.Tensor,
                 plan: AttentionPlan, from_target: bool) -> torch.Tensor:
        """Head entries (tokens, hidden (T, F or H)) at `positions` appended to `cache`: output states (T, H)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        states = self.head(ids, hidden[None].to(self.device, self.dtype), positions[None].to(self.device), cache,
                           from_target, attention_plan=plan)[0]
        cache.note_appended(positions)
        return states

    @torch.no_grad()
    def _logits(self, states: torch.Tensor) -> torch.Tensor:
        """The head's logits over the target's vocabulary for output states (T, H): (T, V), fp32 on its device."""
        return self.head.logits(states).float()

    def prefill(self, prompt: list[int], stop, block: int = 2048) -> Iterator[int]:
        """The store's entries for the prompt (its features with each next token; sliding window per the policy)."""
        feats = self.features.take()  # (n, F): the prompt's rows
        window = self.policy.prefill_window
        block = min(block, window) if window else block
        body = len(prompt) - 1
        plan = AttentionPlan("prefill", self.kernels.prefill, window=window)
        for start in range(0, body, block):
            if stop is not None and stop.is_set():
                return
            end = min(start + block, body)
            self._forward(self.store, prompt[start + 1 : end + 1], feats[start:end], torch.arange(start, end), plan, True)
            yield end
        self.tokens, self.hidden = [], feats[body:]

    def propose(self, room: int, generator: torch.Generator | None) -> DraftTree:
        """Feed the pending entries, then grow a tree from the last one's output state."""
        base = self.working.length
        m = len(self.tokens)
        plan = AttentionPlan("tree", self.kernels.verify, tree_mask=torch.ones(m, m, dtype=torch.bool).tril())
        states = self._forward(self.working, self.tokens, self.hidden, torch.arange(base, base + m), plan, True)
        tree = GrowingTree(base + m - 1, base + m)
        self._states = {-1: states[-1]}

        def run(nodes: list[int], tokens: list[int], positions: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
            parents = torch.stack([self._states[tree.parents[n]] for n in nodes])  # (len(nodes), H)
            out = self._forward(self.working, tokens, parents, positions, plan, False)
            self._states.update(zip(nodes, out))
            return self._logits(out)

        self._tree = self.grow(tree, self._logits(states[-1]), room, generator, run)
        return tree.freeze(sampling=generator is not None)

    def commit(self, tokens: list[int]) -> None:
        """The fed pending entries join the store and the draft nodes' entries go; the committed tokens, each with the
        target's features of the token before it, become the pending entries."""
        tree, self._tree = self._tree, None
        self._states = {}
        if tree is not None:
            self.settle(tree.slot0, [], tree.slot0 - len(self.tokens))
            self.tokens, self.hidden = [], self.hidden[:0]
        new = self.features.take()  # the target's rows of the root and the accepted nodes (none after prefill)
        self.tokens = self.tokens + list(tokens)
        if new is not None:
            self.hidden = torch.cat([self.hidden, new])
