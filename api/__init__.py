"""dartree: speculative decoding with block-diffusion drafters and draft trees, lossless against the target.

The Python API in three lines (the README's example; :mod:`dartree.speculator`)::

    import dartree

    spec = dartree.load()                      # the packaged target (SmolLM2-135M-Instruct) and drafter (dspark_b16)
    out = spec.generate("Write a haiku about trees.", max_new_tokens=64)
    print(out.text, out.stats.tau, out.tokens_per_s)

The parts: :mod:`dartree.models` (target, drafter, heads, checkpoints), :mod:`dartree.decode` (trees, verify, the
decoding loops, the evaluation harness), :mod:`dartree.training` (recipes, the trainer, the data campaign),
:mod:`dartree.convert` (published checkpoint layouts) and :mod:`dartree.kernels` (Triton kernels with torch twins).
"""

from __future__ import annotations

__all__ = ["Generation", "SpeculativeDecoder", "load"]


def __getattr__(name: str):
    if name in __all__:
        # lazy: the API's names load torch and transformers when first used (`import dartree.models` stays light)
        from dartree import speculator

        return getattr(speculator, name)
    raise AttributeError(f"module 'dartree' has no attribute {name!r}")
