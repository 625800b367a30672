"""How every dartree command-line program refuses bad input: one line on stderr, ``error: WHAT; FIX``, and exit
status 2 (argparse's own status for a bad argument), never a traceback. The programs check what they can before
loading a model, so a refusal costs nothing. Layer 0 (``dartree.base``): imports nothing of dartree."""

from __future__ import annotations

import sys


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type name when the message is empty (one-line errors from
    exceptions whose text runs over several lines, such as Hugging Face's loading errors)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def fail(message: str | BaseException, code: int = 2) -> int:
    """Print ``error: <message>`` (an exception: its :func:`first_line`; a leading ``error: `` is not doubled) to
    stderr and return ``code``, the status the program exits with: ``return fail("--limit must be >= 1")``.

    Args:
        message: what is wrong and how to fix it, or the exception that says so.
        code: exit status (2: bad input).
    Returns:
        ``code``.
    """
    text = first_line(message) if isinstance(message, BaseException) else str(message)
    print(text if text.startswith("error: ") else f"error: {text}", file=sys.stderr)
    return code
