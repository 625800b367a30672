"""T > 0 chain decoding with sampled drafts and standard speculative (rejection) sampling.

Standard speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling",
Algorithm 2), as z-lab ``dflash_generate`` (``z-lab/dflash`` ``dflash/model.py``) and DeepSpec's DSpark eval
(``deepspec/eval/base_evaluator.py``) run it:

- drafting: at depth k the draft token x_k is sampled from q_k = softmax(g(C_k, H_k, r_{k-1}) / T) over the
  top-K candidates C_k of the base logits (tokens outside C_k have q_k = 0), and the head state advances along
  the sampled token, r_k = advance(r_{k-1}, x_k);
- verification: one target forward over [root, x_1 .. x_M] gives p_k = softmax(z_k / T) at every node; x_k is
  accepted with probability min(1, p_k(x_k) / q_k(x_k)), stopping at the first rejection, whose replacement
  ("bonus") token is sampled from the residual norm(max(p_k - q_k, 0)) (p_k itself when the residual mass is
  below :data:`RESIDUAL_EPS`); after a full acceptance the bonus is a sample of p at the last node.

Every committed token is then distributed exactly as the target's own sample given the committed prefix
(lossless), and a draft whose q is close to p is accepted far more often than under exact target-sample
matching of a deterministic draft (acceptance sum_x min(p(x), q(x)) instead of p(argmax q)). Only chains:
recursive rejection over trees (SpecInfer-style) is not implemented; trees keep exact matching
(:mod:`dartree.decode.verify`).

Dimension letters as in docs/design.md: N rows, P proposals per block, M drafted chain nodes (M <= P), K candidates
per depth, V vocabulary, D hidden size, S head-state width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import dartree.decode.builders  # noqa: F401 - the registry: _check_params accepts the parameters its builders declare
from dartree.decode.trees import DraftBlock, Tree, _check_k, _check_params, block_candidates, check_build_args, head_k
from dartree.decode.verify import TreeInputs, Verification, compile_tree
from dartree.models.heads import CorrectionHead
from dartree.models.target import Target, cache_length, compact_cache

ACCEPTANCE_RULES = ("match", "rejection")
RESIDUAL_EPS = 1e-8  # below this residual mass the bonus is sampled from p itself (DeepSpec's fallback)


def check_acceptance(acceptance, builder: str, temperature: float) -> str:
    """Check the ``acceptance`` rule of :func:`dartree.decode.generate.speculative_generate`.

    Args:
        acceptance: ``"match"`` (exact target-sample matching of deterministic drafts, every builder and T) or
            ``"rejection"`` (sampled chain drafts + standard speculative sampling; builder ``chain``, T > 0 only).
        builder: the tree-builder name.
        temperature: the sampling temperature T.
    Returns:
        The rule, unchanged.
    Raises:
        ValueError: an unknown rule, or ``"rejection"`` with a builder other than ``chain`` or with T = 0.
    """
    if not isinstance(acceptance, str) or acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"acceptance={acceptance!r} must be one of {list(ACCEPTANCE_RULES)}")
    if acceptance == "rejection":
        if builder != "chain":
            raise ValueError(f"acceptance='rejection' needs builder='chain' (got {builder!r}): trees verify by exact "
                             "target-sample matching only")
        if not temperature > 0:
            raise ValueError(f"acceptance='rejection' needs temperature > 0 (got {temperature}); at T = 0 use "
                             "acceptance='match' (greedy)")
    return acceptance


@dataclass
class SampledChain:
    """A chain drafted by sampling, with the exact distributions its tokens were drawn from.

    Attributes:
        tree: the chain as a Tree of M nodes (node d+1 at depth d+1 under node d); ``score`` [M] fp32 is the
            surrogate sum_{j<=d} log max_x q_j(x) in nats (non-increasing along the chain): the greedy chain's own
            path score, which ``budget="auto"`` reads as the acceptance estimate (not the random log q_j(x_j)).
        cand: [M, K] int64 candidate token ids per depth (distinct within a row).
        q: [M, K] fp32 draft probabilities over ``cand`` (rows sum to 1; the distribution x_d was sampled from).
    """

    tree: Tree
    cand: torch.Tensor
    q: torch.Tensor

    def first(self, m: int) -> "SampledChain":
        """The first ``m`` nodes (a truncated chain is still a valid sampled draft: later depths are unused)."""
        t = self.tree
        return SampledChain(Tree(t.tokens[:m], t.parents[:m], t.depth[:m], t.score[:m]), self.cand[:m], self.q[:m])


@torch.no_grad()
def sample_chain_tokens(head: CorrectionHead, cand: torch.Tensor, base: torch.Tensor, hidden: torch.Tensor,
                        root_ids: torch.Tensor, temperature: float, generator: torch.Generator | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample N independent chains through the correction head: x_d ~ softmax(g(C_d, H_d, r_{d-1}) / T).

    Args:
        head: the correction head (g = ``head.score``; the state advances along the sampled token).
        cand: [M, K] int64 candidate token ids per depth (shared by all rows).
        base: [M, K] fp32 base logits U[C] of those candidates.
        hidden: [M, D] drafter hidden state H per depth.
        root_ids: [N] int64 root (anchor) token per row.
        temperature: T > 0.
        generator: torch.Generator on the tensors' device (seeded for reproducibility).
    Returns:
        (tokens [N, M] int64, q [N, M, K] fp32): sampled tokens and, per depth, the distribution each was
        sampled from (over the K candidates).
    Raises:
        ValueError: T <= 0.
    """
    if not temperature > 0:
        raise ValueError(f"sampled drafts need temperature > 0, got {temperature}")
    m, kk = cand.shape
    n = root_ids.numel()
    state = head.init_state(root_ids)
    toks, qs = [], []
    for d in range(m):
        hid = hidden[d].expand(n, -1)
        g = head.score(cand[d].expand(n, kk), hid, state, base[d].expand(n, kk))  # [N, K]
        q = torch.softmax(g.float() / temperature, dim=-1)
        col = torch.multinomial(q, 1, generator=generator).squeeze(-1)  # [N]
        tok = cand[d][col]
        toks.append(tok)
        qs.append(q)
        state = head.advance(state, tok, hid)
    if not toks:
        return (torch.zeros((n, 0), dtype=torch.long, device=cand.device),
                torch.zeros((n, 0, kk), dtype=torch.float32, device=cand.device))
    return torch.stack(toks, dim=1), torch.stack(qs, dim=1)


