"""Causal-correction heads behind one interface, g(C, H, r) (docs/design.md, "Interfaces").

A head corrects the drafter's per-position base logits U = lm_head(H) using the tokens drafted before:

- ``init_state(anchor_ids [N]) -> r [N, S]`` (None for stateless heads): the state at depth 0 (the root).
- ``score(C [N, K], H [N, D], r, base [N, K]) -> [N, K]``: corrected logits of candidates C, i.e. g(C, H, r);
  ``base`` = U[C], the base logits of the same candidates. Callers normalise over C (log-softmax over K).
- ``advance(r [N, S], tokens [N], hidden [N, D] | None) -> r' [N, S]``: the state of a child from its parent's
  state and token; ``hidden`` is H at the child's own depth (needed by the DSpark RNN head, whose next state
  mixes in h_k; the others ignore it).
- ``factors(hidden [N, D], r) -> A [N, R]`` and ``out_rows(C [K]) -> W [K, R]``: the low-rank form that every
  published head shares, g(C, H, r) = U[C] + A · W[C]^T (``None`` for the identity head). Builders hand these
  to the fused frontier-scoring kernel (``dartree.kernels.frontier``); ``score`` is the plain form.
- ``bind_embeddings(weight [V, D])``: heads that read the target's frozen input embeddings (Domino's GRU)
  receive them here after loading; a no-op for the others.
- ``block_logits(prev_ids [N, P], H [N, P, D], U [N, P, V], vocab=None) -> [N, P, V]``: the teacher-forced form
  for training, where prev_ids[:, j] is the token before proposal j (the anchor for j = 0); with ``vocab`` [N']
  (a draft vocabulary) U holds only those columns and the result is restricted the same way. It is
  U + A · W^T with ``block_factors(prev_ids, H, vocab) -> (A [N, P, R], W [V', R])`` (None for identity), the
  form the fused training loss (``dartree.training.losses.fused_block_loss``) consumes without materialising
  the [N, P, V'] logits.

Unrolling ``score``/``advance`` along prev_ids equals ``block_logits`` (pinned by a test). Each head class lists its
hyper-parameters and their allowed values as ``fields``; each is trained by one drafter family
(:mod:`dartree.models.families`: the head classes, their recipe defaults and their loss; docs/families.md).
Heads here: ``identity`` (plain DFlash), ``markov`` (DSpark vanilla Markov head), ``gated_markov`` (DSpark gated
variant), ``rnn`` (DSpark RNN head), ``gru`` (Domino) and ``selector`` (DFlash 2's candidate selector, defined over
the top-k of U only: ``max_candidates`` caps the builders' K). The DSpark heads optionally carry DSpark's confidence
head (stored and converted, not used by the decoders). Logits are fp32.

Concat and split orders below follow the public code (SpecForge ``specforge/modeling/draft/{domino,
dspark_heads}.py``, DeepSpec ``deepspec/modeling/dspark/qwen3/modeling.py``): Domino's ``embed_proj.0`` reads
``[z ; s]`` (drafter hidden first, GRU state last); the gated head's ``gate_proj`` reads ``[h ; W1[x]]``; the RNN
head's ``joint_proj`` reads ``[s ; W1[x] ; h]`` and its output splits as (gate, candidate, output); the confidence
head reads ``[h ; W1[x]]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dartree.kernels.gru import gru_cell
from dartree.models.validate import Flag, Range, check_fields

# The checkpoint-config rules of the heads' hyper-parameters (config ``head`` besides ``type``), shared by the head
# classes below; each class lists its own as ``fields`` (checked at construction and when a checkpoint loads).
_VOCAB = Range(1, optional=True, note="V, the target's vocabulary")
_RANK = Range(1, note="the head's rank R; a head without a Markov part is head type identity")
_HIDDEN = Range(1, optional=True, note="D, the drafter's hidden size")
_CONFIDENCE = {"confidence_head": Flag(), "confidence_with_markov": Flag()}


class CorrectionHead(nn.Module):
    """Base class; see the module docstring for the interface. ``type_name`` keys the registry."""

    type_name = "base"
    # the hyper-parameters of hparams() and their allowed values (dartree.models.validate field rules)
    fields: dict = {}
    max_candidates: int | None = None  # a head defined over the top-k of U only (DFlash 2's selector) caps K
    # True for a head that reads the target's frozen token embeddings (bound by bind_embeddings; Domino's GRU)
    reads_embeddings: bool = False
    # True when a node's state is a function of its own token alone (r = W1[x] or none), so g at depth d depends
    # only on (H_d, the parent's token): builders then score every (previous candidate, candidate) pair of a round
    # at once (dartree.decode.trees.pair_log_probs). False for recurrent heads (DSpark RNN, Domino GRU).
    first_order: bool = False

    def hparams(self) -> dict:
        """Hyper-parameters stored as ``head`` in checkpoint configs (besides ``type``)."""
        return {}

    def init_state(self, anchor_ids: torch.Tensor):
        """State at the root. anchor_ids [N] int64 -> r [N, S] fp32, or None for stateless heads."""
        raise NotImplementedError

    def score(self, cand: torch.Tensor, hidden: torch.Tensor, state, base: torch.Tensor) -> torch.Tensor:
        """g(C, H, r): cand [N, K] int64, hidden [N, D], state [N, S] or None, base = U[C] [N, K]
        -> corrected logits [N, K] fp32 (unnormalised; callers log-softmax over the K candidates)."""
        raise NotImplementedError

    def advance(self, state, tokens: torch.Tensor, hidden: torch.Tensor | None = None):
        """Child state from the parent's state [N, S], the child's token [N] int64 and H at the child's depth
        [N, D] (optional; only heads whose state reads H need it) -> [N, S]."""
        raise NotImplementedError

    def factors(self, hidden: torch.Tensor, state) -> torch.Tensor | None:
        """Per-parent activation A [N, R] fp32 with g(C, H, r) = U[C] + A · out_rows(C)^T; None when the head
        adds nothing (identity). hidden [N, D], state [N, S]."""
        raise NotImplementedError

    def out_rows(self, cand: torch.Tensor) -> torch.Tensor | None:
        """Output rows W[C] [..., R] fp32 for candidate ids C [...] int64 (the head's rank-R output matrix)."""
        raise NotImplementedError

    def bind_embeddings(self, weight: torch.Tensor) -> None:
        """Receive the target's frozen input-embedding matrix [V, D]; no-op unless the head reads it."""
        return None

    def block_states(self, prev_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
        """Teacher-forced states along the true previous tokens: r_0 = init_state(prev[:, 0]), r_j =
        advance(r_{j-1}, prev[:, j], H[:, j-1]); prev_ids [N, P] int64, hidden [N, P, D] -> [N, P, S] fp32 (None
        for stateless heads). Heads whose state is a function of the previous token alone override it with one
        batched lookup."""
        st = self.init_state(prev_ids[:, 0])
        if st is None:
            return None
        out = [st]
        for j in range(1, prev_ids.shape[1]):
            st = self.advance(st, prev_ids[:, j], hidden[:, j - 1])
            out.append(st)
        return torch.stack(out, dim=1)

    def block_factors(self, prev_ids: torch.Tensor, hidden: torch.Tensor, vocab: torch.Tensor | None = None):
        """Teacher-forced low-rank form: prev_ids [N, P] int64 (the token before each proposal; the anchor for
        proposal 0), hidden [N, P, D] -> (A [N, P, R] fp32, W [V', R] fp32) with block logits U + A · W^T, where
        V' = V, or the N' ids of ``vocab`` [N'] int64; None for a head that adds nothing (identity).
        Differentiable in the head's parameters and in ``hidden``."""
        raise NotImplementedError

    def block_logits(self, prev_ids: torch.Tensor, hidden: torch.Tensor, base_logits: torch.Tensor,
                     vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced logits: prev_ids [N, P] int64, hidden [N, P, D], base [N, P, V'] -> [N, P, V'] fp32, where
        V' = V, or the N' ids of ``vocab`` [N'] int64 when given (equal to the full result's ``[..., vocab]``);
        U + A · W^T from :meth:`block_factors`."""
        f = self.block_factors(prev_ids, hidden, vocab)
        if f is None:
            return base_logits.float()
        return base_logits.float() + F.linear(f[0], f[1])


class IdentityHead(CorrectionHead):
    """No correction: g(C, H, r) = U[C]; plain DFlash drafting. Stateless (r is None)."""

    type_name = "identity"
    first_order = True
    fields = {"vocab_size": _VOCAB}

    def __init__(self, vocab_size: int | None = None):
        super().__init__()

    def init_state(self, anchor_ids):
        return None

    def score(self, cand, hidden, state, base):
        return base.float()

    def advance(self, state, tokens, hidden=None):
        return None

    def factors(self, hidden, state):
        return None

    def out_rows(self, cand):
        return None

    def block_factors(self, prev_ids, hidden, vocab=None):
        return None


class _ConfidenceMixin:
    """DSpark's optional confidence head (``AcceptRatePredictor``; DSpark, arXiv 2607.05147, Sec. 3.3).

    ``confidence.weight`` [1, D + R] and ``confidence.bias`` [1] when ``confidence_with_markov`` (input
    ``[h_k ; W1[x_{k-1}]]``, hidden first), else [1, D] (input h_k). It predicts the acceptance probability of
    each proposal, c_k = sigmoid(w^T x + b); it is stored and converted but the decoders do not use it.
    """

    def _init_confidence(self, confidence_head: bool, confidence_with_markov: bool, hidden_size: int | None):
        self.confidence_head = bool(confidence_head)
        self.confidence_with_markov = bool(confidence_with_markov)
        if self.confidence_head:
            if hidden_size is None:
                raise ValueError(f"{self.type_name} head: confidence_head=True needs hidden_size (the drafter's D)")
            self.confidence = nn.Linear(int(hidden_size) + (self.rank if self.confidence_with_markov else 0), 1)

    def _confidence_hparams(self) -> dict:
        if not self.confidence_head:
            return {}
        return {"confidence_head": True, "confidence_with_markov": self.confidence_with_markov}

    def _prev_embedding(self, state: torch.Tensor) -> torch.Tensor:
        """W1[x_prev] [N, R] from a state [N, S]."""
        return state[:, : self.rank]

    def confidence_logits(self, hidden: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Confidence logit (pre-sigmoid) per row: hidden [N, D], state [N, S] -> [N] fp32.

        Raises:
            RuntimeError: the head was built without a confidence head.
        """
        if not self.confidence_head:
            raise RuntimeError(f"this {self.type_name} head has no confidence head (confidence_head=False)")
        x = hidden.float()
        if self.confidence_with_markov:
            x = torch.cat([x, self._prev_embedding(state).float()], dim=-1)
        return F.linear(x, self.confidence.weight.float(), self.confidence.bias.float())[:, 0]


class MarkovHead(_ConfidenceMixin, CorrectionHead):
    """DSpark vanilla Markov head: logits_k = U_k + W2 · W1[x_{k-1}] (DSpark, arXiv 2607.05147, Sec. 3).

    Parameters: ``w1.weight`` [V, R] (an embedding, DSpark ``markov_w1``), ``w2.weight`` [V, R] (a bias-free
    linear R -> V, DSpark ``markov_w2``), optionally ``confidence.{weight,bias}`` (see :class:`_ConfidenceMixin`).
    The state r is W1[x_prev] [N, R]; the first position's previous token is the anchor. H is unused.
    ``w2`` starts at zero, so an untrained head is the identity.

    Args:
        vocab_size: V.
        rank: R (DSpark default 256; the default target's recipe uses less to fit the 32 MB checkpoint cap).
        hidden_size: D, needed only with ``confidence_head``.
        confidence_head, confidence_with_markov: carry DSpark's confidence head (input [h ; W1[x_prev]] or h).
    Raises:
        ValueError: ``confidence_head`` without ``hidden_size``, or a hyper-parameter of the wrong type or out of
            range (``rank`` >= 1, ``vocab_size`` >= 1; :attr:`fields`), named.
    """

    type_name = "markov"
    first_order = True
    fields = {"vocab_size": _VOCAB, "rank": _RANK, "hidden_size": _HIDDEN, **_CONFIDENCE}

    def __init__(self, vocab_size: int, rank: int = 256, hidden_size: int | None = None,
                 confidence_head: bool = False, confidence_with_markov: bool = True):
        super().__init__()
        check_fields({"vocab_size": vocab_size, "rank": rank, "hidden_size": hidden_size,
                      "confidence_head": confidence_head, "confidence_with_markov": confidence_with_markov},
                     self.fields, f"{self.type_name} head: ")
        self.vocab_size, self.rank = int(vocab_size), int(rank)
        self.hidden_size = None if hidden_size is None else int(hidden_size)
        self.w1 = nn.Embedding(self.vocab_size, self.rank)
        self.w2 = nn.Linear(self.rank, self.vocab_size, bias=False)
        nn.init.normal_(self.w1.weight, std=0.02)
        nn.init.zeros_(self.w2.weight)
        self._init_confidence(confidence_head, confidence_with_markov, hidden_size)

    def hparams(self) -> dict:
        out = {"vocab_size": self.vocab_size, "rank": self.rank}
        if self.hidden_size is not None:
            out["hidden_size"] = self.hidden_size
        return {**out, **self._confidence_hparams()}

    def init_state(self, anchor_ids):
        return self.w1(anchor_ids).float()

    def score(self, cand, hidden, state, base):
        rows = self.w2.weight[cand].float()  # [N, K, R]
        return base.float() + torch.einsum("nkr,nr->nk", rows, state.float())

    def advance(self, state, tokens, hidden=None):
        return self.w1(tokens).float()

    def factors(self, hidden, state):
        return state.float()

    def out_rows(self, cand):
        return self.w2.weight[cand].float()

    def _w2(self, vocab):
        return self.w2.weight.float() if vocab is None else torch.index_select(self.w2.weight, 0, vocab).float()

    def block_states(self, prev_ids, hidden):
        return self.w1(prev_ids).float()  # r = W1[x_prev]: one lookup (and one sparse-to-dense gradient)

    def block_factors(self, prev_ids, hidden, vocab=None):
        return self.w1(prev_ids).float(), self._w2(vocab)


class GatedMarkovHead(MarkovHead):
    """DSpark gated Markov head (arXiv 2607.05147; SpecForge ``GatedMarkovHead``, DeepSpec
    ``markov_head_type="gated"``).

    logits_k = U_k + W2 · (gate_k ⊙ W1[x_{k-1}]), gate_k = sigmoid(gate_proj([h_k ; W1[x_{k-1}]])).
    Parameters: ``w1.weight`` [V, R], ``w2.weight`` [V, R], ``gate_proj.weight`` [R, D + R] and
    ``gate_proj.bias`` [R] (input order: hidden first), optionally ``confidence.*``. State r = W1[x_prev] [N, R].
    ``score``/``factors`` need H (the proposal's hidden state).

    Args:
        vocab_size: V. rank: R. hidden_size: D (required).
        confidence_head, confidence_with_markov: as :class:`MarkovHead`.
    """

    type_name = "gated_markov"

    def __init__(self, vocab_size: int, rank: int = 256, hidden_size: int | None = None,
                 confidence_head: bool = False, confidence_with_markov: bool = True):
        if hidden_size is None:
            raise ValueError("gated_markov head needs hidden_size (the drafter's D) for gate_proj")
        super().__init__(vocab_size, rank, hidden_size, confidence_head, confidence_with_markov)
        self.gate_proj = nn.Linear(self.hidden_size + self.rank, self.rank)

    def _gate(self, hidden: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        if hidden is None:
            raise ValueError("gated_markov head needs the proposal's hidden state H; got None")
        x = torch.cat([hidden.float(), emb.float()], dim=-1)
        return torch.sigmoid(F.linear(x, self.gate_proj.weight.float(), self.gate_proj.bias.float()))

    def factors(self, hidden, state):
        return self._gate(hidden, state) * state.float()

    def score(self, cand, hidden, state, base):
        return base.float() + torch.einsum("nkr,nr->nk", self.out_rows(cand), self.factors(hidden, state))

    def block_factors(self, prev_ids, hidden, vocab=None):
        emb = self.w1(prev_ids).float()  # [N, P, R]
        return self._gate(hidden, emb) * emb, self._w2(vocab)


class RNNHead(MarkovHead):
    """DSpark RNN head (arXiv 2607.05147, Sec. 4.3.2; SpecForge ``RNNMarkovHead``, DeepSpec ``markov_head_type="rnn"``).

    With e_k = W1[x_{k-1}] and (a, c, o) = joint_proj([s_{k-1} ; e_k ; h_k]) split in that order:
    s_k = sigmoid(a) ⊙ s_{k-1} + (1 - sigmoid(a)) ⊙ tanh(c), logits_k = U_k + W2 · tanh(o), s_{-1} = 0.
    Parameters: ``w1.weight`` [V, R], ``w2.weight`` [V, R], ``joint_proj.weight`` [3R, 2R + D],
    ``joint_proj.bias`` [3R], optionally ``confidence.*``.

    dartree state r = [s_{k-1} ; e_k] [N, 2R] (the recurrent state before proposal k and the previous token's
    embedding). ``advance(r, x_k, h_k)`` needs H at the child's own proposal index (the row scored with r).

    Args:
        vocab_size: V. rank: R. hidden_size: D (required).
        confidence_head, confidence_with_markov: as :class:`MarkovHead`.
    """

    type_name = "rnn"
    first_order = False  # s_k follows the recurrence over the whole path

    def __init__(self, vocab_size: int, rank: int = 256, hidden_size: int | None = None,
                 confidence_head: bool = False, confidence_with_markov: bool = True):
        if hidden_size is None:
            raise ValueError("rnn head needs hidden_size (the drafter's D) for joint_proj")
        super().__init__(vocab_size, rank, hidden_size, confidence_head, confidence_with_markov)
        self.joint_proj = nn.Linear(2 * self.rank + self.hidden_size, 3 * self.rank)

    def _prev_embedding(self, state):
        return state[:, self.rank :]

    block_states = CorrectionHead.block_states  # r = [s ; e] follows the recurrence

    def _step(self, s: torch.Tensor, e: torch.Tensor, hidden: torch.Tensor):
        """One RNN step: s [.., R], e [.., R], hidden [.., D] -> (s' [.., R], tanh(o) [.., R]) fp32."""
        if hidden is None:
            raise ValueError("rnn head needs the proposal's hidden state H; got None")
        x = torch.cat([s.float(), e.float(), hidden.float()], dim=-1)
        a, c, o = F.linear(x, self.joint_proj.weight.float(), self.joint_proj.bias.float()).chunk(3, dim=-1)
        gate = torch.sigmoid(a)
        return gate * s.float() + (1 - gate) * torch.tanh(c), torch.tanh(o)

    def init_state(self, anchor_ids):
        e = self.w1(anchor_ids).float()
        return torch.cat([torch.zeros_like(e), e], dim=-1)

    def factors(self, hidden, state):
        return self._step(state[:, : self.rank], state[:, self.rank :], hidden)[1]

    def score(self, cand, hidden, state, base):
        return base.float() + torch.einsum("nkr,nr->nk", self.out_rows(cand), self.factors(hidden, state))

    def advance(self, state, tokens, hidden=None):
        s_new = self._step(state[:, : self.rank], state[:, self.rank :], hidden)[0]
        return torch.cat([s_new, self.w1(tokens).float()], dim=-1)

    def block_factors(self, prev_ids, hidden, vocab=None):
        emb = self.w1(prev_ids).float()  # [N, P, R]
        s = emb.new_zeros(emb.shape[0], self.rank)
        outs = []
        for j in range(prev_ids.shape[1]):
            s, out = self._step(s, emb[:, j], hidden[:, j])
            outs.append(out)
        return torch.stack(outs, dim=1), self._w2(vocab)


class GRUHead(CorrectionHead):
    """Domino GRU head (Domino, arXiv 2605.29707; SpecForge ``DominoDraftModel``).

    With s_k = GRU(E[x_0], ..., E[x_k]) over the target's frozen token embeddings E of the previous tokens
    (x_0 = the anchor; ``nn.GRU`` without bias, gate order r, z, n) and z_k the drafter's hidden state:
    logits_k = U_k + fc2 · SiLU(fc1 · [z_k ; s_k]) for k >= ``prefix_len``, and U_k for the first ``prefix_len``
    proposals (Domino's ``pure_draft_prefix_len``). Rank E = ``emb_dim``.

    Parameters: ``weight_ih`` [3G, D_emb] (``prefix_gru.weight_ih_l0``), ``weight_hh`` [3G, G]
    (``prefix_gru.weight_hh_l0``), ``fc1.weight`` [E, D + G] (``embed_proj.0``, columns: first D for z, last G
    for s), ``fc2.weight`` [V, E] (``embed_proj.2``).

    State r = [s ; depth] [N, G + 1]: the GRU state after the path's tokens and the proposal index it scores
    (a float counter), so the pure-prefix positions are absorbed here: ``factors`` is zero while
    depth < prefix_len. Root r0 = [GRUCell(E[anchor], 0) ; 0]; ``advance`` = [GRUCell(E[x], s) ; depth + 1]
    through :func:`dartree.kernels.gru.gru_cell`. E comes from :meth:`bind_embeddings` (not stored).

    Args:
        vocab_size: V. hidden_size: D. emb_dim: E. gru_hidden_dim: G.
        prefix_len: leading proposals that use the base logits only (Domino default 1).
        embed_dim: D_emb, the token-embedding width (default D).
    Raises:
        ValueError: a hyper-parameter of the wrong type or out of range (sizes >= 1, ``prefix_len`` >= 0), named.
        RuntimeError: (at use) no embeddings bound.
    """

    type_name = "gru"
    reads_embeddings = True
    fields = {"vocab_size": _VOCAB, "hidden_size": _HIDDEN,
              "emb_dim": Range(1, note="E, rank of the GRU head's logit residual"),
              "gru_hidden_dim": Range(1, note="G, the GRU state width"),
              "prefix_len": Range(0, note="leading proposals without correction"),
              "embed_dim": Range(1, optional=True, note="width of the target's token embeddings")}

    def __init__(self, vocab_size: int, hidden_size: int, emb_dim: int = 256, gru_hidden_dim: int = 1024,
                 prefix_len: int = 1, embed_dim: int | None = None):
        super().__init__()
        check_fields({"vocab_size": vocab_size, "hidden_size": hidden_size, "emb_dim": emb_dim,
                      "gru_hidden_dim": gru_hidden_dim, "prefix_len": prefix_len, "embed_dim": embed_dim},
                     self.fields, "gru head: ")
        self.vocab_size, self.hidden_size = int(vocab_size), int(hidden_size)
        self.emb_dim, self.gru_hidden_dim, self.prefix_len = int(emb_dim), int(gru_hidden_dim), int(prefix_len)
        self.embed_dim = self.hidden_size if embed_dim is None else int(embed_dim)
        if self.prefix_len < 0:
            raise ValueError(f"gru head: prefix_len must be >= 0, got {self.prefix_len}")
        g = self.gru_hidden_dim
        self.weight_ih = nn.Parameter(torch.empty(3 * g, self.embed_dim))
        self.weight_hh = nn.Parameter(torch.empty(3 * g, g))
        bound = 1.0 / g**0.5
        nn.init.uniform_(self.weight_ih, -bound, bound)
        nn.init.uniform_(self.weight_hh, -bound, bound)
        self.fc1 = nn.Linear(self.hidden_size + g, self.emb_dim, bias=False)
        self.fc2 = nn.Linear(self.emb_dim, self.vocab_size, bias=False)
        nn.init.zeros_(self.fc2.weight)  # an untrained head is the identity
        self.__dict__["_embed"] = None  # the target's embedding; never a parameter or buffer

    def hparams(self) -> dict:
        out = {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "emb_dim": self.emb_dim,
               "gru_hidden_dim": self.gru_hidden_dim, "prefix_len": self.prefix_len}
        if self.embed_dim != self.hidden_size:
            out["embed_dim"] = self.embed_dim
        return out

    def bind_embeddings(self, weight: torch.Tensor) -> None:
        """Use ``weight`` [V, D_emb] (the target's frozen input embedding) as E; kept by reference, not stored.

        Raises:
            ValueError: its shape is not [V, D_emb].
        """
        if tuple(weight.shape) != (self.vocab_size, self.embed_dim):
            raise ValueError(f"gru head: embeddings of shape {list(weight.shape)} do not fit "
                             f"[vocab_size {self.vocab_size}, embed_dim {self.embed_dim}]")
        self.__dict__["_embed"] = weight.detach()

    def _gi(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input-gate pre-activations E[x] · W_ih^T: tokens [...] -> [..., 3G] fp32."""
        emb = self.__dict__["_embed"]
        if emb is None:
            raise RuntimeError("gru head has no token embeddings: call head.bind_embeddings(target.embed_tokens.weight) "
                               "(load_dartree(..., target=...) does it)")
        e = F.embedding(tokens.to(emb.device), emb).to(self.weight_ih.device).float()
        return F.linear(e, self.weight_ih.float())

    def init_state(self, anchor_ids):
        gi = self._gi(anchor_ids)
        s = gru_cell(gi, gi.new_zeros(gi.shape[0], self.gru_hidden_dim), self.weight_hh)
        return torch.cat([s, s.new_zeros(s.shape[0], 1)], dim=-1)

    def advance(self, state, tokens, hidden=None):
        s = gru_cell(self._gi(tokens), state[:, :-1].float(), self.weight_hh)
        return torch.cat([s, state[:, -1:].float() + 1], dim=-1)

    def factors(self, hidden, state):
        x = torch.cat([hidden.float(), state[:, :-1].float()], dim=-1)
        act = F.silu(F.linear(x, self.fc1.weight.float()))
        return act * (state[:, -1:] >= self.prefix_len).float()

    def out_rows(self, cand):
        return self.fc2.weight[cand].float()

    def score(self, cand, hidden, state, base):
        return base.float() + torch.einsum("nkr,nr->nk", self.out_rows(cand), self.factors(hidden, state))

    def block_factors(self, prev_ids, hidden, vocab=None):
        gi = self._gi(prev_ids)  # [N, P, 3G]
        s = gi.new_zeros(gi.shape[0], self.gru_hidden_dim)
        states = []
        for j in range(prev_ids.shape[1]):
            s = gru_cell(gi[:, j], s, self.weight_hh, backend="torch")  # differentiable path for training
            states.append(s)
        x = torch.cat([hidden.float(), torch.stack(states, dim=1)], dim=-1)
        act = F.silu(F.linear(x, self.fc1.weight.float()))
        keep = (torch.arange(prev_ids.shape[1], device=act.device) >= self.prefix_len).float()[None, :, None]
        fc2 = self.fc2.weight if vocab is None else self.fc2.weight[vocab]
        return act * keep, fc2.float()


class SelectorHead(CorrectionHead):
    """DFlash 2's candidate selector (z-lab ``CandidateSelector``, speculators ``dflash2``) as a correction head.

    g(C, H, r) = U[C] + <P1[x_prev] ⊙ (Wh · h), P2[C]> over the top-``top_k`` candidates of U; every other token is
    out of the distribution (builders cap the candidate count K at ``top_k``: :attr:`max_candidates`). This is
    the shared low-rank form with A = P1[x_prev] ⊙ Wh h (the previous token's predecessor code, gated by the
    projected hidden state) and W = P2 (successor codes). Source: z-lab/dflash ``dflash/model.py``
    (``CandidateSelector.select``: score = unary + einsum(pred[prev] * proj(h), succ[C])); the anchor is the
    first proposal's previous token.

    Parameters: ``w1.weight`` [V, R] (predecessor codebook), ``w2.weight`` [V, R] (successor codebook),
    ``proj.weight`` [R, D] (hidden projection). State r = P1[x_prev] [N, R] fp32.

    Args:
        vocab_size: V. rank: R (z-lab ``selector_rank``, default 256). hidden_size: D (required).
        top_k: candidates reranked per position (``selector_top_k``, default 16).
    Raises:
        ValueError: a hyper-parameter of the wrong type or out of range (:attr:`fields`), named.
    """

    type_name = "selector"
    first_order = True
    fields = {"vocab_size": _VOCAB, "rank": _RANK, "hidden_size": _HIDDEN,
              "top_k": Range(1, note="DFlash 2 selector: candidates reranked per position (selector_top_k)")}

    def __init__(self, vocab_size: int, rank: int = 256, hidden_size: int | None = None, top_k: int = 16):
        super().__init__()
        check_fields({"vocab_size": vocab_size, "rank": rank, "hidden_size": hidden_size, "top_k": top_k},
                     self.fields, "selector head: ")
        if hidden_size is None:
            raise ValueError("selector head needs hidden_size (the drafter's D) for its hidden projection")
        self.vocab_size, self.rank, self.hidden_size = int(vocab_size), int(rank), int(hidden_size)
        self.top_k = int(top_k)
        self.max_candidates = self.top_k
        self.w1 = nn.Embedding(self.vocab_size, self.rank)
        self.w2 = nn.Linear(self.rank, self.vocab_size, bias=False)
        self.proj = nn.Linear(self.hidden_size, self.rank, bias=False)
        for w in (self.w1.weight, self.w2.weight, self.proj.weight):  # the publishers' initialisation
            nn.init.normal_(w, std=0.02)

    def hparams(self) -> dict:
        return {"vocab_size": self.vocab_size, "rank": self.rank, "hidden_size": self.hidden_size,
                "top_k": self.top_k}

    def init_state(self, anchor_ids):
        return self.w1(anchor_ids).float()

    def advance(self, state, tokens, hidden=None):
        return self.w1(tokens).float()

    def factors(self, hidden, state):
        if hidden is None:
            raise ValueError("selector head needs the proposal's hidden state H; got None")
        return state.float() * F.linear(hidden.float(), self.proj.weight.float())

    def out_rows(self, cand):
        return self.w2.weight[cand].float()

    def score(self, cand, hidden, state, base):
        return base.float() + torch.einsum("nkr,nr->nk", self.out_rows(cand), self.factors(hidden, state))

    def block_states(self, prev_ids, hidden):
        return self.w1(prev_ids).float()

    def block_factors(self, prev_ids, hidden, vocab=None):
        w2 = self.w2.weight.float() if vocab is None else self.w2.weight[vocab].float()
        return self.w1(prev_ids).float() * F.linear(hidden.float(), self.proj.weight.float()), w2


HEADS: dict[str, type[CorrectionHead]] = {}


def register_head(cls: type[CorrectionHead]) -> type[CorrectionHead]:
    """Add a head class to the registry under ``cls.type_name``.

    Raises:
        ValueError: the name is already registered.
    """
    if cls.type_name in HEADS:
        raise ValueError(f"head type {cls.type_name!r} is already registered")
    HEADS[cls.type_name] = cls
    return cls


for _cls in (IdentityHead, MarkovHead, GatedMarkovHead, RNNHead, GRUHead, SelectorHead):
    register_head(_cls)


def build_head(type_name: str, **params) -> CorrectionHead:
    """Construct a head by registered name.

    Raises:
        KeyError: unknown name; the message lists the registered ones (a head of a family outside
            :mod:`dartree.models.families` registers when its family's module is imported).
    """
    if type_name not in HEADS:
        raise KeyError(f"unknown head type {type_name!r}; available: {sorted(HEADS)} (a head of another drafter "
                       "family registers when that family's module is imported)")
    return HEADS[type_name](**params)


def head_fields(type_name) -> dict:
    """The hyper-parameter rules (:attr:`CorrectionHead.fields`) of the registered head type ``type_name``; {} for
    an unknown name (its lookup error comes from :func:`build_head`)."""
    cls = HEADS.get(type_name) if isinstance(type_name, str) else None
    return dict(cls.fields) if cls is not None else {}
