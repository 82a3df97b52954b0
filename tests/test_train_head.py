"""The EAGLE head's training pieces (scripts/train_head.py): the training-time-test mask, and a loss that a few steps
of AdamW bring down on a tiny target's own labels, its unrolled steps reading the head's own states."""

from __future__ import annotations

import torch
from conftest import tiny

from scripts.train_head import Unrolled, head_loss, make_head, unrolled_mask


def test_the_unrolled_mask_shows_step_zero_causally_and_later_steps_on_the_diagonal():
    m = unrolled_mask(4, 2)[0, 0]
    assert m.shape == (4, 12)
    assert torch.equal(m[:, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(m[:, 4:8], torch.eye(4, dtype=torch.bool)) and torch.equal(m[:, 8:], torch.eye(4, dtype=torch.bool))


def test_unrolled_keys_join_every_step():
    cache = Unrolled()
    k1, v1 = cache.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 0)
    k2, _ = cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    assert k1.shape[2] == 3 and k2.shape[2] == 6 and k2[:, :, :3].eq(1).all() and k2[:, :, 3:].eq(0).all()


def test_a_few_steps_bring_the_loss_down_on_the_targets_own_labels():
    target = tiny("llama", layers=6, seed=3)
    for p in target.parameters():
        p.requires_grad_(False)
    vocab_ids = torch.arange(0, 97, 2)  # a reduced draft vocabulary
    head = make_head(target, vocab_ids)
    assert torch.equal(torch.arange(len(vocab_ids)) + head.d2t, vocab_ids) and head.t2d.sum() == len(vocab_ids)
    to_draft = torch.full((97,), -1, dtype=torch.long)
    to_draft[vocab_ids] = torch.arange(len(vocab_ids))
    ids = torch.randint(0, 97, (4, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    lp, top = torch.log_softmax(out.logits, -1).topk(16, dim=-1)
    batch = {"ids": ids, "mask": torch.ones_like(ids, dtype=torch.bool),
             "feats": torch.cat([out.hidden_states[i] for i in head.streams], -1).half(), "top_lp": lp.half(),
             "top_id": top.int()}
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    first, agree = head_loss(head, batch, to_draft, 3)
    assert len(agree) == 3 and all(0.0 <= a <= 1.0 for a in agree)
    for _ in range(30):
        loss, _ = head_loss(head, batch, to_draft, 3)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first.item()
    assert all(p.grad is None for p in target.parameters())  # the target only labels
