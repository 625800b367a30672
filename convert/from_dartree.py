"""Export a dartree checkpoint back to a published drafter layout:
``python convert/from_dartree.py SRC --to LAYOUT --out DST [--target SPEC]``.

A thin script at the documented path: the program is :mod:`dartree.convert.tools.from_dartree` (layer 4, programs).
"""

from dartree.convert.tools.from_dartree import main

if __name__ == "__main__":
    raise SystemExit(main())
