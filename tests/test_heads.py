"""Correction heads: unrolled score/advance equals the teacher-forced block_logits (fp32, atol 1e-5)."""

import pytest
import torch

from dartree.models.heads import HEADS, IdentityHead, MarkovHead, build_head


@pytest.mark.parametrize("name", ["identity", "markov"])
def test_unrolled_score_advance_equals_block_logits(name):
    torch.manual_seed(0)
    v, p, d, n, k = 50, 6, 16, 3, 7
    head = build_head(name, vocab_size=v) if name == "identity" else build_head(name, vocab_size=v, rank=4)
    if name == "markov":
        torch.nn.init.normal_(head.w2.weight)
    prev = torch.randint(0, v, (n, p))
    hidden = torch.randn(n, p, d)
    base = torch.randn(n, p, v)
    full = head.block_logits(prev, hidden, base)  # [N, P, V]
    state = head.init_state(prev[:, 0])
    for j in range(p):
        cand = torch.stack([torch.randperm(v)[:k] for _ in range(n)])
        got = head.score(cand, hidden[:, j], state, base[:, j].gather(1, cand))
        torch.testing.assert_close(got, full[:, j].gather(1, cand), atol=1e-5, rtol=1.3e-6)
        if j + 1 < p:
            state = head.advance(state, prev[:, j + 1], hidden[:, j])  # H of the child's own position
    if name == "markov":
        assert not torch.allclose(full, base)  # the correction is not a no-op


def test_untrained_markov_head_is_identity():
    head = MarkovHead(20, 4)
    base = torch.randn(2, 3, 20)
    torch.testing.assert_close(head.block_logits(torch.zeros(2, 3, dtype=torch.long), None, base), base)


def test_unknown_head_lists_available():
    with pytest.raises(KeyError, match="markov"):
        build_head("nope")
    assert {"identity", "markov"} <= set(HEADS)
    assert IdentityHead().init_state(torch.tensor([1])) is None
