"""Row-invariant target forwards: a verify row's logits equal the AR step's bit for bit (models/invariant.py)."""

import copy

import pytest
import torch

from dartree.decode.harness.invariance import row_invariance_map, verify_rows_vs_ar
from dartree.decode.settings import DecodeSettings
from dartree.models.invariant import invariant_attention, row_invariant


def _attn(q, k, v, mask):
    out, _ = invariant_attention(None, q, k, v, mask, scaling=0.125)
    return out  # [B, Q, H, d]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_gets_the_same_bits_alone_as_inside_a_call_of_any_shape(threads, monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the CPU kernel splits its work by threads and batch size
    try:
        _rows_alone_and_together()
    finally:
        torch.set_num_threads(before)


def _rows_alone_and_together():
    g = torch.Generator().manual_seed(0)
    p, m, h, hkv, d = 37, 9, 6, 2, 64
    k = torch.randn(1, hkv, p + m, d, generator=g)
    v = torch.randn(1, hkv, p + m, d, generator=g)
    q = torch.randn(1, h, m, d, generator=g)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 6]  # a tree: each row sees the prefix, its ancestors and itself
    vis = torch.zeros(m, p + m, dtype=torch.bool)
    vis[:, :p] = True
    for r in range(m):
        a = r
        while a >= 0:
            vis[r, p + a] = True
            a = parents[a]
    mask = torch.where(vis, 0.0, torch.finfo(torch.float32).min)[None, None]
    many = _attn(q, k, v, mask)
    for r in range(m):  # the AR step at node r: its visible keys in position order, one query, no mask
        idx = vis[r].nonzero()[:, 0]
        one = _attn(q[:, :, r : r + 1], k[:, :, idx], v[:, :, idx], None)
        assert torch.equal(one[0, 0], many[0, r]), r
    # a boolean mask and the causal default give the same rows; a row that sees nothing is named
    assert torch.equal(_attn(q, k, v, vis[None, None]), many)
    causal = _attn(q, k, v, None)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :p + m].repeat_interleave(3, 1),
                                                           v.repeat_interleave(3, 1), scale=0.125,
                                                           attn_mask=torch.ones(m, p + m, dtype=torch.bool).tril(p))
    torch.testing.assert_close(causal, ref.transpose(1, 2))
    vis[4] = False
    with pytest.raises(ValueError, match="sees no key"):
        _attn(q, k, v, vis[None, None])


def _verify_vs_ar(target, ids, tree: bool):
    """Rows of one 9-row verify forward (a chain, or siblings under the root) against AR steps, inside the mode."""
    with row_invariant(target):
        return verify_rows_vs_ar(target, ids, 9, tree=tree)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_rows_equal_ar_steps_bit_for_bit_on_the_default_target(dtype):
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # as a decode on 2 cores runs (the kernels split work by thread count)
    try:
        _default_target_rows(dtype)
    finally:
        torch.set_num_threads(before)


def _default_target_rows(dtype):
    from dartree.models.invariant import choose_invariant_linear
    from dartree.models.target import load_target

    target = load_target("smollm2", dtype=dtype)
    try:
        choose_invariant_linear(target.model)
    except ValueError as exc:
        pytest.skip(f"{dtype} on this CPU: {exc}")
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "Explain how a hash map works."}],
                                               add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert _verify_vs_ar(target, ids, tree=False) == [True] * 9
    assert _verify_vs_ar(target, ids, tree=True) == [True] * 9
    # the per-operation map under the mode: every linear, norm, attention and the logits agree
    with row_invariant(target):
        res = row_invariance_map(target, ids, 9)
    assert len(res) == 30 * 10 + 3 and all(d == 0.0 for d in res.values()), {k: d for k, d in res.items() if d}
    # without it the row-wise norms are invariant anyway; which other ops split depends on the CPU's kernels
    res = row_invariance_map(target, ids, 9)
    assert len(res) == 303 and all(d == 0.0 for k, d in res.items() if k.endswith("norm"))


def test_speculative_output_equals_ar_inside_the_mode(target, drafter):
    from dartree.decode.generate import autoregressive_generate, speculative_generate
    from dartree.models.heads import IdentityHead

    prompt = [5, 9, 11, 3, 7, 2, 8]
    with row_invariant(target):
        ar = autoregressive_generate(target, prompt, max_new_tokens=24).tokens
        for name in ("chain", "pruned"):
            out = speculative_generate(target, drafter, IdentityHead(), prompt, DecodeSettings(builder=name,
                                                                                               max_new_tokens=24,
                                                                                               budget=8)).tokens
            assert list(out) == list(ar), name
    assert target.model.config._attn_implementation != "dartree_row_invariant"  # restored on exit


