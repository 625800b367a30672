"""Backend choice shared by every kernel: ``auto`` | ``triton`` | ``torch``.

``auto`` runs the Triton kernel when the input lives on a CUDA device and Triton imports, and the plain-torch
``*_ref`` twin otherwise (CPU). ``triton`` forces the kernel; on a machine without a GPU it only works under the
Triton interpreter (``TRITON_INTERPRET=1`` set before the kernel modules are imported), which is how the tests
run it. Kernel modules are imported lazily, so importing ``dartree.kernels.*`` never imports Triton.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "torch")


def triton_available() -> bool:
    """True when the ``triton`` package imports."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """True when the Triton interpreter is switched on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve(backend: str, device: torch.device) -> str:
    """Return ``"triton"`` or ``"torch"`` for a requested backend and the device the inputs live on.

    Raises:
        ValueError: an unknown backend name.
        RuntimeError: ``backend="triton"`` where it cannot run (Triton missing, or a CPU tensor without
            ``TRITON_INTERPRET=1``); the message names the fix.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; use one of {BACKENDS}")
    if backend == "torch":
        return "torch"
    on_gpu = torch.device(device).type == "cuda"
    if backend == "auto":
        return "triton" if on_gpu and triton_available() else "torch"
    if not triton_available():
        raise RuntimeError("backend='triton' needs the triton package: pip install triton (or use backend='torch')")
    if not on_gpu and not interpreting():
        raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before the kernels are "
                           "imported (or move the inputs to a CUDA device, or use backend='torch')")
    return "triton"


def next_pow2(n: int, floor: int = 16) -> int:
    """Smallest power of two >= max(n, floor) (Triton block sizes must be powers of two; tl.dot needs >= 16)."""
    p = floor
    while p < n:
        p *= 2
    return p
