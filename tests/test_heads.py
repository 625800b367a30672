"""Correction heads: unrolled score/advance equals the teacher-forced block_logits (fp32, atol 1e-5), and every
head's score equals its low-rank form base + A · W[C]^T (what the fused frontier kernel relies on)."""

import pytest
import torch

from dartree.models.families import build_head
from dartree.models.families.domino import GRUHead
from dartree.models.families.dspark import MarkovHead
from dartree.models.heads import HEADS, IdentityHead

V, D = 50, 16


def _make(name: str, seed: int = 0):
    """A head of each registered type with non-trivial (randomised) weights; gru heads get embeddings bound."""
    torch.manual_seed(seed)
    params = {"identity": {}, "markov": {"rank": 4}, "gated_markov": {"rank": 4, "hidden_size": D},
              "rnn": {"rank": 4, "hidden_size": D},
              "gru": {"hidden_size": D, "emb_dim": 6, "gru_hidden_dim": 5, "prefix_len": 1},
              "selector": {"rank": 4, "hidden_size": D, "top_k": 7}}[name]
    head = build_head(name, vocab_size=V, **params)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.5)
    if name == "gru":
        head.bind_embeddings(torch.randn(V, D))
    return head.eval()


@pytest.mark.parametrize("name", ["identity", "markov", "gated_markov", "rnn", "gru", "selector"])
def test_unrolled_score_advance_equals_block_logits(name):
    head = _make(name)
    p, n, k = 6, 3, 7
    prev = torch.randint(0, V, (n, p))
    hidden = torch.randn(n, p, D)
    base = torch.randn(n, p, V)
    full = head.block_logits(prev, hidden, base)  # [N, P, V]
    state = head.init_state(prev[:, 0])
    for j in range(p):
        cand = torch.stack([torch.randperm(V)[:k] for _ in range(n)])
        got = head.score(cand, hidden[:, j], state, base[:, j].gather(1, cand))
        torch.testing.assert_close(got, full[:, j].gather(1, cand), atol=1e-5, rtol=1.3e-6)
        if j + 1 < p:
            state = head.advance(state, prev[:, j + 1], hidden[:, j])  # H of the child's own position
    if name != "identity":
        assert not torch.allclose(full[:, 1:], base[:, 1:])  # the correction is not a no-op


@pytest.mark.parametrize("name", ["identity", "markov", "gated_markov", "rnn", "gru", "selector"])
def test_block_states_equal_unrolled_init_state_and_advance(name):
    """The batched teacher-forced states (the Markov family's one lookup) equal init_state/advance unrolled."""
    head = _make(name, seed=2)
    n, p = 3, 5
    prev = torch.randint(0, V, (n, p))
    hidden = torch.randn(n, p, D)
    got = head.block_states(prev, hidden)
    if name == "identity":
        assert got is None
        return
    state = head.init_state(prev[:, 0])
    for j in range(p):
        torch.testing.assert_close(got[:, j], state, atol=1e-6, rtol=1e-6)
        if j + 1 < p:
            state = head.advance(state, prev[:, j + 1], hidden[:, j])


@pytest.mark.parametrize("name", ["markov", "gated_markov", "rnn", "gru", "selector"])
def test_score_equals_low_rank_form(name):
    head = _make(name, seed=1)
    n, k = 4, 9
    hidden = torch.randn(n, D)
    state = head.init_state(torch.randint(0, V, (n,)))
    state = head.advance(state, torch.randint(0, V, (n,)), hidden)  # past the gru head's pure prefix
    cand = torch.stack([torch.randperm(V)[:k] for _ in range(n)])
    base = torch.randn(n, k)
    a = head.factors(hidden, state)  # [N, R]
    rows = head.out_rows(cand)  # [N, K, R]
    torch.testing.assert_close(head.score(cand, hidden, state, base), base + (a[:, None, :] * rows).sum(-1))
    assert a.abs().sum() > 0


def test_gru_head_pure_prefix_uses_base_logits_only():
    head = _make("gru")
    head.prefix_len = 2
    hidden, base = torch.randn(2, D), torch.randn(2, 5)
    cand = torch.randint(0, V, (2, 5))
    state = head.init_state(torch.tensor([3, 4]))
    for depth in range(3):
        got = head.score(cand, hidden, state, base)
        assert torch.equal(got, base) == (depth < 2)
        assert torch.equal(head.factors(hidden, state), torch.zeros(2, head.emb_dim)) == (depth < 2)
        state = head.advance(state, torch.tensor([1, 2]), hidden)


def test_gru_head_unbound_and_rnn_without_hidden_are_clear_errors():
    head = GRUHead(V, D, emb_dim=4, gru_hidden_dim=3)
    with pytest.raises(RuntimeError, match="bind_embeddings"):
        head.init_state(torch.tensor([1]))
    with pytest.raises(ValueError, match=r"embeddings of shape \[3, 16\]"):
        head.bind_embeddings(torch.zeros(3, D))
    rnn = _make("rnn")
    with pytest.raises(ValueError, match="hidden state H"):
        rnn.advance(rnn.init_state(torch.tensor([1])), torch.tensor([2]), None)
    with pytest.raises(ValueError, match="hidden_size"):
        build_head("gated_markov", vocab_size=V, rank=4)


def test_embeddings_are_not_stored_and_hparams_rebuild_the_head():
    for name in ("markov", "gated_markov", "rnn", "gru"):
        head = _make(name)
        again = build_head(name, **head.hparams())
        assert {k: v.shape for k, v in again.state_dict().items()} == {k: v.shape for k, v in head.state_dict().items()}
    assert "_embed" not in _make("gru").state_dict()


def test_confidence_head_is_optional_and_reads_hidden_then_prev_embedding():
    head = build_head("markov", vocab_size=V, rank=4, hidden_size=D, confidence_head=True)
    assert tuple(head.confidence.weight.shape) == (1, D + 4) and tuple(head.confidence.bias.shape) == (1,)
    hidden, tok = torch.randn(3, D), torch.tensor([1, 2, 3])
    state = head.init_state(tok)
    want = hidden @ head.confidence.weight[0, :D] + head.w1.weight[tok] @ head.confidence.weight[0, D:] + head.confidence.bias
    torch.testing.assert_close(head.confidence_logits(hidden, state), want)
    assert "confidence.weight" not in MarkovHead(V, 4).state_dict()


def test_untrained_markov_head_is_identity():
    head = MarkovHead(20, 4)
    base = torch.randn(2, 3, 20)
    torch.testing.assert_close(head.block_logits(torch.zeros(2, 3, dtype=torch.long), None, base), base)


def test_unknown_head_lists_available():
    with pytest.raises(KeyError, match="markov"):
        build_head("nope")
    assert {"identity", "markov", "gated_markov", "rnn", "gru"} <= set(HEADS)
    assert IdentityHead().init_state(torch.tensor([1])) is None


@pytest.mark.parametrize("name", ["identity", "markov", "gated_markov", "rnn", "gru", "selector"])
def test_block_logits_on_a_draft_vocabulary_equals_the_restricted_full_result(name, target):
    from conftest import make_head

    torch.manual_seed(1)
    head = make_head(name, target)
    v, p, n = 96, 5, 3
    prev = torch.randint(0, v, (n, p))
    hidden = torch.randn(n, p, 32)
    base = torch.randn(n, p, v)
    vocab = torch.tensor([0, 3, 7, 8, 40, 95])
    full = head.block_logits(prev, hidden, base)
    sub = head.block_logits(prev, hidden, base[..., vocab], vocab=vocab)
    torch.testing.assert_close(sub, full[..., vocab], atol=1e-5, rtol=1e-5)
