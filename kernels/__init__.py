"""dartree.kernels: Triton kernels with plain-torch ``*_ref`` twins, numba CPU kernels of the tree stage
(``tree_expand``) with NumPy / torch twins, the numba row-invariant decode attention (``row_attention``), tested
against a float64 softmax attention, and its GPU twins (``invariant_gpu``: row-invariant linear, RMSNorm and
attention in Triton).

Kept free of imports on purpose: transformers probes for a package named ``kernels`` at model import
and may import this one to read a version, so nothing heavy (triton, torch) is imported here and no
``__version__`` is defined. Import kernel modules explicitly, e.g. ``from dartree.kernels import ...``.
"""
