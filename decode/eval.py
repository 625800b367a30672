"""Acceptance length and speedup of tree decoders against plain autoregressive decoding of the target.

``python decode/eval.py --tree pruned [--datasets humaneval mtbench gsm8k | --prompts FILE] [--limit N] [--budget B] ...``

For every prompt (chat-templated by the target's tokenizer) the target first decodes on its own (AR, the
baseline and the losslessness oracle), then each requested method decodes the same prompt. Reported per
method and dataset: tau (committed tokens per verify forward, bonus included), tokens/s and speedup over AR
(AR time-per-output-token / method time-per-output-token, prefill excluded, same process, after a warm-up),
per-round stage times, and losslessness (T = 0: the count of prompts whose output differs from AR's, with
the first divergence and the target's top-2 logit margin there). Writes ``report.json`` and ``report.md``,
then the figures beside them, embedded in report.md (``dartree.decode.report``; ``--no-plots`` skips them;
``dartree-report DIR`` redraws them from report.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console
from tqdm.auto import tqdm

from dartree.decode.generate import ARStepper, GenerateOutput, autoregressive_generate, speculative_generate
from dartree.decode.peers import PEERS, load_bf16_twin, load_zlab_drafter, run_peer
from dartree.decode.prompts import add_prompt_source_args, Prompt, load_prompt_file, load_prompts
from dartree.models.chat import chat_prompt_ids, check_chat_template, messages_prompt_ids, text_prompt_ids
from dartree.decode.report import annotate_trees, lossless_cell, report_console, report_markdown, write_figures
from dartree.decode.trees import BUILDERS
from dartree.models.checkpoint import CheckpointError, load_dartree, write_file_atomically
from dartree.models.packed import (LINEAR_BACKENDS, choose_linear, onednn_linear_supported, pack_linears,
                                   tune_linears)
from dartree.models.generation import sampling_settings
from dartree.models.generation import stop_ids as target_stop_ids
from dartree.models.target import DEFAULT_TARGET, check_speculative_target, load_target

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CHECKPOINT = REPO / "checkpoints" / "dspark_b16"


def choose_dtype(requested: str, device: str = "cpu") -> tuple[str, str]:
    """The dtype a run uses, and why (printed and recorded in the report).

    ``auto`` takes bfloat16 only where bf16 matrix arithmetic is native (CUDA, or a CPU whose oneDNN build
    supports bf16: AVX512-BF16 / AMX); elsewhere bf16 is emulated and a bf16 verify forward of 9+ tokens is
    slower than fp32 (figures: docs/performance.md, "bf16 on the AVX2 machine"), so float32, the exact mode
    (every output equal to AR's), is also the faster one.

    Args:
        requested: ``auto`` or a key of the dtype table (``float32``, ``bfloat16``, ``float16``).
        device: ``cpu`` or ``cuda``.
    Returns:
        (dtype name, reason).
    """
    if requested != "auto":
        exact = " (the exact mode: every T=0 output must equal AR's)" if requested == "float32" else (
            " (near-ties may flip between a verify forward and an AR step: divergences are reported with the "
            "target's top-2 margin)")
        return requested, f"--dtype {requested} requested{exact}"
    if device.startswith("cuda"):
        return "bfloat16", "auto: CUDA has native bf16 matrix arithmetic"
    native = onednn_linear_supported(torch.bfloat16)[0]
    cap = torch.backends.cpu.get_cpu_capability()
    if native:
        return "bfloat16", f"auto: this CPU ({cap}) has native bf16 matrix arithmetic (oneDNN bf16)"
    return "float32", (f"auto: this CPU ({cap}) has no native bf16 matrix arithmetic (oneDNN bf16 unsupported), where "
                       "bf16 multi-token verify forwards are slower than fp32; float32 is both the exact mode "
                       "(every output equal to AR's) and the faster one here")


def budget_arg(text: str) -> int | str:
    """argparse type of ``--budget``: ``auto`` (the cost-model budget, :mod:`dartree.decode.budget`) or an int >= 0.

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


def template_kwargs_arg(text: str) -> dict:
    """argparse type of ``--chat-template-kwargs``: a JSON object of template variables.

    Raises:
        argparse.ArgumentTypeError: not JSON, or JSON that is not an object (one line with an example).
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({exc.msg}); give an object such as "
                                         "'{\"enable_thinking\": false}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is a JSON {type(value).__name__}, not an object such as "
                                         "'{\"enable_thinking\": false}'")
    return value


def sampling_problem(settings: dict, temperature: float, ignore: bool) -> str | None:
    """Why this run cannot sample as the target's own ``generate`` would: ``settings`` (the target's
    :func:`~dartree.models.generation.sampling_settings`) act at ``temperature`` > 0 (and repetition_penalty at
    any T) and ``--ignore-generation-config`` was not given. None when the run may go ahead."""
    acting = {k: v for k, v in settings.items() if temperature > 0 or k == "repetition_penalty"}
    if not acting or ignore:
        return None
    named = ", ".join(f"{k}={v}" for k, v in acting.items())
    return (f"the target's generation_config sets {named}, which dartree's decoders do not apply (they take "
            f"{'softmax(logits / T) samples' if temperature > 0 else 'the argmax'} exactly); pass "
            "--ignore-generation-config to decode without them (recorded in the report)"
            + (", or --temperature 0" if temperature > 0 and "repetition_penalty" not in acting else ""))


def prompt_encoder(tok, mode: str, template_kwargs: dict) -> Callable[[str | list[dict]], list[int]]:
    """text (one user turn) or a chat's messages -> prompt token ids for ``--chat-template`` ``mode`` (``auto``: the
    tokenizer's chat template with ``template_kwargs``; ``none``: the raw text, and messages raise ValueError, as
    they need a template).

    Raises:
        ValueError: no tokenizer, no chat template in ``auto`` mode, template options with ``none`` or that
            ``apply_chat_template`` cannot take (:func:`dartree.models.chat.check_chat_template`); one line each.
    """
    if tok is None:
        raise ValueError("the target has no tokenizer; eval needs it to tokenize the prompts")
    if mode == "none":
        if template_kwargs:
            raise ValueError("--chat-template-kwargs needs a chat template; drop it with --chat-template none")

        def raw(prompt: str | list[dict]) -> list[int]:
            if not isinstance(prompt, str):
                raise ValueError("chat messages need the chat template; drop --chat-template none")
            return text_prompt_ids(tok, prompt)
        return raw
    check_chat_template(tok, template_kwargs, fix="pass --chat-template none to feed each prompt's raw text")
    return lambda prompt: (chat_prompt_ids(tok, prompt, template_kwargs) if isinstance(prompt, str)
                           else messages_prompt_ids(tok, prompt, template_kwargs))


def encode_prompts(encode: Callable[[str], list[int]], prompts: list[Prompt], target, max_new_tokens: int
                   ) -> list[list[int]]:
    """The token ids of every prompt, checked against the target's context before any decoding.

    Args:
        encode: text or messages -> ids (:func:`prompt_encoder`). prompts: the data sets' prompts (a prompt with
            ``messages`` is encoded from them, else from its text). target: the Target.
        max_new_tokens: ``--max-new-tokens``.
    Returns:
        one [T_i] id list per prompt.
    Raises:
        ValueError: the chat template fails on a prompt, or a prompt plus ``max_new_tokens`` does not fit the
            target's context (:func:`dartree.decode.inputs.check_context`); one line naming the prompt.
    """
    from dartree.decode.inputs import check_context

    out = []
    for p in prompts:
        try:
            ids = encode(p.text if p.messages is None else p.messages)
        except Exception as exc:  # a template's own error (jinja2, ValueError, ...): one line naming the prompt
            raise ValueError(f"the chat template failed on prompt {p.dataset}:{p.id}: {type(exc).__name__}: "
                             f"{(str(exc).strip().splitlines() or [''])[0]}") from None
        check_context(target, len(ids), max_new_tokens, f"prompt {p.dataset}:{p.id}", "lower --max-new-tokens")
        out.append(ids)
    return out


METHOD_ALIASES = {"dartree-pruned": "pruned", "dartree-fixed": "fixed"}
LOOKUP_SUFFIX = "+lookup"  # BUILDER+lookup: the builder's tree with a prompt-lookup chain grafted on (decode/lookup.py)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _add_method_args(ap: argparse.ArgumentParser) -> None:
    """The arguments that choose the decoders, their trees, the prompts and the sampling rule (before the target's
    own generation settings)."""
    ap.add_argument("--tree", nargs="+", default=["pruned"],
                    help=f"methods besides the AR baseline: ar, {', '.join(sorted(BUILDERS))}, or all "
                         "(every builder once; heap-sequential is the slow exact reference); BUILDER+lookup also "
                         "grafts a prompt-lookup chain onto each round's tree (--lookup tokens)")
    ap.add_argument("--lookup", type=int, default=10,
                    help="tokens of the prompt-lookup chain of the +lookup methods (transformers' default, 10)")
    ap.add_argument("--lookup-ngram", type=int, default=3, help="longest n-gram the +lookup methods match")
    add_prompt_source_args(ap)
    ap.add_argument("--limit", type=int, default=20, help="prompts per data set (with --prompts: the first N of the file)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated per prompt")
    ap.add_argument("--budget", type=budget_arg, nargs="+", default=["auto"],
                    help="tree nodes per round B, or auto: per round the cost model (calibrated at start-up) keeps the "
                         "tree size that maximises expected tokens per second, 0 = a plain AR step, and chain is "
                         "shortened the same way; several values run a budget sweep, "
                         "reported as METHOD@B<n> (METHOD@auto) for every tree builder other than chain (which runs at full "
                         "length, and as chain@auto when auto is among the values)")
    ap.add_argument("--width", type=int, default=12, help="supertree width W per depth (pruned)")
    ap.add_argument("--candidates", type=int, default=64, help="candidate count K per depth")
    ap.add_argument("--beta", type=float, default=-0.2, help="depth bonus beta (pruned, heap-sequential; <= 0)")
    ap.add_argument("--children", type=int, default=4, help="children per kept parent k (pctree)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (output must equal AR's)")
    ap.add_argument("--acceptance", default="match", choices=["match", "rejection"],
                    help="T > 0 rule: exact target-sample matching of deterministic drafts (every tree), or sampled "
                         "chain drafts + speculative rejection sampling (--tree chain only)")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="dartree-eval", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_method_args(ap)
    ap.add_argument("--ignore-generation-config", action="store_true",
                    help="at --temperature > 0, sample softmax(logits / T) even where the target's generation_config "
                         "sets top_k / top_p / min_p / typical_p / repetition_penalty, which dartree's samplers do "
                         "not apply (refused by name without this flag); the report records them as ignored")
    ap.add_argument("--chat-template", default="auto", choices=["auto", "none"],
                    help="auto: each prompt through the target tokenizer's chat template (refused by name when it has "
                         "none); none: the raw prompt text (a base model), named in the report")
    ap.add_argument("--chat-template-kwargs", type=template_kwargs_arg, default={}, metavar="JSON",
                    help="extra chat-template variables as a JSON object, passed to apply_chat_template, e.g. "
                         "'{\"enable_thinking\": false}'; recorded in the report")
    ap.add_argument("--seed", type=int, default=0, help="prompt choice and sampling seed")
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT), help="dartree checkpoint folder")
    ap.add_argument("--target", default=DEFAULT_TARGET, help="'smollm2' or a local Hugging Face folder")
    ap.add_argument("--dtype", default="auto", choices=["auto", *sorted(_DTYPES)],
                    help="target and drafter dtype; auto: bfloat16 where the hardware has native bf16 matrix "
                         "arithmetic (CUDA, or a CPU with oneDNN bf16), else float32 (the exact mode); the run prints "
                         "which and why")
    ap.add_argument("--linear", default="auto", choices=list(LINEAR_BACKENDS),
                    help="matmul path of the target's and drafter's linear layers: onednn (weights prepacked once, "
                         "the fast small-M path on CPU), aten (plain F.linear), auto (onednn where it can run); "
                         "every row of the run, AR and peers included, uses the same one")
    ap.add_argument("--invariant", action="store_true",
                    help="row-invariant target forwards (dartree.models.invariant): every verify row computes the bits "
                         "an AR step computes for it, so the output equals AR's by construction in bf16 too; costs "
                         "time per verify (docs/invariance.md)")
    ap.add_argument("--no-tune", dest="tune", action="store_false",
                    help="with onednn: keep the fixed single-row rule instead of timing F.linear against the packed "
                         "call per weight shape and row count at start-up (a few seconds) and taking the faster")
    ap.add_argument("--ar-repeats", type=int, default=2,
                    help="AR runs per prompt, spread through that prompt's rows; the AR baseline is their mean "
                         "time, and the report gives their spread (the machine's own timing noise, next to every "
                         "speedup)")
    ap.add_argument("--paired", action="store_true",
                    help="also time every method in lockstep with its own AR decode of the same prompt (after each "
                         "round the AR loop steps until it has as many tokens), and report that paired speedup next to "
                         "the plain one: both loops then see the same seconds of a machine whose speed drifts, which "
                         "separate runs minutes apart do not (costs one more AR decode per method and prompt)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--out", default="reports/latest", help="folder for report.json and report.md")
    ap.add_argument("--no-plots", action="store_true",
                    help="tables only: no PNG figures (report.json still keeps the data to draw them later)")
    ap.add_argument("--draw-round", type=int, default=None,
                    help="1-based verify round of the first prompt to draw as a tree per method (default: the "
                         "round with the longest accepted path)")
    ap.add_argument("--peers", nargs="*", default=[], choices=list(PEERS),
                    help="other decoders as extra rows on the same prompts and target, greedy only "
                         "(dartree.decode.peers): transformers generate, transformers prompt-lookup decoding, "
                         "dartree's AR loop on a bfloat16 copy of the target (ar-bf16), "
                         "z-lab dflash_generate on this checkpoint exported to z-lab's layout")
    return ap.parse_args(argv)


def resolve_methods(names: list[str]) -> list[str]:
    """Expand ``all`` and aliases; drop duplicates; ``ar`` means the baseline only.

    Raises:
        KeyError: an unknown method name (lists the available ones).
    """
    out: list[str] = []
    for n in names:
        for m in (sorted(set(BUILDERS) - {"dartree-pruned", "dartree-fixed"}) if n == "all" else [n]):
            base, plus = (m[: -len(LOOKUP_SUFFIX)], LOOKUP_SUFFIX) if m.endswith(LOOKUP_SUFFIX) else (m, "")
            m = METHOD_ALIASES.get(base, base) + plus
            if m != "ar" and METHOD_ALIASES.get(base, base) not in BUILDERS:
                raise KeyError(f"unknown --tree {n!r}; available: ar, all, {', '.join(sorted(BUILDERS))}, each "
                               f"also as NAME{LOOKUP_SUFFIX}")
            if m not in out:
                out.append(m)
    return [m for m in out if m != "ar"]


def _first_divergence(a: list, b: list) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


@torch.no_grad()
def _margin_at(target, prompt_ids: list, ref: list, idx: int) -> float:
    """Target's top-2 logit margin when predicting ref[idx] after prompt + ref[:idx] (a near-tie check)."""
    ids = torch.tensor([prompt_ids + ref[:idx]], device=target.device)
    logits = target.forward(ids, logits_slice=slice(-1, None)).logits[0, -1]
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def write_report_files(out: Path, report: dict, md: str) -> None:
    """Write ``out/report.json`` (``report``) and ``out/report.md`` (``md``, made from the same report), each
    atomically under a unique temporary name (:func:`dartree.models.checkpoint.write_file_atomically`), so two runs
    writing one folder never share a temporary file. Call it inside :meth:`Signals.held`, so that SIGINT / SIGTERM
    cannot fall between the two files and leave one a prompt behind the other.

    Raises:
        OSError: ``out`` cannot be written.
    """
    write_file_atomically(out / "report.json", json.dumps(report, indent=1))
    write_file_atomically(out / "report.md", md)


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived (a ``BaseException``, as ``KeyboardInterrupt``: no ``except Exception`` swallows it).

    Attributes:
        signum: the signal's number; the process exits with 128 + signum (130 for SIGINT, 143 for SIGTERM).
    """

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Signals:
    """Context manager: while active, SIGINT and SIGTERM raise :class:`Interrupted` in the main thread, except
    inside :meth:`held`, where they wait until the held block ends (so report.json and report.md are written as a
    pair or not at all). Outside the main thread (where Python cannot install handlers) it does nothing."""

    def __init__(self):
        self._old: dict = {}
        self._depth, self._pending = 0, None

    def __enter__(self) -> "Signals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    def _handle(self, signum, _frame) -> None:
        if self._depth:
            self._pending = signum
        else:
            raise Interrupted(signum)

    @contextlib.contextmanager
    def held(self):
        """A block that SIGINT / SIGTERM do not cut: one arriving inside it raises :class:`Interrupted` at its end."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            pending, self._pending = (self._pending, None) if not self._depth else (None, self._pending)
            if pending is not None:
                raise Interrupted(pending)


