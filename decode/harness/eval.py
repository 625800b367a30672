"""Acceptance length and speedup of tree decoders against plain autoregressive decoding of the target.

``python decode/eval.py --tree pruned [--datasets humaneval mtbench gsm8k | --prompts FILE] [--limit N] [--budget B] ...``

For every prompt (chat-templated by the target's tokenizer) the target first decodes on its own (AR, the
baseline and the losslessness oracle), then each requested method decodes the same prompt. Reported per
method and dataset: tau (committed tokens per verify forward, bonus included), tokens/s and speedup over AR
(AR time-per-output-token / method time-per-output-token, prefill excluded, same process, after a warm-up),
per-round stage times, and losslessness (T = 0: the count of prompts whose output differs from AR's, with
the first divergence and the target's top-2 logit margin there). Writes ``report.json`` and ``report.md``,
then the figures beside them, embedded in report.md (``dartree.decode.harness.report_figures``; ``--no-plots``
skips them; ``dartree-report DIR`` redraws them from report.json).

``--batch 1 2 4 8`` reports the throughput curve instead (:mod:`dartree.decode.harness.batch_sweep`): tokens/s per
method and batch size, the speedup over dartree's batched AR loop at each size, tau per row, losslessness per row
against each prompt's own AR decode, batch 1 against the one-prompt path, and a figure of throughput against batch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from rich.console import Console
from tqdm.auto import tqdm

from dartree.decode.harness.batch_report import sweep_markdown, sweep_warnings
from dartree.decode.harness.batch_sweep import BATCH_PEERS, BatchSweep
from dartree.decode.harness.builder_args import add_builder_param_args, builder_param_problems
from dartree.decode.harness.flags import add_decode_flags
from dartree.decode.harness.peers import PEERS
from dartree.decode.harness.report import report_warnings, write_report_files
from dartree.decode.harness.report_figures import write_figures
from dartree.decode.harness.report_rows import PromptRow
from dartree.decode.harness.prompt_rows import spread_repeats
from dartree.decode.harness.session import EvalConfig, Refused, open_session
from dartree.decode.builders import BUILDERS
from dartree.base.cli import fail
from dartree.base.fields import folder_problem


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


# eval's help of the flags it shares with the bench (:func:`~dartree.decode.harness.flags.add_decode_flags`)
SHARED_HELP = {
    "tree": f"methods besides the AR baseline: ar, {', '.join(sorted(BUILDERS))}, or all (every builder once; "
            "heap-sequential is the slow exact reference); BUILDER+lookup also grafts a prompt-lookup chain onto "
            "each round's tree (--lookup tokens); METHOD@B<n> runs METHOD at the fixed budget n beside --budget "
            "(with --budget auto the auto row is then METHOD@auto), so the report shows what auto chose against",
    "budget": "tree nodes per round B, or auto: per round the cost model (calibrated at start-up) keeps the tree "
              "size that maximises expected tokens per second, 0 = a plain AR step, and chain is shortened the "
              "same way; several values run a budget sweep, reported as METHOD@B<n> (METHOD@auto) for every "
              "tree builder other than chain (which runs at full length, and as chain@auto when auto is among "
              "the values)",
    "dtype": "target and drafter dtype; auto: bfloat16 on CUDA, float32 on a CPU without native bf16 matrix "
             "arithmetic; on a CPU with it (oneDNN bf16), bfloat16 in the row-invariant mode and float32 are "
             "timed at start-up and the faster decodes; the run prints which and why",
    "linear": "matmul path of the target's and drafter's linear layers: onednn (weights prepacked once, the fast "
              "small-M path on CPU), aten (plain F.linear), auto (onednn where it can run); every row of the run, "
              "AR and peers included, uses the same one",
    "tune": "with onednn: keep the fixed single-row rule instead of timing F.linear against the packed call per "
            "weight shape and row count at start-up (a few seconds) and taking the faster",
    "invariant": "row-invariant target forwards (dartree.models.invariant): every verify row computes the bits an "
                 "AR step computes for it, so the output equals AR's by construction, in bf16 too; auto: on for a "
                 "CPU target in bfloat16, off in float32 (exact in practice, and the mode costs its AR step "
                 "~25%%) and on CUDA (measured on an H200: not needed there, 16-21%% dearer; on enters it), the "
                 "reason in the header; a bare --invariant means on (docs/invariance.md)",
    "checkpoint": "dartree checkpoint folder", "target": "'smollm2' or a local Hugging Face folder",
    "max_new_tokens": "tokens generated per prompt", "out": "folder for report.json and report.md"}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="dartree-eval", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_decode_flags(ap, sweep=False, tree=["pruned"], budget=["auto"], dtype="auto", linear="auto", limit=20,
                     max_new_tokens=256, out="reports/latest", helps=SHARED_HELP)
    ap.add_argument("--lookup", type=int, default=10,
                    help="tokens of the prompt-lookup chain of the +lookup methods (transformers' default, 10)")
    ap.add_argument("--lookup-ngram", type=int, default=3, help="longest n-gram the +lookup methods match")
    add_builder_param_args(ap)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (output must equal AR's)")
    ap.add_argument("--acceptance", default="match", choices=["match", "rejection"],
                    help="T > 0 rule: exact target-sample matching of deterministic drafts (every tree), or sampled "
                         "chain drafts + speculative rejection sampling (--tree chain only)")
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
    ap.add_argument("--ar-repeats", type=int, default=2,
                    help="AR runs per prompt, spread through that prompt's rows; the AR baseline is their mean "
                         "time, and the report gives their spread (the machine's own timing noise, next to every "
                         "speedup)")
    ap.add_argument("--paired", action="store_true",
                    help="also time every method in lockstep with its own AR decode of the same prompt (after each "
                         "round the AR loop steps until it has as many tokens), and report that paired speedup next to "
                         "the plain one: both loops then see the same seconds of a machine whose speed drifts, which "
                         "separate runs minutes apart do not (costs one more AR decode per method and prompt)")
    ap.add_argument("--no-plots", action="store_true",
                    help="tables only: no PNG figures (report.json still keeps the data to draw them later)")
    ap.add_argument("--draw-round", type=int, default=None,
                    help="1-based verify round of the first prompt to draw as a tree per method (default: the "
                         "round with the longest accepted path)")
    ap.add_argument("--batch", type=int, nargs="+", default=None, metavar="N",
                    help="the throughput curve instead of the per-prompt report: every method, dartree's batched AR "
                         "loop and (with --peers hf-generate) transformers' batched generate decode the prompts N at a "
                         "time for each N (e.g. --batch 1 2 4 8), after every request alone (the one-prompt path and "
                         "the lossless reference); reports tokens/s, the speedup over batched AR at each N, tau per "
                         "row and a figure of throughput against N (decode/harness/batch_sweep.py)")
    ap.add_argument("--queue", type=int, default=2, metavar="K",
                    help="with --batch: the prompts are cycled into at least K x the largest batch requests, so the "
                         "largest batch is refilled from a queue as a served one is (default 2; 1: as many requests "
                         "as its rows, measured draining)")
    ap.add_argument("--peers", nargs="*", default=[], choices=list(PEERS),
                    help="other decoders as extra rows on the same prompts and target, greedy only "
                         "(dartree.decode.harness.peers): transformers generate, transformers prompt-lookup decoding, "
                         "dartree's AR loop on a bfloat16 copy of the target (ar-bf16), "
                         "z-lab dflash_generate on this checkpoint exported to z-lab's layout")
    return ap.parse_args(argv)


def out_problem(out: str) -> str | None:
    """Why ``--out`` cannot receive the report (an existing file, or a folder that cannot be created or written;
    :func:`dartree.base.fields.folder_problem`), checked before any model is loaded; None when it can."""
    why = folder_problem(out)
    return None if why is None else f"--out {out!r} {why}; give a writable folder for report.json and report.md"


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
            f"{progress.get('unit', 'prompts')} that finished")


def _arg_problems(args: argparse.Namespace) -> list[str]:
    """Every bad argument value that needs no model to see, one message each (empty: the arguments are fine)."""
    return [msg for bad, msg in (
        (args.threads < 0, f"--threads must be >= 0 (0: torch's default), got {args.threads}"),
        *builder_param_problems(args),
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
        *_batch_problems(args),
    ) if bad]


def _batch_problems(args: argparse.Namespace) -> list[tuple[bool, str]]:
    """The arguments a ``--batch`` sweep cannot take, each with its fix."""
    if args.batch is None:
        return []
    return [
        (min(args.batch) < 1, f"--batch sizes must be >= 1 (rows decoded together), got {args.batch}"),
        (args.queue < 1, f"--queue must be >= 1 (requests per row of the largest batch), got {args.queue}"),
        (args.acceptance != "match", "--batch decodes with --acceptance match only; drop --acceptance rejection"),
        (args.paired, "--batch times whole batches, not lockstep pairs; drop --paired"),
        (bool(set(args.peers) - set(BATCH_PEERS)),
         f"--batch runs the batched peer {', '.join(BATCH_PEERS)} only; drop --peers "
         f"{' '.join(sorted(set(args.peers) - set(BATCH_PEERS)))}"),
    ]


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
        return fail("; ".join(problems))
    config = EvalConfig.from_args(args)
    try:
        s = open_session(config, console, modes)
    except Refused as exc:
        return fail(exc.args[0])
    s.warm_up()
    if config.batch is not None:
        return _sweep_main(s, sig, progress)
    out = Path(config.out)
    rows: dict[str, list[PromptRow]] = {m: [] for m in s.names}
    trees: dict[str, dict] = {}
    progress.update(done=0, planned=len(s.prompts), out=str(out))
    # one step per decode (every prompt's AR runs, methods and peers), so the bar's rate and time left count them all
    per_prompt = len(spread_repeats(s.names, "ar", config.ar_repeats))
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
    if not config.no_plots:  # after report.json and the tables: a figure problem is a warning, never a lost report
        for w in write_figures(report, out, config.draw_round):
            console.print(f"[bold yellow]{w}[/bold yellow]")
    console.print(f"wrote {out / 'report.json'} and {out / 'report.md'} ({(time.time() - s.t0) / 60:.1f} min)")
    return 0


def _sweep_main(s, sig: Signals, progress: dict) -> int:
    """``--batch``: the throughput curve (:class:`~dartree.decode.harness.batch_sweep.BatchSweep`): the one-prompt
    path, then every batch size, report.json / report.md rewritten after each (so an interrupted run keeps the batch
    sizes that finished), the tables and warnings printed, the figure drawn. Returns the exit status (0)."""
    config, console, out = s.config, s.console, Path(s.config.out)
    sweep = BatchSweep(s, config.batch)
    console.print(f"batch sweep: {len(sweep.requests)} requests from {len(s.prompt_ids)} prompts, batch sizes "
                  f"{config.batch}, rows: {', '.join(sweep.names)}")
    sweep.prepare()
    total = len(sweep.requests) * (1 + len(s.methods)) + sum(len(sweep.order(i)) for i in range(len(config.batch)))
    bar = tqdm(total=total, desc="decoding", unit="decode", file=sys.stderr, dynamic_ncols=True)
    progress.update(done=0, planned=len(config.batch), out=str(out), unit="batch sizes")

    def write(interrupted: str | None = None) -> dict:
        report = {"environment": s.environment(len(s.prompts), interrupted), "batch_sweep": sweep.section()}
        report["environment"]["batch"] = config.batch
        with sig.held():
            write_report_files(out, report, sweep_markdown(report))
        return report

    try:
        sweep.one_prompt(bar)
        for bi, b in enumerate(config.batch):
            rows = sweep.run_batch(bi, bar)
            with tqdm.external_write_mode(file=sys.stderr):
                console.print(f"batch {b}: " + ", ".join(f"{r.method} {r.tokens_per_s:.1f} tok/s {r.speedup:.3f}x "
                                                         f"tau {r.tau_mean:.2f}" for r in rows))
            write()
            progress["done"] = bi + 1
    except Interrupted as exc:
        bar.close()
        if progress["done"]:
            write(str(exc))
        raise
    bar.close()
    report = write()
    console.print(sweep_markdown(report))
    for w in sweep_warnings(report):
        console.print(f"[bold red]{w}[/bold red]")
    if not config.no_plots:
        for w in write_figures(report, out):
            console.print(f"[bold yellow]{w}[/bold yellow]")
    console.print(f"wrote {out / 'report.json'} and {out / 'report.md'} ({(time.time() - s.t0) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
