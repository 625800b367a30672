"""The row-invariant CPU attention kernel (kernels/row_attention.py): right values, and a row's bits independent of
the call it is in (row count, the other rows, thread count), for the prefix form (an AR step, a chain verify) and
the index form (a tree verify)."""

import pytest
import torch

from dartree.kernels.row_attention import row_attention

H, HKV, D, L = 6, 2, 64, 83


def _inputs(dtype, seed=0, rows=17):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, H, D, generator=g).to(dtype)
    k = (torch.randn(HKV, L, D, generator=g) * 2).to(dtype)
    v = torch.randn(HKV, L, D, generator=g).to(dtype)
    return q, k, v


def _reference(q, k, v, keys, scale):
    """float64 softmax(q k^T * scale) v for one row over the given keys (grouped heads as repeat_kv orders them)."""
    kk = k[:, keys].double().repeat_interleave(H // HKV, dim=0)  # [H, n, d]
    vv = v[:, keys].double().repeat_interleave(H // HKV, dim=0)
    s = torch.einsum("hd,hnd->hn", q.double(), kk) * scale
    return torch.einsum("hn,hnd->hd", s.softmax(-1), vv)


def _tree_index(rows):
    """Row r sees the first 60 keys and a chain of tree nodes 60 + (r's ancestors) as a random tree would."""
    parents = [-1] + [int(p) for p in torch.randint(0, 10**6, (rows - 1,), generator=torch.Generator().manual_seed(3))]
    parents = [-1] + [parents[r] % r for r in range(1, rows)]
    idx, counts = torch.full((rows, 60 + rows), L, dtype=torch.long), []
    for r in range(rows):
        anc, a = [], r
        while a >= 0:
            anc.append(60 + a)
            a = parents[a]
        keys = list(range(60)) + sorted(anc)
        idx[r, : len(keys)] = torch.tensor(keys)
        counts.append(len(keys))
    return idx, torch.tensor(counts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_equal_a_float64_softmax_attention(dtype):
    q, k, v = _inputs(dtype)
    counts = torch.arange(L - 16, L + 1)
    out = row_attention(q, k, v, counts, scale=0.1)
    assert out.dtype == torch.float32 and out.shape == (17, H, D)
    for r in range(17):
        ref = _reference(q[r], k, v, list(range(int(counts[r]))), 0.1)
        torch.testing.assert_close(out[r].double(), ref, rtol=0, atol=2e-6)
    idx, counts = _tree_index(17)
    out = row_attention(q, k, v, counts, idx)  # default scale d ** -0.5
    for r in range(17):
        ref = _reference(q[r], k, v, idx[r, : counts[r]].tolist(), D ** -0.5)
        torch.testing.assert_close(out[r].double(), ref, rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_has_the_same_bits_alone_as_in_any_call(dtype, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v = _inputs(dtype)
        counts = torch.arange(L - 16, L + 1)
        full = row_attention(q, k, v, counts)
        other = row_attention(torch.randn(17, H, D).to(dtype), k, v, counts)  # other queries in the other rows
        for r in range(17):
            alone = row_attention(q[r : r + 1], k, v, counts[r : r + 1])  # the AR step at that node
            assert torch.equal(alone[0], full[r])
            mixed = torch.cat([q[:r], q[r : r + 1], torch.randn(16 - r, H, D).to(dtype)])
            assert torch.equal(row_attention(mixed, k, v, counts)[r], full[r])
        assert not torch.equal(other, full)
        # a tree row (index form) equals the AR step over its keys gathered in position order (prefix form)
        idx, tc = _tree_index(17)
        tree = row_attention(q, k, v, tc, idx)
        for r in range(17):
            keys = idx[r, : tc[r]]
            ar = row_attention(q[r : r + 1], k[:, keys].contiguous(), v[:, keys].contiguous(), tc[r : r + 1])
            assert torch.equal(ar[0], tree[r])
    finally:
        torch.set_num_threads(before)


def test_bad_input_is_named():
    q, k, v = _inputs(torch.float32, rows=3)
    with pytest.raises(ValueError, match="q \\[R, H, d\\]"):
        row_attention(q[:, :5], k, v, torch.tensor([3, 4, 5]))  # 5 heads over 2 key/value heads
    with pytest.raises(ValueError, match="q \\[R, H, d\\]"):
        row_attention(q[:, :, :0], k[:, :, :0], v[:, :, :0], torch.tensor([3, 4, 5]))  # head size 0
    with pytest.raises(ValueError, match="idx must be .* got 1 dims"):
        row_attention(q, k, v, [2, 2, 2], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        row_attention(q, k.half(), v.half(), torch.tensor([3, 4, 5]))
    with pytest.raises(ValueError, match="counts must be 3 key counts in 1..83"):
        row_attention(q, k, v, torch.tensor([0, 4, 5]))
    with pytest.raises(ValueError, match="counts must be"):
        row_attention(q, k, v, torch.tensor([3, 4, L + 1]))
    with pytest.raises(ValueError, match="idx must be"):
        row_attention(q, k, v, torch.tensor([2, 2, 2]), torch.tensor([[0, 1], [0, 1], [0, L]]))
    # entries past a row's count are ignored (padding)
    out = row_attention(q, k, v, torch.tensor([1, 2, 2]), torch.tensor([[0, -5], [0, 1], [0, 1]]))
    assert torch.equal(out[0], row_attention(q[:1], k, v, torch.tensor([1]))[0])
