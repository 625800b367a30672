"""Peer decoders run beside dartree's methods in the same eval: the same target, prompt ids, max_new_tokens and stop ids.

* ``hf-generate``: transformers ``generate``, greedy, on ``Target.model`` (the plain AR loop a user already has);
  in a batch sweep (``--batch``) its batched form, N left-padded prompts per call (:func:`hf_generate_batch`).
* ``hf-prompt-lookup``: transformers prompt-lookup decoding (``generate(prompt_lookup_num_tokens=N)``), the free
  drafter-less speculative method a CPU user tries first.
* ``ar-bf16``: dartree's own AR loop on a bfloat16 copy of the target, the fastest plain decoding on a CPU whose
  memory-bound one-token step gains from half the weight bytes even without native bf16 arithmetic (docs/performance.md,
  "The honest baseline"). Its outputs are compared with the fp32 AR's like every row (near-ties may split).
* ``zlab-dflash``: z-lab's ``dflash_generate`` (package ``dflash`` 0.1.0) on the drafter exported to z-lab's layout
  by :func:`dartree.convert.exporter.export`; a drafter that layout cannot express is skipped with the reason.

Every peer runs greedy (T = 0) only. Timing, the same for all peers: forward hooks on the target's Hugging Face
module (``Target.model``) record the end of its first forward (the prefill, prompt ids only) and the cache length
at the start of every later forward; ``decode_s`` runs from the end of the prefill forward to the return of the
peer's call, so prefill is excluded as in :func:`dartree.decode.generate.autoregressive_generate` (whose decode
clock also starts after the first token). One call per measurement, no ``generate(1)`` subtraction. z-lab's own
stats timer (``_cuda_time``, which calls ``torch.cuda.synchronize``) is never used (``return_stats=False``).

Committed tokens per target forward (``accept_lengths``, bonus included, prefill excluded) come from the target
cache length seen at the start of consecutive forwards (a forward starting at cache length ``s_i`` and the next at
``s_{i+1}`` committed ``s_{i+1} - s_i`` tokens), so tau = sum / count is comparable with dartree's tau.
Output tokens are cut after the first stop id (inclusive), as dartree's loops do.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from dartree.models.target import Target
from dartree.convert.exporter import export
from dartree.decode.generate import autoregressive_generate
from dartree.models.checkpoint import CheckpointError
from dartree.models import target as target_lib

PEERS = ("hf-generate", "hf-prompt-lookup", "ar-bf16", "zlab-dflash")
PROMPT_LOOKUP_TOKENS = 10  # candidate tokens per lookup (transformers' documented example value)
PROMPT_LOOKUP_NGRAM = 2  # longest n-gram matched (transformers' default)


@dataclass
class PeerOutput:
    """One peer decode of one prompt.

    Attributes:
        tokens: generated ids (prompt excluded; ends at the first stop id, inclusive); [] when skipped.
        decode_s: seconds from the end of the prefill forward to the end of the call (prefill excluded).
        prefill_s: seconds from the call to the end of the prefill forward.
        accept_lengths: tokens committed by each target forward after the prefill (bonus included); its length
            is the number of decode forwards, its sum ``len(tokens) - 1``.
        skipped: why the peer did not run (None when it ran).
    """

    tokens: list = field(default_factory=list)
    decode_s: float = 0.0
    prefill_s: float = 0.0
    accept_lengths: list = field(default_factory=list)
    skipped: str | None = None

    @property
    def forwards(self) -> int:
        """Target forwards after the prefill."""
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        """Committed tokens per target forward, prefill excluded (nan if none)."""
        return sum(self.accept_lengths) / self.forwards if self.forwards else float("nan")


class _ForwardProbe:
    """Forward hooks on a Hugging Face causal LM: the end time of its first forward and the cache length at the
    start of every forward (from ``past_key_values.get_seq_length()``, else ``position_ids[0, 0]``)."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.starts, self.first_end = model, [], None

    def _pre(self, _module, args, kwargs):
        cache, pos = kwargs.get("past_key_values"), kwargs.get("position_ids")
        if cache is not None and hasattr(cache, "get_seq_length"):
            self.starts.append(int(cache.get_seq_length()))
        elif pos is not None:
            self.starts.append(int(pos[0, 0]))
        else:
            self.starts.append(None)

    def _post(self, _module, _args, _output):
        if self.first_end is None:
            self.first_end = time.perf_counter()

    def __enter__(self):
        self._hooks = [self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
                       self.model.register_forward_hook(self._post)]
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()


