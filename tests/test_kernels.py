"""Triton kernels against their plain-torch twins.

Without a GPU the kernels run in the Triton interpreter: TRITON_INTERPRET=1 is set here, before the kernel
modules (imported lazily on the first Triton launch) define their @triton.jit functions. Ids and masks must be
equal exactly (ties toward the lower token id / flat index in both); floats within per-dtype tolerances.
"""

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from dartree.kernels._backend import resolve  # noqa: E402
from dartree.kernels.candidates import topk_candidates, topk_candidates_ref  # noqa: E402
from dartree.kernels.frontier import frontier_topk, frontier_topk_ref  # noqa: E402
from dartree.kernels.gru import gru_cell, gru_cell_ref  # noqa: E402
from dartree.kernels.tree_compile import tree_attention, tree_attention_ref  # noqa: E402

DEV = "cuda" if ON_GPU else "cpu"
SIZES = [1, 7, 63, 64, 65]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("m", SIZES)
def test_candidates_rows(m):
    # M rows (depths), odd vocabulary spanning two Triton blocks, many exact ties
    x = torch.randn(m, 1100, generator=_gen(m))
    x[:, ::7] = x[:, :1]
    x[:, 3] = x[:, 5]
    ids, vals, lse = topk_candidates(x.to(DEV), 9, backend="triton")
    rids, rvals, rlse = topk_candidates_ref(x, 9)
    assert torch.equal(ids.cpu(), rids) and torch.equal(vals.cpu(), rvals)
    torch.testing.assert_close(lse.cpu(), rlse, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("k", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_candidates_k_and_dtypes(k, dtype):
    x = (torch.randn(3, 97, generator=_gen(k)) * 4).to(dtype)  # low precision dtypes produce ties themselves
    ids, vals, lse = topk_candidates(x.to(DEV), k, backend="triton")
    rids, rvals, rlse = topk_candidates_ref(x, k)
    assert ids.shape == (3, min(k, 97))
    assert torch.equal(ids.cpu(), rids) and torch.equal(vals.cpu(), rvals)
    torch.testing.assert_close(lse.cpu(), rlse, atol=1e-5, rtol=1e-6)
    # the ref's meaning: sorted by (value desc, id asc), and nothing outside beats the K-th
    xf = x.float()
    for r in range(3):
        pairs = list(zip((-rvals[r]).tolist(), rids[r].tolist()))
        assert pairs == sorted(pairs)
        rest = torch.ones(97, dtype=torch.bool)
        rest[rids[r]] = False
        if rest.any():
            assert float(xf[r][rest].max()) <= float(rvals[r, -1])


def test_candidates_all_tied_take_lowest_ids():
    ids, vals, lse = topk_candidates(torch.zeros(2, 50, device=DEV), 4, backend="triton")
    assert ids.cpu().tolist() == [[0, 1, 2, 3]] * 2
    torch.testing.assert_close(lse.cpu(), torch.full((2,), float(torch.log(torch.tensor(4.0)))))


@pytest.mark.parametrize("f", SIZES)
@pytest.mark.parametrize("r", [0, 5, 64])
def test_frontier_matches_ref(f, r):
    g = _gen(100 * f + r)
    k = 64 if f != 7 else 33
    base = torch.randn(k, generator=g) * 3
    s = -torch.rand(f, generator=g) * 4
    act = torch.randn(f, r, generator=g) if r else None
    rows = torch.randn(k, r, generator=g) * 0.3 if r else None
    q = {1: 1, 7: 12, 63: 64, 64: 4, 65: 30}[f]
    mv = (lambda t: None if t is None else t.to(DEV))
    pick, path = frontier_topk(base.to(DEV), s.to(DEV), q, mv(act), mv(rows), backend="triton")
    rpick, rpath = frontier_topk_ref(base, s, q, act, rows)
    assert torch.equal(pick.cpu(), rpick)
    torch.testing.assert_close(path.cpu(), rpath, atol=1e-5, rtol=1e-5)
    assert bool((rpath[:-1] >= rpath[1:]).all())


def test_frontier_ties_go_to_the_lower_flat_index():
    # integer-valued factors make every product exact, so both backends see the same exact ties
    base = torch.tensor([1.0, 1.0, 0.0, 1.0, -2.0])
    s = torch.tensor([0.0, 0.0, -1.0])
    act = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    rows = torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [2.0, 0.0]])
    for a, w in ((None, None), (act, rows)):
        mv = (lambda t: None if t is None else t.to(DEV))
        pick, _ = frontier_topk(base.to(DEV), s.to(DEV), 8, mv(a), mv(w), backend="triton")
        rpick, _ = frontier_topk_ref(base, s, 8, a, w)
        assert torch.equal(pick.cpu(), rpick)
    # identity form: parents 0 and 1 tie exactly; candidates 0, 1, 3 tie within a row
    assert frontier_topk_ref(base, s, 6)[0].tolist() == [0, 1, 3, 5, 6, 8]


