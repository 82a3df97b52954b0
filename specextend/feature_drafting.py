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

from . import numerics
from .attention import AttentionPlan, placed
from .cache import KVCache
from .config import GenerationConfig
from .drafting import DraftTree, PolicyDrafter, GrowingTree, working_room
from .heads import EagleHead
from .methods import DraftCache
from .retrieval import DraftCachePolicy
from .steps import Step, StepRunner, make_runner
from .target import FeatureRows


class HeadRunner(StepRunner):
    """An EAGLE head's forwards over its working cache, run as the target's are (from static buffers, captured on
    CUDA): each entry is a token with a hidden state, the target's features (`variant` True: (T, F)) or the head's
    own state fed back ((T, H)). Outputs: the logits over the target's vocabulary, then the output states (T, H)."""

    def __init__(self, model: EagleHead, cache: KVCache, mode: str, sizes: tuple[int, ...]) -> None:
        super().__init__(model, cache, mode, sizes)
        self.dtype = model.fc.weight.dtype  # the head's own (its embedding may be the target's)

    def _eager(self, tokens: list[int], positions: torch.Tensor, plan: AttentionPlan, keep: int,
               inputs: torch.Tensor | None, variant: bool) -> tuple[torch.Tensor, ...]:
        states = head_forward(self.model, self.cache, tokens, inputs, positions, plan, variant)[-keep:]
        return self.model.logits(states).float(), states

    def _call(self, step: Step, plan: AttentionPlan, variant: bool) -> tuple[torch.Tensor, ...]:
        states = self.model(step.ids, step.inputs, step.positions, self.cache, variant, attention_plan=plan)[0]
        return self.model.logits(states), states


@torch.no_grad()
def head_forward(head: EagleHead, cache: KVCache, tokens: list[int], hidden: torch.Tensor, positions: torch.Tensor,
                 plan: AttentionPlan, from_target: bool) -> torch.Tensor:
    """Head entries (tokens, hidden (T, F or H)) at `positions` appended to `cache`: output states (T, H)."""
    param = head.fc.weight
    ids = torch.tensor([tokens], dtype=torch.long, device=param.device)
    states = head(ids, hidden[None].to(param.device, param.dtype), positions[None].to(param.device), cache, from_target,
                  attention_plan=placed(plan, param.device))[0]
    cache.note_appended(positions)
    return states


class FeatureDrafter(PolicyDrafter):
    """Drafts with an EAGLE head from a policy-managed working cache of head entries."""

    def __init__(self, head: EagleHead, config: GenerationConfig, policy: DraftCachePolicy, capacity: int) -> None:
        head.get_output_embeddings()  # built (lazily) before the switch, so that its output rows switch too
        self.head = numerics.apply(head, config.attention.numerics)  # the head's products in the target's numerics
        largest = max(config.draft.depth + 1, config.draft.width[0])  # the pending entries, or one tree level
        steps = config.attention.steps
        if policy.name is DraftCache.FULL:
            self.runner = make_runner(self.head, capacity, steps, largest, kind=HeadRunner)
            store = self.runner.cache
        else:
            store = KVCache(1, capacity)
            self.runner = make_runner(self.head, working_room(config, capacity), steps, largest, kind=HeadRunner)
        self.runners = (self.runner,)
        super().__init__(config, policy, head.rotary_emb.inv_freq, store, self.runner.cache)
        # what the target hands over: its streams, turned into this head's features (T, F)
        self.features = FeatureRows(head.streams, lambda streams: head.features({i: h[None] for i, h in streams.items()})[0])
        self.tokens: list[int] = []  # pending: the next token of each pending feature row
        self.hidden: torch.Tensor | None = None  # pending: the target's features (m, F), set by prefill
        self._tree: GrowingTree | None = None
        self._states: dict[int, torch.Tensor] = {}  # node (-1: the root) -> the head's output state (H,)

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
            head_forward(self.head, self.store, prompt[start + 1 : end + 1], feats[start:end], torch.arange(start, end), plan,
                         True)
            yield end
        self.tokens, self.hidden = [], feats[body:]

    def propose(self, room: int, generator: torch.Generator | None) -> DraftTree:
        """Feed the pending entries, then grow a tree from the last one's output state."""
        base = self.working.length
        m = len(self.tokens)
        plan = AttentionPlan("tree", self.kernels.verify, tree_mask=torch.ones(m, m, dtype=torch.bool).tril())
        logits = self.runner.forward(self.tokens, torch.arange(base, base + m), plan, 1, self.hidden, True)
        tree = GrowingTree(base + m - 1, base + m)
        self._states = {-1: self.runner.outputs[1][-1].clone()}  # kept past the runner's next forward

        def run(nodes: list[int], tokens: list[int], positions: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
            parents = torch.stack([self._states[tree.parents[n]] for n in nodes])  # (len(nodes), H)
            level = self.runner.forward(tokens, positions, plan, len(nodes), parents, False)
            self._states.update(zip(nodes, self.runner.outputs[1].clone()))
            return level

        self._tree = self.grow(tree, logits[-1], room, generator, run)
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
