"""Acceptance length and speedup of tree decoders against plain autoregressive decoding of the target:
``python decode/eval.py --tree pruned [--datasets ... | --prompts FILE] [--limit N] [--budget B] ...``.

A thin script at the documented path: the program is :mod:`dartree.decode.harness.eval` (layer 4, programs).
"""

from dartree.decode.harness.eval import main

if __name__ == "__main__":
    raise SystemExit(main())
