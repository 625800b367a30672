"""Plain autoregressive decoding and the speculative generate loop (one flat loop with named stages).

Each round of :func:`speculative_generate` reads draft -> build -> choose budget -> verify -> commit; the budget
policy, the acceptance rule, the prompt-lookup graft and the lockstep pairing are the small objects of
:mod:`dartree.decode.rounds` it calls. Stages timed per round (seconds, in ``DecodeStats.stage_s``): ``draft``
(drafter forward + base logits), ``tree_build`` (builder, lookup graft, budget choice), ``tree_compile`` (ids,
positions, ancestor mask), ``verify`` (one target forward, walk, KV compaction), ``commit`` (stop / length handling,
bookkeeping). The loop follows z-lab ``dflash_generate`` with DDTree's tree verify (``z-lab/dflash``
``dflash/model.py``; ``liranringel/ddtree`` ``ddtree.py``). Prefill is timed separately and excluded from decode time.

Both loops (and the draft) run under ``torch.inference_mode``, as z-lab's loop does (no version counters or autograd
dispatch per op; the measured difference is in docs/results.md, 2026-12-01). Tensors a call caches on the drafter
(its draft-vocabulary rows) are then inference tensors: fine to read anywhere, never to train through.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from dartree.decode.inputs import check_generate_args, check_lookup, check_speculative_args
from dartree.decode.sampling import check_acceptance
from dartree.decode.budget import CostModel, calibrate, prune_to
from dartree.decode.builders import builder_beta, builder_name, get_builder
from dartree.decode.draft import draft_block
from dartree.decode.lookup import LookupStats, graft_chain, lookup_match
from dartree.decode.settings import DecodeSettings, check_settings
from dartree.decode.rounds import (AutoBudget, DraftFeed, FixedBudget, GreedyMatch, Lockstep, LookupGraft,
                                   RejectionSampling)
from dartree.decode.trees import Tree
from dartree.decode.verify import compile_tree, target_tokens, verify
from dartree.models.drafter import DFlashDrafter, DraftCache
from dartree.models.heads import CorrectionHead
from dartree.models.target import Target, check_speculative_target, compact_cache

STAGES = ("draft", "tree_build", "tree_compile", "verify", "commit")


@dataclass
class DecodeStats:
    """Per-request statistics.

    Attributes:
        accept_lengths: tokens committed by each verify round (accepted drafts + bonus, after truncation
            by stop ids / max_new_tokens).
        stage_s: seconds per stage over all rounds.
        prefill_s: seconds of the prompt forward (and first token).
        decode_s: seconds after prefill until the last token.
        new_tokens: generated tokens (the first token, from prefill, included).
        tree_nodes: tree size of each round.
        depth_nodes: per round, the tree's node count at depth 1, 2, ... up to its deepest node
            (``[]`` for an empty tree); sums to ``tree_nodes``.
        accepted_depths: per round, the depth of the deepest accepted tree node before any truncation by
            stop ids / max_new_tokens (0: every drafted token rejected); ``accept_lengths[i] <=
            accepted_depths[i] + 1``, with equality except in a round cut short by a stop id or the length cap.
        budgets: per round, the verification budget used (nodes verified; with ``budget="auto"`` the cost
            model's choice, 0 = a plain AR step).
        round_s: per round, its wall seconds from the draft to the commit (``lockstep`` time excluded), so a
            round that paid a one-time cost shows.
        trees: only with ``DecodeSettings(record_trees=True)``: per round a dict with the verify tree
            (``root`` token id, tree ``tokens`` / ``parents`` / ``depth`` / ``score`` as in ``Tree``, ``accepted``
            node indices root (0) first, and the ``bonus`` token id), for drawing and for replaying smaller budgets
            (:mod:`dartree.decode.replay`); empty otherwise.
    """

    accept_lengths: list = field(default_factory=list)
    stage_s: dict = field(default_factory=lambda: {s: 0.0 for s in STAGES})
    prefill_s: float = 0.0
    decode_s: float = 0.0
    new_tokens: int = 0
    tree_nodes: list = field(default_factory=list)
    depth_nodes: list = field(default_factory=list)
    budgets: list = field(default_factory=list)
    accepted_depths: list = field(default_factory=list)
    trees: list = field(default_factory=list)
    round_s: list = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        """Acceptance length: committed tokens per target verify forward, bonus included (nan if no round)."""
        return sum(self.accept_lengths) / self.rounds if self.rounds else float("nan")

    def add_round(self, committed: int, tree: Tree, ver, budget: int, root_id: int, record_tree: bool) -> None:
        """Record one verified round: ``committed`` tokens, the verify ``tree`` (M nodes), its
        :class:`~dartree.decode.verify.Verification` ``ver``, the ``budget`` used, and with ``record_tree`` the tree
        itself (root ``root_id``) for :attr:`trees`."""
        self.accept_lengths.append(committed)
        self.tree_nodes.append(tree.size)
        self.budgets.append(budget)
        self.depth_nodes.append(torch.bincount(tree.depth.cpu(), minlength=1).tolist()[1:])
        self.accepted_depths.append(ver.accepted.numel() - 1)
        if record_tree:
            self.trees.append({"root": int(root_id), "tokens": tree.tokens.tolist(), "parents": tree.parents.tolist(),
                               "depth": tree.depth.tolist(), "score": tree.score.float().tolist(),
                               "accepted": ver.accepted.tolist(), "bonus": int(ver.bonus_id)})

    def add_stage_times(self, ta: float, tb: float, tc: float, tc2: float, td: float, te: float) -> None:
        """Add one round's stage seconds from its clock readings (start, drafted, built, compiled, verified,
        committed) to :attr:`stage_s`, and its wall seconds to :attr:`round_s`."""
        st = self.stage_s
        st["draft"] += tb - ta
        st["tree_build"] += tc - tb
        st["tree_compile"] += tc2 - tc
        st["verify"] += td - tc2
        st["commit"] += te - td
        self.round_s.append(te - ta)


@dataclass
class GenerateOutput:
    """Generated token ids (prompt excluded; ends at the first stop id, inclusive) and their stats."""

    tokens: list
    stats: DecodeStats


def _commit(out: list, new: Sequence[int], max_new_tokens: int, stop_ids: set) -> tuple[int, bool]:
    """Append ``new`` tokens to ``out`` up to and including a stop id or the length limit.

    Returns:
        (number appended, finished).
    """
    n = 0
    for t in new:
        if len(out) >= max_new_tokens:
            return n, True
        out.append(int(t))
        n += 1
        if int(t) in stop_ids:
            return n, True
    return n, len(out) >= max_new_tokens


def _prefill(target: Target, prompt_ids: Sequence[int], cache, temperature, generator):
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=target.device)
    out = target.forward(ids, cache=cache, logits_slice=slice(-1, None))
    first = int(target_tokens(out.logits[0], temperature, generator)[0])
    return first, out.features[0]


def _check_args(target, prompt_ids, max_new_tokens, temperature, stop_ids, generator) -> tuple[list, list]:
    """(prompt ids, stop ids) as int lists after the checks of :func:`dartree.decode.inputs.check_generate_args`."""
    return check_generate_args(target, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                               stop_ids=stop_ids, generator=generator)


class ARStepper:
    """Plain autoregressive decoding one step at a time (the loop of :func:`autoregressive_generate`), so that its
    steps can run interleaved with another decoder's rounds on the same prompt (``speculative_generate(lockstep=)``):
    both then see the same minutes of a machine whose speed drifts, and their per-token times compare paired.

    The prefill runs in the constructor (timed as ``stats.prefill_s``); each :meth:`step` is one one-token target
    forward and adds its wall time to ``stats.decode_s``. Arguments and errors as :func:`autoregressive_generate`.

    Attributes:
        tokens: the generated ids so far (prompt excluded; ends at the first stop id, inclusive).
        stats: :class:`DecodeStats` (``decode_s`` sums the steps' times only, never the time between them).
        done: True once a stop id or ``max_new_tokens`` is reached.
    """

    @torch.inference_mode()
    def __init__(self, target: Target, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0,
                 stop_ids: Sequence[int] = (), generator: torch.Generator | None = None):
        prompt_ids, stop_ids = _check_args(target, prompt_ids, max_new_tokens, temperature, stop_ids, generator)
        self.target, self.temperature, self.generator = target, temperature, generator
        self.max_new_tokens, self.stops = max_new_tokens, set(int(s) for s in stop_ids)
        self.stats, self.tokens, self.done = DecodeStats(), [], max_new_tokens == 0
        if self.done:
            return
        self.cache = target.new_cache()
        t0 = time.perf_counter()
        self._tok, _ = _prefill(target, prompt_ids, self.cache, temperature, generator)
        self.stats.prefill_s = time.perf_counter() - t0
        _, self.done = _commit(self.tokens, [self._tok], max_new_tokens, self.stops)
        self._pos = len(prompt_ids)
        self.stats.new_tokens = len(self.tokens)

    @torch.inference_mode()
    def step(self) -> bool:
        """One AR step (nothing once done); returns ``done``."""
        if self.done:
            return True
        t0 = time.perf_counter()
        target = self.target
        ids = torch.tensor([[self._tok]], dtype=torch.long, device=target.device)
        o = target.forward(ids, position_ids=torch.tensor([[self._pos]], device=target.device), cache=self.cache)
        self._tok = int(target_tokens(o.logits[0, -1:], self.temperature, self.generator)[0])
        self._pos += 1
        n, self.done = _commit(self.tokens, [self._tok], self.max_new_tokens, self.stops)
        self.stats.accept_lengths.append(n)
        self.stats.decode_s += time.perf_counter() - t0
        self.stats.new_tokens = len(self.tokens)
        return self.done

    def run_to(self, n_tokens: int) -> None:
        """Step until at least ``n_tokens`` tokens are out (or done)."""
        while not self.done and len(self.tokens) < n_tokens:
            self.step()


def autoregressive_generate(
    target: Target,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
) -> GenerateOutput:
    """Plain one-token-per-forward decoding of the target (the baseline and the losslessness oracle).

    ``prompt_ids`` is [T] or [1, T] (list, tensor or array; Hugging Face ``input_ids`` work as they are);
    ``stop_ids`` a sequence, a set, one int or None. Arguments as the fields of
    :class:`~dartree.decode.settings.DecodeSettings`. Runs :class:`ARStepper` to the end; ``stats.decode_s`` is the
    sum of its steps' times.
    Raises:
        TypeError: ``target`` is not a dartree Target, or an argument has the wrong type (named).
        ValueError: empty or batched prompt ([N > 1, T]: one request at a time), an id outside the target's
            vocabulary, negative max_new_tokens, negative or non-finite temperature, a generator on another device.
    """
    ar = ARStepper(target, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, stop_ids=stop_ids,
                   generator=generator)
    while not ar.done:
        ar.step()
    return GenerateOutput(ar.tokens, ar.stats)


@torch.inference_mode()
def speculative_generate(
    target: Target, drafter: DFlashDrafter, head: CorrectionHead, prompt_ids: Sequence[int],
    settings: DecodeSettings, *, generator: torch.Generator | None = None, cost_model: CostModel | None = None,
    lockstep: Callable[[int], None] | None = None,
) -> GenerateOutput:
    """Speculative decoding with a block drafter, a correction head and a tree builder; lossless.

    Args:
        target: the target (its ``layer_ids`` must equal the drafter's ``target_layer_ids``).
        drafter, head: the block drafter and its correction head (same dtype/device as the target).
        prompt_ids: prompt token ids (already chat-templated), [T] or [1, T]: a list, an integer tensor (any
            device) or array; Hugging Face ``input_ids`` work as they are. Several prompts are refused.
        settings: the :class:`~dartree.decode.settings.DecodeSettings` of the decode: builder, budget (an int, None
            for P, or ``"auto"``: per round the builder drafts up to ``cost_model.max_budget`` nodes and the cost
            model keeps the number that maximises expected tokens per second, 0 meaning a plain AR step,
            :mod:`dartree.decode.budget`; its choices follow the round times it measures, so at T > 0 a seed fixes
            the output only under a fixed budget, the output's distribution is the target's either way), builder
            parameters, acceptance (``"match"``: every builder; ``"rejection"``: ``chain`` at T > 0, Leviathan et
            al. 2023, Algorithm 1, :mod:`dartree.decode.sampling`), the prompt-lookup graft (with a fixed budget
            its new nodes come on top of it, with ``"auto"`` the cost model sizes the union), max_new_tokens (an
            exact cap), temperature, stop ids (generation ends right after the first, even mid-block) and
            record_trees.
        generator: seeded torch.Generator for T > 0, on the target's device type.
        cost_model: the calibrated :class:`~dartree.decode.budget.CostModel` for ``budget="auto"`` (shared
            across calls, so its acceptance calibration carries over; seed it with :func:`seed_policy` after
            :func:`warm_paths`); None calibrates one on this prompt, warms every path of this setting and seeds the
            policy with a pass over the prompt's first tokens, all before the prefill and outside ``stats``.
        lockstep: called after every round with the number of tokens generated so far, e.g. ``ar.run_to`` of an
            :class:`ARStepper` on the same prompt, which then decodes in step with this loop (paired timing on a
            machine whose speed drifts); its time is left out of ``stats.decode_s``.
    Returns:
        Tokens equal to :func:`autoregressive_generate`'s at T = 0 (and distributed as the target's samples
        at T > 0), plus stats.
    Raises (all before the prefill; :mod:`dartree.decode.inputs`):
        TypeError: an argument of the wrong type (named), e.g. settings that are not a ``DecodeSettings``, a
            loaded ``DraftModel`` as the drafter, a non-integer ``lookup``, or an unknown builder parameter.
        ValueError: empty or batched prompt ([N > 1, T]: one request at a time), an id outside the vocabulary,
            negative max_new_tokens / budget / lookup, lookup_ngram < 1, negative or non-finite temperature, an
            out-of-range builder parameter, a drafter / head that does not fit the target, or target capture layers
            that differ from the drafter's;
            an unknown ``acceptance``, or ``"rejection"`` with a builder other than ``chain`` or with T = 0; a
            target whose rope scaling changes with the sequence length (dynamic NTK, LongRoPE) when the decode can
            reach its switch length, or one with sliding-window cache layers
            (:func:`~dartree.models.target.check_speculative_target`).
        ValueError: unknown builder (lists the available ones), or builder None (plain AR:
            :func:`autoregressive_generate`).
    """
    prompt_ids, stop_ids, s, rejection, pair = check_speculative(target, drafter, head, prompt_ids, settings,
                                                                 generator=generator, lockstep=lockstep)
    if s.max_new_tokens == 0:
        return GenerateOutput([], DecodeStats())
    if s.budget == "auto":
        cm = cost_model if cost_model is not None else _one_off_policy(target, drafter, head, prompt_ids, s)
        policy = AutoBudget(cm, builder_beta(s.builder, s.params), clock=time.perf_counter)
    else:
        policy = FixedBudget(drafter.cfg.num_proposals if s.budget is None else int(s.budget))
    rule = (RejectionSampling if rejection else GreedyMatch)(get_builder(s.builder), head, s.params, s.temperature,
                                                            generator)
    return _decode(target, drafter, prompt_ids, policy=policy, rule=rule,
                   graft=LookupGraft(prompt_ids, s.lookup, s.lookup_ngram), lockstep=pair,
                   max_new_tokens=s.max_new_tokens, stops=set(int(t) for t in stop_ids), temperature=s.temperature,
                   generator=generator, record_trees=s.record_trees)


def check_speculative(target, drafter, head, prompt_ids, settings: DecodeSettings, *, generator=None,
                      lockstep=None) -> tuple:
    """Every check of :func:`speculative_generate`, before the prefill (arguments as it takes them), so that a caller
    with work to do first (the API's warm-up) can refuse bad arguments before it. Returns (prompt ids, stop ids,
    the settings with the builder's registered name, whether the acceptance rule is rejection sampling, the
    :class:`Lockstep` or None).

    Raises:
        TypeError / ValueError: as :func:`speculative_generate` (its Raises), one line naming the argument.
    """
    s = check_settings(settings)
    if s.builder is None:
        raise ValueError("settings.builder is None (plain AR); name a tree builder (e.g. 'pruned' or 'chain'), or "
                         "decode with autoregressive_generate")
    prompt_ids, stop_ids = _check_args(target, prompt_ids, s.max_new_tokens, s.temperature, s.stop_ids, generator)
    check_speculative_args(target, drafter, head, builder=s.builder, budget=s.budget, builder_params=s.builder_params)
    s = s.with_(builder=builder_name(s.builder))
    rejection = check_acceptance(s.acceptance, s.builder, s.temperature) == "rejection"
    pair = None if lockstep is None else Lockstep(lockstep, clock=time.perf_counter)
    check_lookup(s.lookup, s.lookup_ngram)
    if s.lookup and rejection:
        raise ValueError("lookup > 0 needs acceptance='match': rejection sampling verifies a sampled chain, and a "
                         "grafted lookup branch would make it a tree; use lookup=0 with acceptance='rejection'")
    # the deepest tree node is a proposal (depth <= P) or a grafted lookup token (depth <= lookup)
    check_speculative_target(target, len(prompt_ids) + s.max_new_tokens + max(drafter.cfg.num_proposals, s.lookup))
    return prompt_ids, stop_ids, s, rejection, pair


def _decode(target: Target, drafter: DFlashDrafter, prompt_ids: list, *, policy: FixedBudget, rule: GreedyMatch,
            graft: LookupGraft, lockstep: Lockstep | None, max_new_tokens: int, stops: set, temperature: float,
            generator: torch.Generator | None, record_trees: bool) -> GenerateOutput:
    """The prefill, then one round per iteration: draft -> build -> choose budget -> verify -> commit, until a stop
    id or ``max_new_tokens`` (arguments as :func:`speculative_generate` resolved them; ``policy`` a
    :class:`FixedBudget` or :class:`AutoBudget`, ``rule`` a :class:`GreedyMatch` or :class:`RejectionSampling`)."""
    stats, out, cache = DecodeStats(), [], target.new_cache()
    t0 = time.perf_counter()
    anchor, prefill_feats = _prefill(target, prompt_ids, cache, temperature, generator)
    stats.prefill_s = time.perf_counter() - t0
    _, done = _commit(out, [anchor], max_new_tokens, stops)
    t1 = time.perf_counter()
    feed, start = DraftFeed(target, drafter, prefill_feats), len(prompt_ids)
    while not done:
        ta = time.perf_counter()  # draft
        drafted = policy.drafts()  # False: a plain AR step or a lookup chain alone; features wait for the next draft
        block = feed.draft(anchor, start) if drafted else None
        tb = time.perf_counter()  # build, graft the lookup chain, choose the budget
        tree = rule.build(block, anchor, policy.nodes) if drafted else Tree.empty()
        tree, chain_pos, ngram = graft(tree, out, policy.lookup_stats)
        tree, chain_pos = policy.choose(tree, chain_pos, drafted, build_started=tb)
        tc = time.perf_counter()  # compile, verify
        inputs = compile_tree(tree, anchor, start, dtype=target.dtype, device=target.device) if tree.size else None
        tc2 = time.perf_counter()
        ver = rule.verify(target, tree, anchor, start, cache, inputs)
        td = time.perf_counter()  # commit
        n, done = _commit(out, ver.tokens + [ver.bonus_id], max_new_tokens, stops)
        stats.add_round(n, tree, ver, policy.recorded_budget(tree), anchor, record_trees)
        start += ver.accepted.numel()
        anchor = ver.bonus_id
        feed.add(ver.features)
        te = time.perf_counter()
        policy.observe(tree, ver.accepted, chain_pos, ngram, drafted, draft_s=tb - ta, verify_s=td - tc2,
                       round_s=te - ta)
        stats.add_stage_times(ta, tb, tc, tc2, td, te)
        if lockstep is not None:
            lockstep(len(out), since=te)
    stats.decode_s = time.perf_counter() - t1 - (lockstep.seconds if lockstep is not None else 0.0)
    stats.new_tokens = len(out)
    return GenerateOutput(out, stats)


# ---- before anything is timed: every path warmed, the auto budget's policy seeded ----------------------------------

# The calibration prompt of the ``budget="auto"`` policy (:func:`seed_policy`): an ordinary request, none of the
# evaluated prompts, so that what the policy starts from depends on no prompt of the run.
POLICY_PROMPT = "Explain in a short paragraph how a bicycle stays upright while it is moving."
SEED_TOKENS = 64  # tokens the calibration pass decodes (about 30-50 drafted rounds with the packaged drafter)


def _one_off_policy(target, drafter, head, prompt_ids, settings: DecodeSettings) -> CostModel:
    """The cost model of a ``budget="auto"`` call given none: calibrated on its prompt, every path of its setting
    (builder, builder_params, lookup, lookup_ngram) warmed, seeded by a pass over the prompt's first tokens."""
    cm = calibrate(target, drafter, prompt_ids)
    warm_paths(target, drafter, head, prompt_ids, [settings], max_budget=cm.max_budget)
    seed_policy(cm, target, drafter, head, prompt_ids, settings,
                new_tokens=min(SEED_TOKENS, max(8, settings.max_new_tokens)), source="this prompt")
    return cm


def max_tree_nodes(builder: str, budget: int, proposals: int, builder_params: dict | None = None,
                   head: CorrectionHead | None = None) -> int:
    """The most nodes the builder called ``builder`` can return with ``budget`` for a drafter of ``proposals`` (P)
    proposals per block: ``budget`` capped by the largest tree the builder declares it makes whatever the budget
    (:meth:`~dartree.decode.builders.TreeBuilder.max_nodes`: a chain's P, DARTree-pruned's P * width, ...). A grafted
    lookup chain adds up to ``lookup`` nodes on top (not counted here). The sizes :func:`warm_paths` warms, so that
    a budget far above what the drafter can fill costs no warm-up for sizes that never occur.

    Raises:
        ValueError: an unknown builder (:func:`~dartree.decode.builders.builder_name`).
    """
    return get_builder(builder).max_nodes(budget, proposals, builder_params, head)


def _run_nodes(run: DecodeSettings, proposals: int, max_budget: int,
               head: CorrectionHead | None = None) -> tuple[int, int]:
    """(nodes the builder drafts, largest verify size T, root included) of one setting:
    T = :func:`max_tree_nodes` + lookup + 1."""
    nodes = max_budget if run.budget == "auto" else (proposals if run.budget is None else int(run.budget))
    return nodes, max_tree_nodes(run.builder, nodes, proposals, run.params, head) + int(run.lookup) + 1


@torch.inference_mode()
def warm_paths(target: Target, drafter: DFlashDrafter, head: CorrectionHead, context_ids: Sequence[int],
               runs: Sequence[DecodeSettings], *, max_budget: int | None = None) -> dict:
    """Run every code path the decodes of ``runs`` take, at every size they can take, before anything is timed, so
    that no one-time cost falls inside a timed round: the tree kernels' numba loading or compilation, oneDNN's
    primitive for a row count it has not seen, first-call allocations.

    Covered: the drafter forward with 1 .. 2(P + 1) new context rows (a round appends accepted + 1 rows, more after
    rounds without a draft); each builder at the node count it drafts (``budget="auto"``: the cost model's
    ``max_budget``), its top-b selection (:func:`~dartree.decode.budget.prune_to`) at every b, a grafted lookup chain;
    tree compile and verify (forward, walk, KV compaction) at every verify size T = 1 .. N + lookup + 1, N the largest
    tree the builder can make with that node count (:func:`max_tree_nodes`: a chain's P whatever the budget); then one
    short decode per setting (a ``budget="auto"`` one on a scratch :class:`~dartree.decode.budget.CostModel` that
    drafts every round), which runs the loop's own code. The rejection sampler (``acceptance="rejection"``) is not
    covered.

    Args:
        target, drafter, head: as :func:`speculative_generate`.
        context_ids: [T0] token ids (T0 >= 2), e.g. a chat-templated prompt.
        runs: the :class:`~dartree.decode.settings.DecodeSettings` of each decode setting (its builder, budget,
            builder parameters, lookup graft and n-gram; its stop ids end the short decodes, which are greedy and
            16 tokens long whatever its temperature and cap).
        max_budget: B_max of the ``"auto"`` settings (default: P, the drafter's proposals).
    Returns:
        {"seconds": wall time, "verify_sizes": [T, ...] run, "draft_rows": [C, ...] run}.
    Raises:
        ValueError: fewer than 2 context tokens, or a setting :func:`speculative_generate` refuses.
        ValueError: an unknown builder.
    """
    t0 = time.perf_counter()
    ids = [int(t) for t in context_ids]
    if len(ids) < 2:
        raise ValueError(f"warm_paths needs at least 2 context tokens, got {len(ids)}")
    p = drafter.cfg.num_proposals
    bmax = p if max_budget is None else int(max_budget)
    runs = [check_settings(r, "runs[i]") for r in runs]
    cache, start, anchor = target.new_cache(), len(ids) - 1, ids[-1]
    feats = target.forward(torch.tensor([ids[:-1]], device=target.device), cache=cache,
                           logits_slice=slice(-1, None)).features[0]
    dcache = DraftCache(len(drafter.layers))
    block = draft_block(target, drafter, anchor, start, feats, dcache)  # the first draft: the prompt's rows
    rows = list(range(1, 2 * (p + 1) + 1))
    for c in rows:  # later drafts: c new rows each (values are irrelevant to the shapes)
        block = draft_block(target, drafter, anchor, dcache.length + c, feats[-1:].expand(c, -1), dcache)
    sizes: set[int] = {1}
    for run in runs:
        nodes, top = _run_nodes(run, p, bmax, head)
        sizes.update(range(1, top + 1))
        name = builder_name(run.builder)
        beta = builder_beta(name, run.params)
        tree = get_builder(name)(block, head, anchor, nodes, **run.params)
        chain_pos = None
        if run.lookup:
            chain, n = lookup_match(torch.tensor(ids + ids), int(run.lookup), run.lookup_ngram)  # a repeat: a match
            tree, chain_pos, _ = (*graft_chain(tree, chain, LookupStats().path_probs(chain.numel(), n)), n)
        for b in range(tree.size + 1):
            prune_to(tree, b, beta, chain_pos)
    for t in sorted(sizes):  # tree compile + verify forward at every size, the cache cropped back after each
        tree = Tree(torch.full((t - 1,), anchor, dtype=torch.long), torch.arange(t - 1, dtype=torch.long),
                    torch.arange(1, t, dtype=torch.long), torch.zeros(t - 1))
        inputs = compile_tree(tree, anchor, start, dtype=target.dtype, device=target.device) if t > 1 else None
        verify(target, tree, anchor, start, cache, inputs=inputs)
        compact_cache(cache, start, torch.zeros(0, dtype=torch.long))
    _warm_decodes(target, drafter, head, ids, runs, bmax)
    return {"seconds": time.perf_counter() - t0, "verify_sizes": sorted(sizes), "draft_rows": rows}


def _warm_decodes(target, drafter, head, ids, runs: Sequence[DecodeSettings], bmax: int) -> None:
    """One short decode per setting; an ``"auto"`` one on a scratch cost model that drafts every round but every
    third, a plain AR step (its decisions do not matter here, only that the loop's code runs)."""
    for run in runs:
        cm = None
        if run.budget == "auto":
            cm = CostModel(t_ar=1.0, t_draft=0.1, verify_s={1: 1.0, 2: 1.0, bmax + 1: 1.0}, max_budget=bmax)
            cm.start_seeding(1 << 30)
        speculative_generate(target, drafter, head, ids, run.with_(max_new_tokens=16, temperature=0.0,
                                                                   acceptance="match", record_trees=False),
                             cost_model=cm)


def seed_policy(cost_model: CostModel, target: Target, drafter: DFlashDrafter, head: CorrectionHead,
                context_ids: Sequence[int], settings: DecodeSettings, *, new_tokens: int = SEED_TOKENS,
                source: str = "calibration prompt") -> dict:
    """Seed a ``budget="auto"`` cost model with a calibration pass, so that the policy starts from what drafting gives
    with this builder rather than from the first timed rounds: :func:`speculative_generate` decodes up to
    ``new_tokens`` tokens of ``context_ids`` with ``budget="auto"``, every round drafting but every
    :data:`~dartree.decode.cost_decision.SEED_AR_EVERY`-th, a plain AR step
    (:meth:`~dartree.decode.budget.CostModel.start_seeding`); the rounds teach the acceptance calibration, the
    drafted rounds' statistics (tokens per round, cost per round in AR steps, both measured by the loop) and what a
    plain AR step costs beside them, and
    :meth:`~dartree.decode.budget.CostModel.finish_seeding` keeps them as a prior worth
    :data:`~dartree.decode.cost_decision.PRIOR_ROUNDS` rounds. Run it after :func:`warm_paths`, so that the pass's rounds
    pay no one-time cost. At T > 0 the pass samples with a fixed seed.

    Args:
        cost_model: the calibrated model (:func:`~dartree.decode.budget.calibrate`), updated in place.
        target, drafter, head: as the run's own decodes (:func:`speculative_generate`).
        settings: the run's :class:`~dartree.decode.settings.DecodeSettings` (builder, builder parameters, lookup,
            n-gram, stop ids, temperature); the pass decodes with ``budget="auto"``, exact matching and its own
            length whatever they say.
        context_ids: [T0] prompt ids of the pass (e.g. :data:`POLICY_PROMPT` through the chat template).
        new_tokens: tokens the pass decodes (it stops earlier at a stop id).
        source: what the pass ran on, for reports.
    Returns:
        :attr:`~dartree.decode.budget.CostModel.prior` (rounds, tokens per round, AR steps per round, ...).
    Raises:
        ValueError / TypeError: as :func:`speculative_generate`.
    """
    s = check_settings(settings).with_(budget="auto", max_new_tokens=new_tokens, acceptance="match",
                                       record_trees=False)
    cost_model.start_seeding(new_tokens)
    gen = torch.Generator(device=target.device.type).manual_seed(0) if s.temperature > 0 else None
    out = speculative_generate(target, drafter, head, context_ids, s, generator=gen, cost_model=cost_model)
    return cost_model.finish_seeding(f"{source} ({len(out.tokens)} tokens)")