def _spread_repeats(order: list[str], name: str, repeats: int) -> list[str]:
    """``order`` with ``repeats - 1`` more runs of ``name`` (``name#2``, ``name#3``, ..): run j + 1 goes before the
    row that comes ``round(j * n / repeats)`` rows after the first run (cyclically, n = ``len(order)``), so the
    repeats spread over the prompt's rows and a drift of the machine's speed during them reaches the baseline
    the way it reaches the other rows. E.g. (["b", "ar", "c", "d"], "ar", 2) -> ["b", "ar", "c", "ar#2", "d"].

    Raises:
        ValueError: ``name`` is not in ``order`` or ``repeats`` < 1.
    """
    if repeats < 1 or name not in order:
        raise ValueError(f"need repeats >= 1 and {name!r} in the order, got {repeats} and {order}")
    n, first = len(order), order.index(name)
    before: dict[int, list[str]] = {}
    for j in range(1, repeats):
        before.setdefault((first + round(j * n / repeats)) % n, []).append(f"{name}#{j + 1}")
    out: list[str] = []
    for i, row in enumerate(order):
        out += before.get(i, [])
        out.append(row)
    return out


def _agg(rows: list[dict], ar_rows: list[dict]) -> dict:
    """Aggregate per-prompt rows of one method (and the matching AR rows) into tau / speed figures."""
    committed = sum(sum(r["accept_lengths"]) for r in rows)
    rounds = sum(len(r["accept_lengths"]) for r in rows)
    dec_tok = sum(max(r["new_tokens"] - 1, 0) for r in rows)
    dec_s = sum(r["decode_s"] for r in rows)
    ar_tok = sum(max(r["new_tokens"] - 1, 0) for r in ar_rows)
    ar_s = sum(r["decode_s"] for r in ar_rows)
    tps = dec_tok / dec_s if dec_s > 0 else float("nan")
    ar_tps = ar_tok / ar_s if ar_s > 0 else float("nan")
    out = {
        "tau": committed / rounds if rounds else float("nan"),
        "tokens_per_s": tps,
        "speedup": tps / ar_tps if ar_tps and ar_tps == ar_tps else float("nan"),
        "rounds": rounds,
        "decode_tokens": dec_tok,
        "prompts": len(rows),
    }
    if rows and "stage_s" in rows[0]:
        for st in rows[0]["stage_s"]:
            out[f"{st}_ms_per_round"] = 1000 * sum(r["stage_s"][st] for r in rows) / max(rounds, 1)
        out["mean_tree_nodes"] = sum(sum(r["tree_nodes"]) for r in rows) / max(rounds, 1)
    if rows and "budgets" in rows[0]:  # verification budget per round (with --budget auto: the cost model's choice)
        hist: dict[int, int] = {}
        for r in rows:
            for b in r["budgets"]:
                hist[int(b)] = hist.get(int(b), 0) + 1
        out["budget_histogram"] = {b: hist[b] for b in sorted(hist)}
    paired = [r for r in rows if "paired_ar_decode_s" in r]
    if paired:  # against the AR decode that ran in lockstep with each row (--paired)
        p_tok = sum(max(r["paired_ar_new_tokens"] - 1, 0) for r in paired)
        p_s = sum(r["paired_ar_decode_s"] for r in paired)
        m_tok = sum(max(r["new_tokens"] - 1, 0) for r in paired)
        m_s = sum(r["decode_s"] for r in paired)
        out["paired_speedup"] = (m_tok / m_s) / (p_tok / p_s) if m_s > 0 and p_s > 0 and p_tok else float("nan")
        per = [(max(r["new_tokens"] - 1, 0) / r["decode_s"]) / (max(r["paired_ar_new_tokens"] - 1, 0) / r["paired_ar_decode_s"])
               for r in paired if r["decode_s"] > 0 and r["paired_ar_decode_s"] > 0 and r["paired_ar_new_tokens"] > 1]
        if per:
            out["paired_speedup_range"] = [min(per), max(per)]
    reps = [r["decode_s_repeats"] for r in rows if len(r.get("decode_s_repeats", ())) > 1]
    if reps:  # the baseline's own timing noise: (slowest - fastest) / mean of one prompt's repeats, averaged
        out["repeat_spread"] = sum((max(t) - min(t)) / (sum(t) / len(t)) for t in reps) / len(reps)
    mism = [r for r in rows if r.get("mismatch")]
    out["mismatches"] = len(mism)
    out["lossless"] = (len(mism) == 0) if rows and rows[0].get("mismatch") is not None else None
    if rows and rows[0].get("mismatch") is not None:  # a split only counts as a loss where the arithmetic is exact
        out["exact"] = all(r.get("exact", True) for r in rows)
    return out


