"""A published drafter's tensors in dartree terms, shared by every publisher module: the names of the backbone's
Qwen3 tensors ``layers.{i}.self_attn.{q,k,v,o}_proj / {q,k}_norm``, ``layers.{i}.mlp.{gate,up,down}_proj``,
``layers.{i}.{input,post_attention}_layernorm`` plus ``fc``, ``hidden_norm`` and ``norm`` (no embedding or lm_head;
:func:`backbone_name`), the renaming of a head's tensors by its head type's published names (:func:`published_name`;
the names live with the head's family, :attr:`dartree.models.families.Family.published`, the same for every
publisher), and the strict checks (:func:`check_tensors`, :func:`check_copy_of_target`) with which a parsed config
is finished into a dartree checkpoint (:func:`read_parsed`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from dartree.models.checkpoint import CheckpointError, dartree_config, expected_tensors
from dartree.models.families import published_names


_LEGACY_PREFIXES = ("prefix_gru.", "embed_proj.", "markov_head.", "confidence_head.")


_LAYER = re.compile(r"^backbone\.layers\.(\d+)\.(.+)$")


_ATTN = {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}


_MLP = {"gate_proj", "up_proj", "down_proj"}


def backbone_name(name: str) -> str:
    """The published name of a dartree backbone tensor (``backbone.*``), the same in every layout.

    ``backbone.layers.{i}.q_proj.weight`` -> ``layers.{i}.self_attn.q_proj.weight``, ``...gate_proj...`` ->
    ``layers.{i}.mlp.gate_proj...``; other names (``fc``, ``hidden_norm``, ``norm``, DFlash 2's
    ``layers.{i}.{attention,mlp}_conv.*``) lose the ``backbone.`` prefix.
    """
    m = _LAYER.match(name)
    if m:
        i, rest = m.groups()
        mod = rest.split(".", 1)[0]
        if mod in _ATTN:
            return f"layers.{i}.self_attn.{rest}"
        if mod in _MLP:
            return f"layers.{i}.mlp.{rest}"
        return f"layers.{i}.{rest}"
    return name[len("backbone."):]


def published_name(name: str, heads: dict[str, str], fmt: str) -> str:
    """Map a dartree tensor name (``backbone.*`` / ``head.*``) to its name in the published layout ``fmt``.

    Args:
        name: the dartree name. heads: the head's published names, dartree name without ``head.`` -> published name
            (:func:`dartree.models.families.published_names` of its head type; empty for a head without tensors).
        fmt: the layout's name, for the message.
    Raises:
        CheckpointError: a head tensor that ``heads`` has no name for (the head type does not fit the layout).
    """
    if name.startswith("backbone."):
        return backbone_name(name)
    local = name[len("head."):]
    if local not in heads:
        raise CheckpointError(f"tensor {name!r} has no counterpart in the {fmt} layout")
    return heads[local]


def strip_legacy(tensors: dict, where) -> dict:
    """Rename older SpecForge ``logit_head.{prefix_gru,embed_proj,markov_head,confidence_head}.*`` tensors to
    the direct layout (SpecForge ``normalize_draft_head_checkpoint_keys``).

    Raises:
        CheckpointError: both the legacy and the direct name of one tensor are present.
    """
    out = {}
    for k, v in tensors.items():
        new = k
        if k.startswith("logit_head.") and k[len("logit_head."):].startswith(_LEGACY_PREFIXES):
            new = k[len("logit_head."):]
        if new in out:
            raise CheckpointError(f"{where}: tensor {new!r} appears twice (also as {k!r}); keep one of them")
        out[new] = v
    return out


@dataclass
class Parsed:
    """A published config read into dartree terms: drafter fields, head config, target identity, and the
    names of published tensors that dartree drops (with their expected shapes)."""

    drafter: dict
    head: dict
    target: dict
    dropped: dict


def read_parsed(parsed: Parsed, fmt: str, given: dict, where, target=None) -> tuple[dict, dict]:
    """Finish reading a DFlash-family checkpoint whose config is parsed: check and rename its tensors (the head's
    by the published names of its type, :func:`dartree.models.families.published_names`).

    Args:
        parsed: the config in dartree terms (the publisher's parse function). fmt: the layout's name (provenance
            ``source_format``, messages). given: published name -> tensor (older SpecForge ``logit_head.*`` names
            accepted, :func:`strip_legacy`). where: the checkpoint folder. target: optional
            :class:`~dartree.models.target.Target`, against which the copies in ``parsed.dropped`` are checked
            (:func:`check_copy_of_target`).
    Returns:
        (dartree config, tensors by dartree name); the tensors are ``given``'s own objects, unchanged.
    Raises:
        CheckpointError: a missing, unexpected or mis-shaped tensor (its published name and both shapes), a
            tensor under both its legacy and its direct name, or a dropped copy that differs from ``target``'s.
    """
    out = dartree_config(parsed.drafter, parsed.head, parsed.target, {"source_format": fmt, "source": str(where)})
    expected = expected_tensors(out, f"{where}/config.json")
    given = strip_legacy(given, where)
    for name, shape in parsed.dropped.items():  # DeepSpec's frozen copies of the target's embedding / lm_head
        if name not in given:
            raise CheckpointError(f"{where}: missing tensor {name!r} (expected shape {list(shape)})")
        if tuple(given[name].shape) != shape:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {list(given[name].shape)}, expected {list(shape)}")
        check_copy_of_target(name, given.pop(name), target, where)
    heads = published_names(parsed.head["type"])
    check_tensors(given, expected, where, rename=lambda n: published_name(n, heads, fmt))
    tensors = {k: given[published_name(k, heads, fmt)] for k in expected}
    if parsed.dropped:
        out["provenance"]["dropped"] = sorted(parsed.dropped)
    return out, tensors


def publish_tensors(tensors: dict, head_type: str, fmt: str) -> dict:
    """Tensors by dartree name -> by published name (:func:`published_name` with the published names of
    ``head_type``, :func:`dartree.models.families.published_names`), contiguous, values and dtypes kept.

    Raises:
        CheckpointError: a head tensor the layout has no name for.
    """
    heads = published_names(head_type)
    return {published_name(k, heads, fmt): v.contiguous() for k, v in tensors.items()}


def check_copy_of_target(name: str, tensor, target, where, rows=None) -> None:
    """Check a published drafter's own frozen copy of a target tensor against the target, when one is given.

    DeepSpec drafters keep ``embed_tokens.weight`` / ``lm_head.weight`` [V, D]; speculators checkpoints with a
    reduced vocabulary keep ``lm_head.weight`` [N, D] (the target's rows ``rows`` [N]). dartree drafts with the
    target's own tensors, so a copy that differs would silently change the drafts.

    Args:
        name: the published tensor name (``embed_tokens.weight``, ``lm_head.weight``, ``verifier_lm_head.weight``).
        tensor: the stored copy. target: a :class:`~dartree.models.target.Target` or None (nothing to check).
        rows: [N] int64 target row ids the copy holds (None: all rows).
    Raises:
        CheckpointError: shapes differ, or values differ after casting the target's tensor to the copy's dtype
            (the message gives the number of differing rows and the largest absolute difference).
    """
    if target is None:
        return
    ref = (target.embed_tokens.weight if name.startswith("embed_tokens") else target.lm_head.weight).detach()
    if rows is not None:
        ref = ref[rows.to(ref.device)]
    if tuple(ref.shape) != tuple(tensor.shape):
        raise CheckpointError(f"{where}: the drafter's own {name} has shape {list(tensor.shape)} but the target "
                              f"{target.name!r} gives {list(ref.shape)}")
    diff = (tensor.float().cpu() - ref.to(tensor.dtype).float().cpu()).abs()
    if bool((diff > 0).any()):
        bad = int((diff.amax(-1) > 0).sum()) if diff.dim() > 1 else int((diff > 0).sum())
        raise CheckpointError(
            f"{where}: the drafter's own {name} differs from target {target.name!r}'s ({bad} of {diff.shape[0]} rows "
            f"differ, max |difference| {float(diff.max()):.4g}); dartree drafts with the target's tensor, so this "
            "drafter was trained for another target: convert it with the target it was trained for")


def check_tensors(given: dict, expected: dict, where, rename: Callable[[str], str] = lambda n: n) -> None:
    """Compare source tensors with the expected set, naming tensors in the source's own terms.

    Args:
        given: source name -> tensor. expected: dartree name -> shape. rename: dartree name -> source name.
    Raises:
        CheckpointError: missing, mis-shaped or unexpected tensor (the first one, by name, with shapes).
    """
    want = {rename(k): shape for k, shape in expected.items()}
    for name, shape in want.items():
        if name not in given:
            raise CheckpointError(f"{where}: missing tensor {name!r} (expected shape {list(shape)})")
        if tuple(given[name].shape) != tuple(shape):
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {list(given[name].shape)}, expected {list(shape)}"
            )
    extra = sorted(set(given) - set(want))
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected in all)")


def selector_spelling(tensors: dict, where) -> dict:
    """Rename the selector codebooks' ``candidate_selector.{predecessor,successor}_codebook.weight`` (z-lab's own
    ``save_pretrained`` spelling) to the published name without ``.weight`` (what z-lab's ``from_pretrained`` maps
    and speculators stores); other tensors pass through.

    Args:
        tensors: published name -> tensor. where: the checkpoint, for the message.
    Returns:
        a new dict, published name -> tensor (same tensor objects).
    Raises:
        CheckpointError: both spellings of one codebook are present (the message names both; keep one).
    """
    out = dict(tensors)
    names = published_names("selector")
    for name in (names["w1.weight"], names["w2.weight"]):  # the codebooks
        if name + ".weight" in out:
            if name in out:
                raise CheckpointError(f"{where}: tensor {name!r} appears twice (also as {name + '.weight'!r}); keep one "
                                      "of them")
            out[name] = out.pop(name + ".weight")
    return out


def take_tensors(given: dict, want: dict, rename, where) -> dict:
    """Strictly pick the tensors a dartree config calls for out of a published checkpoint.

    Args:
        given: published name -> tensor (every one must be used). want: dartree name -> shape
            (:func:`~dartree.models.checkpoint.expected_tensors`). rename: dartree name -> published name.
        where: the checkpoint, for the message.
    Returns:
        dartree name -> tensor (passed through unchanged, dtype kept).
    Raises:
        CheckpointError: a missing or mis-shaped tensor (its published name and both shapes), or an unexpected one.
    """
    check_tensors(given, want, where, rename)
    return {name: given[rename(name)] for name in want}