def test_frontier_quota_clamps_and_bad_shapes_are_named():
    pick, path = frontier_topk_ref(torch.zeros(3), torch.zeros(2), 100)
    assert pick.tolist() == list(range(6))
    torch.testing.assert_close(path, torch.full((6,), -float(torch.log(torch.tensor(3.0)))))
    with pytest.raises(ValueError, match="act"):
        frontier_topk_ref(torch.zeros(3), torch.zeros(2), 1, torch.zeros(2, 4), None)
    with pytest.raises(ValueError, match="disagree"):
        frontier_topk_ref(torch.zeros(3), torch.zeros(2), 1, torch.zeros(2, 4), torch.zeros(3, 5))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gru_cell_matches_ref_and_torch(n, dtype):
    g = {1: 5, 7: 64, 63: 17, 64: 33, 65: 65}[n]
    gen = _gen(n)
    gi = torch.randn(n, 3 * g, generator=gen).to(dtype)
    h = torch.randn(n, g, generator=gen).to(dtype)
    w = (torch.randn(3 * g, g, generator=gen) / g**0.5).to(dtype)
    got = gru_cell(gi.to(DEV), h.to(DEV), w.to(DEV), backend="triton").cpu()
    ref = gru_cell_ref(gi, h, w)
    torch.testing.assert_close(got, ref, atol=TOL[torch.float32] * 10, rtol=1e-5)
    # the ref is nn.GRUCell without bias, gate order r, z, n (input projection given as gi = x W_ih^T)
    cell = torch.nn.GRUCell(g, g, bias=False)
    x = torch.randn(n, g, generator=gen)
    with torch.no_grad():
        cell.weight_hh.copy_(w.float())
        want = cell(x, h.float())
    torch.testing.assert_close(gru_cell_ref(x @ cell.weight_ih.detach().t(), h.float(), w.float()), want,
                               atol=1e-5, rtol=1e-5)
    assert got.dtype == torch.float32


def test_gru_cell_bad_shapes():
    with pytest.raises(ValueError, match="disagree"):
        gru_cell_ref(torch.zeros(2, 9), torch.zeros(2, 4), torch.zeros(12, 4))


def _random_parents(m, seed):
    g = _gen(seed)
    return torch.tensor([int(torch.randint(0, i + 1, (1,), generator=g)) for i in range(m)], dtype=torch.long)


@pytest.mark.parametrize("m", [0] + SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tree_compile_matches_ref(m, dtype):
    for parents in (_random_parents(m, m), torch.arange(m), torch.zeros(m, dtype=torch.long)):
        got = tree_attention(parents.to(DEV), 11, dtype, backend="triton")
        ref = tree_attention_ref(parents, 11, dtype)
        for a, b in zip(got, ref):
            assert a.dtype == b.dtype and torch.equal(a.cpu(), b)


@pytest.mark.parametrize("m", [0, 1, 16, 65])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_compile_cpu_path_equals_ref(m, dtype):
    # backend="torch" on CPU runs the NumPy-row version: exactly the ref's tensors (values, dtypes)
    for parents in (_random_parents(m, m + 1), torch.arange(m), torch.zeros(m, dtype=torch.long)):
        got = tree_attention(parents, 11, dtype, backend="torch")
        ref = tree_attention_ref(parents, 11, dtype)
        for a, b in zip(got, ref):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    with pytest.raises(ValueError, match="precede"):
        tree_attention(torch.tensor([0, 2]), backend="torch")


@pytest.mark.parametrize("m", [0, 1, 16, 65])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compiled_full_mask_equals_the_ref_with_the_prefix(m, dtype):
    """The compiled CPU verify mask (integer bit patterns viewed as the float dtype) is the ref's tree block with
    zeros prepended for the committed prefix, bit for bit; depths and positions equal the ref's; bad parents are
    refused with the ref's message."""
    from dartree.kernels.tree_compile import full_mask_cpu

    for start in (0, 11, 300):
        for parents in (_random_parents(m, m + 2), torch.arange(m), torch.zeros(m, dtype=torch.long)):
            depth, pos, mask = full_mask_cpu(parents, start, dtype)
            rd, rp, rmask = tree_attention_ref(parents, start, dtype)
            want = torch.cat([torch.zeros(m + 1, start, dtype=dtype), rmask], dim=1)
            assert torch.equal(depth, rd) and torch.equal(pos, rp)
            assert mask.dtype == dtype and torch.equal(mask.view(torch.uint8), want.view(torch.uint8))
    for bad in (torch.tensor([0, 2]), torch.tensor([-1]), torch.tensor([[0]])):
        with pytest.raises(ValueError, match="precede|1-D"):
            full_mask_cpu(bad, 5, torch.float32)
    for start in (-1, -3):  # would index before the buffer: refused, never written
        with pytest.raises(ValueError, match="start must be >= 0"):
            full_mask_cpu(torch.arange(4), start, torch.float32)


def test_tree_compile_ref_meaning():
    # root -> 1 -> 2, root -> 3, 1 -> 4
    depth, pos, mask = tree_attention_ref(torch.tensor([0, 1, 0, 1]), 5)
    assert depth.tolist() == [0, 1, 2, 1, 2] and pos.tolist() == [5, 6, 7, 6, 7]
    vis = (mask == 0).int().tolist()
    assert vis == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 1, 0, 0, 1]]
    assert float(mask.min()) == torch.finfo(torch.float32).min
    with pytest.raises(ValueError, match="precede"):
        tree_attention_ref(torch.tensor([0, 2]))


