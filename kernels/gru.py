"""Fused GRU cell for the Domino head's ``advance`` (Domino, arXiv 2605.29707; DARTree's fused GRU-cell
kernel, ``magneto0124/DARTree``).

Domino advances its path state with ``r' = GRUCell(E[x], r)`` (``nn.GRU`` without bias, gate order r, z, n).
The input projection E[x] · W_ih^T is a table lookup ``gi`` [N, 3G] precomputed once per target; the kernel
fuses the recurrent GEMV h · W_hh^T with the three gates:

    r = sigmoid(gi_r + W_hr h),  z = sigmoid(gi_z + W_hz h),  n = tanh(gi_n + r * (W_hn h)),
    h' = (1 - z) * n + z * h

Shapes: N rows (tree frontier), G state width. All math in fp32; the output is fp32.
"""

from __future__ import annotations

import torch

from dartree.kernels._backend import resolve


def _check(gi: torch.Tensor, h: torch.Tensor, w_hh: torch.Tensor) -> None:
    if h.dim() != 2 or gi.dim() != 2 or w_hh.dim() != 2:
        raise ValueError(f"gru_cell expects gi [N, 3G], h [N, G], w_hh [3G, G]; got {tuple(gi.shape)}, "
                         f"{tuple(h.shape)}, {tuple(w_hh.shape)}")
    n, g = h.shape
    if tuple(gi.shape) != (n, 3 * g) or tuple(w_hh.shape) != (3 * g, g):
        raise ValueError(f"gru_cell shapes disagree: gi {tuple(gi.shape)} and w_hh {tuple(w_hh.shape)} must be "
                         f"[{n}, {3 * g}] and [{3 * g}, {g}] for h {tuple(h.shape)}")


def gru_cell_ref(gi: torch.Tensor, h: torch.Tensor, w_hh: torch.Tensor) -> torch.Tensor:
    """Plain-torch GRU cell (defines the kernel's meaning; equals ``nn.GRUCell(bias=False)``).

    Args:
        gi: [N, 3G] input-gate pre-activations E[x] · W_ih^T (gate order r, z, n), any float dtype.
        h: [N, G] previous state.
        w_hh: [3G, G] recurrent weight (``weight_hh_l0``).
    Returns:
        h' [N, G] fp32.
    Raises:
        ValueError: shapes that do not fit together.
    """
    _check(gi, h, w_hh)
    hf = h.float()
    gh = hf @ w_hh.float().t()
    i_r, i_z, i_n = gi.float().chunk(3, dim=-1)
    h_r, h_z, h_n = gh.chunk(3, dim=-1)
    r = torch.sigmoid(i_r + h_r)
    z = torch.sigmoid(i_z + h_z)
    n = torch.tanh(i_n + r * h_n)
    return (1 - z) * n + z * hf


def gru_cell(gi: torch.Tensor, h: torch.Tensor, w_hh: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """GRU cell, Triton-fused on CUDA (``backend="auto"``), :func:`gru_cell_ref` on CPU. Same contract as the ref.

    Raises:
        ValueError: bad shapes or backend name; RuntimeError: ``backend="triton"`` where it cannot run.
    """
    _check(gi, h, w_hh)
    if resolve(backend, h.device) == "torch" or h.shape[0] == 0:
        return gru_cell_ref(gi, h, w_hh)
    # lazy: triton is optional (CUDA only): the Triton kernel module loads on the first GPU call
    from dartree.kernels import _gru_triton

    return _gru_triton.launch(gi, h, w_hh)
