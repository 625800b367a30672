"""Prepacked oneDNN linears (dartree.models.packed): same values as nn.Linear, safe fallbacks, lossless decoding.

Values against the reference op, losslessness, and bad input named in the error.
"""

import pytest
import torch
import torch.nn.functional as F

from conftest import make_drafter, make_head
from dartree.decode.generate import autoregressive_generate, speculative_generate
from dartree.decode.settings import DecodeSettings
from dartree.models.packed import (SINGLE_ROW_PACKED_MIN, TUNE_MAX_MODULES, PackedLinear, choose_linear,
                                   onednn_linear_supported, pack_linears, tune_linears)
from dartree.models.target import tiny_target

pytestmark = pytest.mark.skipif(not onednn_linear_supported()[0], reason="this torch build has no oneDNN")


def _linear(i, o, bias, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Linear(i, o, bias=bias).requires_grad_(False)
    return m


@pytest.mark.parametrize("rows", [2, 5, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_linear_and_rows_are_independent(rows, bias):
    lin = _linear(48, 80, bias)
    x = torch.randn(1, rows, 48)
    want = lin(x)
    pack_linears(lin)
    assert type(lin) is PackedLinear
    got = lin(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, torch.zeros_like(got))
    # a row computed in a batch equals the same row computed with one other row, bit for bit
    pair = lin(x[:, :2])
    assert torch.equal(pair, got[:, :2])


def test_single_row_small_weight_is_exactly_f_linear_and_large_weight_is_packed():
    lin = _linear(64, 32, False)
    pack_linears(lin)
    x = torch.randn(1, 1, 64)
    assert torch.equal(lin(x), F.linear(x, lin.weight))  # the aten path itself, not a close copy
    assert "_dartree_packed" not in lin.__dict__
    big_out = SINGLE_ROW_PACKED_MIN // 64 + 1
    big = _linear(64, big_out, False)
    want = big(x)
    pack_linears(big)
    torch.testing.assert_close(big(x), want, rtol=1e-5, atol=1e-5)
    assert big.__dict__["_dartree_packed"][4] is not None  # the single-row call went through the packed copy


def test_packed_copy_follows_in_place_weight_changes_and_replacement():
    lin = _linear(16, 24, True)
    pack_linears(lin)
    x = torch.randn(3, 16)
    before = lin(x)
    with torch.no_grad():
        lin.weight.mul_(2.0)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(lin(x), before)
    lin.weight = torch.nn.Parameter(torch.randn(24, 16), requires_grad=False)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    lin.load_state_dict({"weight": torch.ones(24, 16), "bias": torch.zeros(24)})
    torch.testing.assert_close(lin(x), x.sum(-1, keepdim=True).expand(3, 24), rtol=1e-5, atol=1e-5)


def test_training_through_a_packed_module_is_nn_linear():
    ref = torch.nn.Linear(12, 7)
    lin = torch.nn.Linear(12, 7)
    lin.load_state_dict(ref.state_dict())
    pack_linears(lin)
    x = torch.randn(4, 12)
    ref(x).square().sum().backward()
    lin(x).square().sum().backward()
    assert torch.equal(lin.weight.grad, ref.weight.grad) and torch.equal(lin.bias.grad, ref.bias.grad)
    # other dtypes fall back as well
    assert lin(x.double().float()).dtype == torch.float32
    with torch.no_grad():
        assert lin.to(torch.float64)(x.double()).dtype == torch.float64


def test_packing_keeps_names_tying_and_unpacks():
    target = tiny_target(vocab_size=96)
    keys = list(target.model.state_dict())
    n = pack_linears(target.model)
    assert n == sum(1 for m in target.model.modules() if isinstance(m, torch.nn.Linear)) and n > 0
    assert list(target.model.state_dict()) == keys
    assert pack_linears(target.model, "aten") == n
    assert not any(type(m) is PackedLinear for m in target.model.modules())
    with pytest.raises(ValueError, match="'onednn' or 'aten'"):
        pack_linears(target.model, "mkl")


def test_choose_linear_reasons_and_errors():
    assert choose_linear("auto", torch.float32)[0] == "onednn"
    assert choose_linear("aten", torch.float32)[0] == "aten"
    backend, why = choose_linear("auto", torch.float32, "cuda")
    assert backend == "aten" and "not a CPU" in why
    with pytest.raises(ValueError, match="use --linear aten or auto"):
        choose_linear("onednn", torch.float32, "cuda")
    with pytest.raises(ValueError, match="not one of"):
        choose_linear("fast", torch.float32)


def test_tuned_layers_take_the_measured_path_per_row_count():
    layers = torch.nn.Sequential(*[_linear(40, 40, True, seed=i) for i in range(TUNE_MAX_MODULES + 2)],
                                 _linear(40, 24, False), torch.nn.LayerNorm(40))
    pack_linears(layers)
    summary = tune_linears(layers, max_rows=6, reps=1)
    assert set(summary) == {"40x40 float32", "24x40 float32"}
    for rows in summary.values():
        assert rows == list(range(1, len(rows) + 1)) and len(rows) <= 6  # one threshold R*: F.linear for 1..R*
    tables = [m.__dict__["_dartree_aten_rows"] for m in layers if type(m) is PackedLinear]
    assert len(tables) == TUNE_MAX_MODULES + 3 and all(len(t) == 7 and t[0] is False for t in tables)
    assert len(set(tables[: TUNE_MAX_MODULES + 2])) == 1  # the whole group, untimed members too, shares one table
    # the dispatch follows the table: forced to aten at 3 rows, to the packed call at 2
    lin = layers[0]
    lin.__dict__["_dartree_aten_rows"] = (False, False, False, True, False, False, False)
    x3, x2 = torch.randn(3, 40), torch.randn(2, 40)
    assert torch.equal(lin(x3), F.linear(x3, lin.weight, lin.bias))
    lin.__dict__.pop("_dartree_packed")
    torch.testing.assert_close(lin(x2), F.linear(x2, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert lin.__dict__["_dartree_packed"][4] is not None  # 2 rows went through the packed copy
    x20 = torch.randn(20, 40)  # beyond the tuned rows: packed
    torch.testing.assert_close(lin(x20), F.linear(x20, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    pack_linears(layers, "aten")
    assert not any("_dartree_aten_rows" in m.__dict__ for m in layers)
    assert tune_linears(layers) == {}  # nothing packed: nothing to tune
    with pytest.raises(ValueError, match="max_rows >= 1"):
        tune_linears(layers, max_rows=0)


@pytest.mark.parametrize("head_name", ["markov", "gru", "selector"])
@pytest.mark.parametrize("builder,budget", [("chain", None), ("pruned", 8), ("heap-sequential", 6)])
def test_packed_decoding_equals_packed_and_unpacked_ar(prompts, head_name, builder, budget):
    target = tiny_target(vocab_size=96, layer_ids=[1, 2])
    drafter = make_drafter()
    head = make_head(head_name, target)
    want = [autoregressive_generate(target, p, max_new_tokens=32, stop_ids=[1]).tokens for p in prompts]
    for module in (target.model, drafter, head):
        pack_linears(module)
    tune_linears(target.model, drafter, head, max_rows=9, reps=1)
    for p, w in zip(prompts, want):
        assert autoregressive_generate(target, p, max_new_tokens=32, stop_ids=[1]).tokens == w
        got = speculative_generate(target, drafter, head, p, DecodeSettings(builder=builder, budget=budget,
                                                                            max_new_tokens=32, stop_ids=[1],
                                                                            builder_params={"k": 8, "width": 4}))
        assert got.tokens == w


@pytest.mark.parametrize("rows", [1, 3, 4, 11])
def test_row_invariant_tiling_pads_short_calls_and_splits_long_ones(rows):
    from dartree.models.packed import pack_weight, packed_linear

    lin = _linear(48, 80, True, seed=3)
    pack_linears(lin, "onednn", row_invariant=True, min_rows=2, max_rows=4)
    x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(rows))
    p = pack_weight(lin.weight)
    want = []
    for i in range(0, rows, 4):  # one packed call per 4-row tile, a tile under 2 rows padded with its last row
        tile = x[i : i + 4]
        padded = torch.cat([tile, tile[-1:].expand(2 - len(tile), -1)]) if len(tile) < 2 else tile
        want.append(packed_linear(padded, p, lin.bias)[: len(tile)])
    assert torch.equal(lin(x), torch.cat(want))
    assert torch.equal(lin(x[None])[0], torch.cat(want))  # leading dims kept
    pack_linears(lin, "onednn")  # packed again without the mode: the tiling is gone
    assert "_dartree_max_rows" not in lin.__dict__ and "_dartree_min_rows" not in lin.__dict__


def test_row_invariant_tiling_bad_bounds_are_named():
    lin = _linear(8, 8, False)
    with pytest.raises(ValueError, match="1 <= min_rows <= max_rows, got min_rows=4, max_rows=2"):
        pack_linears(lin, "onednn", row_invariant=True, min_rows=4, max_rows=2)
    with pytest.raises(ValueError, match="min_rows=0"):
        pack_linears(lin, "onednn", row_invariant=True, min_rows=0)


def test_the_invariant_linear_choice_splits_where_large_calls_round_otherwise(monkeypatch):
    # a stand-in for AMX oneDNN: calls of more than 32 rows take another blocking, which rounds a row differently
    import dartree.models.packed as packed
    from dartree.models.invariant import choose_invariant_linear, linear_is_row_invariant

    real = packed._pointwise()

    def blocked_by_rows(x, w, b, *rest):
        y = real(x, w, b, *rest)
        return y + 1e-3 if x.shape[0] > 32 else y

    monkeypatch.setattr(packed, "_pointwise", lambda: blocked_by_rows)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40, bias=False), torch.nn.Linear(40, 24, bias=False))
    w = model[0].weight.detach()
    assert not linear_is_row_invariant(w, "onednn", 1) and not linear_is_row_invariant(w, "onednn", 2)
    assert linear_is_row_invariant(w, "onednn", 1, max_rows=32)
    assert not linear_is_row_invariant(w, "onednn", 1, max_rows=33)
    tiling = choose_invariant_linear(model)
    assert (tiling.backend, tiling.min_rows, tiling.max_rows) == ("onednn", 1, 32)
    assert "calls over 32 rows split into 32-row calls" in tiling.why and "all 2 weight shapes" in tiling.why