def test_the_linear_check_finds_a_path_that_splits_rows():
    from dartree.models.invariant import linear_is_row_invariant

    w = torch.randn(384, 256, generator=torch.Generator().manual_seed(0))
    assert linear_is_row_invariant(w, "onednn", 2)  # the packed call, one-row calls padded to two

    import dartree.models.invariant as inv

    real = inv.F.linear
    try:
        # a stand-in for a kernel chosen by row count: it rounds a lone row differently
        inv.F.linear = lambda x, w_: real(x, w_) + (1e-3 if x.shape[0] == 1 else 0.0)
        assert not linear_is_row_invariant(w, "aten")
    finally:
        inv.F.linear = real


def test_enter_invariant_on_off_auto_and_the_reason_when_off(target):
    import contextlib

    from dartree.models.invariant import enter_invariant

    impl = target.model.config._attn_implementation
    with contextlib.ExitStack() as stack:
        mode, note = enter_invariant("off", target, stack)
        assert mode is None and note.startswith("row-invariant verify: off (--invariant off)")
        assert target.model.config._attn_implementation == impl
    with contextlib.ExitStack() as stack:  # auto in float32: the default kernels (exact in practice, cheaper)
        mode, note = enter_invariant("auto", target, stack)
        assert mode is None and note.startswith("row-invariant verify: off (auto: float32")
    from dartree.models.invariant import choose_invariant_linear

    bf16 = copy.deepcopy(target)
    bf16.model.to(torch.bfloat16)
    cases = [("on", target)]
    try:
        choose_invariant_linear(bf16.model)
        cases += [("auto", bf16), ("on", bf16)]
    except ValueError as exc:  # no row-invariant bf16 linear on this CPU: auto says so, on refuses
        mode, note = enter_invariant("auto", bf16, contextlib.ExitStack())
        assert mode is None and str(exc) in note
        with pytest.raises(ValueError):
            enter_invariant("on", bf16, contextlib.ExitStack())
    for requested, t in cases:  # the CPU kernel's dtypes
        impl = t.model.config._attn_implementation
        with contextlib.ExitStack() as stack:
            mode, note = enter_invariant(requested, t, stack)
            assert mode is not None and note.startswith("row-invariant verify: on (linear ")
            assert t.model.config._attn_implementation == "dartree_row_invariant"
        assert t.model.config._attn_implementation == impl  # closing the stack restores the kernels
    with pytest.raises(ValueError, match="invariant must be one of auto, on, off, got 'yes'"):
        enter_invariant("yes", target, contextlib.ExitStack())
    half = copy.deepcopy(target)  # a copy: the session's target stays float32
    half.model.to(torch.float16)
    mode, note = enter_invariant("auto", half, contextlib.ExitStack())
    assert mode is None and "no row-invariant attention kernel for float16" in note
    with pytest.raises(ValueError, match="no row-invariant attention kernel for float16"):
        enter_invariant("on", half, contextlib.ExitStack())


def test_a_verify_of_more_than_256_rows_keeps_the_ar_steps_bits():
    # every call but a prefill from an empty cache goes through the row-invariant kernel, however many rows
    g = torch.Generator().manual_seed(4)
    p, m, h, hkv, d = 40, 300, 4, 2, 16
    q = torch.randn(1, h, m, d, generator=g).bfloat16()
    k = torch.randn(1, hkv, p + m, d, generator=g).bfloat16()
    v = torch.randn(1, hkv, p + m, d, generator=g).bfloat16()
    vis = torch.ones(m, p + m, dtype=torch.bool).tril(p)  # a chain: row r sees the prefix and rows 0..r
    mask = torch.zeros(1, 1, m, p + m).bfloat16().masked_fill(~vis, torch.finfo(torch.bfloat16).min)
    out = _attn(q, k, v, mask)
    for r in (0, 150, m - 1):
        ar = _attn(q[:, :, r : r + 1], k[:, :, : p + r + 1], v[:, :, : p + r + 1], None)  # the AR step, no mask
        assert torch.equal(out[0, r], ar[0, 0]), r
