"""One evaluation session of ``decode/eval.py``: everything a run decodes with, built once (:func:`open_session`:
target, checkpoint, matmul path and tuning, row-invariant mode through :func:`dartree.decode.assembly.assemble`, the
assembly the API and the bench use too; prompts and their ids, runs, cost models, peers, stop ids, sampling record),
and the per-prompt decode that turns each prompt into report rows
(:meth:`EvalSession.decode_prompt`, from :class:`dartree.decode.harness.prompt_rows.PromptRows`; each single decode
through :func:`dartree.decode.harness.runner.decode_one`, the step the bench runs too). Rendering the rows is
:mod:`dartree.decode.harness.report`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import re
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console

from dartree.decode.assembly import Assembly, ModeUnavailable, TargetLoadError, assemble, dtype_plan
from dartree.decode.harness.builder_args import builder_params_of
from dartree.decode.inputs import check_prompt_set
from dartree.decode.harness.runner import PromptDecode, decode_one
from dartree.decode.settings import DecodeSettings
from dartree.decode.harness.peers import load_bf16_twin, load_zlab_drafter, run_peer
from dartree.decode.harness.prompt_rows import PromptRows
from dartree.decode.harness.prompts import Prompt, load_prompt_file, load_prompts
from dartree.decode.harness.report import build_report, prior_text, report_console, report_markdown, write_report_files
from dartree.decode.harness.report_rows import EvalReport, PromptRow
from dartree.decode.builders import BUILDERS, builder_name
from dartree.models.chat import chat_prompt_ids, check_chat_template, messages_prompt_ids, text_prompt_ids
from dartree.models.generation import sampling_problem, sampling_settings
from dartree.models.generation import stop_ids as target_stop_ids
from dartree.models.packed import choose_linear, pack_linears, tune_linears
from dartree.decode.generate import POLICY_PROMPT, SEED_TOKENS, seed_policy, warm_paths
from dartree.decode import budget as budget_lib

LOOKUP_SUFFIX = "+lookup"  # BUILDER+lookup: the builder's tree with a prompt-lookup chain grafted on (decode/lookup.py)
FIXED_RUN = re.compile(r"^(?P<method>.+)@B(?P<budget>\d+)$")  # METHOD@B<n>: a fixed-budget run beside --budget


def resolve_methods(names: list[str]) -> list[str]:
    """Expand ``all`` (every builder once) and the builders' aliases (:func:`dartree.decode.builders.builder_name`);
    drop duplicates; ``ar`` means the baseline only. ``BUILDER+lookup`` keeps its suffix, and so does
    ``METHOD@B<n>`` (the method at the fixed budget n, whatever ``--budget`` says: :func:`plan_runs`).

    Raises:
        ValueError: an unknown method name (lists the available ones).
    """
    out: list[str] = []
    for n in names:
        hit = FIXED_RUN.match(n)
        stem, fixed = (hit["method"], f"@B{int(hit['budget'])}") if hit else (n, "")
        for m in (sorted(BUILDERS) if stem == "all" else [stem]):
            base, plus = (m[: -len(LOOKUP_SUFFIX)], LOOKUP_SUFFIX) if m.endswith(LOOKUP_SUFFIX) else (m, "")
            if base != "ar" or plus or fixed:
                try:
                    base = builder_name(base)
                except ValueError:
                    raise ValueError(f"unknown --tree {n!r}; available: ar, all, {', '.join(sorted(BUILDERS))}, "
                                     f"each also as NAME{LOOKUP_SUFFIX}, and any of them as NAME@B<n> (a fixed budget "
                                     "n beside --budget)") from None
            if base + plus + fixed not in out:
                out.append(base + plus + fixed)
    return [m for m in out if m != "ar"]


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
            target's context (:func:`dartree.decode.inputs.check_prompt_set`); one line naming the prompt.
    """
    out = []
    for p in prompts:
        try:
            ids = encode(p.text if p.messages is None else p.messages)
        except Exception as exc:  # a template's own error (jinja2, ValueError, ...): one line naming the prompt
            raise ValueError(f"the chat template failed on prompt {p.dataset}:{p.id}: {type(exc).__name__}: "
                             f"{(str(exc).strip().splitlines() or [''])[0]}") from None
        out.append(ids)
    check_prompt_set(target, out, [f"{p.dataset}:{p.id}" for p in prompts], max_new_tokens)
    return out


