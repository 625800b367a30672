"""The GPU row-invariant kernels (Triton; the interpreter without a GPU): each agrees with its torch op, and a row
computed alone has the bits it has inside a call of any size (kernels/invariant_gpu.py)."""

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from dartree.decode.settings import DecodeSettings
from dartree.kernels.invariant_gpu import invariant_linear, invariant_rms_norm, row_attention_gpu  # noqa: E402
from dartree.kernels.row_attention import row_attention  # noqa: E402

DEV = "cuda" if ON_GPU else "cpu"
CALLS = (1, 2, 3, 5, 9, 17, 33)


def _heavy(rows, cols, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    return (x * (1 + 15 * (torch.rand(x.shape, generator=g) < 0.02))).to(dtype).to(DEV)


def _split(f, x, m):
    return torch.cat([f(x[i : i + m]) for i in range(0, x.shape[0], m)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_alone_equal_rows_in_any_call_and_match_f_linear(dtype):
    x = _heavy(40, 150, 1, dtype)  # K spans three 64-wide chunks with a ragged tail; N = 70 spans two tiles
    w = _heavy(70, 150, 2, dtype) / 8
    b = _heavy(70, 1, 3, dtype)[:, 0]
    full = invariant_linear(x, w, b)
    assert full.dtype == dtype and full.shape == (40, 70)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(full.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)
    for m in CALLS:
        assert torch.equal(_split(lambda t: invariant_linear(t, w, b), x, m), full), m
    # leading dims are flattened: [B, T, K] as [B * T, K]
    assert torch.equal(invariant_linear(x.reshape(4, 10, 150), w, b).reshape(40, 70), full)


def test_rms_norm_matches_the_llama_norm_and_is_row_invariant():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(96, eps=1e-5).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(_heavy(1, 96, 4)[0])
    x = _heavy(20, 96, 5)
    full = invariant_rms_norm(x, norm.weight, norm.variance_epsilon)
    with torch.no_grad():
        torch.testing.assert_close(full, norm(x), atol=1e-5, rtol=1e-5)
    for m in CALLS:
        assert torch.equal(_split(lambda t: invariant_rms_norm(t, norm.weight, 1e-5), x, m), full), m


def test_attention_matches_the_cpu_kernel_and_a_row_keeps_its_bits_in_any_call():
    g = torch.Generator().manual_seed(6)
    hq, hkv, length, d = 6, 2, 75, 32  # grouped-query heads; 75 keys: three 32-key blocks, the last ragged
    q = torch.randn(9, hq, d, generator=g).to(DEV)
    k = torch.randn(hkv, length, d, generator=g).to(DEV)
    v = torch.randn(hkv, length, d, generator=g).to(DEV)
    # a tree verify: each row sees the 66-key prefix and its ancestors among the 9 new keys
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 6]
    rows = []
    for r in range(9):
        anc, a = [], r
        while a >= 0:
            anc.append(66 + a)
            a = parents[a]
        rows.append(list(range(66)) + sorted(anc))
    counts = torch.tensor([len(x) for x in rows])
    idx = torch.zeros(9, int(counts.max()), dtype=torch.int64)
    for r, x in enumerate(rows):
        idx[r, : len(x)] = torch.tensor(x)
    out = row_attention_gpu(q, k, v, counts, idx)
    ref = row_attention(q.cpu(), k.cpu(), v.cpu(), counts, idx)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    for r in range(9):  # alone, as the AR step at that node computes it
        alone = row_attention_gpu(q[r : r + 1], k, v, counts[r : r + 1], idx[r : r + 1, : counts[r]])
        assert torch.equal(alone[0], out[r]), r
    # leading keys without an index (an AR step, a chain) equal the same keys through an index
    lead = row_attention_gpu(q[:3], k, v, torch.tensor([10, 40, 75]))
    through = row_attention_gpu(q[:3], k, v, torch.tensor([10, 40, 75]), torch.arange(75).repeat(3, 1))
    assert torch.equal(lead, through)


def test_bad_inputs_are_named():
    x = torch.zeros(3, 8, device=DEV)
    with pytest.raises(ValueError, match="weight \\[N, K\\]"):
        invariant_linear(x, torch.zeros(4, 9, device=DEV))
    with pytest.raises(ValueError, match="one dtype"):
        invariant_linear(x, torch.zeros(4, 8, dtype=torch.float64, device=DEV))
    with pytest.raises(ValueError, match="weight \\[H\\]"):
        invariant_rms_norm(x, torch.ones(9, device=DEV), 1e-6)
    q, kv = torch.zeros(2, 4, 8, device=DEV), torch.zeros(2, 5, 8, device=DEV)
    with pytest.raises(ValueError, match="key counts in 1..5"):
        row_attention_gpu(q, kv, kv, [0, 3])
    with pytest.raises(ValueError, match="in 0..4"):
        row_attention_gpu(q, kv, kv, [2, 2], [[0, 5], [1, 2]])
    with pytest.raises(ValueError, match="H % H_kv"):
        row_attention_gpu(torch.zeros(2, 3, 8, device=DEV), kv, kv, [1, 1])


def _on_device(target, dtype):
    """The session's tiny target (its weights, its layers captured), built again on DEV in ``dtype``."""
    from dartree.models.target import tiny_target

    t = tiny_target(vocab_size=target.model.config.vocab_size, layer_ids=target.layer_ids, dtype=dtype)
    t.model.to(DEV)
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_mode_verify_rows_equal_ar_steps_bit_for_bit(target, dtype):
    from dartree.decode.harness.invariance import verify_rows_vs_ar
    from dartree.models.invariant import row_invariant

    t = _on_device(target, dtype)
    ids = [5, 9, 11, 3, 7, 2, 8, 13, 21, 34, 4, 6]
    with row_invariant(t, backend="triton") as mode:
        assert mode.linear == "triton" and t.model.config._attn_implementation == "dartree_row_invariant"
        linears = [m for m in t.model.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all("forward" in m.__dict__ for m in linears)
        assert verify_rows_vs_ar(t, ids, 9, tree=False) == [True] * 9
        assert verify_rows_vs_ar(t, ids, 9, tree=True) == [True] * 9
    # on exit the modules have their own forwards again and the attention is the model's
    assert not any("forward" in m.__dict__ for m in t.model.modules())
    assert not any(hasattr(m, "_dartree_invariant_backend") for m in t.model.modules())
    assert t.model.config._attn_implementation != "dartree_row_invariant"


@pytest.mark.slow  # ~1 min under the Triton interpreter
def test_triton_mode_speculative_output_equals_ar(target, drafter):
    from dartree.decode.generate import autoregressive_generate, speculative_generate
    from dartree.models.heads import IdentityHead
    from dartree.models.invariant import row_invariant

    t = _on_device(target, torch.float32)
    d = drafter.to(DEV)
    prompt = [5, 9, 11, 3, 7, 2, 8]
    with row_invariant(t, backend="triton"):
        ar = autoregressive_generate(t, prompt, max_new_tokens=8).tokens
        for name in ("chain", "pruned"):
            out = speculative_generate(t, d, IdentityHead(), prompt, DecodeSettings(builder=name, max_new_tokens=8,
                                                                                    budget=8)).tokens
            assert list(out) == list(ar), name
    assert list(ar) == list(autoregressive_generate(target, prompt, max_new_tokens=8).tokens)  # fp32: same text


def test_triton_mode_names_what_it_cannot_run(target):
    from dartree.models.invariant import row_invariant

    t = _on_device(target, torch.float32)
    t.model.model.norm = torch.nn.LayerNorm(t.model.config.hidden_size).to(DEV)
    with pytest.raises(ValueError, match="model.norm is a LayerNorm, which has no row-invariant kernel"):
        row_invariant(t, backend="triton").__enter__()
    with pytest.raises(ValueError, match="backend must be one of cpu, triton"):
        row_invariant(t, backend="cuda")
