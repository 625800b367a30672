"""Train a DFlash drafter with a correction head: ``python training/train.py recipe=NAME [key=value ...]``.

A thin script at the documented path: the program is :mod:`dartree.training.tools.train` (layer 4, programs).
"""

from dartree.training.tools.train import main

if __name__ == "__main__":
    raise SystemExit(main())
