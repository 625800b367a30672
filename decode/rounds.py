"""The parts one speculative round calls (:func:`dartree.decode.generate.speculative_generate`'s loop): the drafter's
feed, the acceptance rule, the prompt-lookup graft, the budget policy and the lockstep pairing.

The loop reads draft -> build -> choose budget -> verify -> commit; each object here holds the state of one of those
concerns across the rounds of one decode and never reads a clock itself: the loop passes it the seconds it measured
(or, for :class:`AutoBudget` and :class:`Lockstep`, the clock to read), so that every stage time comes from one clock.

Shapes: P proposals per block, M tree nodes without the root, D hidden size, V vocabulary; token ids int64.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from dartree.decode.budget import CostModel, prune_to
from dartree.decode.draft import draft_block
from dartree.decode.lookup import LookupStats, graft_chain, lookup_match
from dartree.decode.sampling import SampledChain, rejection_verify, sample_chain
from dartree.decode.trees import DraftBlock, Tree
from dartree.decode.verify import TreeInputs, Verification, verify
from dartree.models.drafter import DFlashDrafter, DraftCache
from dartree.models.heads import CorrectionHead
from dartree.models.target import Target


class DraftFeed:
    """The drafter's side of a decode: its KV cache and the target features [C, D_f] not yet in it (the prefill's,
    then each verify's accepted rows), concatenated once at the next draft (a round that skips the drafter leaves them
    waiting). One block per :meth:`draft` (z-lab ``dflash_generate``: the drafter attends to the target's captured
    hidden states of every committed token).
    """

    def __init__(self, target: Target, drafter: DFlashDrafter, prefill_features: torch.Tensor):
        self.target, self.drafter = target, drafter
        self.pending = [prefill_features]
        self.cache = DraftCache(len(drafter.layers))

    def add(self, features: torch.Tensor) -> None:
        """Queue a verify's captured features [A, D_f] (its accepted nodes, root first)."""
        self.pending.append(features)

    def draft(self, root_id: int, start: int) -> DraftBlock:
        """The round's block (hidden [P, D], base logits [P, V]) after ``root_id`` at position ``start``
        (:func:`~dartree.decode.draft.draft_block`); the queued features enter the drafter's cache."""
        feats = self.pending[0] if len(self.pending) == 1 else torch.cat(self.pending)
        block = draft_block(self.target, self.drafter, root_id, start, feats, self.cache)
        self.pending.clear()
        return block


class GreedyMatch:
    """``acceptance="match"``: a deterministic tree from the registered builder, verified by matching the target's
    own token at every node (its argmax at T = 0, a sample at T > 0) and walking the matching children (DDTree's
    tree verify, ``liranringel/ddtree``; lossless since every committed token is the target's own).

    Args:
        build: the builder (``build(block, head, root_id, budget, **params) -> Tree``).
        head: the correction head passed to it. params: its keyword parameters.
        temperature, generator: the target's sampling (T >= 0; a seeded generator for T > 0).
    """

    def __init__(self, build: Callable[..., Tree], head: CorrectionHead, params: dict, temperature: float,
                 generator: torch.Generator | None):
        self.builder, self.head, self.params = build, head, params
        self.temperature, self.generator = temperature, generator

    def build(self, block: DraftBlock, root_id: int, nodes: int) -> Tree:
        """The round's tree of at most ``nodes`` nodes (the builder's errors)."""
        return self.builder(block, self.head, root_id, nodes, **self.params)

    def verify(self, target: Target, tree: Tree, root_id: int, start: int, cache,
               inputs: TreeInputs | None) -> Verification:
        """One target forward over root + ``tree`` (compiled as ``inputs``; None for the root alone), the walk, the
        KV compaction (:func:`~dartree.decode.verify.verify`)."""
        return verify(target, tree, root_id, start, cache, self.temperature, self.generator, inputs=inputs)