@torch.no_grad()
def sample_chain(block: DraftBlock, head: CorrectionHead, root_id: int, budget: int, *, temperature: float,
                 generator: torch.Generator | None = None, k: int = 64, backend: str = "auto", **extra
                 ) -> SampledChain:
    """Draft one chain of min(budget, P) tokens by sampling the corrected head (the draft side of standard
    speculative sampling, Leviathan et al. 2023 Algorithm 1; z-lab ``dflash_generate`` / DeepSpec at T > 0).

    Candidates C_d are the top-K of the base logits per depth (as :func:`dartree.decode.builders.chain.build_chain`);
    q_d = softmax(g(C_d, H_d, r_{d-1}) / T) over them, x_d ~ q_d, r_d = advance(r_{d-1}, x_d, H_d).
    Args:
        block: DraftBlock (hidden [P, D], base logits [P, V'], optional draft vocabulary).
        head: the correction head.
        root_id: the anchor token (depth 0).
        budget: maximum chain length M.
        temperature: T > 0 (the same T as the target's).
        generator: torch.Generator on the block's device.
        k: candidates per depth K (clamped to V').
        backend: candidate-selection kernel backend.
    Returns:
        SampledChain (Tree of M nodes, cand [M, K], q [M, K]).
    Raises:
        ValueError: T <= 0, k < 1, or arguments rejected by :func:`dartree.decode.trees.check_build_args`.
        TypeError: an unknown builder parameter (``width``, ``beta``, ``children`` are accepted and ignored).
    """
    _check_params("chain", extra)
    budget = check_build_args(block, root_id, budget, head)
    _check_k(k)
    if not temperature > 0:
        raise ValueError(f"sampled drafts need temperature > 0, got {temperature}")
    m = max(0, min(int(budget), block.base_logits.shape[0]))
    if m == 0:
        dev = block.base_logits.device
        return SampledChain(Tree.empty(), torch.zeros((0, 1), dtype=torch.long, device=dev),
                            torch.zeros((0, 1), device=dev))
    ids, vals = block_candidates(block.first(m), head_k(k, head), backend=backend)  # [M, K]
    dev = ids.device
    toks, q = sample_chain_tokens(head, ids, vals, block.hidden[:m], torch.tensor([root_id], device=dev),
                                  temperature, generator)
    toks, q = toks[0], q[0]
    tree = Tree(toks, torch.arange(m, dtype=torch.long, device=dev), torch.arange(1, m + 1, device=dev),
                torch.cumsum(torch.log(q.max(dim=-1).values), 0).float())
    return SampledChain(tree, ids, q)