class Refused(Exception):
    """A run refused before any decoding: ``args[0]`` is its one stderr line; the CLI exits with 2."""


@dataclass(frozen=True)
class EvalConfig:
    """What one ``dartree-eval`` run is asked for, built once from its parsed flags (:meth:`from_args`) and never
    changed after: each field is the flag of that name (``max_new_tokens`` is ``--max-new-tokens``, ``tune`` is
    ``not --no-tune``), as given; what the run resolves (the dtype ``auto`` chose, the prompt file's data set name)
    lives in the session (its ``models``' ``dtype_name``, its ``prompt_file``)."""

    tree: list[str]  # method names as given (resolve_methods expands them)
    budget: list[int | str]  # tree nodes per round, or "auto"
    dtype: str  # "auto" or a name of dartree.base.dtypes.DTYPES
    linear: str  # matmul path: auto, onednn or aten
    tune: bool
    invariant: str  # auto, on or off
    checkpoint: str  # folder
    target: str  # "smollm2" or a Hugging Face folder
    datasets: list[str]  # packaged prompt sets (ignored with prompts)
    prompts: str | None  # a prompt file
    limit: int  # prompts per data set
    max_new_tokens: int  # tokens generated per prompt
    threads: int  # torch threads, 0: torch's default
    out: str  # report folder
    lookup: int  # tokens of a +lookup method's chain
    lookup_ngram: int
    builder_params: dict  # the builders' flagged parameters by name (builder_args.builder_params_of)
    temperature: float  # 0: greedy
    acceptance: str  # match or rejection
    ignore_generation_config: bool
    chat_template: str  # auto or none
    chat_template_kwargs: dict
    seed: int
    ar_repeats: int  # AR runs per prompt
    paired: bool
    no_plots: bool
    draw_round: int | None  # 1-based verify round to draw
    batch: list[int] | None  # batch sizes of a --batch sweep
    queue: int  # with batch: requests per row of the largest batch
    peers: list[str]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EvalConfig":
        """The configuration of eval's parsed flags (:func:`dartree.decode.harness.eval.parse_args`; their values
        are checked there, not here). Raises AttributeError where ``args`` lacks one of them."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if f.name != "builder_params"},
                   builder_params=builder_params_of(args))


def read_prompt_file(config: EvalConfig) -> tuple[list[Prompt], dict | None]:
    """The ``--prompts`` file's prompts and record (path, sha256, ...; its ``name`` is the run's data set), checked
    before any model loads. ([], None) without ``--prompts``.

    Raises:
        Refused: the file is unreadable or malformed, or has messages lines under ``--chat-template none``.
    """
    if config.prompts is None:
        return [], None
    try:
        prompts, prompt_file = load_prompt_file(config.prompts, config.limit)
    except ValueError as exc:
        raise Refused(f"error: --prompts {exc}") from None
    if config.chat_template == "none" and any(p.messages is not None for p in prompts):
        raise Refused(f"error: --prompts {config.prompts} has \"messages\" lines, which need the chat template; drop "
                       "--chat-template none, or give \"text\" lines")
    return prompts, prompt_file


def plan_runs(methods: list[str], budgets: list) -> dict[str, tuple[str, int | str | None]]:
    """One run per (method, budget): run name -> (tree builder, budget). Chain drafts one node per proposal, so a
    numeric ``--budget`` does not size it: in a sweep it runs once at full length, and once more as METHOD@auto when
    the sweep has auto. A method named ``METHOD@B<n>`` (:func:`resolve_methods`) runs at the fixed budget n, chain
    included, beside the others; the ``--budget auto`` run of that METHOD is then named ``METHOD@auto``, so the two
    rows say which is which (``make run``: ``pruned@auto`` beside ``pruned@B8``)."""
    runs: dict[str, tuple[str, int | str | None]] = {}
    fixed = {m: FIXED_RUN.match(m) for m in methods if FIXED_RUN.match(m)}
    beside = {hit["method"] for hit in fixed.values()}
    for m in methods:
        if m in fixed:
            runs[m] = (fixed[m]["method"].removesuffix(LOOKUP_SUFFIX), int(fixed[m]["budget"]))
            continue
        builder = m.removesuffix(LOOKUP_SUFFIX)
        if builder == "chain" or len(budgets) == 1:
            name = f"{m}@auto" if budgets == ["auto"] and m in beside else m
            runs[name] = (builder, "auto" if budgets == ["auto"] else (None if builder == "chain" else budgets[0]))
            if builder == "chain" and len(budgets) > 1 and "auto" in budgets:
                runs[f"{m}@auto"] = (builder, "auto")
        else:
            for b in budgets:
                runs.setdefault(f"{m}@auto" if b == "auto" else f"{m}@B{b}", (builder, b))
    return runs


def _check_target(config: EvalConfig, target) -> tuple[list, dict, Callable]:
    """The target's stop ids, generation-config sampling settings and prompt encoder, checked as soon as it loads,
    before anything else is loaded or timed.

    Raises:
        Refused: its sampling settings or chat template do not fit the run.
    """
    try:  # the target's own generation settings and prompt format, before anything else is loaded or timed
        stop_ids, sampling = target_stop_ids(target), sampling_settings(target)
        why = sampling_problem(sampling, config.temperature, config.ignore_generation_config)
        if why is not None:
            raise ValueError(why)
        encode = prompt_encoder(target.tokenizer, config.chat_template, config.chat_template_kwargs)
    except ValueError as exc:
        raise Refused(f"error: --target {config.target}: {exc}") from None
    return stop_ids, sampling, encode


def _check_prompts(config: EvalConfig, target, dm, methods: list[str], prompts: list[Prompt],
                   prompt_file: dict | None, encode: Callable) -> tuple[list[Prompt], list[list[int]]]:
    """The packaged prompts (unless ``--prompts`` gave them) and every prompt's ids, checked against the context
    and the decoder's needs, before any packing, tuning or timing.

    Returns:
        (prompts, prompt_ids).
    Raises:
        Refused: a missing prompt package, a prompt that does not fit, an unsupported target.
    """
    try:
        for d in config.datasets if prompt_file is None else []:
            prompts += load_prompts(d, config.limit, config.seed)
    except (RuntimeError, KeyError, OSError) as exc:  # a prompt package missing or unreadable
        raise Refused(f"error: --datasets {d}: {exc.args[0] if exc.args else exc}") from None
    try:  # every prompt fits the context, and the decoder supports the target, before calibration and decoding
        prompt_ids = encode_prompts(encode, prompts, target, config.max_new_tokens)
        if dm is not None:  # a verify tree reaches a proposal (depth <= P) or a lookup token (depth <= --lookup)
            lookup = config.lookup if any(LOOKUP_SUFFIX in m for m in methods) else 0
            check_prompt_set(target, prompt_ids, [f"{p.dataset}:{p.id}" for p in prompts], config.max_new_tokens,
                             max(dm.drafter.cfg.num_proposals, lookup))
    except ValueError as exc:
        raise Refused(f"error: {exc}") from None
    return prompts, prompt_ids


def _assemble_models(config: EvalConfig, console: Console, methods: list[str], prompts: list[Prompt],
                     prompt_file: dict | None) -> tuple[Assembly, dict]:
    """Target and checkpoint (None when only AR runs) through :func:`dartree.decode.assembly.assemble`, the one
    assembly the API and the bench use too: ``--dtype``, ``--linear``, ``--invariant`` and ``--no-tune`` passed
    through, the target and the prompts checked as soon as they can be (:func:`_check_target`,
    :func:`_check_prompts`), a ``--dtype auto`` choice timed on the first prompt; each choice printed.

    Returns:
        (the assembly, {stop_ids, sampling, encode, prompts, prompt_ids}).
    Raises:
        Refused: a target that does not load or does not fit the run, a bad checkpoint, a prompt that does not fit,
            a ``--linear`` path or ``--invariant on`` that cannot run here (one line each).
    """
    vetted: dict = {}

    def check_target(target) -> None:
        vetted["stop_ids"], vetted["sampling"], vetted["encode"] = _check_target(config, target)

    def check_models(target, dm) -> None:
        vetted["prompts"], vetted["prompt_ids"] = _check_prompts(config, target, dm, methods, prompts, prompt_file,
                                                                 vetted["encode"])

    try:
        models = assemble(config.checkpoint if methods else None, config.target, dtype=config.dtype,
                          linear=config.linear, invariant=config.invariant, tune=config.tune,
                          calibration_ids=lambda _: vetted["prompt_ids"][0], check_target=check_target,
                          check_models=check_models, log=console.print)
    except TargetLoadError as exc:
        raise Refused(f"error: cannot load --target {config.target!r}: {exc.reason}") from None
    except ModeUnavailable as exc:
        raise Refused(f"error: --invariant on: {exc}") from None
    except ValueError as exc:  # a bad checkpoint (CheckpointError), a --linear path that cannot run here
        raise Refused(f"error: {exc}") from None
    return models, vetted


@dataclass
class EvalSession(PromptRows):
    """Everything one evaluation run decodes with, built once from its :class:`EvalConfig` (``config``, which it
    never changes) by :func:`open_session`:
    the assembled models (``models``, :class:`~dartree.decode.assembly.Assembly`: target, checkpoint, dtype, matmul
    path, row-invariant mode), the prompts and their ids, the runs (name -> (builder, budget)), their cost models,
    the peers, the stop ids and the sampling settings."""

    config: EvalConfig
    console: Console
    models: Assembly
    runs: dict
    budget: object
    prompts: list
    prompt_ids: list
    prompt_file: dict | None
    encode: Callable
    stop_ids: list
    sampling: dict
    t0: float
    cost_models: dict = field(default_factory=dict)
    peers: list = field(default_factory=list)
    peers_skipped: dict = field(default_factory=dict)
    zlab: object = None
    twin: object = None
    warm_record: dict | None = None

    @property
    def target(self):
        """The target (:attr:`models`)."""
        return self.models.target

    @property
    def dm(self):
        """The checkpoint (:class:`~dartree.models.checkpoint.DraftModel`, :attr:`models`), None when only AR runs."""
        return self.models.draft

    @property
    def methods(self) -> list[str]:
        """The run names besides AR (METHOD, METHOD@B<n>, METHOD@auto)."""
        return list(self.runs)

    @property
    def names(self) -> list[str]:
        """Every row of the report: ar, the methods, then the peers that run."""
        return ["ar", *self.methods, *self.peers]

    @property
    def exact_rows(self) -> bool:
        """Whether a split from AR is a loss of exactness (fp32, or the row-invariant mode)."""
        return self.models.dtype == torch.float32 or self.models.invariant is not None

    @property
    def sampling_record(self) -> dict:
        """What this run's samplers do, and the target's own settings it did not apply."""
        t = self.config.temperature
        return {"temperature": t, "rule": "greedy (argmax)" if t == 0 else f"softmax(logits / {t}) samples",
                "ignored": {k: v for k, v in self.sampling.items() if t > 0 or k == "repetition_penalty"},
                "generation_config": self.sampling}

    def run(self, method: str, ids: list, seed: int, max_new: int, record: bool = False,
            cost_model=None) -> PromptDecode:
        """One decode of ``ids`` (:func:`~dartree.decode.harness.runner.decode_one`); with --paired a method's
        result carries ``paired_ar``, the ARStepper that ran in lockstep with it (then run to its end).
        ``cost_model``: a ``--budget auto`` method's model for this decode (default: the method's own,
        :attr:`cost_models`)."""
        dm = self.dm
        return decode_one(self.target, ids, self.settings(method, max_new_tokens=max_new, record_trees=record),
                          drafter=dm.drafter if dm is not None else None, head=dm.head if dm is not None else None,
                          seed=seed, cost_model=self.cost_models.get(method) if cost_model is None else cost_model,
                          paired=self.config.paired and method != "ar")

    def settings(self, method: str, **changes) -> DecodeSettings:
        """The :class:`~dartree.decode.settings.DecodeSettings` of the row ``method`` (``"ar"``: builder None), built
        from the run's configuration (``--max-new-tokens``, ``--temperature``, the builder parameters, ``--acceptance``,
        the lookup graft of a ``+lookup`` row) and the target's stop ids, with ``changes`` applied.

        Raises:
            KeyError: a method this run does not decode.
        """
        a = self.config
        builder, budget = (None, None) if method == "ar" else self.runs[method]
        return DecodeSettings(builder, budget, a.builder_params, a.acceptance,
                              a.lookup if LOOKUP_SUFFIX in method else 0, a.lookup_ngram, a.max_new_tokens,
                              a.temperature, tuple(self.stop_ids)).with_(**changes)

    def run_peer_on(self, name: str, ids: list, max_new: int):
        """One decode of ``ids`` by the peer ``name`` (:func:`dartree.decode.harness.peers.run_peer`)."""
        return run_peer(name, self.target, ids, max_new_tokens=max_new, stop_ids=self.stop_ids,
                        zlab_drafter=self.zlab, bf16_twin=self.twin)

    def calibrate(self) -> None:
        """The cost models of the ``--budget auto`` runs, calibrated on the first prompt."""
        if not any(b == "auto" for _, b in self.runs.values()):
            return
        tc0 = time.time()
        drafter = self.dm.drafter
        cal = budget_lib.calibrate(self.target, drafter, self.prompt_ids[0] if self.prompts else [1, 2, 3],
                        max_budget=drafter.cfg.num_proposals)
        self.cost_models = {m: cal.fresh() for m, (_, b) in self.runs.items() if b == "auto"}
        self.console.print(f"cost model calibrated in {time.time() - tc0:.1f}s: AR step {1000 * cal.t_ar:.1f} ms, "
                           f"draft {1000 * cal.t_draft:.1f} ms, verify " + ", ".join(
                               f"{t}: {1000 * v:.1f}" for t, v in sorted(cal.verify_s.items())) + " ms")

    def load_peers(self) -> None:
        """The ``--peers`` that can run (greedy only), each with what it needs; the others in ``peers_skipped``."""
        a = self.config
        for name in dict.fromkeys(a.peers):
            if a.temperature != 0:
                self.peers_skipped[name] = f"peers run greedy only; --temperature is {a.temperature}"
                continue
            if name == "zlab-dflash":
                self.zlab, why = load_zlab_drafter(a.checkpoint, self.target)
                if why is not None:
                    self.peers_skipped[name] = why
                    continue
                pack_linears(self.zlab, self.models.linear)  # z-lab's drafter gets the same matmul path as ours
                if self.models.linear_tuning:
                    tune_linears(self.zlab)
            if name == "ar-bf16":
                if self.models.dtype == torch.bfloat16:
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
        """Everything before the first timed decode: every code path of every method at every size it can take
        (:func:`~dartree.decode.generate.warm_paths`), one short decode per row (AR, every method, every peer; a
        ``--budget auto`` method on a scratch copy of its cost model, so that nothing of the warm-up reaches the
        policy), then each ``--budget auto`` policy seeded by a calibration pass with its own builder on
        :data:`~dartree.decode.generate.POLICY_PROMPT` (:meth:`seed_policies`)."""
        warm_ids = self.encode("Say hello.")
        policy_ids = self.encode(POLICY_PROMPT) if self.methods else []
        if self.methods:
            dm = self.dm
            runs = list({(s.builder, s.budget, s.lookup): s for s in map(self.settings, self.runs)}.values())
            rec = warm_paths(self.target, dm.drafter, dm.head, policy_ids, runs,
                             max_budget=dm.drafter.cfg.num_proposals)
            self.warm_record = {"seconds": rec["seconds"], "verify_sizes": [min(rec["verify_sizes"]),
                                max(rec["verify_sizes"])], "draft_rows": [min(rec["draft_rows"]),
                                                                         max(rec["draft_rows"])]}
            self.console.print(f"every path warmed in {rec['seconds']:.1f}s: verify sizes 1-"
                               f"{max(rec['verify_sizes'])}, drafter rows 1-{max(rec['draft_rows'])}, "
                               f"{len(runs)} decode settings")
        for m in ["ar", *self.methods]:
            scratch = None
            if m in self.cost_models:
                scratch = self.cost_models[m].fresh()
                scratch.start_seeding(1 << 30)  # drafts (every third round an AR step): both paths run
            self.run(m, warm_ids, 0, 16, cost_model=scratch)
        for name in self.peers:
            self.run_peer_on(name, warm_ids, 16)
        self.seed_policies(policy_ids)

    def seed_policies(self, policy_ids: list) -> None:
        """Seed every ``--budget auto`` method's cost model with a calibration pass of its own builder on
        ``policy_ids`` (:func:`~dartree.decode.generate.seed_policy`), and print what each policy starts from."""
        for m, cm in self.cost_models.items():
            t0 = time.time()
            prior = seed_policy(cm, self.target, self.dm.drafter, self.dm.head, policy_ids, self.settings(m),
                                new_tokens=SEED_TOKENS)
            self.console.print(f"{m}: policy seeded in {time.time() - t0:.1f}s: {prior_text(prior)}")

    def environment(self, done: int, interrupted: str | None = None) -> dict:
        """report.json's ``environment``: the machine, versions and every setting of the run, with the first
        ``done`` prompts; ``interrupted``: the signal's name when the run was stopped."""
        a, target, dm, models = self.config, self.target, self.dm, self.models
        return {
            "device": str(target.device), "dtype": models.dtype_name, "dtype_reason": models.dtype_note,
            "linear": models.linear, "linear_reason": models.linear_note, "linear_aten_rows": models.linear_tuning,
            "row_invariant": models.invariant_record, "attn_implementation": target.config._attn_implementation,
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "python": platform.python_version(), "platform": platform.platform(), "threads": torch.get_num_threads(),
            "target": target.name, "checkpoint": str(a.checkpoint) if self.methods else None,
            "max_new_tokens": a.max_new_tokens, "temperature": a.temperature, "seed": a.seed,
            "acceptance": a.acceptance, "lookup": a.lookup, "lookup_ngram": a.lookup_ngram,
            "stop_ids": self.stop_ids, "sampling": self.sampling_record,
            "chat_template": "tokenizer" if a.chat_template == "auto" else "none (raw prompt text)",
            "chat_template_kwargs": a.chat_template_kwargs,
            "budget": self.budget, "builder_params": a.builder_params, "ar_repeats": a.ar_repeats, "paired": a.paired,
            "cost_models": {m: cm.summary() for m, cm in self.cost_models.items()},
            "warm_up": self.warm_record,
            "proposals": dm.drafter.cfg.num_proposals if dm is not None else None,
            "prompts": [{"dataset": p.dataset, "id": p.id, "text": p.text[:120]} for p in self.prompts[:done]],
            "prompt_file": self.prompt_file,
            "prompts_done": done, "prompts_planned": len(self.prompts), "interrupted": interrupted,
        }

    def write_report(self, rows: dict[str, list[PromptRow]], trees: dict, done: int, sig, show: bool,
                     interrupted: str | None = None) -> EvalReport:
        """Aggregate the rows of the first ``done`` prompts; write report.json/md atomically (after every prompt,
        so a long run can be read, or survive an interruption, before it ends), inside ``sig.held()``; ``show``:
        print the tables too."""
        datasets = [self.prompt_file["name"]] if self.prompt_file else self.config.datasets
        report = build_report(self.environment(done, interrupted), rows, trees, self.methods, self.peers, datasets,
                              self.peers_skipped)
        md = report_markdown(report)
        if show:
            for item in report_console(report):
                self.console.print(item)
        with sig.held():
            write_report_files(Path(self.config.out), report, md)
        return report