class RejectionSampling(GreedyMatch):
    """``acceptance="rejection"`` (builder ``chain``, T > 0): a chain sampled from the head's corrected distribution
    q, verified by standard speculative sampling (Leviathan et al. 2023, Algorithm 1: accept x_i with probability
    min(1, p(x_i) / q(x_i)), on a rejection sample the residual max(0, p - q) normalised;
    :func:`~dartree.decode.sampling.rejection_verify`). The q rows of the round's chain travel from :meth:`build` to
    :meth:`verify`; a round whose tree is empty (a plain AR step of ``budget="auto"``) verifies the root alone.
    RNG draws, in order: the chain's samples (build), then the acceptance tests and the residual or bonus sample
    (verify), all from ``generator``.
    """

    def __init__(self, build, head, params, temperature, generator):
        super().__init__(build, head, params, temperature, generator)
        self.chain: SampledChain | None = None

    def build(self, block: DraftBlock, root_id: int, nodes: int) -> Tree:
        """A sampled chain of at most ``nodes`` tokens (:func:`~dartree.decode.sampling.sample_chain`)."""
        self.chain = sample_chain(block, self.head, root_id, nodes, temperature=self.temperature,
                                  generator=self.generator, **self.params)
        return self.chain.tree

    def verify(self, target, tree, root_id, start, cache, inputs):
        """Rejection sampling over the chain's first ``tree.size`` tokens (the budget may have cut it)."""
        if not tree.size:
            return super().verify(target, tree, root_id, start, cache, inputs)
        return rejection_verify(target, self.chain.first(tree.size), root_id, start, cache, self.temperature,
                                self.generator, inputs=inputs)


class LookupGraft:
    """The prompt-lookup chain of every round (Saxena 2023, "Prompt Lookup Decoding"): the tokens that followed the
    latest earlier occurrence of the last n committed tokens (n = ``ngram`` .. 1) in prompt + output, grafted onto
    the round's tree with the chain probabilities ``stats`` has learned (:mod:`dartree.decode.lookup`).

    Args:
        prompt_ids: [T] the prompt's ids. tokens: chain length cap (0: no graft, the tree passes unchanged).
        ngram: longest n-gram matched (>= 1).
    """

    def __init__(self, prompt_ids: Sequence[int], tokens: int, ngram: int):
        self.prompt = [int(t) for t in prompt_ids] if tokens else []
        self.tokens, self.ngram = tokens, ngram

    def __call__(self, tree: Tree, committed: list, stats: LookupStats) -> tuple[Tree, torch.Tensor | None, int]:
        """(the tree with the chain grafted, chain position per node [M] int64 (0: a drafter node), the n-gram
        length that matched (0: none)); without a graft (``tokens == 0``) (``tree``, None, 0)."""
        if not self.tokens:
            return tree, None, 0
        chain, n = lookup_match(torch.tensor(self.prompt + committed), self.tokens, self.ngram)
        return (*graft_chain(tree, chain, stats.path_probs(chain.numel(), n)), n)


class FixedBudget:
    """A fixed verification budget: every round drafts and the builder keeps ``nodes`` nodes (plus a grafted lookup
    chain's new nodes on top); the lookup chain's acceptance is learned in :attr:`lookup_stats`.

    Args:
        nodes: B >= 0, tree nodes per round (the proposals P by default, as the caller resolves it).
    """

    def __init__(self, nodes: int):
        self.nodes = nodes
        self.lookup_stats = LookupStats()

    def drafts(self) -> bool:
        """Whether this round runs the drafter: always."""
        return True

    def choose(self, tree: Tree, chain_pos: torch.Tensor | None, drafted: bool,
               build_started: float) -> tuple[Tree, torch.Tensor | None]:
        """The tree as built (the builder already kept ``nodes``)."""
        return tree, chain_pos

    def recorded_budget(self, tree: Tree) -> int:
        """The round's budget for ``DecodeStats.budgets``: B."""
        return self.nodes

    def observe(self, tree: Tree, accepted: torch.Tensor, chain_pos: torch.Tensor | None, ngram: int, drafted: bool,
                *, draft_s: float, verify_s: float, round_s: float) -> None:
        """Learn the lookup chain's acceptance from the verified round (``accepted`` [A] node indices, root first)."""
        if chain_pos is not None and drafted:
            self.lookup_stats.record(chain_pos, accepted, ngram)


