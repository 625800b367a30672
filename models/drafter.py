"""The DFlash block-diffusion drafter backbone (DFlash; ``z-lab/dflash`` ``dflash/model.py``).

One forward drafts a whole block: the input is ``[anchor, MASK x (L-1)]`` at positions ``start .. start+L-1``
(``start`` = the anchor's position), attention inside the block is bidirectional, and every layer also attends
to the *context*: the target's captured layer outputs for positions ``< start``, fused as
``hidden_norm(fc(concat_l h_l))`` and projected by that layer's own ``k_proj``/``v_proj`` ("KV injection").
The drafter owns no embedding and no lm_head: it uses the target's, frozen (DFlash).

Proposal convention: block positions ``proposal_offset .. L-1`` are predictions, P = L - proposal_offset of
them, and proposal j (0-based) predicts the token at ``start + 1 + j``. DSpark / Domino ("shift_label")
drafters use offset 0 (P = L = 16); z-lab DFlash uses offset 1 (P = L - 1 = 15).

Shapes: N rows, Q block query tokens, C context tokens, D hidden, nL captured target layers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dartree.models.packed import is_packed, pack_weight, packed_linear
from dartree.base.fields import check_fields
from dartree.models.validate import DRAFTER_FIELDS


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash default target layer ids: ``[n//2]`` for one draft layer, else ``round(1 + i*(n-4)/(k-1))``.

    Source: z-lab/dflash ``build_target_layer_ids`` (``dflash/model.py``); 36 layers and 5 ids give [1, 9, 17, 25, 33].
    Raises:
        ValueError: non-positive counts.
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError("build_target_layer_ids needs positive layer counts")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DrafterConfig:
    """Hyper-parameters of the DFlash backbone (stored in every dartree checkpoint).

    Attributes:
        hidden_size: D, must equal the target's hidden size (shared embedding and lm_head).
        intermediate_size: SwiGLU width.
        num_layers, num_heads, num_kv_heads, head_dim: attention geometry (GQA when kv < heads).
        rms_norm_eps, rope_theta: as the target's.
        qk_norm: Qwen3-style RMSNorm on q and k per head (z-lab DFlash layers have it; Llama layers do not).
        block_size: L, tokens per drafted block (anchor included).
        proposal_offset: first predicting block position (0: DSpark/Domino, P = L; 1: z-lab DFlash, P = L - 1).
        target_layer_ids: decoder layers of the target whose outputs are fused (``hidden_states[l+1]``).
        mask_token_id: id of the MASK token filling the block (must be < the target's vocab rows).
        draft_vocab_size: 0 drafts over the target's full vocabulary; N > 0 restricts the drafter's base logits
            to N token ids (buffer ``draft_vocab``, the most frequent target tokens, EAGLE-3 style) scored with the
            target's own lm_head rows. Verification always uses the full vocabulary, so output is unchanged.
        conv_kernel_size: 0 for DFlash layers; k >= 1 wraps attention and MLP of every layer in DFlash 2's grouped
            dynamic causal convolutions of k taps (:class:`GroupedDynamicCausalConv`; z-lab ``conv_kernel_size``).
        conv_group_size: channels sharing one dynamic tap (z-lab ``conv_group_size``); must divide hidden_size.
        causal_block: True: attention causal inside the block (offset i sees block keys <= i; context as before), in
            training and decoding alike (SpecForge's ``causal_block``, DSpine); False: DFlash's bidirectional block.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    target_layer_ids: list[int] = field(default_factory=list)
    mask_token_id: int = 0
    block_size: int = 16
    proposal_offset: int = 0
    qk_norm: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    draft_vocab_size: int = 0
    conv_kernel_size: int = 0
    conv_group_size: int = 16
    causal_block: bool = False

    @property
    def num_proposals(self) -> int:
        """P: proposals per block."""
        return self.block_size - self.proposal_offset

    def to_dict(self) -> dict:
        return asdict(self)

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field (its value and allowed range:
        :data:`dartree.models.validate.DRAFTER_FIELDS`)."""
        check_fields(asdict(self), DRAFTER_FIELDS)
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.proposal_offset not in (0, 1):
            raise ValueError(f"proposal_offset must be 0 (DSpark/Domino) or 1 (z-lab DFlash), got {self.proposal_offset}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty; give the target layers the drafter is conditioned on")
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0 (0 = full vocabulary), got {self.draft_vocab_size}")
        if self.conv_kernel_size:
            if self.hidden_size % self.conv_group_size:
                raise ValueError(f"conv_group_size {self.conv_group_size} does not divide hidden_size "
                                 f"{self.hidden_size}; choose a divisor (z-lab DFlash 2 uses 16)")
            if self.conv_kernel_size > self.block_size:
                raise ValueError(f"conv_kernel_size {self.conv_kernel_size} exceeds block_size {self.block_size}: "
                                 "a tap cannot reach before the block's anchor")


class RMSNorm(nn.Module):
    """Root-mean-square norm (computed in fp32), weight [D]."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE. x [N, h, T, d], pos [N, T] int64 -> same shape as x."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos.to(torch.float32)[..., None] * inv  # [N, T, d/2]
    emb = torch.cat([ang, ang], dim=-1)[:, None]  # [N, 1, T, d]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DraftCache:
    """The drafter's own KV cache: per layer the context K/V [N, kv_heads, C, d] (never block entries).

    DFlash keeps only context K/V between rounds (``draft_cache.crop(start)`` after each draft).
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        """Number of context positions held."""
        return 0 if self.keys[0] is None else int(self.keys[0].shape[-2])


@dataclass
class BlockAttention:
    """Training attention structure: block n sees context keys ``< anchors[n]`` and its own L block keys.

    Equivalent to the dense additive mask of ``dartree.training.losses.block_attention_mask`` over
    [context ; all A*L block keys], but attention is computed over [context ; own block] only (S + L keys per
    query instead of S + A*L): 2.6x fewer keys at 32 anchors of 16 on a 300-token sequence.

    Attributes:
        ctx_bias: [A*L, S] additive float mask over the context keys (0 visible, finfo.min hidden).
        block_size: L.
        causal: a block query sees the block keys at offsets <= its own only (set by the drafter from
            ``DrafterConfig.causal_block``).
    """

    ctx_bias: torch.Tensor
    block_size: int
    causal: bool = False

    @classmethod
    def from_anchors(cls, anchors: torch.Tensor, ctx_len: int, block_size: int) -> "BlockAttention":
        """anchors [A] int64 -> the structure for A blocks of ``block_size`` over ``ctx_len`` context keys; the bias is
        built on ``anchors``' device (the training device: no per-layer host-to-device copy)."""
        q_anchor = anchors.repeat_interleave(block_size)  # [A*L]
        vis = torch.arange(ctx_len, device=anchors.device)[None, :] < q_anchor[:, None]
        bias = torch.zeros(vis.shape, dtype=torch.float32, device=anchors.device).masked_fill_(
            ~vis, torch.finfo(torch.float32).min)
        return cls(bias, block_size)


def block_structured_attention(q, k_blk, v_blk, ctx_k, ctx_v, spec: BlockAttention, scale: float) -> torch.Tensor:
    """Attention of one row of A blocks: q [1, H, A*L, d], k_blk/v_blk [1, kv, A*L, d] (block keys),
    ctx_k/ctx_v [1, kv, S, d]; returns [1, H, A*L, d]. Query heads are grouped over their key/value head
    (no repeated K/V); scores and softmax in fp32 (DFlash training attention, SpecForge
    ``specforge/algorithms/common/dflash_family_model.py``).
    """
    _, h, al, d = q.shape
    kv = k_blk.shape[1]
    rep, L = h // kv, spec.block_size
    a = al // L
    qg = q.reshape(kv, rep * al, d)
    s_ctx = torch.matmul(qg, ctx_k[0].transpose(-1, -2)).reshape(kv, rep, al, -1).float()  # [kv, rep, AL, S]
    s_ctx = s_ctx * scale + spec.ctx_bias.to(s_ctx.device)
    qb = q.reshape(kv, rep, a, L, d).transpose(1, 2).reshape(kv, a, rep * L, d)
    kb = k_blk[0].reshape(kv, a, L, d)
    s_blk = torch.matmul(qb, kb.transpose(-1, -2)).float() * scale  # [kv, A, rep*L, L]
    s_blk = s_blk.reshape(kv, a, rep, L, L).transpose(1, 2).reshape(kv, rep, al, L)
    if spec.causal:  # row a*L + i sees the block keys at offsets <= i
        upper = torch.ones(L, L, dtype=torch.bool, device=s_blk.device).triu(1).repeat(a, 1)
        s_blk = s_blk.masked_fill(upper, torch.finfo(torch.float32).min)
    p = torch.cat([s_ctx, s_blk], dim=-1).softmax(-1).to(q.dtype)
    n_ctx = s_ctx.shape[-1]
    out = torch.matmul(p[..., :n_ctx].reshape(kv, rep * al, n_ctx), ctx_v[0]).reshape(kv, rep, al, d)
    pb = p[..., n_ctx:].reshape(kv, rep, a, L, L).transpose(1, 2).reshape(kv, a, rep * L, L)
    ob = torch.matmul(pb, v_blk[0].reshape(kv, a, L, d)).reshape(kv, a, rep, L, d).transpose(1, 2).reshape(kv, rep, al, d)
    return (out + ob).reshape(1, h, al, d)


def grouped_dynamic_conv(x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor, block_len: int) -> torch.Tensor:
    """DFlash 2's grouped dynamic causal convolution inside each block of ``block_len`` positions.

    y[t, c] = sum over o < k with o <= pos(t) of (base[o, c] + dyn[t, o, group(c)]) * x[t - o, c], where pos(t) =
    t mod block_len is the position inside the block (taps never reach into the previous block or the context)
    and group(c) = c // (D / G). Source: z-lab/dflash ``dflash/model.py`` (DFlash 2 ``GroupedDynamicCausalConv``),
    speculators ``models/dflash2`` (its ``grouped_dynamic_conv``).

    Args:
        x: [N, Q, D] block hidden states (Q = block_len at inference, A*block_len in training rows).
        dyn: [N, Q, k, G] dynamic taps (G groups of D / G channels).
        base: [k, D] static taps.
        block_len: L, the block length.
    Returns:
        [N, Q, D] in x's dtype.
    """
    n, q, d = x.shape
    k, g = base.shape[0], dyn.shape[-1]
    xg = x.view(n, q, g, d // g)
    pos = torch.arange(q, device=x.device) % block_len
    out = torch.zeros_like(xg)
    for o in range(min(k, q)):
        shifted = xg if o == 0 else F.pad(xg[:, : q - o], (0, 0, 0, 0, o, 0))
        coef = base[o].to(x.dtype).view(1, 1, g, d // g) + dyn[:, :, o, :, None].to(x.dtype)
        term = shifted * coef
        if o:
            term = term * (pos >= o).to(x.dtype).view(1, q, 1, 1)
        out = out + term
    return out.view(n, q, d)


class GroupedDynamicCausalConv(nn.Module):
    """The pair of convolutions DFlash 2 wraps around one sublayer (attention or MLP) of a drafter layer.

    ``prepare(h)`` convolves the sublayer's (normed) input with taps ``base_kernel[0] + dyn_in`` and returns the
    output-side dynamic taps; ``finish(y, dyn_out)`` convolves the sublayer's output with ``base_kernel[1] +
    dyn_out``. Both dynamic taps come from one projection of the sublayer input: ``kernel_projection(h)`` viewed
    as [..., 2, k, G] (input side first). Source: z-lab/dflash ``dflash/model.py`` (DFlash 2).

    Parameters: ``base_kernel`` [2, k, D], ``kernel_projection.weight`` [2*k*G, D] with G = D / group_size.
    Initialised to the identity (tap 0 = 1, all else 0, projection 0), as the publishers do, so a DFlash 2
    drafter initialised from a DFlash one computes the same function.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.kernel_size, self.groups, self.block_size = kernel_size, hidden_size // group_size, block_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        with torch.no_grad():
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [N, Q, D] -> (convolved input [N, Q, D], output-side dynamic taps [N, Q, k, G])."""
        dyn = self.kernel_projection(h).view(*h.shape[:-1], 2, self.kernel_size, self.groups)
        return grouped_dynamic_conv(h, dyn[..., 0, :, :], self.base_kernel[0], self.block_size), dyn[..., 1, :, :]

    def finish(self, y: torch.Tensor, dyn: torch.Tensor) -> torch.Tensor:
        """y [N, Q, D] sublayer output, dyn [N, Q, k, G] from :meth:`prepare` -> [N, Q, D]."""
        return grouped_dynamic_conv(y, dyn, self.base_kernel[1], self.block_size)


class DrafterLayer(nn.Module):
    """One pre-norm DFlash layer: block queries attend to [context K/V ; block K/V] without a causal mask.

    With ``cfg.conv_kernel_size`` > 0 (DFlash 2) the attention and MLP sublayers are each wrapped in a
    :class:`GroupedDynamicCausalConv` (``attention_conv``, ``mlp_conv``) over the block tokens; the context K/V
    are not convolved.
    """

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, kv * hd, bias=False)
        self.v_proj = nn.Linear(d, kv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)
        if cfg.conv_kernel_size:
            conv = (d, cfg.conv_kernel_size, cfg.conv_group_size, cfg.block_size)
            self.attention_conv = GroupedDynamicCausalConv(*conv)
            self.mlp_conv = GroupedDynamicCausalConv(*conv)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """x + MLP(post_attention_layernorm(x)), convolved on both sides for DFlash 2."""
        h = self.post_attention_layernorm(x)
        if not self.cfg.conv_kernel_size:
            return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        h, dyn = self.mlp_conv.prepare(h)
        return x + self.mlp_conv.finish(self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)), dyn)

    def _heads(self, x: torch.Tensor, n: int, norm: str | None) -> torch.Tensor:
        b, t, _ = x.shape
        x = x.view(b, t, n, self.cfg.head_dim)
        if norm is not None and self.cfg.qk_norm:
            x = getattr(self, norm)(x)
        return x.transpose(1, 2)

    def context_kv(self, ctx: torch.Tensor, ctx_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of fused context features. ctx [N, C, D], ctx_pos [N, C] -> ([N, kv, C, d], [N, kv, C, d])."""
        k = _rope(self._heads(self.k_proj(ctx), self.cfg.num_kv_heads, "k_norm"), ctx_pos, self.cfg.rope_theta)
        v = self._heads(self.v_proj(ctx), self.cfg.num_kv_heads, None)
        return k, v

    def forward(self, x, q_pos, ctx_k, ctx_v, mask):
        """x [N, Q, D]; q_pos [N, Q]; ctx_k/ctx_v [N, kv, C, d]; mask None, additive [N|1, 1, Q, C+Q], or a
        :class:`BlockAttention` (training, N = 1)."""
        cfg = self.cfg
        h = self.input_layernorm(x)
        dyn = None
        if cfg.conv_kernel_size:
            h, dyn = self.attention_conv.prepare(h)
        q = _rope(self._heads(self.q_proj(h), cfg.num_heads, "q_norm"), q_pos, cfg.rope_theta)
        k = _rope(self._heads(self.k_proj(h), cfg.num_kv_heads, "k_norm"), q_pos, cfg.rope_theta)
        v = self._heads(self.v_proj(h), cfg.num_kv_heads, None)
        if isinstance(mask, BlockAttention):
            a = block_structured_attention(q, k, v, ctx_k, ctx_v, mask, 1.0 / math.sqrt(cfg.head_dim))
        else:
            k = torch.cat([ctx_k, k], dim=2)
            v = torch.cat([ctx_v, v], dim=2)
            rep = cfg.num_heads // cfg.num_kv_heads
            if rep > 1:
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            if mask is not None:
                mask = mask.to(q.dtype)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(cfg.head_dim))
        b, _, t, _ = a.shape
        a = self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
        if dyn is not None:
            a = self.attention_conv.finish(a, dyn)
        return self._mlp(x + a)


class DFlashDrafter(nn.Module):
    """DFlash backbone: ``fc`` + ``hidden_norm`` over target features, ``layers``, final ``norm``.

    Parameters (dartree names): ``fc.weight`` [D, nL*D], ``hidden_norm.weight`` [D], ``norm.weight`` [D],
    ``layers.{i}.{q,k,v,o}_proj.weight``, ``layers.{i}.{q,k}_norm.weight`` (qk_norm only),
    ``layers.{i}.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``,
    DFlash 2's ``layers.{i}.{attention,mlp}_conv.{base_kernel, kernel_projection.weight}`` (conv_kernel_size > 0),
    and ``draft_vocab`` [N] int64 when ``cfg.draft_vocab_size`` = N > 0.

    Raises:
        ValueError: from :meth:`DrafterConfig.validate`.
    """

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        convs = {id(m.kernel_projection) for m in self.modules() if isinstance(m, GroupedDynamicCausalConv)}
        for m in self.modules():
            if isinstance(m, nn.Linear) and id(m) not in convs:  # DFlash 2 convolutions start as the identity
                nn.init.normal_(m.weight, std=0.02)
        if cfg.draft_vocab_size:
            self.register_buffer("draft_vocab", torch.arange(cfg.draft_vocab_size, dtype=torch.long))

    def draft_logits(self, hidden: torch.Tensor, lm_head: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Base logits over the drafter's own vocabulary only (the decode hot path).

        With a draft vocabulary of N tokens the logits are computed over those N rows of the target's lm_head,
        in ascending token-id order (so "lowest index" tie-breaks equal "lowest token id" ones), and nothing of
        size V is formed; the N-row weight slice is cached per lm_head weight version. Without one this is
        :meth:`base_logits` over the full vocabulary.

        Args:
            hidden: [..., D] drafter hidden states.
            lm_head: the target's output projection, weight [V, D].
        Returns:
            (logits [..., N] fp32, vocab [N] int64 ascending token ids), or (logits [..., V] fp32, None).
        """
        w = lm_head.weight
        packed = is_packed(lm_head) and not (torch.is_grad_enabled() and (w.requires_grad or hidden.requires_grad))
        if not self.cfg.draft_vocab_size:
            if packed and hidden.device == w.device:
                return packed_linear(hidden.to(w.dtype), lm_head._packed_weight()).float(), None
            return F.linear(hidden.to(w.dtype), w).float(), None
        key = (w.data_ptr(), w._version, w.dtype, w.device, self.draft_vocab.data_ptr(), self.draft_vocab._version)
        cached = getattr(self, "_draft_rows", None)
        if cached is None or cached[0] != key:
            vocab = torch.sort(self.draft_vocab).values
            cached = (key, vocab, w.index_select(0, vocab.to(w.device)).contiguous(), None)
            self._draft_rows = cached
        if packed and hidden.device == w.device:  # the N-row slice prepacked like the lm_head it came from
            if cached[3] is None:
                cached = cached[:3] + (pack_weight(cached[2]),)
                self._draft_rows = cached
            return packed_linear(hidden.to(w.dtype), cached[3]).float(), cached[1]
        return F.linear(hidden.to(w.dtype), cached[2]).float(), cached[1]

    def base_logits(self, hidden: torch.Tensor, lm_head: nn.Linear) -> torch.Tensor:
        """Base logits U = lm_head(H) over the full vocabulary, fp32: hidden [..., D] -> [..., V].

        With a draft vocabulary only its N rows of the (target's) lm_head are used and every other token gets
        -inf, so candidate selection never proposes it; the cost is N/V of the full head.
        """
        w = lm_head.weight
        if not self.cfg.draft_vocab_size:
            return F.linear(hidden.to(w.dtype), w).float()
        sub = F.linear(hidden.to(w.dtype), w[self.draft_vocab]).float()
        full = sub.new_full((*sub.shape[:-1], w.shape[0]), float("-inf"))
        return full.scatter_(-1, self.draft_vocab.expand(*sub.shape[:-1], -1), sub)

    def attach(self, source) -> None:
        """Run every forward with ``source.layer_hook(block_ids)`` (:meth:`layer_hook`; :meth:`forward` refuses to run
        without it): a correction head acting between the layers attaches itself when bound
        (:meth:`dartree.models.heads.CorrectionHead.bind_models`). Kept by reference, not as a submodule.

        Raises:
            TypeError: ``source`` has no ``layer_hook``.
        """
        if not callable(getattr(source, "layer_hook", None)):
            raise TypeError(f"{type(source).__name__} has no layer_hook(block_ids); it cannot be attached to a drafter")
        self.__dict__["_hook_source"] = source

    def layer_hook(self, block_ids: torch.Tensor, **extra):
        """The attached source's hook for one forward over blocks of token ids ``block_ids`` [N, A, L] int64 (anchor
        first; ``extra`` goes to it), or None when nothing is attached (a plain DFlash backbone)."""
        src = self.__dict__.get("_hook_source")
        return None if src is None else src.layer_hook(block_ids, **extra)

    def _block_mask(self, mask, q_len: int, keys: int, device):
        """``mask`` made causal inside each block of Q consecutive queries when ``cfg.causal_block``: a
        :class:`BlockAttention` gets ``causal``, an additive mask [N|1, 1, Q, keys] the bias on its last Q keys, None
        the additive [1, 1, Q, keys] mask with every context key visible."""
        if not self.cfg.causal_block or isinstance(mask, BlockAttention):
            return BlockAttention(mask.ctx_bias, mask.block_size, True) if self.cfg.causal_block else mask
        off, L = torch.arange(q_len, device=device), self.cfg.block_size
        blk = torch.zeros(q_len, q_len, device=device).masked_fill_(
            (off[None] % L > off[:, None] % L) | (off[None] // L != off[:, None] // L), torch.finfo(torch.float32).min)
        if mask is None:
            return torch.cat([torch.zeros(q_len, keys - q_len, device=device), blk], dim=1)[None, None]
        return torch.cat([mask[..., : keys - q_len], mask[..., keys - q_len:] + blk.to(mask.dtype)], dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        q_pos: torch.Tensor,
        ctx_feats: torch.Tensor | None,
        ctx_pos: torch.Tensor | None,
        *,
        mask: torch.Tensor | None = None,
        cache: DraftCache | None = None,
        hook=None,
    ) -> torch.Tensor:
        """Hidden states of block tokens after the final norm.

        Args:
            x: [N, Q, D] embedded block tokens (target embedding of anchor / MASK ids).
            q_pos: [N, Q] int64 absolute positions of the block tokens.
            ctx_feats: [N, C, nL*D] target features of new context positions (or None / C = 0).
            ctx_pos: [N, C] int64 positions of those features.
            mask: None (every query sees all context and the whole block: inference), an additive float
                mask [N|1, 1, Q, C_total + Q] over [cached + new context ; block] keys, or a
                :class:`BlockAttention` (training: the same visibility, computed over each block's own keys).
                With ``cfg.causal_block`` the block part is made causal here (callers pass the same masks).
            cache: when given, the new context K/V are appended to it and all cached context is attended.
            hook: None, or :meth:`layer_hook`'s: ``hook(i, h)`` -> the [N, Q, D] states layer i hands on (it may
                record the states a head scores from); required when a head is attached (:meth:`attach`).
        Returns:
            [N, Q, D] in the dtype of x.
        Raises:
            ValueError: a head is attached and no hook is given (the message says how to build it).
        """
        if hook is None and self.__dict__.get("_hook_source") is not None:
            raise ValueError(f"this drafter's {type(self.__dict__['_hook_source']).__name__} acts between its layers: "
                             "pass hook=drafter.layer_hook(block_ids) (decode.draft.draft_block does)")
        n = x.shape[0]
        has_ctx = ctx_feats is not None and ctx_feats.shape[1] > 0
        ctx = self.hidden_norm(self.fc(ctx_feats.to(self.fc.weight.dtype))) if has_ctx else None
        keys = (cache.length if cache is not None else 0) + (ctx_feats.shape[1] if has_ctx else 0) + x.shape[1]
        mask = self._block_mask(mask, x.shape[1], keys, x.device)
        h = x
        for i, layer in enumerate(self.layers):
            if has_ctx:
                ck, cv = layer.context_kv(ctx, ctx_pos)
            else:
                shape = (n, self.cfg.num_kv_heads, 0, self.cfg.head_dim)
                ck = cv = x.new_zeros(shape)
            if cache is not None:
                if cache.keys[i] is not None:
                    ck = torch.cat([cache.keys[i], ck], dim=2)
                    cv = torch.cat([cache.values[i], cv], dim=2)
                cache.keys[i], cache.values[i] = ck, cv
            h = layer(h, q_pos, ck, cv, mask)
            if hook is not None:
                h = hook(i, h)
        return self.norm(h)

    def init_from_target_layers(self, target_model, layer_ids: Sequence[int]) -> None:
        """Copy decoder layers of a Llama/Qwen-style HF target into this drafter's first ``len(layer_ids)`` layers
        (drafter layer i <- target layer ``layer_ids[i]``; later drafter layers keep their random weights).

        Raises:
            ValueError: no ids, more ids than drafter layers, or a shape that differs.
        """
        if not 1 <= len(layer_ids) <= len(self.layers):
            raise ValueError(f"init_from_target_layers: {len(layer_ids)} ids for {len(self.layers)} drafter layers "
                             f"(give 1 to {len(self.layers)})")
        for mine, idx in zip(self.layers, layer_ids):
            src = target_model.model.layers[idx]
            pairs = {
                "q_proj": src.self_attn.q_proj, "k_proj": src.self_attn.k_proj, "v_proj": src.self_attn.v_proj,
                "o_proj": src.self_attn.o_proj, "gate_proj": src.mlp.gate_proj, "up_proj": src.mlp.up_proj,
                "down_proj": src.mlp.down_proj, "input_layernorm": src.input_layernorm,
                "post_attention_layernorm": src.post_attention_layernorm,
            }
            if self.cfg.qk_norm and hasattr(src.self_attn, "q_norm"):
                pairs.update({"q_norm": src.self_attn.q_norm, "k_norm": src.self_attn.k_norm})
            for name, mod in pairs.items():
                dst = getattr(mine, name).weight
                if dst.shape != mod.weight.shape:
                    raise ValueError(f"init_from_target_layers: {name} shape {tuple(mod.weight.shape)} != {tuple(dst.shape)}")
                with torch.no_grad():
                    dst.copy_(mod.weight.to(dst.dtype))

    def warm_start(self, target_model, variant: str, copy_layers: int = 0) -> dict:
        """Initialise this drafter from the target's own weights (``drafter.init_from_target``).

        - ``"layers"``: drafter layers 0..k-1 copy the target's top k decoder layers n-k .. n-1 (k =
          ``copy_layers``, 0: every drafter layer); everything else stays random.
        - ``"specforge"``: the same copies, and the rest of the path into them set as SpecForge's DSpark warm start
          does (``scripts/init_dspark_v4_from_target.py`` and ``examples/configs/kan-ablations`` in the SpecForge
          repository): ``fc`` is the identity on the captured feature that feeds the first copied layer (target
          layer n-k-1 when it is one of ``target_layer_ids``, else the last captured layer) and zero elsewhere, the
          context norm ``hidden_norm`` is the first copied layer's ``input_layernorm`` (so the first layer's context
          K/V are the target's own at layer n-k), and the final ``norm`` is the target's final norm.

        The correction heads start as "no correction" on their own (their output rows are zero at construction).
        In a DFlash backbone the block enters as raw token embeddings and the features only as context K/V, so a
        warm start does not predict at step 0; it can only start training from a better point.

        Args:
            target_model: a Llama/Qwen-style HF causal LM (``.model.layers``, ``.model.norm``).
            variant: ``"layers"`` or ``"specforge"``.
            copy_layers: k, the number of copied layers (0: all drafter layers).
        Returns:
            {"copied": [target layer ids], "identity_feature": the target layer id fed through ``fc`` (specforge;
            else None)}.
        Raises:
            ValueError: an unknown variant, k outside [0, drafter layers] or above the target's layers, or shapes
                that differ (named).
        """
        if variant not in ("layers", "specforge"):
            raise ValueError(f"warm_start: variant {variant!r} is not one of 'layers', 'specforge'")
        n_t, n_d = len(target_model.model.layers), len(self.layers)
        k = int(copy_layers) or n_d
        if not 1 <= k <= min(n_d, n_t):
            raise ValueError(f"warm_start: copy_layers={copy_layers} must be in [0, {min(n_d, n_t)}] (0: every "
                             f"drafter layer; the drafter has {n_d}, the target {n_t})")
        first = n_t - k
        self.init_from_target_layers(target_model, list(range(first, n_t)))
        if variant == "layers":
            return {"copied": list(range(first, n_t)), "identity_feature": None}
        ids, d = list(self.cfg.target_layer_ids), self.cfg.hidden_size
        src = first - 1 if (first - 1) in ids else ids[-1]
        j = ids.index(src)
        norm_in = target_model.model.layers[first].input_layernorm.weight
        norm_out = target_model.model.norm.weight
        if tuple(norm_in.shape) != (d,) or tuple(norm_out.shape) != (d,):
            raise ValueError(f"warm_start: the target's norms {tuple(norm_in.shape)}, {tuple(norm_out.shape)} do "
                             f"not fit the drafter's hidden size {d}")
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, j * d:(j + 1) * d] = torch.eye(d, dtype=self.fc.weight.dtype)
            self.hidden_norm.weight.copy_(norm_in.to(self.hidden_norm.weight.dtype))
            self.norm.weight.copy_(norm_out.to(self.norm.weight.dtype))
        return {"copied": list(range(first, n_t)), "identity_feature": src}