def _cut_at_stop(tokens: list, stop_ids: set) -> list:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens


def _round_lengths(starts: list, prompt_len: int, n_tokens: int) -> list:
    """Committed tokens per decode forward from the cache lengths at the start of each forward (prefill first).

    The decode forward starting at cache length ``s_i`` commits ``s_{i+1} - s_i`` tokens; the last one commits up to
    position ``prompt_len + n_tokens - 1`` (the last token is never fed back). Clipped so the lengths sum to
    ``n_tokens - 1`` (tokens past a stop id are not counted).
    Raises:
        RuntimeError: a forward without a readable cache length or position.
    """
    dec = starts[1:]
    if any(s is None for s in dec):
        raise RuntimeError("a target forward had neither past_key_values nor position_ids; cannot count rounds")
    end = prompt_len + max(n_tokens, 1) - 1
    bounds = [min(b, end) for b in dec[1:] + [end]]
    return [b - s for b, s in zip(bounds, dec) if b > s]


def _run_probed(target: Target, call, prompt_len: int, stop_ids: set) -> PeerOutput:
    """Run ``call() -> list of generated ids`` under a forward probe; tokens cut at the first stop id."""
    with _ForwardProbe(target.model) as probe:
        t0 = time.perf_counter()
        tokens = _cut_at_stop([int(t) for t in call()], stop_ids)
        t1 = time.perf_counter()
    first = probe.first_end if probe.first_end is not None else t1
    return PeerOutput(tokens=tokens, decode_s=t1 - first, prefill_s=first - t0,
                      accept_lengths=_round_lengths(probe.starts, prompt_len, len(tokens)))


def _ids(target: Target, prompt_ids: Sequence[int]) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=target.device).reshape(1, -1)
    if ids.numel() == 0:
        raise ValueError("empty prompt: peers need at least one prompt token")
    return ids


def _hf_generate(target: Target, prompt_ids, max_new_tokens: int, stop_ids: Sequence[int], **extra) -> PeerOutput:
    from transformers import GenerationConfig

    ids, stops = _ids(target, prompt_ids), [int(s) for s in stop_ids]
    if not stops:
        raise ValueError("peers need at least one stop id (Hugging Face generate would fall back to the model's eos)")
    cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=stops,
                           pad_token_id=stops[0], num_beams=1, **extra)

    def call():
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        return out[0, ids.shape[1]:].tolist()

    return _run_probed(target, call, ids.shape[1], set(stops))


@torch.no_grad()
def hf_generate(target: Target, prompt_ids: Sequence[int], *, max_new_tokens: int,
                stop_ids: Sequence[int]) -> PeerOutput:
    """transformers ``generate`` on ``target.model``, greedy (``do_sample=False``, one beam).

    Args:
        target: the dartree Target whose Hugging Face model runs. prompt_ids: [T] or [1, T] ids (no padding).
        max_new_tokens: cap on generated tokens (>= 1). stop_ids: ids that end generation (inclusive), at least one.
    Returns:
        PeerOutput: tokens (equal to :func:`~dartree.decode.generate.autoregressive_generate`'s at T = 0 in fp32),
        decode seconds (prefill excluded, see the module docstring) and one committed token per decode forward.
    Raises:
        ValueError: an empty prompt or no stop id.
    """
    return _hf_generate(target, prompt_ids, max_new_tokens, stop_ids)


