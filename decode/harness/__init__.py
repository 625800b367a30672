"""The evaluation harness, a programs folder (layer 4): the commands ``decode/eval.py`` and ``decode/bench.py`` (thin
scripts calling :mod:`.eval` and :mod:`.bench`) and what they stand on, kept apart from the decoding library in
``decode/`` (which never imports it).

- :mod:`.eval`, :mod:`.bench`: the two commands (``dartree-eval``, ``dartree-bench``), their shared flags :mod:`.flags`;
- :mod:`.session`: one evaluation session (target, drafter, packing, row-invariant mode, runs, cost models,
  peers) and its per-prompt decode;
- :mod:`.report_rows`: the report's typed records (a prompt's row, a method's summary, the report, and their JSON);
- :mod:`.report`: report.json to report.md and the console (pure renderers) and the figures; :mod:`.plots` draws them;
  :mod:`.break_even` prices a round in AR steps (the tau each method needs to beat AR on the machine);
- :mod:`.peers`: the loops a user would otherwise run (transformers generate and prompt lookup, z-lab's DFlash);
- :mod:`.prompts`: the packaged prompt sets and ``--prompts FILE``;
- :mod:`.invariance`: the per-operation map of row invariance (``python decode/harness/invariance.py``).
"""
