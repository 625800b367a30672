"""The floating-point dtypes the tools take by name (``--dtype``, recipe ``target.dtype``), in one table, and what
this machine runs natively (layer 0, ``dartree.base``: imports nothing of dartree)."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str, what: str = "dtype") -> torch.dtype:
    """The torch dtype called ``name`` in :data:`DTYPES`.

    Args:
        name: ``float32``, ``bfloat16`` or ``float16``.
        what: the option or key the name came from, for the message (e.g. ``target.dtype``).
    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    if name not in DTYPES:
        raise ValueError(f"{what}: unknown dtype {name!r}; use one of {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


def onednn_linear_supported(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> tuple[bool, str]:
    """Whether prepacked oneDNN linears can run for this dtype and device, and why not.

    Returns:
        (supported, reason). fp32 needs a CPU torch build with oneDNN (``torch.backends.mkldnn``); bf16 also
        needs oneDNN bf16 support of the CPU (AVX512-BF16 / AMX / AVX-NE-CONVERT); CUDA and other devices never.
    """
    if torch.device(device).type != "cpu":
        return False, f"device {device} is not a CPU (oneDNN prepacking is a CPU path)"
    if not torch.backends.mkldnn.is_available():
        return False, "this torch build has no oneDNN (torch.backends.mkldnn unavailable)"
    if dtype == torch.float32:
        return True, "fp32 oneDNN linear available"
    if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return True, "bf16 oneDNN linear supported by this CPU"
    return False, f"oneDNN has no native {dtype} linear on this CPU"


def native_bf16() -> tuple[bool, str]:
    """Whether this machine's CPU has native bf16 matrix arithmetic (oneDNN bf16: AVX512-BF16 / AMX), and why.

    Where bf16 is emulated (AVX2 only), a bf16 matmul is several times slower than fp32 (figures:
    docs/performance.md, "bf16 on the AVX2 machine"), so the ``auto`` dtypes of training, regeneration and
    decoding pick float32 there.

    Returns:
        (native, a one-line reason naming the CPU capability).
    """
    cap = torch.backends.cpu.get_cpu_capability()
    if onednn_linear_supported(torch.bfloat16)[0]:  # the same oneDNN bf16 check the packed linears use
        return True, f"this CPU ({cap}) has native bf16 matrix arithmetic"
    return False, (f"this CPU ({cap}) has no native bf16 matrix arithmetic (bf16 matmuls run several times slower "
                   "than fp32 there)")


def dtype_candidates(requested: str, device: str = "cpu") -> tuple[list[str], str]:
    """The dtypes a decode run may use, and why: one where the choice needs no measurement, two where the caller
    times them (:func:`dartree.decode.precision.pick_dtype`).

    ``auto``: on a CPU with native bf16 matrix arithmetic (:func:`native_bf16`), bfloat16 and float32, timed at
    start-up, because there a bf16 AR step is no faster than an fp32 one while a bf16 verify is much cheaper, so
    which decodes faster depends on the CPU and the drafter (docs/invariance.md); bfloat16 counts only with the
    row-invariant mode, which makes it exact. On a CPU without it, float32: bf16 is emulated there and a bf16
    verify forward of 9+ tokens is slower than fp32, so float32, the exact mode, is also the faster one. On CUDA,
    bfloat16.

    Args:
        requested: ``auto`` or a key of :data:`DTYPES`.
        device: ``cpu`` or ``cuda``.
    Returns:
        ([dtype name, ...] in order of preference on a tie, reason).
    Raises:
        ValueError: an unknown dtype name (:func:`parse_dtype`).
    """
    if requested != "auto":
        parse_dtype(requested, "--dtype")
        exact = " (the exact mode: every T=0 output must equal AR's)" if requested == "float32" else (
            " (exact where the row-invariant mode is on, see below; without it near-ties may flip between a verify "
            "forward and an AR step, and divergences are reported with the target's top-2 margin)")
        return [requested], f"--dtype {requested} requested{exact}"
    if device.startswith("cuda"):
        return ["bfloat16"], "auto: CUDA has native bf16 matrix arithmetic"
    cap = torch.backends.cpu.get_cpu_capability()
    if native_bf16()[0]:
        return ["bfloat16", "float32"], (f"auto: this CPU ({cap}) has native bf16 matrix arithmetic (oneDNN bf16), so "
                                         "bfloat16 (with the row-invariant mode) and float32 are timed at start-up")
    return ["float32"], (f"auto: this CPU ({cap}) has no native bf16 matrix arithmetic (oneDNN bf16 unsupported), "
                         "where bf16 multi-token verify forwards are slower than fp32; float32 is both the exact mode "
                         "(every output equal to AR's) and the faster one here")
