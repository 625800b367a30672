"""The base utilities every layer may use (layer 0: imports nothing of dartree): how a program refuses input
(:mod:`~dartree.base.cli`), atomic writes (:mod:`~dartree.base.files`), checks of cached data
(:mod:`~dartree.base.integrity`), JSON records read with their shape (:mod:`~dartree.base.records`), field checks
(:mod:`~dartree.base.fields`), dtypes (:mod:`~dartree.base.dtypes`) and figures written as PNGs
(:mod:`~dartree.base.figures`)."""