def rejection_accept(p: torch.Tensor, cand: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard speculative sampling over N chains at once (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023,
    Algorithm 2): accept x_d with probability min(1, p_d(x_d) / q_d(x_d)) up to the first rejection, then sample
    the bonus from norm(max(p_d - q_d, 0)) at the rejected depth (p_d itself when that mass is below
    :data:`RESIDUAL_EPS`), or from p_M after a full acceptance.

    Args:
        p: [N, M+1, V] fp32 target probabilities (softmax(z / T)) at the root and at each chain node; row d
            predicts the token at depth d+1.
        cand: [N, M, K] or [M, K] int64 candidate ids of the draft distributions (distinct within a row).
        q: [N, M, K] fp32 draft probabilities over ``cand`` (0 for every token outside it).
        tokens: [N, M] int64 drafted tokens, each sampled from its q row (so q_d(x_d) > 0).
        generator: torch.Generator on ``p``'s device. Per call it draws N*M uniforms, then one categorical
            sample per row.
    Returns:
        (accepted [N] int64 in [0, M]: accepted draft tokens per row, bonus [N] int64: the token that follows).
    Raises:
        ValueError: shapes that do not fit, or a drafted token outside its candidates.
    """
    n, m1, v = p.shape
    m = m1 - 1
    if cand.dim() == 2:
        cand = cand.expand(n, -1, -1)
    if tokens.shape != (n, m) or q.shape[:2] != (n, m) or cand.shape != q.shape:
        raise ValueError(f"shapes do not fit: p {list(p.shape)}, cand {list(cand.shape)}, q {list(q.shape)}, "
                         f"tokens {list(tokens.shape)}; need [N, M+1, V], [N, M, K], [N, M, K], [N, M]")
    hit = cand == tokens[..., None]  # [N, M, K]
    if m and not bool(hit.any(-1).all()):
        raise ValueError("a drafted token is not among its depth's candidates (q would be 0)")
    qx = (q * hit).sum(-1)  # [N, M]
    px = p[:, :m].gather(2, tokens[..., None]).squeeze(-1)  # [N, M]
    u = torch.rand((n, m), generator=generator, device=p.device, dtype=p.dtype)
    ok = u * qx < px  # u < min(1, p/q) without a division
    accepted = torch.cumprod(ok.long(), dim=1).sum(1) if m else torch.zeros(n, dtype=torch.long, device=p.device)
    rows = torch.arange(n, device=p.device)
    p_at = p[rows, accepted]  # [N, V]: target distribution where the bonus is drawn
    q_full = torch.zeros((n, m1, v), dtype=p.dtype, device=p.device)  # q_M = 0 after a full acceptance
    if m:
        q_full[:, :m].scatter_(2, cand, q.to(p.dtype))
    resid = (p_at - q_full[rows, accepted]).clamp_min(0)
    mass = resid.sum(-1, keepdim=True)
    dist = torch.where(mass > RESIDUAL_EPS, resid / mass.clamp_min(RESIDUAL_EPS), p_at)
    bonus = torch.multinomial(dist, 1, generator=generator).squeeze(-1)
    return accepted, bonus


@torch.no_grad()
def rejection_verify(target: Target, chain: SampledChain, root_id: int, start: int, cache, temperature: float,
                     generator: torch.Generator | None = None, inputs: TreeInputs | None = None) -> Verification:
    """Verify a sampled chain with one target forward and standard speculative sampling (:func:`rejection_accept`),
    commit the accepted prefix to the KV cache and return it (the T > 0 counterpart of
    :func:`dartree.decode.verify.verify` for ``acceptance="rejection"``).

    Args:
        target: the target model.
        chain: the SampledChain drafted this round (root = ``root_id`` at position ``start``).
        root_id: the root token (last committed token, not yet in the cache).
        start: committed positions in ``cache``.
        cache: the target KV cache; on return it holds ``start + A`` positions (root + accepted nodes).
        temperature: T > 0, the target's sampling temperature (the chain must have been sampled at the same T).
        generator: torch.Generator on the target's device.
        inputs: ``compile_tree(chain.tree, ...)`` output when the caller compiled (and timed) it already.
    Returns:
        Verification (accepted node indices 0..A-1, accepted tokens, bonus token, features [A, nL*D]).
    Raises:
        ValueError: T <= 0, or the cache does not hold exactly ``start`` positions.
    """
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"rejection sampling needs a finite temperature > 0, got {temperature}")
    if cache_length(cache) != start:
        raise ValueError(f"target cache holds {cache_length(cache)} positions but the root is at {start}")
    tree = chain.tree
    inp = inputs if inputs is not None else compile_tree(tree, root_id, start, dtype=target.dtype, device=target.device)
    out = target.forward(inp.input_ids, position_ids=inp.position_ids, attention_mask=inp.attention_mask, cache=cache)
    p = torch.softmax(out.logits[0].float() / temperature, dim=-1)  # [M+1, V]
    dev = p.device
    n_acc, bonus = rejection_accept(p[None], chain.cand.to(dev), chain.q[None].to(dev), tree.tokens[None].to(dev),
                                    generator)
    a = int(n_acc[0])
    acc = torch.arange(a + 1, dtype=torch.long)
    compact_cache(cache, start, acc)
    tokens = [int(t) for t in tree.tokens[:a].tolist()]
    return Verification(acc, tokens, int(bonus[0]), out.features[0, : a + 1])