def open_session(config: EvalConfig, console: Console, modes: contextlib.ExitStack) -> EvalSession:
    """Load and check everything a run needs, in the order the CLI always has (prompt file, methods, dtype, target,
    checkpoint, prompts, matmul path, row-invariant mode: :func:`_assemble_models`; cost models, peers), printing
    each choice; the assembly's row-invariant mode is entered into ``modes``.

    Raises:
        Refused: a bad argument, target, checkpoint or prompt set (one line; exit 2).
    """
    prompts, prompt_file = read_prompt_file(config)
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        methods = resolve_methods(config.tree)
    except ValueError as exc:
        raise Refused(f"error: {exc}") from None
    names, dtype_reason = dtype_plan(config.dtype, config.invariant, drafter=bool(methods))
    console.print(f"mode: {names[0] if len(names) == 1 else ' or '.join(names) + ' (timed below)'}; {dtype_reason}")
    budgets = list(config.budget)
    budget = budgets[0] if len(budgets) == 1 else budgets
    runs = plan_runs(methods, budgets)
    t0 = time.time()
    models, vetted = _assemble_models(config, console, methods, prompts, prompt_file)
    modes.enter_context(models.modes)
    s = EvalSession(config=config, console=console, models=models, runs=runs, budget=budget, prompt_file=prompt_file,
                    t0=t0, **vetted)
    if len(names) > 1:  # the candidates' own lines came before the choice: say which mode decodes
        inv = models.invariant_record
        console.print(f"mode: {models.dtype_name}; {models.dtype_note}")
        console.print(f"row-invariant verify (the {models.dtype_name} mode chosen): " + (
            f"on (linear {inv['linear']}: {inv['why']})" if inv is not None else "off"))
    console.print(f"target {s.target.name} ({models.dtype_name}), {len(s.prompts)} prompts, methods: ar + {methods}, "
                  f"budget {budget}; loaded in {time.time() - t0:.1f}s")
    s.calibrate()
    s.load_peers()
    return s
