"""Convert a drafter checkpoint into the dartree format: ``python convert/to_dartree.py SRC [--out DST] ...``.

A thin script at the documented path: the program is :mod:`dartree.convert.tools.to_dartree` (layer 4, programs).
"""

from dartree.convert.tools.to_dartree import main

if __name__ == "__main__":
    raise SystemExit(main())
