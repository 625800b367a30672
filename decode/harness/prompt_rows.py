"""The per-prompt decode of an evaluation session: the order of one prompt's decodes, with the AR baseline's
repeats spread through it (:func:`spread_repeats`, the order a ``--batch`` sweep uses too), and
:class:`PromptRows`, the part of :class:`~dartree.decode.harness.session.EvalSession` that decodes a prompt with
every row and turns its decodes into report rows, each output compared with AR's.
"""

from __future__ import annotations

import sys

import torch
from tqdm.auto import tqdm

from dartree.decode.harness.report import split_label
from dartree.decode.harness.report_figures import annotate_trees
from dartree.decode.harness.report_rows import PromptRow
from dartree.decode.harness.runner import first_divergence


def spread_repeats(order: list[str], name: str, repeats: int) -> list[str]:
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


def _margin_at(target, prompt_ids: list, ref: list, idx: int) -> float:
    """Target's top-2 logit margin when predicting ref[idx] after prompt + ref[:idx] (a near-tie check)."""
    ids = torch.tensor([prompt_ids + ref[:idx]], device=target.device)
    logits = target.forward(ids, logits_slice=slice(-1, None)).logits[0, -1]
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


class PromptRows:
    """The per-prompt decode of :class:`~dartree.decode.harness.session.EvalSession`, which it is a base of: its
    methods read the session's prompts and their ids, rows (``names``, ``methods``, ``peers``), ``config``,
    ``target``, ``console`` and ``exact_rows``, and decode with its ``run`` and ``run_peer_on``."""

    def prompt_order(self, pi: int) -> list[str]:
        """The decodes of prompt ``pi``, back to back in an order rotated per prompt (this machine's speed drifts
        over minutes, and a fixed order would hand the same share of that drift to the same rows on every prompt),
        with the AR repeats spread through it (ar#2, ...; :func:`spread_repeats`)."""
        order = self.names
        order = order[pi % len(order):] + order[:pi % len(order)]
        return spread_repeats(order, "ar", self.config.ar_repeats)

    def decode_prompt(self, pi: int, bar=None) -> tuple[dict[str, PromptRow], dict[str, dict]]:
        """Decode prompt ``pi`` with AR (``--ar-repeats`` times), every method and every peer (``bar``: a tqdm bar
        stepped once per decode) and print its one-line summary.

        Returns:
            (that prompt's row per method, its recorded verify trees per method: the first prompt's only).
        """
        p, ids = self.prompts[pi], self.prompt_ids[pi]
        seed = self.config.seed * 100003 + pi
        order = self.prompt_order(pi)
        row_of = {name: name.split("#")[0] for name in order}  # ar#2 .. are repeats of ar
        outs = {}
        for name in order:
            if bar is not None:
                bar.set_postfix_str(f"{p.dataset}:{p.id} {name}")
            outs[name] = (self.run_peer_on(name, ids, self.config.max_new_tokens) if name in self.peers
                          else self.run(row_of[name], ids, seed, self.config.max_new_tokens,
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

    def prompt_rows(self, pi: int, outs: dict,
                    ar_runs: list) -> tuple[dict[str, PromptRow], dict[str, dict], list[str]]:
        """Prompt ``pi``'s row per method from its decodes ``outs`` (``ar_runs``: the AR repeats, first one the
        reference), its recorded trees, and the parts of its console line."""
        p, ids, ar = self.prompts[pi], self.prompt_ids[pi], outs["ar"]
        base = {"dataset": p.dataset, "id": p.id}
        new_trees: dict[str, dict] = {}
        ar_times = [o.stats.decode_s for o in ar_runs]
        new = {"ar": PromptRow(**base, new_tokens=ar.stats.new_tokens, decode_s=sum(ar_times) / len(ar_times),
                               decode_s_repeats=ar_times, accept_lengths=ar.stats.accept_lengths)}
        line = [f"[{pi + 1}/{len(self.prompts)}] {p.dataset}:{p.id} ar {ar.stats.new_tokens} tok"]
        for m in self.methods:
            o = outs[m]
            st = o.stats
            row = PromptRow(**base, new_tokens=st.new_tokens, decode_s=st.decode_s, accept_lengths=st.accept_lengths,
                            stage_s=st.stage_s, tree_nodes=st.tree_nodes, budgets=st.budgets,
                            depth_nodes=st.depth_nodes, accepted_depths=st.accepted_depths)
            pair = o.paired_ar
            if pair is not None:  # the AR decode that ran in lockstep with this one
                row.paired_ar_decode_s, row.paired_ar_new_tokens = pair.stats.decode_s, pair.stats.new_tokens
            if pi == 0:
                tok = self.target.tokenizer
                new_trees[m] = {**base, "rounds": annotate_trees(o.stats.trees, lambda i: tok.decode([i]))}
            if self.config.temperature == 0:
                self.compare_with_ar(row, o.tokens, ids, ar.tokens, exact=self.exact_rows)
            new[m] = row
            line.append(f"{m} tau {o.stats.tau:.2f} {split_label(row)}".rstrip())
        for m in self.peers:
            o = outs[m]
            row = PromptRow(**base, new_tokens=len(o.tokens), decode_s=o.decode_s, prefill_s=o.prefill_s,
                            accept_lengths=o.accept_lengths)
            self.compare_with_ar(row, o.tokens, ids, ar.tokens, exact=False)  # a peer's own arithmetic may split
            new[m] = row
            line.append(f"{m} tau {o.tau:.2f} {split_label(row)}".rstrip())
        return new, new_trees, line

    def compare_with_ar(self, row: PromptRow, tokens: list, ids: list, ref: list, exact: bool = True) -> None:
        """Record in ``row`` whether ``tokens`` differ from AR's ``ref`` and, if so, the first divergence and the
        target's top-2 logit margin there (a near-tie check); ``exact``: whether a split is a loss of exactness
        (:func:`split_label`)."""
        row.mismatch, row.exact = tokens != ref, exact
        if row.mismatch:
            row.first_divergence = first_divergence(tokens, ref)
            row.margin_at_divergence = _margin_at(self.target, ids, ref, row.first_divergence)