@torch.no_grad()
def hf_generate_batch(target: Target, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                      stop_ids: Sequence[int]) -> tuple[list[PeerOutput], float, float]:
    """transformers ``generate`` on ``target.model`` for N prompts in one static batch, greedy, left-padded (the
    padding transformers documents for batched generation with decoder-only models: each row's prompt ends at the
    last column, ``attention_mask`` 0 over its padding, positions counted from its first real token), as a user
    batches requests with it. Rows that end early wait, emitting padding, until the last row ends.

    Args:
        target: the dartree Target whose Hugging Face model runs. prompts: N [T_i] id lists (N >= 1).
        max_new_tokens: cap on generated tokens per row (>= 1). stop_ids: ids that end a row (inclusive), at least
            one (the first is the padding id).
    Returns:
        (one PeerOutput per row: its tokens cut after its first stop id, one committed token per decode forward;
        the batch's decode seconds, from the end of its prefill forward to the end of the call; its prefill
        seconds). At T = 0 in fp32 each row's tokens equal its own AR decode's up to the padding's rounding (a peer:
        compared, never assumed).
    Raises:
        ValueError: no prompt, an empty prompt or no stop id.
    """
    from transformers import GenerationConfig

    stops = [int(s) for s in stop_ids]
    if not stops:
        raise ValueError("peers need at least one stop id (Hugging Face generate would fall back to the model's eos)")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("hf_generate_batch needs at least one prompt, each of at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), stops[0], dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(target.device), mask.to(target.device)
    cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=stops,
                           pad_token_id=stops[0], num_beams=1)
    with _ForwardProbe(target.model) as probe:
        t0 = time.perf_counter()
        out = target.model.generate(ids, attention_mask=mask, generation_config=cfg)[:, width:].tolist()
        t1 = time.perf_counter()
    first = probe.first_end if probe.first_end is not None else t1
    rows = [_cut_at_stop([int(t) for t in row], set(stops)) for row in out]
    return ([PeerOutput(tokens=r, decode_s=t1 - first, prefill_s=first - t0, accept_lengths=[1] * max(len(r) - 1, 0))
             for r in rows], t1 - first, first - t0)


@torch.no_grad()
def hf_prompt_lookup(target: Target, prompt_ids: Sequence[int], *, max_new_tokens: int, stop_ids: Sequence[int],
                     num_tokens: int = PROMPT_LOOKUP_TOKENS, max_ngram: int = PROMPT_LOOKUP_NGRAM) -> PeerOutput:
    """transformers prompt-lookup decoding (Saxena 2023, ``generate(prompt_lookup_num_tokens=N)``), greedy.

    Candidates are the ``num_tokens`` ids that followed the latest earlier occurrence of the last ``max_ngram``
    (down to 1) ids; the target verifies them in one forward. Arguments and errors as :func:`hf_generate`.
    Returns:
        PeerOutput; its ``tau`` is committed tokens per target forward (prefill excluded), counted by forward
        hooks, so ``forwards <= len(tokens)``.
    """
    return _hf_generate(target, prompt_ids, max_new_tokens, stop_ids, prompt_lookup_num_tokens=num_tokens,
                        max_matching_ngram_size=max_ngram)


def load_bf16_twin(spec, layer_ids=()) -> Target:
    """Load the target named by ``spec`` (as :func:`dartree.models.target.load_target` takes it) again in bfloat16,
    for the ``ar-bf16`` peer. Raises what ``load_target`` raises."""
    return target_lib.load_target(spec, dtype=torch.bfloat16, layer_ids=layer_ids)


