"""The flags ``decode/eval.py`` and ``decode/bench.py`` share, declared once (:func:`add_decode_flags`): the same
names, types and choices in both programs, with each program's own defaults and help texts."""

from __future__ import annotations

import argparse
from pathlib import Path

from dartree.base.dtypes import DTYPES
from dartree.decode.harness.prompts import add_prompt_source_args
from dartree.models.invariant import INVARIANT_CHOICES
from dartree.models.packed import LINEAR_BACKENDS
from dartree.models.target import DEFAULT_TARGET

DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "dspark_b16"  # both --checkpoint defaults


def budget_arg(text: str) -> int | str:
    """argparse type of eval's ``--budget``: ``auto`` (the cost-model budget, :mod:`dartree.decode.budget`) or an
    int >= 0.

    Raises:
        argparse.ArgumentTypeError: anything else (names the accepted values).
    """
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'auto' nor an integer >= 0") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0 (tree nodes per round) or 'auto'")
    return value


def add_decode_flags(ap: argparse.ArgumentParser, *, sweep: bool, helps: dict[str, str], **defaults) -> None:
    """Add to ``ap`` the flags eval and bench share: ``--tree --budget --dtype --linear --no-tune --invariant
    --checkpoint --target --datasets/--prompts --limit --max-new-tokens --threads --out``.

    Args:
        sweep: False (eval, one setting per run): one ``--dtype`` (``auto`` too) and ``--linear``, ``--budget``
            ``auto`` or ints >= 0 (:func:`budget_arg`), ``--invariant`` auto / on / off (bare: on). True (bench,
            settings measured side by side): several ``--dtype`` and ``--linear``, ``--budget`` ints, ``--invariant``
            a switch (one more pass per dtype in the row-invariant mode).
        helps: help text by dest (``tree``, ``tune``, ...; none where left out; ``--limit``, ``--threads``: shared).
        defaults: by dest, each required: ``tree``, ``budget``, ``dtype``, ``linear``, ``limit`` (prompts per data
            set), ``max_new_tokens`` (tokens per prompt), ``out``.
    Raises:
        KeyError: a default left out.
    """
    one_or_several = {"nargs": "+"} if sweep else {}
    ap.add_argument("--tree", nargs="+", default=defaults["tree"], help=helps.get("tree"))
    ap.add_argument("--budget", type=int if sweep else budget_arg, nargs="+", default=defaults["budget"],
                    help=helps.get("budget"))
    ap.add_argument("--dtype", **one_or_several, default=defaults["dtype"], help=helps.get("dtype"),
                    choices=sorted(DTYPES) if sweep else ["auto", *sorted(DTYPES)])
    ap.add_argument("--linear", **one_or_several, default=defaults["linear"], choices=list(LINEAR_BACKENDS),
                    help=helps.get("linear"))
    ap.add_argument("--no-tune", dest="tune", action="store_false", help=helps.get("tune"))
    invariant = {"action": "store_true"} if sweep else {"nargs": "?", "const": "on", "default": "auto",
                                                        "choices": list(INVARIANT_CHOICES)}
    ap.add_argument("--invariant", **invariant, help=helps.get("invariant"))
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT), help=helps.get("checkpoint"))
    ap.add_argument("--target", default=DEFAULT_TARGET, help=helps.get("target"))
    add_prompt_source_args(ap)
    ap.add_argument("--limit", type=int, default=defaults["limit"],
                    help="prompts per data set (with --prompts: the first N of the file)")
    ap.add_argument("--max-new-tokens", type=int, default=defaults["max_new_tokens"], help=helps.get("max_new_tokens"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--out", default=defaults["out"], help=helps.get("out"))
