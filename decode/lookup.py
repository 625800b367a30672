"""Prompt-lookup drafts grafted onto a draft tree (``--tree pruned+lookup``): a free second drafter.

Prompt-lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; transformers' ``prompt_lookup_num_tokens``) drafts by
string matching: find an earlier occurrence of the last n committed tokens (n = ``max_ngram`` .. 1) in the prompt and
the text generated so far and propose the tokens that followed it. It costs no forward, and on code, edits and
summaries it is often right for many tokens in a row. The block drafter and the lookup chain fail on different
tokens, so one tree verifies both: the chain is grafted onto the drafter's tree (shared prefixes merge, as
SpecInfer merges the token trees of several drafters, arXiv 2305.09781) and one tree-attention forward verifies
the union. Verification is unchanged, so the output is
still exactly the target's.

Acceptance estimates for the cost model (``budget="auto"``): a lookup node j deep in the chain gets the path
probability p_j learnt online from how often chain position j was accepted when verified (:class:`LookupStats`);
a node on both the drafter's tree and the chain keeps the larger of the two path scores, so scores still never
increase along a path and the top-B selection stays prefix-closed (DARTree Lemma 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dartree.decode.trees import Tree


def lookup_match(context: torch.Tensor, num_tokens: int, max_ngram: int = 3,
                 min_ngram: int = 1) -> tuple[torch.Tensor, int]:
    """Prompt-lookup draft: the tokens that followed the most recent earlier occurrence of the context's last n
    tokens, for the largest n in ``max_ngram`` .. ``min_ngram`` that occurs.

    Args:
        context: [T] int64 committed token ids (prompt + generated, the current anchor last).
        num_tokens: at most this many drafted tokens (>= 0).
        max_ngram, min_ngram: n-gram sizes tried, longest first (1 <= min_ngram <= max_ngram).
    Returns:
        ([N] int64 drafted tokens, N <= num_tokens, empty when no n-gram recurs; the matched n, 0 for none).
    Raises:
        ValueError: n-gram sizes out of order or below 1, or num_tokens < 0.
    """
    if min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"lookup n-gram sizes need 1 <= min_ngram <= max_ngram (got {min_ngram}, {max_ngram})")
    if num_tokens < 0:
        raise ValueError(f"lookup num_tokens must be >= 0 (got {num_tokens})")
    t = context.numel()
    empty = context.new_zeros(0)
    if num_tokens == 0:
        return empty, 0
    for n in range(min(max_ngram, t - 1), min_ngram - 1, -1):
        # windows starting at 0 .. t - n - 1: every occurrence except the suffix itself, each followed by a token
        windows = context[: t - 1].unfold(0, n, 1)
        hits = torch.nonzero((windows == context[t - n:]).all(dim=1)).flatten()
        if hits.numel():
            s = int(hits[-1]) + n
            return context[s: s + num_tokens].clone(), n
    return empty, 0


@dataclass
class LookupStats:
    """Online acceptance of the lookup chain, by matched n-gram size n and position j = 1..L, learnt as the
    probability that node j is accepted given that its parent was (for j = 1, given the round verified it);
    the path probability of node j is the product down the chain.

    Conditioning on the parent matters: a position-j count only accrues in rounds whose node j - 1 was accepted,
    so a few early rejections at position 1 do not drag every deeper position's estimate towards zero, which
    would stop the cost model from ever verifying them again (as it did when path probabilities were counted
    directly). Each (n, j) estimate is shrunk, with a prior worth ``prior`` rounds, towards the same position
    over every n, itself shrunk towards ``first_prior`` (j = 1) or ``continue_prior`` (j >= 2): once the
    target follows a copied span it tends to keep following it (prompt lookup's premise; Saxena 2023).

    Attributes:
        verified: {(n, j): rounds that verified chain node j after an n-gram match, its parent accepted (j >= 2)}.
        accepted: {(n, j): of them, rounds that accepted node j}.
    """

    prior: float = 2.0
    first_prior: float = 0.5
    continue_prior: float = 0.7
    verified: dict = field(default_factory=dict)
    accepted: dict = field(default_factory=dict)

    def _pooled(self, j: int) -> float:
        v = sum(c for (_, jj), c in self.verified.items() if jj == j)
        a = sum(c for (_, jj), c in self.accepted.items() if jj == j)
        return (a + self.prior * (self.first_prior if j == 1 else self.continue_prior)) / (v + self.prior)

    def conditional(self, j: int, ngram: int = 0) -> float:
        """Estimated P(node j accepted | its parent accepted) after an ``ngram``-token match (0: pooled over n)."""
        pooled = self._pooled(j)
        if not ngram:
            return pooled
        return (self.accepted.get((ngram, j), 0) + self.prior * pooled) / (self.verified.get((ngram, j), 0) + self.prior)

    def path_probs(self, length: int, ngram: int = 0) -> torch.Tensor:
        """[length] fp32 estimated path acceptance probabilities of chain positions 1..length after a match of
        ``ngram`` tokens (0: pooled over every n): the running product of :meth:`conditional`, non-increasing."""
        out, prev = [], 1.0
        for j in range(1, length + 1):
            prev *= self.conditional(j, ngram)
            out.append(prev)
        return torch.tensor(out, dtype=torch.float32)

    def record(self, chain_pos: torch.Tensor, accepted_nodes: torch.Tensor, ngram: int = 0) -> None:
        """Account one verified round. ``chain_pos`` [M] int64: each verified node's chain position (0: not on
        the chain); ``accepted_nodes``: the verifier's accepted indices, root (0) first, node i at i + 1;
        ``ngram``: the matched n-gram size of that round's chain. Position j >= 2 counts only when node j - 1
        was accepted."""
        on = torch.nonzero(chain_pos > 0).flatten()
        if not on.numel():
            return
        hit = torch.zeros(chain_pos.numel(), dtype=torch.bool)
        hit[accepted_nodes.cpu()[1:] - 1] = True
        by_pos = {int(chain_pos[i]): bool(hit[i]) for i in on.tolist()}
        for j, ok in sorted(by_pos.items()):
            if j > 1 and not by_pos.get(j - 1, False):
                break  # the parent was rejected: this round says nothing about node j given its parent
            key = (int(ngram), j)
            self.verified[key] = self.verified.get(key, 0) + 1
            self.accepted[key] = self.accepted.get(key, 0) + int(ok)

    def summary(self) -> dict:
        """JSON-ready {"n=N": {position j: [verified, accepted]}} (j >= 2: rounds whose node j - 1 was accepted)."""
        out: dict = {}
        for (n, j) in sorted(self.verified):
            out.setdefault(f"n={n}", {})[int(j)] = [self.verified[(n, j)], self.accepted.get((n, j), 0)]
        return out


def graft_chain(tree: Tree, chain: torch.Tensor, chain_probs: torch.Tensor) -> tuple[Tree, torch.Tensor]:
    """Graft a chain of tokens below the root of ``tree``: follow existing nodes while the tokens agree, then append
    new nodes (so indices stay topological). A node on both keeps the larger path score.

    Args:
        tree: the drafter's tree (M nodes; ``score`` path log-scores, nats).
        chain: [N] int64 tokens drafted after the root.
        chain_probs: [N] fp32 path acceptance probabilities of the chain positions (non-increasing, in (0, 1]).
    Returns:
        (merged tree of M + new nodes, [M'] int64 chain position of every node, 0 for nodes off the chain).
    """
    m = tree.size
    pos = torch.zeros(m, dtype=torch.long)
    if not chain.numel():
        return tree, pos
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    child: dict[tuple[int, int], int] = {}
    for i, (p, t) in enumerate(zip(parents, tokens), start=1):
        child.setdefault((p, t), i)  # the first sibling wins on duplicates, as the verifier's walk does
    score = tree.score.clone()
    new_tok, new_par, new_dep, new_score, new_pos = [], [], [], [], []
    cur, logs = 0, torch.log(chain_probs.clamp(min=1e-9)).tolist()
    for j, (t, s) in enumerate(zip(chain.tolist(), logs), start=1):
        nxt = child.get((cur, t))  # only drafter nodes are in ``child``
        if nxt is not None:  # already a drafter node: boost it (max keeps scores non-increasing down each path)
            score[nxt - 1] = max(float(score[nxt - 1]), s)
            pos[nxt - 1] = j
            cur = nxt
            continue
        if 0 < cur <= m:  # a new child of a drafter node: no higher than its parent
            s = min(s, float(score[cur - 1]))
        elif cur > m:  # below an earlier grafted node
            s = min(s, new_score[-1])
        new_tok.append(t)
        new_par.append(cur)
        new_dep.append(j)
        new_score.append(s)
        new_pos.append(j)
        cur = m + len(new_tok)
    if not new_tok:
        return Tree(tree.tokens, tree.parents, tree.depth, score), pos
    merged = Tree(torch.cat([tree.tokens, torch.tensor(new_tok, dtype=torch.long)]),
                  torch.cat([tree.parents, torch.tensor(new_par, dtype=torch.long)]),
                  torch.cat([tree.depth, torch.tensor(new_dep, dtype=torch.long)]),
                  torch.cat([score, torch.tensor(new_score, dtype=score.dtype)]))
    return merged, torch.cat([pos, torch.tensor(new_pos, dtype=torch.long)])