def split_label(row: dict) -> str:
    """How one prompt's output that differs from AR's is named: ``MISMATCH`` where the run's arithmetic makes a
    verify row equal an AR step (fp32, or ``--invariant``), so the split is a real loss of exactness; else
    ``split@N (top-2 margin M)``, the first differing token N and the target's margin there (a near-tie that bf16
    verify rows may round the other way; a peer's own arithmetic splits the same way). Empty when equal."""
    if not row.get("mismatch"):
        return ""
    if row.get("exact", True):
        return "MISMATCH"
    return f"split@{row.get('first_divergence')} (top-2 margin {row.get('margin_at_divergence', float('nan')):.3f})"


def report_warnings(report: dict, tau_floor: float = 1.05) -> list[str]:
    """Loud warnings for a report: a method whose tau is about 1 (the drafter contributes nothing) and a
    method whose T = 0 output differs from AR's."""
    out = []
    auto = report.get("environment", {}).get("cost_models", {})  # the --budget auto rows
    for m, r in report["methods"].items():
        if m == "ar":
            continue
        peer = r.get("peer", False)  # a peer's tau is its own business (hf-generate: 1 by construction)
        if not peer and r["tau"] < tau_floor and r.get("mean_tree_nodes", 1.0) == 0 and m in auto:
            out.append(f"WARNING: {m} took a plain AR step every round: the cost model (--budget auto) found that "
                       "drafting never paid with this drafter and target (its tau and tree sizes show why)")
        elif not peer and r["tau"] < tau_floor and r.get("mean_tree_nodes", 1.0) == 0:
            out.append(f"WARNING: {m} drafted no tree nodes (budget 0), so tau is 1: raise --budget")
        elif not peer and r["tau"] < tau_floor:
            out.append(f"WARNING: {m} tau = {r['tau']:.3f} is about 1: the drafter contributes nothing "
                       "(untrained, mismatched to the target, or the wrong checkpoint)")
        if r["lossless"] is False and r.get("exact", True):
            out.append(f"WARNING: {m} differs from AR on {r['mismatches']} prompts: MISMATCH, a loss of exactness "
                       "where verify rows and AR steps compute the same bits (see per_prompt first_divergence)")
        elif r["lossless"] is False:
            out.append(f"note: {m} splits from AR on {r['mismatches']} prompts at near-ties (per_prompt: "
                       "first_divergence, margin_at_divergence): "
                       + ("its own arithmetic" if peer else "bf16 verify rows round differently from AR steps; "
                          "--invariant makes them equal"))
    return out