class AutoBudget(FixedBudget):
    """``budget="auto"``: per round the cost model decides whether to draft at all (:meth:`CostModel.should_draft`),
    the builder drafts up to ``max_budget`` nodes, and the model keeps the b* best by ``score + beta * depth`` that
    maximise expected committed tokens per second (:mod:`dartree.decode.budget`, docs/budget.md); after the round it
    learns the times and the outcome. Starting a decode marks a gap in the model's verify sequence
    (:meth:`CostModel.mark_gap`).

    Args:
        model: the calibrated cost model (shared across decodes; updated in place).
        beta: the builder's depth bonus (<= 0; 0.0 for a builder that does not rank by beta).
        clock: the loop's clock (seconds), read once after the build to time it.
    """

    def __init__(self, model: CostModel, beta: float, clock: Callable[[], float]):
        super().__init__(model.max_budget)
        self.model, self.beta, self.clock = model, beta, clock
        self.lookup_stats = model.lookup
        model.mark_gap()  # this decode's first verify does not follow the last one the model saw

    def drafts(self) -> bool:
        """Whether this round runs the drafter (False: a plain AR step, or a lookup chain alone)."""
        return self.model.should_draft()

    def choose(self, tree, chain_pos, drafted, build_started):
        """The b* best nodes of ``tree`` (with their chain positions when a chain is grafted). A drafted round first
        reports its build time (the clock now minus ``build_started``); an undrafted one is cut at beta 0."""
        cm = self.model
        if drafted:
            cm.observe_build(self.clock() - build_started)
            if chain_pos is not None:
                b, _ = cm.choose(tree, self.beta, chain_pos)
                return prune_to(tree, b, self.beta, chain_pos)
            b, _ = cm.choose(tree, self.beta)
            return prune_to(tree, b, self.beta), None
        if chain_pos is not None:
            b, _ = cm.choose(tree, 0.0, chain_pos, drafted=False)  # also tracks what undrafted rounds promise
            return prune_to(tree, b, 0.0, chain_pos)
        return tree, None

    def recorded_budget(self, tree: Tree) -> int:
        """The round's budget for ``DecodeStats.budgets``: the nodes kept (0: a plain AR step)."""
        return tree.size

    def observe(self, tree, accepted, chain_pos, ngram, drafted, *, draft_s, verify_s, round_s):
        """The machine's speed drifts: the model follows the stages just timed (verify of M + 1 tokens, the draft when
        one ran), then counts the round's seconds and outcome (:meth:`CostModel.record`)."""
        cm = self.model
        cm.observe_verify(tree.size + 1, verify_s)
        if drafted:
            cm.observe_draft(draft_s)
        cm.record(tree, accepted, chain_pos, ngram, seconds=round_s)


class Lockstep:
    """Another decoder stepped after every round (``speculative_generate(lockstep=)``, e.g. ``ARStepper.run_to`` on
    the same prompt), so that both see the same minutes of a machine whose speed drifts; its seconds are summed in
    :attr:`seconds` and left out of the loop's ``decode_s``.

    Args:
        step: called with the number of tokens generated so far. clock: the loop's clock (seconds).
    Raises:
        TypeError: ``step`` is not callable (named, with the fix).
    """

    def __init__(self, step: Callable[[int], None], clock: Callable[[], float]):
        if not callable(step):
            raise TypeError(f"lockstep must be a callable taking the generated token count (e.g. ARStepper.run_to) "
                            f"or None, got {type(step).__name__}")
        self.step, self.clock, self.seconds = step, clock, 0.0

    def __call__(self, n_tokens: int, since: float) -> None:
        """Step the other decoder to ``n_tokens``; ``since``: the clock reading at this round's end."""
        self.step(n_tokens)
        self.seconds += self.clock() - since