def test_backend_choice(monkeypatch):
    assert resolve("auto", torch.device("cpu")) == "torch"
    assert resolve("torch", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        resolve("cuda", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not ON_GPU:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            resolve("triton", torch.device("cpu"))


@pytest.mark.parametrize("builder", ["chain", "pruned", "fixed", "pctree", "heap-sequential", "ddtree"])
def test_builders_give_the_same_tree_on_both_backends(builder):
    from conftest import make_markov
    from dartree.decode.builders import get_builder
    from dartree.decode.trees import DraftBlock

    g = _gen(3)
    block = DraftBlock(torch.randn(5, 32, generator=g), torch.randn(5, 80, generator=g) * 3)
    head = make_markov()
    if ON_GPU:
        block, head = DraftBlock(block.hidden.to(DEV), block.base_logits.to(DEV)), head.to(DEV)
    trees = [get_builder(builder)(block, head, 4, 12, k=16, width=4, backend=b) for b in ("torch", "triton")]
    assert trees[0].size > 0
    for field in ("tokens", "parents", "depth"):
        assert torch.equal(getattr(trees[0], field).cpu(), getattr(trees[1], field).cpu())
    torch.testing.assert_close(trees[0].score.cpu(), trees[1].score.cpu(), atol=1e-5, rtol=1e-5)


def _inside_tie(x):
    x[:, 20] = 50.0  # rank 0 and 1 tie; the topk order may put id 20 first, the ref puts id 10 first
    x[:, 10] = 50.0
    x[:2, 30] = 49.0
    return x


def test_cpu_topk_candidates_equal_the_ref_with_and_without_boundary_ties():
    """The CPU path (one top-(K+1), falling back to the ref on a tie at the K-th value) returns the ref's ids,
    values and log-sum-exp exactly, including tie order (value desc, id asc)."""
    from dartree.kernels.candidates import topk_candidates, topk_candidates_ref

    g = _gen(11)
    for logits in (torch.randn(7, 300, generator=g) * 4,  # no ties
                   torch.randint(0, 6, (7, 300), generator=g).float(),  # ties everywhere, also at the boundary
                   torch.cat([torch.randn(3, 40, generator=g), torch.full((3, 40), 2.0)], dim=1),  # tied top block
                   _inside_tie(torch.randn(4, 300, generator=g)),  # a tie among the top values, none at the K-th
                   (torch.randn(6, 2048, generator=g) * 3).bfloat16().float()):  # bf16 rounding: ties at the K-th
        for k in (1, 5, 40, 64, 299, 300):
            got, want = topk_candidates(logits, k, backend="torch"), topk_candidates_ref(logits, k)
            for a, b in zip(got, want):
                assert torch.equal(a, b), k
            ids, vals, lse = topk_candidates(logits, k, backend="torch", with_lse=False)  # selection only
            assert torch.equal(ids, want[0]) and torch.equal(vals, want[1])
            assert lse is None or torch.equal(lse, want[2])


def test_cpu_bf16_keyed_topk_equals_the_ref_and_hands_back_infinities_and_zeros():
    """bf16 logits on CPU (and fp32 ones holding bf16 values) take one top-K of fp32 keys carrying the token id in
    their low bits: exact against the ref (ids, values, tie order), also for negative values; a selected infinity or
    zero goes back to the other path."""
    from dartree.kernels.candidates import _bf16_keyed_topk, topk_candidates, topk_candidates_ref

    g = _gen(12)
    base = (torch.randn(6, 2048, generator=g) * 3).bfloat16()  # bf16 rounding ties at and inside the K-th value
    neg = (torch.randn(4, 513, generator=g) - 30).bfloat16()  # all negative: keys of negatives run the other way
    tied = torch.randint(-3, 4, (5, 700), generator=g).bfloat16()  # heavy ties, values of both signs, zeros
    masked = base.clone()
    masked[:, ::3] = float("-inf")  # a masked vocabulary
    hot = base.clone()
    hot[1, 17] = float("inf")
    zeros = base.clone()
    zeros[:, 5], zeros[:, 9] = 50.0, -0.0
    zeros[:, 7] = 0.0
    for logits, keyed in ((base, True), (neg, True), (base[:, 1:], True), (tied, None), (masked, None),
                          (hot, False), (zeros, None)):
        for k in (1, 5, 64, 300):
            k = min(k, logits.shape[1] - 1)
            want = topk_candidates_ref(logits, k)
            got = topk_candidates(logits, k, backend="torch")
            for a, b in zip(got, want):
                assert torch.equal(a, b), k
            fast = _bf16_keyed_topk(logits, k)
            if keyed is True:
                assert fast is not None and torch.equal(fast[0], want[0]) and torch.equal(fast[1], want[1])
            elif keyed is False:
                assert fast is None  # +inf is a NaN key: never trusted
            elif fast is not None:  # zeros or -inf only where they were not selected
                assert torch.equal(fast[0], want[0]) and torch.equal(fast[1], want[1])
                assert not bool((fast[1] == 0).any())
    # fp32 logits holding bf16 values (a bf16 drafter's base logits cast up) take the keyed path; true fp32 does not
    up = base.float()
    fast = _bf16_keyed_topk(up, 64)
    want = topk_candidates_ref(up, 64)
    assert fast is not None and torch.equal(fast[0], want[0]) and torch.equal(fast[1], want[1])
    assert _bf16_keyed_topk(torch.randn(3, 500, generator=g), 5) is None
    k3 = topk_candidates(zeros, 3, backend="torch")[0]
    assert k3[:, 0].tolist() == [5] * 6  # 50.0 first; the ±0 ties then follow id order in the ref's path


def test_a_bf16_draft_flags_its_logits_and_the_flagged_keyed_path_equals_the_ref():
    """draft_block in bf16 marks its fp32 base logits as bf16 values (all 16 low bits zero), in fp32 it does not;
    the flagged selection (no low-bit check) equals the ref, for positive, negative and mixed-sign rows."""
    from conftest import LAYERS, VOCAB, make_drafter
    from dartree.decode.generate import draft_block
    from dartree.decode.trees import block_candidates
    from dartree.kernels.candidates import topk_candidates, topk_candidates_ref
    from dartree.models.drafter import DraftCache
    from dartree.models.target import tiny_target

    prompt = [4, 9, 16, 25, 36, 49]
    for dtype in (torch.float32, torch.bfloat16):
        tgt = tiny_target(vocab_size=VOCAB, layer_ids=LAYERS, dtype=dtype)
        dr = make_drafter().to(dtype)
        with torch.inference_mode():
            feats = tgt.forward(torch.tensor([prompt])).features[0]
            block = draft_block(tgt, dr, 3, len(prompt), feats, DraftCache(len(dr.layers)))
        assert block.base_logits.dtype == torch.float32
        assert block.bf16_values is (dtype == torch.bfloat16)
        if block.bf16_values:
            assert not bool((block.base_logits.view(torch.int32) & 0xFFFF).any())
            assert block.first(3).bf16_values
        for k in (1, 7, 40):
            ids, vals = block_candidates(block, k)
            want = topk_candidates_ref(block.base_logits, k)
            assert torch.equal(ids, want[0]) and torch.equal(vals, want[1])
    g = _gen(21)
    for rows in ((torch.randn(5, 3000, generator=g) * 3 + 8), (torch.randn(5, 3000, generator=g) - 40),
                 torch.randn(5, 3000, generator=g)):
        up = rows.bfloat16().float()
        for k in (1, 64, 1500):
            got = topk_candidates(up, k, backend="torch", bf16_values=True)
            for a, b in zip(got, topk_candidates_ref(up, k)):
                assert torch.equal(a, b), k
