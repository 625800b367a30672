"""Domino (arXiv 2605.29707; SpecForge ``DominoDraftModel`` / ``OnlineDominoModel``): the GRU correction head
``gru``, trained by ``(1 - lambda) CE(corrected) + lambda CE(base)`` with a base-anchored linear curriculum for
lambda. Recipe ``loss.type=domino``.

The head's concat order follows SpecForge ``specforge/modeling/draft/domino.py``: ``embed_proj.0`` reads ``[z ; s]``
(drafter hidden first, GRU state last).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from dartree.kernels.gru import gru_cell
from dartree.models.families.base import Family, Objective, register_family
from dartree.models.heads import HIDDEN_RULE, VOCAB_RULE, CorrectionHead
from dartree.base.fields import Range, check_fields


def lambda_schedule(step: int, total_steps: int, start: float = 1.0, ratio: float = 1.0) -> float:
    """Domino's base-anchored curriculum (arXiv 2605.29707), as SpecForge 0.2.0's ``linear_lambda_base``:
    lambda = clamp(start * (1 - min(step / max(1, int(total * ratio)), 1)), 0, 1), ``step`` counting optimiser
    steps from 0. The int() rounds the decay horizon down (total 7, ratio 0.5: 0 at step 3); for an integer
    ``ratio * total`` (ratio 1.0) it is step / (ratio * total) exactly.

    Raises:
        ValueError: ratio <= 0 or total_steps < 1.
    """
    if ratio <= 0 or total_steps < 1:
        raise ValueError(f"lambda schedule needs ratio > 0 and total_steps >= 1, got {ratio}, {total_steps}")
    progress = min(step / max(1, int(total_steps * ratio)), 1.0)
    return float(min(1.0, max(0.0, start * (1.0 - progress))))


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
    fields = {"vocab_size": VOCAB_RULE, "hidden_size": HIDDEN_RULE,
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


class DominoFamily(Family):
    """Domino's GRU head (:class:`GRUHead`) and its curriculum CE."""

    name = "domino"
    heads = (GRUHead,)
    # SpecForge specforge/modeling/draft/domino.py: the GRU's prefix_gru (nn.GRU without bias) and the embed_proj
    # Sequential (0: fc1, 2: fc2); speculators has no Domino model
    published = {"weight_ih": "prefix_gru.weight_ih_l0", "weight_hh": "prefix_gru.weight_hh_l0",
                 "fc1.weight": "embed_proj.0.weight", "fc2.weight": "embed_proj.2.weight"}
    export_to = ("specforge-domino",)

    def head_kwargs(self, head: Mapping[str, Any], vocab_size: int, hidden_size: int) -> dict:
        """``emb_dim`` E (default ``head.rank``), ``gru_hidden_dim`` (default 4 E), ``prefix_len`` (default 1,
        Domino's pure_draft_prefix_len); ``hidden_size`` D and ``vocab_size`` V from the target."""
        emb = int(head.get("emb_dim", None) or head["rank"])
        return {"vocab_size": vocab_size, "hidden_size": hidden_size, "emb_dim": emb,
                "gru_hidden_dim": int(head.get("gru_hidden_dim", None) or 4 * emb),
                "prefix_len": int(head.get("prefix_len", 1))}

    def objective(self, loss: Mapping[str, Any], head: Mapping[str, Any]) -> Objective:
        """lambda from :func:`lambda_schedule` (``loss.lambda_base_start``, ``loss.lambda_decay_ratio``)."""
        schedule = partial(lambda_schedule, start=loss["lambda_base_start"], ratio=loss["lambda_decay_ratio"])
        return Objective(gamma=loss["gamma"], base_weight=0.0, curriculum=schedule, logged=("lam",))

    def recipe_problems(self, recipe: Mapping[str, Any]) -> list[str]:
        """``head.prefix_len`` that leaves no proposal to correct."""
        d, prefix = recipe["drafter"], recipe["head"]["prefix_len"]
        proposals = d["block_size"] - d["proposal_offset"]
        if prefix >= proposals:
            return [f"head.prefix_len={prefix} leaves no proposal to correct (block {d['block_size']}, "
                    f"{proposals} proposals): must be < {proposals}"]
        return []


register_family(DominoFamily())