@torch.no_grad()
def ar_bf16(twin: Target, prompt_ids: Sequence[int], *, max_new_tokens: int, stop_ids: Sequence[int]) -> PeerOutput:
    """dartree's AR loop (:func:`~dartree.decode.generate.autoregressive_generate`, greedy) on the bf16 ``twin``.

    Args:
        twin: the target in bfloat16 (:func:`load_bf16_twin`), or None (then the result is skipped).
        prompt_ids: [T] or [1, T]. max_new_tokens: cap. stop_ids: ids that end generation (inclusive).
    Returns:
        PeerOutput with the loop's own clock (prefill excluded, as the AR row) and one token per forward.
    Raises:
        ValueError / TypeError: as ``autoregressive_generate``.
    """
    if twin is None:
        return PeerOutput(skipped="no bf16 copy of the target (see load_bf16_twin)")
    out = autoregressive_generate(twin, prompt_ids, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    return PeerOutput(tokens=list(out.tokens), decode_s=out.stats.decode_s, prefill_s=out.stats.prefill_s,
                      accept_lengths=list(out.stats.accept_lengths))


def load_zlab_drafter(checkpoint: str | Path, target: Target):
    """Export the dartree checkpoint to z-lab's DFlash layout and load it with z-lab's ``DFlashDraftModel``.

    Args:
        checkpoint: dartree checkpoint folder. target: the target (its dtype and device are used).
    Returns:
        (model, None), or (None, reason) when the drafter cannot run as z-lab's: the exporter's refusal (head type,
        qk_norm, proposal offset, reduced vocabulary; :func:`dartree.convert.formats.export_config`), a checkpoint
        that does not load, or the ``dflash`` package missing.
    """
    try:
        from dflash.model import DFlashDraftModel
    except ImportError as exc:
        return None, f"z-lab dflash is not installed ({exc}); make setup installs dflash==0.1.0"
    with tempfile.TemporaryDirectory(prefix="dartree-zlab-") as tmp:
        try:
            folder = export(checkpoint, Path(tmp) / "zlab", to="zlab-dflash")
        except CheckpointError as exc:
            return None, f"cannot export {checkpoint} to z-lab's DFlash layout: {exc}"
        model = DFlashDraftModel.from_pretrained(folder, dtype=target.dtype)
    return model.to(device=target.device, dtype=target.dtype).eval(), None


@torch.no_grad()
def zlab_dflash(target: Target, drafter, prompt_ids: Sequence[int], *, max_new_tokens: int,
                stop_ids: Sequence[int]) -> PeerOutput:
    """z-lab's ``dflash_generate`` (``z-lab/dflash`` ``dflash/model.py``), greedy, with ``drafter`` from
    :func:`load_zlab_drafter`.

    Args:
        target: the dartree Target (its Hugging Face model is z-lab's target). drafter: z-lab ``DFlashDraftModel``
            or None (then the result is skipped). prompt_ids: [T] or [1, T]. max_new_tokens: cap (>= 1).
        stop_ids: ids that end generation (inclusive).
    Returns:
        PeerOutput: at T = 0 its tokens equal the chain decoder's and the AR loop's (fp32); accept_lengths equal
        z-lab's per-round acceptance lengths.
    Raises:
        ValueError: an empty prompt.
    """
    if drafter is None:
        return PeerOutput(skipped="no z-lab drafter (see load_zlab_drafter)")
    from dflash.model import dflash_generate

    ids = _ids(target, prompt_ids)
    stops = [int(s) for s in stop_ids]

    def call():
        out = dflash_generate(drafter, target.model, ids, max_new_tokens, stops or None, temperature=0.0)
        return out[0, ids.shape[1]:].tolist()

    return _run_probed(target, call, ids.shape[1], set(stops))


def run_peer(name: str, target: Target, prompt_ids: Sequence[int], *, max_new_tokens: int, stop_ids: Sequence[int],
             zlab_drafter=None, bf16_twin: Target | None = None) -> PeerOutput:
    """Run peer ``name`` (one of :data:`PEERS`) on one prompt; arguments as the peer functions.

    Raises:
        KeyError: an unknown peer (lists the available ones).
    """
    if name == "hf-generate":
        return hf_generate(target, prompt_ids, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    if name == "hf-prompt-lookup":
        return hf_prompt_lookup(target, prompt_ids, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    if name == "ar-bf16":
        return ar_bf16(bf16_twin, prompt_ids, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    if name == "zlab-dflash":
        return zlab_dflash(target, zlab_drafter, prompt_ids, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    raise KeyError(f"unknown peer {name!r}; available: {', '.join(PEERS)}")
