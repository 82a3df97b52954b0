"""Sampling through the whole engine keeps the target's distribution: the second and third generated
tokens of a tiny-vocabulary model (both decided by verifying a depth-2 chain or tree, the first comes
from the prefill), sampled with speculative decoding many times, follow the target's exact joint
distribution (chi-square), also when the draft can draw only some of the tokens, and when a chain ends where the
draft is unsure (a confidence floor decides from q before drawing)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

from specextend.config import DraftConfig, preset
from specextend.engine import generate
from specextend.events import Drafted
from specextend.metrics import node_depths
from specextend.models import make_pair
from specextend.vocab import ReducedVocabHead

V = 6
DRAFT_OUTPUT_IDS = (0, 2, 3, 5)  # the reduced-vocabulary draft: q is zero for tokens 1 and 4


def model(seed: int, layers: int):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, initializer_range=1.0)
    return LlamaForCausalLM(config).float().eval()


@pytest.fixture(scope="module", params=["full", "reduced"])
def pair(request):
    draft = model(2, 1)
    if request.param == "reduced":
        draft.set_output_embeddings(ReducedVocabHead.of(draft.get_output_embeddings(), torch.tensor(DRAFT_OUTPUT_IDS)))
    return make_pair(model(1, 2), draft)


def next_probs(target, ids: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        return torch.softmax(target(input_ids=torch.tensor([ids])).logits[0, -1] / temperature, -1)


def exact_joint(target, prompt: list[int], temperature: float) -> torch.Tensor:
    """P(t2, t3) under the target alone, summed over t1: (V, V)."""
    joint = torch.zeros(V, V)
    for t1, p1 in enumerate(next_probs(target, prompt, temperature)):
        for t2, p2 in enumerate(next_probs(target, prompt + [t1], temperature)):
            joint[t2] += p1 * p2 * next_probs(target, prompt + [t1, t2], temperature)
    return joint


@pytest.mark.parametrize("draft", [DraftConfig(shape="chain", k=2),
                                   DraftConfig(shape="tree", max_depth=2, node_budget=6, branch=2, children=3,
                                               stop_threshold=0.0),
                                   DraftConfig(shape="chain", k=2, confidence_floor=0.6)],
                         ids=["chain", "tree", "chain-floor"])
def test_speculative_sampling_matches_target(pair, draft):
    prompt = [1, 4, 2, 5, 0, 3, 3, 1]
    temperature = 1.3
    joint = exact_joint(pair.target, prompt, temperature).flatten()
    runs = 1200
    counts = torch.zeros(V * V)
    depths = []  # the first step's chain depth, per run
    for seed in range(runs):
        config = preset("speculative", max_new_tokens=4, temperature=temperature, seed=seed, draft=draft)
        trace = list(generate(pair, prompt, config))
        out = trace[-1].token_ids
        first_draft = next(e for e in trace if isinstance(e, Drafted))
        depths.append(max(node_depths(first_draft.parents), default=0))
        assert first_draft.step == 1 and (depths[-1] == 2 or draft.confidence_floor)  # step 1 verifies depth 2
        counts[out[1] * V + out[2]] += 1
    assert not draft.confidence_floor or (2 in depths and min(depths) < 2)  # the floor ended some chains, not all
    keep = joint * runs >= 5  # pool the rare cells so chi-square stays valid
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    expected = torch.cat([joint[keep], joint[~keep].sum()[None]]) * runs
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3
