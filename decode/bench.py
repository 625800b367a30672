"""Round-cost benchmark, where one speculative round spends its time in units of one AR step:
``python decode/bench.py [--tree chain pruned] [--budget 2 4 8 16] ...``.

A thin script at the documented path: the program is :mod:`dartree.decode.harness.bench` (layer 4, programs).
"""

from dartree.decode.harness.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