def _rows_text(rows: list[int]) -> str:
    """Row counts as ranges for the console: [1, 2, 3, 9] -> "1-3, 9"; [] -> "none"."""
    if not rows:
        return "none"
    parts, lo = [], rows[0]
    for a, b in zip(rows, rows[1:] + [None]):
        if b != a + 1:
            parts.append(str(lo) if lo == a else f"{lo}-{a}")
            lo = b
    return ", ".join(parts)


def out_problem(out: str) -> str | None:
    """Why ``--out`` cannot receive the report (an existing file, or a folder that cannot be created or written;
    :func:`dartree.models.validate.folder_problem`), checked before any model is loaded; None when it can."""
    from dartree.models.validate import folder_problem

    why = folder_problem(out)
    return None if why is None else f"--out {out!r} {why}; give a writable folder for report.json and report.md"


def main(argv=None) -> int:
    """Console entry point (``dartree-eval``); returns the exit status: 0, or 2 with a one-line error for a bad
    argument, target (its end ids, sampling settings, chat template, context, attention layout), checkpoint or
    prompt set (checked before any decoding), or 130 / 143 with one line after SIGINT / SIGTERM (the finished
    prompts' report stays). Restores torch's thread count on return, so it can run repeatedly in one process."""
    threads = torch.get_num_threads()
    progress = {"done": 0, "planned": 0, "out": None}
    try:
        with Signals() as sig, contextlib.ExitStack() as modes:
            return _eval_main(argv, sig, progress, modes)
    except Interrupted as exc:  # one line, never a traceback; the report of the finished prompts stays
        print(f"interrupted by {exc}: {_progress_text(progress)}", file=sys.stderr)
        return 128 + exc.signum
    finally:
        torch.set_num_threads(threads)


def _progress_text(progress: dict) -> str:
    """Where an interrupted run left its report: ``progress`` holds ``done`` / ``planned`` prompts and ``out``."""
    if not progress["done"]:
        return "stopped before the first prompt finished; no report written"
    return (f"{progress['out']}/report.json and report.md hold the {progress['done']} of {progress['planned']} "
            "prompts that finished")


class _Refused(Exception):
    """A run refused before any decoding: ``args[0]`` is its one stderr line; the CLI exits with 2."""


