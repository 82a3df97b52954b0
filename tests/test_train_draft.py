"""The draft-training script's data helpers (scripts/train_draft.py), on a tiny random Llama.

They decide what the bundled draft learns from, so their windows and masks must be exact: random
windows are real slices of the training stream, and on-policy windows hold the prompt, then the
draft's own answer from its output vocabulary, cut at eos, with a loss mask over real next tokens.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specextend import bundled

sys.path.insert(0, str(bundled.REPO_ROOT / "scripts"))
import train_draft  # noqa: E402

PAD = EOS = 2


@given(n=st.integers(8, 200), window=st.integers(1, 8), count=st.integers(1, 5), seed=st.integers(0, 10_000))
@settings(max_examples=60, deadline=None)
def test_random_windows_are_slices_of_the_stream(n, window, count, seed):
    stream = torch.arange(1000, 1000 + n, dtype=torch.int32)  # distinct values: a row's start is its offset
    rows = train_draft.random_windows(stream, count, window, random.Random(seed))
    assert rows.shape == (count, window) and rows.dtype == torch.long
    for row in rows:
        start = int(row[0]) - 1000
        assert 0 <= start <= n - window
        assert torch.equal(row, stream[start:start + window].long())


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, initializer_range=0.5, bos_token_id=1, eos_token_id=EOS,
                      pad_token_id=PAD)  # large untied weights: the next token depends on the whole context
    return LlamaForCausalLM(cfg).eval()


def prompts_of(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 48) for _ in range(rng.randrange(2, 12))] for _ in range(count)]


@pytest.mark.parametrize("rows", [None, torch.tensor([0, 2, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47])])
def test_draft_answers_are_prompt_then_answer_from_the_output_vocabulary(tiny, rows):
    torch.manual_seed(1)
    prompts = prompts_of(0, 6)
    ids, mask = train_draft.draft_answers(tiny, prompts, rows, window=24, max_new=8, pad=PAD, eos=EOS)
    assert ids.shape == mask.shape == (6, 24)
    for j, p in enumerate(prompts):
        length = int(mask[j].sum()) + 1  # the mask covers every real token but the last
        assert torch.equal(mask[j], torch.arange(24) < length - 1)
        assert ids[j, :len(p)].tolist() == p
        answer = ids[j, len(p):length].tolist()
        assert 1 <= len(answer) <= 8
        assert EOS not in answer[:-1]  # cut right after the first eos
        assert (ids[j, length:] == PAD).all()
        if rows is not None:
            assert set(answer) <= set(rows.tolist())


def test_batched_left_padded_sampling_matches_one_prompt_at_a_time(tiny):
    """A near-zero temperature makes sampling greedy; the batch pads prompts of different lengths on the
    left, so its answers equal each prompt's own only if the attention mask hides the padding."""
    prompts = prompts_of(3, 5)
    together, _ = train_draft.draft_answers(tiny, prompts, None, 32, 10, PAD, EOS, temperature=1e-4)
    for j, p in enumerate(prompts):
        alone, _ = train_draft.draft_answers(tiny, [p], None, 32, 10, PAD, EOS, temperature=1e-4)
        assert torch.equal(together[j], alone[0])


def test_draft_answers_leave_the_model_in_its_mode(tiny):
    tiny.train()
    train_draft.draft_answers(tiny, prompts_of(5, 2), None, 16, 3, PAD, EOS)
    assert tiny.training
    tiny.eval()
    train_draft.draft_answers(tiny, prompts_of(5, 2), None, 16, 3, PAD, EOS)
    assert not tiny.training