def _arg_problems(args: argparse.Namespace) -> list[str]:
    """Every bad argument value that needs no model to see, one message each (empty: the arguments are fine)."""
    return [msg for bad, msg in (
        (args.threads < 0, f"--threads must be >= 0 (0: torch's default), got {args.threads}"),
        (not math.isfinite(args.beta) or args.beta > 0, f"--beta {args.beta} must be a finite number <= 0 "
                                                         "(beta > 0 breaks prefix closure)"),
        (args.candidates < 1, f"--candidates must be >= 1, got {args.candidates}"),
        (args.width < 1, f"--width must be >= 1, got {args.width}"),
        (args.children < 1, f"--children must be >= 1, got {args.children}"),
        (args.lookup < 1, f"--lookup must be >= 1 (tokens of the +lookup methods' chain), got {args.lookup}"),
        (args.lookup_ngram < 1, f"--lookup-ngram must be >= 1, got {args.lookup_ngram}"),
        (args.limit < 1, f"--limit must be >= 1, got {args.limit}"),
        (args.ar_repeats < 1, f"--ar-repeats must be >= 1 (AR runs per prompt), got {args.ar_repeats}"),
        (args.max_new_tokens < 1, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"),
        (not math.isfinite(args.temperature) or args.temperature < 0,
         f"--temperature must be a finite number >= 0, got {args.temperature}"),
        (args.acceptance == "rejection" and (set(args.tree) != {"chain"} or not args.temperature > 0),
         f"--acceptance rejection needs --tree chain and --temperature > 0, got --tree {' '.join(args.tree)} "
         f"--temperature {args.temperature}"),
        (not 0 <= args.seed < 2**32, f"--seed must be in [0, 2**32), got {args.seed}"),
        (out_problem(args.out) is not None, out_problem(args.out)),
        (args.draw_round is not None and args.draw_round < 1, f"--draw-round is 1-based, got {args.draw_round}"),
    ) if bad]


def _read_prompt_file(args: argparse.Namespace) -> tuple[list[Prompt], dict | None]:
    """The ``--prompts`` file's prompts and record (path, sha256, ...), checked before any model loads; with it,
    ``args.datasets`` becomes the file's name. ([], None) without ``--prompts``.

    Raises:
        _Refused: the file is unreadable or malformed, or has messages lines under ``--chat-template none``.
    """
    if args.prompts is None:
        return [], None
    try:
        prompts, prompt_file = load_prompt_file(args.prompts, args.limit)
    except ValueError as exc:
        raise _Refused(f"error: --prompts {exc}") from None
    if args.chat_template == "none" and any(p.messages is not None for p in prompts):
        raise _Refused(f"error: --prompts {args.prompts} has \"messages\" lines, which need the chat template; drop "
                       "--chat-template none, or give \"text\" lines")
    args.datasets = [prompt_file["name"]]
    return prompts, prompt_file


def _plan_runs(methods: list[str], budgets: list) -> dict[str, tuple[str, int | str | None]]:
    """One run per (method, budget): run name -> (tree builder, budget). Chain drafts one node per proposal, so a
    numeric budget does not size it: in a sweep it runs once at full length, and once more as METHOD@auto when the
    sweep has auto."""
    runs: dict[str, tuple[str, int | str | None]] = {}
    for m in methods:
        builder = m.removesuffix(LOOKUP_SUFFIX)
        if builder == "chain" or len(budgets) == 1:
            runs[m] = (builder, "auto" if budgets == ["auto"] else (None if builder == "chain" else budgets[0]))
            if builder == "chain" and len(budgets) > 1 and "auto" in budgets:
                runs[f"{m}@auto"] = (builder, "auto")
        else:
            for b in budgets:
                runs[f"{m}@auto" if b == "auto" else f"{m}@B{b}"] = (builder, b)
    return runs


def _load_target(args: argparse.Namespace, dtype: torch.dtype):
    """The target with its stop ids, generation-config sampling settings and prompt encoder, checked before
    anything else is loaded or timed.

    Raises:
        _Refused: the target does not load, or its sampling settings or chat template do not fit the run.
    """
    try:
        target = load_target(args.target, dtype=dtype)
    except (FileNotFoundError, RuntimeError, OSError, ValueError) as exc:
        raise _Refused(f"error: cannot load --target {args.target!r}: "
                       f"{(str(exc).strip().splitlines() or [type(exc).__name__])[0]}") from None
    try:  # the target's own generation settings and prompt format, before anything else is loaded or timed
        stop_ids, sampling = target_stop_ids(target), sampling_settings(target)
        why = sampling_problem(sampling, args.temperature, args.ignore_generation_config)
        if why is not None:
            raise ValueError(why)
        encode = prompt_encoder(target.tokenizer, args.chat_template, args.chat_template_kwargs)
    except ValueError as exc:
        raise _Refused(f"error: --target {args.target}: {exc}") from None
    return target, stop_ids, sampling, encode


def _load_drafter_and_prompts(args: argparse.Namespace, target, dtype: torch.dtype, methods: list[str],
                              prompts: list[Prompt], prompt_file: dict | None, encode: Callable):
    """The checkpoint (None when only AR runs; the target then captures its layers), the packaged prompts (unless
    ``--prompts`` gave them) and every prompt's ids, checked against the context and the decoder's needs.

    Returns:
        (dm, prompts, prompt_ids).
    Raises:
        _Refused: a bad checkpoint, a missing prompt package, a prompt that does not fit, an unsupported target.
    """
    try:
        dm = load_dartree(args.checkpoint, target=target, dtype=dtype) if methods else None
    except CheckpointError as exc:
        raise _Refused(f"error: {exc}") from None
    if dm is not None:
        target.set_layer_ids(dm.drafter.cfg.target_layer_ids)
    try:
        for d in args.datasets if prompt_file is None else []:
            prompts += load_prompts(d, args.limit, args.seed)
    except (RuntimeError, KeyError, OSError) as exc:  # a prompt package missing or unreadable
        raise _Refused(f"error: --datasets {d}: {exc.args[0] if exc.args else exc}") from None
    try:  # every prompt fits the context, and the decoder supports the target, before calibration and decoding
        prompt_ids = encode_prompts(encode, prompts, target, args.max_new_tokens)
        if dm is not None:  # a verify tree reaches a proposal (depth <= P) or a lookup token (depth <= --lookup)
            depth = max(dm.drafter.cfg.num_proposals, args.lookup if any(LOOKUP_SUFFIX in m for m in methods) else 0)
            check_speculative_target(target, max(map(len, prompt_ids), default=0) + args.max_new_tokens + depth)
    except ValueError as exc:
        raise _Refused(f"error: {exc}") from None
    return dm, prompts, prompt_ids


def _pack_models(args: argparse.Namespace, console: Console, target, dm, dtype: torch.dtype):
    """Pack the target's and drafter's linear layers on the ``--linear`` path and (onednn, unless ``--no-tune``)
    time F.linear against it per weight shape.

    Returns:
        (linear, why, {weight shape: row counts where F.linear wins}).
    Raises:
        _Refused: the requested path cannot run here.
    """
    try:
        linear, linear_reason = choose_linear(args.linear, dtype, target.device)
    except ValueError as exc:
        raise _Refused(f"error: {exc}") from None
    ours = (target.model, *((dm.drafter, dm.head) if dm is not None else ()))
    for module in ours:
        pack_linears(module, linear)
    console.print(f"linear layers: {linear}; {linear_reason}")
    linear_tuning = {}
    if linear == "onednn" and args.tune:  # per weight shape, the row counts at which F.linear beats the packed call here
        tt0 = time.time()
        linear_tuning = tune_linears(*ours)
        console.print(f"linear paths tuned in {time.time() - tt0:.1f}s; F.linear wins at rows: "
                      + "; ".join(f"{k}: {_rows_text(v)}" for k, v in linear_tuning.items()))
    return linear, linear_reason, linear_tuning


def _enter_invariant(args: argparse.Namespace, console: Console, target, modes: contextlib.ExitStack) -> dict | None:
    """With ``--invariant``: enter the row-invariant mode in ``modes`` (after packing and tuning: the mode re-packs
    the target for row invariance) and return its record; else None.

    Raises:
        _Refused: the target has no row-invariant path.
    """
    if not args.invariant:
        return None
    from dartree.models.invariant import row_invariant

    try:
        mode = modes.enter_context(row_invariant(target))
    except ValueError as exc:
        raise _Refused(f"error: --invariant: {exc}") from None
    console.print(f"row-invariant verify: on (linear {mode.linear}: {mode.why}; attention one row per call)")
    return {"linear": mode.linear, "why": mode.why}


@dataclass
class EvalSession:
    """Everything one evaluation run decodes with, built once from the parsed arguments by :func:`open_session`:
    the target and checkpoint, the prompts and their ids, the matmul path, the row-invariant mode, the runs
    (name -> (builder, budget)), their cost models, the peers, the stop ids and the sampling settings."""

    args: argparse.Namespace
    console: Console
    target: object
    dm: object | None
    dtype: torch.dtype
    dtype_reason: str
    runs: dict
    budget: object
    prompts: list
    prompt_ids: list
    prompt_file: dict | None
    encode: Callable
    stop_ids: list
    sampling: dict
    t0: float
    linear: str = "aten"
    linear_reason: str = ""
    linear_tuning: dict = field(default_factory=dict)
    invariant: dict | None = None
    cost_models: dict = field(default_factory=dict)
    peers: list = field(default_factory=list)
    peers_skipped: dict = field(default_factory=dict)
    zlab: object = None
    twin: object = None

    @property
    def methods(self) -> list[str]:
        """The run names besides AR (METHOD, METHOD@B<n>, METHOD@auto)."""
        return list(self.runs)

    @property
    def names(self) -> list[str]:
        """Every row of the report: ar, the methods, then the peers that run."""
        return ["ar", *self.methods, *self.peers]

    @property
    def params(self) -> dict:
        a = self.args
        return {"k": a.candidates, "width": a.width, "beta": a.beta, "children": a.children}

    @property
    def exact_rows(self) -> bool:
        """Whether a split from AR is a loss of exactness (fp32, or the row-invariant mode)."""
        return self.dtype == torch.float32 or self.invariant is not None

    @property
    def sampling_record(self) -> dict:
        """What this run's samplers do, and the target's own settings it did not apply."""
        t = self.args.temperature
        return {"temperature": t, "rule": "greedy (argmax)" if t == 0 else f"softmax(logits / {t}) samples",
                "ignored": {k: v for k, v in self.sampling.items() if t > 0 or k == "repetition_penalty"},
                "generation_config": self.sampling}

    def run(self, method: str, ids: list, seed: int, max_new: int, record: bool = False) -> GenerateOutput:
        """One decode of ``ids``; with --paired a method's output carries ``paired_ar``, the ARStepper that ran in
        lockstep with it (then run to its end)."""
        a, target = self.args, self.target
        gen = torch.Generator().manual_seed(seed)
        if method == "ar":
            return autoregressive_generate(target, ids, max_new_tokens=max_new, temperature=a.temperature,
                                           stop_ids=self.stop_ids, generator=gen)
        builder, b = self.runs[method]
        pair = ARStepper(target, ids, max_new_tokens=max_new, temperature=a.temperature, stop_ids=self.stop_ids,
                         generator=torch.Generator().manual_seed(seed)) if a.paired else None
        o = speculative_generate(
            target, self.dm.drafter, self.dm.head, ids, builder=builder, max_new_tokens=max_new,
            temperature=a.temperature, stop_ids=self.stop_ids, budget=b, generator=gen, builder_params=self.params,
            record_trees=record, cost_model=self.cost_models.get(method), acceptance=a.acceptance,
            lookup=a.lookup if LOOKUP_SUFFIX in method else 0, lookup_ngram=a.lookup_ngram,
            lockstep=pair.run_to if pair is not None else None,
        )
        if pair is not None:
            pair.run_to(max_new)
            o.paired_ar = pair
        return o

    def run_peer_on(self, name: str, ids: list, max_new: int):
        """One decode of ``ids`` by the peer ``name`` (:func:`dartree.decode.peers.run_peer`)."""
        return run_peer(name, self.target, ids, max_new_tokens=max_new, stop_ids=self.stop_ids,
                        zlab_drafter=self.zlab, bf16_twin=self.twin)

    def calibrate(self) -> None:
        """The cost models of the ``--budget auto`` runs, calibrated on the first prompt."""
        if not any(b == "auto" for _, b in self.runs.values()):
            return
        from dartree.decode.budget import calibrate

        tc0 = time.time()
        drafter = self.dm.drafter
        cal = calibrate(self.target, drafter, self.prompt_ids[0] if self.prompts else [1, 2, 3],
                        max_budget=drafter.cfg.num_proposals)
        self.cost_models = {m: cal.fresh() for m, (_, b) in self.runs.items() if b == "auto"}
        self.console.print(f"cost model calibrated in {time.time() - tc0:.1f}s: AR step {1000 * cal.t_ar:.1f} ms, "
                           f"draft {1000 * cal.t_draft:.1f} ms, verify " + ", ".join(
                               f"{t}: {1000 * v:.1f}" for t, v in sorted(cal.verify_s.items())) + " ms")

    def load_peers(self) -> None:
        """The ``--peers`` that can run (greedy only), each with what it needs; the others in ``peers_skipped``."""
        a = self.args
        for name in dict.fromkeys(a.peers):
            if a.temperature != 0:
                self.peers_skipped[name] = f"peers run greedy only; --temperature is {a.temperature}"
                continue
            if name == "zlab-dflash":
                self.zlab, why = load_zlab_drafter(a.checkpoint, self.target)
                if why is not None:
                    self.peers_skipped[name] = why
                    continue
                pack_linears(self.zlab, self.linear)  # z-lab's drafter gets the same matmul path as ours
                if self.linear_tuning:
                    tune_linears(self.zlab)
            if name == "ar-bf16":
                if self.dtype == torch.bfloat16:
                    self.peers_skipped[name] = "the run is bfloat16 already: its AR row is bf16 AR"
                    continue
                self.twin = load_bf16_twin(a.target)
                twin_linear = choose_linear("aten" if a.linear == "aten" else "auto", torch.bfloat16,
                                            self.twin.device)[0]
                pack_linears(self.twin.model, twin_linear)
            self.peers.append(name)
        for name, why in self.peers_skipped.items():
            self.console.print(f"[bold yellow]peer {name} skipped: {why}[/bold yellow]")

    def warm_up(self) -> None:
        """One short decode per row (AR, every method, every peer) before any timing."""
        warm_ids = self.encode("Say hello.")
        for m in ["ar", *self.methods]:
            self.run(m, warm_ids, 0, 16)
        for name in self.peers:
            self.run_peer_on(name, warm_ids, 16)

    def prompt_order(self, pi: int) -> list[str]:
        """The decodes of prompt ``pi``, back to back in an order rotated per prompt (this machine's speed drifts
        over minutes, and a fixed order would hand the same share of that drift to the same rows on every prompt),
        with the AR repeats spread through it (ar#2, ...; :func:`_spread_repeats`)."""
        order = self.names
        order = order[pi % len(order):] + order[:pi % len(order)]
        return _spread_repeats(order, "ar", self.args.ar_repeats)

    def decode_prompt(self, pi: int, bar=None) -> tuple[dict[str, dict], dict[str, dict]]:
        """Decode prompt ``pi`` with AR (``--ar-repeats`` times), every method and every peer (``bar``: a tqdm bar
        stepped once per decode) and print its one-line summary.

        Returns:
            (that prompt's row per method, its recorded verify trees per method: the first prompt's only).
        """
        p, ids = self.prompts[pi], self.prompt_ids[pi]
        seed = self.args.seed * 100003 + pi
        order = self.prompt_order(pi)
        row_of = {name: name.split("#")[0] for name in order}  # ar#2 .. are repeats of ar
        outs = {}
        for name in order:
            if bar is not None:
                bar.set_postfix_str(f"{p.dataset}:{p.id} {name}")
            outs[name] = (self.run_peer_on(name, ids, self.args.max_new_tokens) if name in self.peers
                          else self.run(row_of[name], ids, seed, self.args.max_new_tokens,
                                        record=pi == 0 and row_of[name] != "ar"))
            if bar is not None:
                bar.update()
        ar_runs = [outs[n] for n in order if row_of[n] == "ar"]
        if any(o.tokens != outs["ar"].tokens for o in ar_runs):
            self.console.print(f"[bold yellow]{p.dataset}:{p.id}: the AR repeats disagree (a non-deterministic "
                               "kernel?); the first one is the reference[/bold yellow]")
        new, new_trees, line = self.prompt_rows(pi, outs, ar_runs)
        with tqdm.external_write_mode(file=sys.stderr):
            self.console.print(", ".join(line))
        return new, new_trees

    def prompt_rows(self, pi: int, outs: dict, ar_runs: list) -> tuple[dict[str, dict], dict[str, dict], list[str]]:
        """Prompt ``pi``'s row per method from its decodes ``outs`` (``ar_runs``: the AR repeats, first one the
        reference), its recorded trees, and the parts of its console line."""
        p, ids, ar = self.prompts[pi], self.prompt_ids[pi], outs["ar"]
        base = {"dataset": p.dataset, "id": p.id}
        new: dict[str, dict] = {}
        new_trees: dict[str, dict] = {}
        ar_times = [o.stats.decode_s for o in ar_runs]
        new["ar"] = {**base, "new_tokens": ar.stats.new_tokens, "decode_s": sum(ar_times) / len(ar_times),
                     "decode_s_repeats": ar_times, "accept_lengths": ar.stats.accept_lengths}
        line = [f"[{pi + 1}/{len(self.prompts)}] {p.dataset}:{p.id} ar {ar.stats.new_tokens} tok"]
        for m in self.methods:
            o = outs[m]
            row = {**base, "new_tokens": o.stats.new_tokens, "decode_s": o.stats.decode_s,
                   "accept_lengths": o.stats.accept_lengths, "stage_s": o.stats.stage_s,
                   "tree_nodes": o.stats.tree_nodes, "budgets": o.stats.budgets, "depth_nodes": o.stats.depth_nodes,
                   "accepted_depths": o.stats.accepted_depths, "mismatch": None}
            pair = getattr(o, "paired_ar", None)
            if pair is not None:  # the AR decode that ran in lockstep with this one
                row["paired_ar_decode_s"], row["paired_ar_new_tokens"] = pair.stats.decode_s, pair.stats.new_tokens
            if pi == 0:
                tok = self.target.tokenizer
                new_trees[m] = {**base, "rounds": annotate_trees(o.stats.trees, lambda i: tok.decode([i]))}
            if self.args.temperature == 0:
                self.compare_with_ar(row, o.tokens, ids, ar.tokens, exact=self.exact_rows)
            new[m] = row
            line.append(f"{m} tau {o.stats.tau:.2f} {split_label(row)}".rstrip())
        for m in self.peers:
            o = outs[m]
            row = {**base, "new_tokens": len(o.tokens), "decode_s": o.decode_s, "prefill_s": o.prefill_s,
                   "accept_lengths": o.accept_lengths}
            self.compare_with_ar(row, o.tokens, ids, ar.tokens, exact=False)  # a peer's own arithmetic may split
            new[m] = row
            line.append(f"{m} tau {o.tau:.2f} {split_label(row)}".rstrip())
        return new, new_trees, line

    def compare_with_ar(self, row: dict, tokens: list, ids: list, ref: list, exact: bool = True) -> None:
        """Record in ``row`` whether ``tokens`` differ from AR's ``ref`` and, if so, the first divergence and the
        target's top-2 logit margin there (a near-tie check); ``exact``: whether a split is a loss of exactness
        (:func:`split_label`)."""
        row["mismatch"], row["exact"] = tokens != ref, exact
        if row["mismatch"]:
            idx = _first_divergence(tokens, ref)
            row["first_divergence"] = idx
            row["margin_at_divergence"] = _margin_at(self.target, ids, ref, idx)

    def environment(self, done: int, interrupted: str | None = None) -> dict:
        """report.json's ``environment``: the machine, versions and every setting of the run, with the first
        ``done`` prompts; ``interrupted``: the signal's name when the run was stopped."""
        a, target, dm = self.args, self.target, self.dm
        return {
            "device": str(target.device), "dtype": a.dtype, "dtype_reason": self.dtype_reason,
            "linear": self.linear, "linear_reason": self.linear_reason, "linear_aten_rows": self.linear_tuning,
            "row_invariant": self.invariant, "attn_implementation": target.config._attn_implementation,
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "python": platform.python_version(), "platform": platform.platform(), "threads": torch.get_num_threads(),
            "target": target.name, "checkpoint": str(a.checkpoint) if self.methods else None,
            "max_new_tokens": a.max_new_tokens, "temperature": a.temperature, "seed": a.seed,
            "acceptance": a.acceptance, "lookup": a.lookup, "lookup_ngram": a.lookup_ngram,
            "stop_ids": self.stop_ids, "sampling": self.sampling_record,
            "chat_template": "tokenizer" if a.chat_template == "auto" else "none (raw prompt text)",
            "chat_template_kwargs": a.chat_template_kwargs,
            "budget": self.budget, "builder_params": self.params, "ar_repeats": a.ar_repeats, "paired": a.paired,
            "cost_models": {m: cm.summary() for m, cm in self.cost_models.items()},
            "proposals": dm.drafter.cfg.num_proposals if dm is not None else None,
            "prompts": [{"dataset": p.dataset, "id": p.id, "text": p.text[:120]} for p in self.prompts[:done]],
            "prompt_file": self.prompt_file,
            "prompts_done": done, "prompts_planned": len(self.prompts), "interrupted": interrupted,
        }

    def write_report(self, rows: dict, trees: dict, done: int, sig: "Signals", show: bool,
                     interrupted: str | None = None) -> dict:
        """Aggregate the rows of the first ``done`` prompts; write report.json/md atomically (after every prompt,
        so a long run can be read, or survive an interruption, before it ends), inside ``sig.held()``; ``show``:
        print the tables too."""
        report = build_report(self.environment(done, interrupted), rows, trees, self.methods, self.peers,
                              self.args.datasets, self.peers_skipped)
        md = report_markdown(report)
        if show:
            for item in report_console(report):
                self.console.print(item)
        with sig.held():
            write_report_files(Path(self.args.out), report, md)
        return report


def open_session(args: argparse.Namespace, console: Console, modes: contextlib.ExitStack) -> EvalSession:
    """Load and check everything a run needs, in the order the CLI always has (prompt file, methods, dtype, target,
    checkpoint, prompts, matmul path, row-invariant mode, cost models, peers), printing each choice.

    Raises:
        _Refused: a bad argument, target, checkpoint or prompt set (one line; exit 2).
    """
    prompts, prompt_file = _read_prompt_file(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        methods = resolve_methods(args.tree)
    except KeyError as exc:
        raise _Refused(f"error: {exc.args[0]}") from None
    args.dtype, dtype_reason = choose_dtype(args.dtype)
    dtype = _DTYPES[args.dtype]
    console.print(f"mode: {args.dtype}; {dtype_reason}")
    budgets = list(args.budget)
    budget = budgets[0] if len(budgets) == 1 else budgets
    runs = _plan_runs(methods, budgets)
    t0 = time.time()
    target, stop_ids, sampling, encode = _load_target(args, dtype)
    dm, prompts, prompt_ids = _load_drafter_and_prompts(args, target, dtype, methods, prompts, prompt_file, encode)
    s = EvalSession(args=args, console=console, target=target, dm=dm, dtype=dtype, dtype_reason=dtype_reason,
                    runs=runs, budget=budget, prompts=prompts, prompt_ids=prompt_ids, prompt_file=prompt_file,
                    encode=encode, stop_ids=stop_ids, sampling=sampling, t0=t0)
    s.linear, s.linear_reason, s.linear_tuning = _pack_models(args, console, target, dm, dtype)
    s.invariant = _enter_invariant(args, console, target, modes)
    console.print(f"target {target.name} ({args.dtype}), {len(prompts)} prompts, methods: ar + {methods}, "
                  f"budget {budget}; loaded in {time.time() - t0:.1f}s")
    s.calibrate()
    s.load_peers()
    return s


def build_report(environment: dict, rows: dict[str, list[dict]], trees: dict, methods: list[str], peers: list[str],
                 datasets: list[str], peers_skipped: dict) -> dict:
    """report.json from the per-prompt ``rows`` (method -> rows) and the run's ``environment``: every method's and
    peer's aggregate (:func:`_agg`) over all prompts and per data set, the skipped peers, the rows themselves and
    the first prompt's verify ``trees``."""
    report = {"methods": {}, "datasets": {}, "environment": environment}
    ar_all = rows["ar"]
    report["methods"]["ar"] = _agg(ar_all, ar_all)
    for m in [*methods, *peers]:
        report["methods"][m] = _agg(rows[m], ar_all)
    for d in datasets:
        ar_d = [r for r in ar_all if r["dataset"] == d]
        report["datasets"][d] = {m: _agg([r for r in rows[m] if r["dataset"] == d], ar_d)
                                 for m in ["ar", *methods, *peers]}
    for m in peers:  # dartree.decode.peers rows: tau = committed tokens per target forward, prefill excluded
        for agg in [report["methods"][m]] + [report["datasets"][d][m] for d in datasets]:
            agg["peer"] = True
    report["peers_skipped"] = peers_skipped
    report["per_prompt"] = rows
    report["trees"] = trees  # every verify tree of the first prompt, per method, for drawing
    return report


def _eval_main(argv=None, sig: Signals | None = None, progress: dict | None = None,
               modes: contextlib.ExitStack | None = None) -> int:
    """:func:`main` without the thread-count restore and the signal handlers (``sig``: the active
    :class:`Signals`; ``progress``: updated with the prompts done and the report folder; ``modes``: holds the
    row-invariant mode until the caller closes it)."""
    sig = sig if sig is not None else Signals()
    modes = modes if modes is not None else contextlib.ExitStack()
    progress = progress if progress is not None else {}
    args = parse_args(argv)
    console = Console(width=120)
    problems = _arg_problems(args)
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    try:
        s = open_session(args, console, modes)
    except _Refused as exc:
        print(exc.args[0], file=sys.stderr)
        return 2
    s.warm_up()
    out = Path(args.out)
    rows: dict[str, list[dict]] = {m: [] for m in s.names}
    trees: dict[str, dict] = {}
    progress.update(done=0, planned=len(s.prompts), out=str(out))
    # one step per decode (every prompt's AR runs, methods and peers), so the bar's rate and time left count them all
    per_prompt = len(_spread_repeats(s.names, "ar", args.ar_repeats))
    bar = tqdm(total=len(s.prompts) * per_prompt, desc="decoding", unit="decode", file=sys.stderr, dynamic_ncols=True)
    try:
        for pi in range(len(s.prompts)):
            new, new_trees = s.decode_prompt(pi, bar)
            with sig.held():  # the rows enter together with the report files that hold them
                for name, row in new.items():
                    rows[name].append(row)
                trees.update(new_trees)
                s.write_report(rows, trees, pi + 1, sig, show=False)
                progress["done"] = pi + 1
    except Interrupted as exc:  # the finished prompts' report, marked as interrupted; then the one-line exit
        bar.close()
        if progress["done"]:
            s.write_report(rows, trees, progress["done"], sig, show=False, interrupted=str(exc))
        raise
    bar.close()
    report = s.write_report(rows, trees, len(s.prompts), sig, show=True)
    for w in report_warnings(report):
        console.print(f"[bold red]{w}[/bold red]")
    if not args.no_plots:  # after report.json and the tables: a figure problem is a warning, never a lost report
        for w in write_figures(report, out, args.draw_round):
            console.print(f"[bold yellow]{w}[/bold yellow]")
    console.print(f"wrote {out / 'report.json'} and {out / 'report.md'} ({(time.time() - s.t0) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
